"""A minimal OpenAI-compatible chat-completions client (stdlib urllib; no SDK), and the adapter that
turns it into an `envs.episode` policy. Used by the solve stage only when an endpoint is configured.

Not here: the agent loop (envs/episode.py) or tool calling (the policy answers with text; tool calls
are parsed from it by envs/protocol.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from envs.protocol import Message


class LLMError(RuntimeError):
    """The endpoint failed (HTTP error, malformed answer) after the allowed retries."""


@dataclass
class ChatClient:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str = ""
    timeout_s: float = 120.0
    retries: int = 2
    temperature: float = 0.0
    max_tokens: int = 2048
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0})

    def chat(self, messages: list[dict[str, str]], **extra: Any) -> str:
        """POST /chat/completions; returns choices[0].message.content. Retries 429/5xx with backoff."""
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **extra}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url.rstrip("/") + "/chat/completions"
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    doc = json.loads(resp.read())
                break
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:500]!r}"
                if e.code not in (408, 429) and e.code < 500:
                    raise LLMError(last) from e
            except (urllib.error.URLError, TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(min(0.5 * 2 ** attempt, 8))
        else:
            raise LLMError(f"chat completion failed after {self.retries + 1} tries: {last}")
        try:
            content = doc["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise LLMError(f"malformed completion: {str(doc)[:500]}") from e
        for k in ("prompt_tokens", "completion_tokens"):
            self.usage[k] += int((doc.get("usage") or {}).get(k, 0))
        self.usage["calls"] += 1
        return content or ""

    def policy(self, messages: list[Message]) -> str:
        """An envs.episode Policy: tool observations are sent as user turns (plain chat endpoints)."""
        wire = [{"role": m.role if m.role in ("system", "user", "assistant") else "user",
                 "content": m.content if m.role != "tool" else f"[observation]\n{m.content}"} for m in messages]
        return self.chat(wire)
