"""FakeOpenAIServer: a tiny OpenAI-compatible /v1/chat/completions server on 127.0.0.1 for protocol tests.

It records every request (path, headers, JSON body) and answers from a script of replies; a reply
that is an int is sent as that HTTP error status instead, and a dict is the assistant message itself
(e.g. with `tool_calls`). Not a model: it never looks at the prompt.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    def __init__(self, replies: list[str | int | dict]):
        self.replies = list(replies)
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                reply = fake.replies.pop(0) if fake.replies else "done"
                if isinstance(reply, int):
                    self.send_response(reply)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "scripted failure"}}')
                    return
                message = {"role": "assistant", **reply} if isinstance(reply, dict) else {"role": "assistant",
                                                                                            "content": reply}
                doc = {"id": f"chatcmpl-{len(fake.requests)}", "object": "chat.completion", "model": body["model"],
                       "choices": [{"index": 0, "finish_reason": "tool_calls" if "tool_calls" in message else "stop",
                                    "message": message}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}}
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
