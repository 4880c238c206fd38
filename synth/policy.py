"""The policy-checkpoint solver: a flashpost checkpoint (model/checkpoint.py, safetensors) loaded into
model/engine.py's InferenceEngine and wrapped as an envs/episode.py policy, so factory tasks are tried
by the same model, chat template and tool protocol that RL rollouts use.

Token-in/token-out: one engine session per episode. The first turn renders the system prompt (with the
tool schemas), the issue and a generation prompt; later turns `extend` the session with only the new
tool/user turns (`ChatTemplate.render_continuation`), so the model sees exactly the tokens it produced.
The model is loaded once per run and shared by the solve stage's threads behind a lock (the engine is
not thread-safe). Not here: the agent loop (envs/episode.py) or the pass matrix (synth/stages/solve.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

from envs.protocol import Message
from envs.tools import tool_schemas
from synth.config import PolicySolverOptions


class ContextFull(RuntimeError):
    """The conversation no longer fits the engine's max_seq_len (the episode ends as a policy error)."""


class CheckpointModel:
    """A checkpoint loaded into an InferenceEngine with the default tokenizer's chat template."""

    def __init__(self, opts: PolicySolverOptions):
        from model.chat_template import ChatTemplate
        from model.checkpoint import load_checkpoint, read_config
        from model.config import ModelArgs, get_flavor
        from model.engine import InferenceEngine
        from model.engram import EngramHasher
        from model.tokenizer import Tokenizer
        from model.transformer import Transformer

        self.opts = opts
        args = read_config(opts.checkpoint)
        if args is None:
            if not opts.flavor:
                raise ValueError(f"{opts.checkpoint} stores no model config; set solvers.policy.flavor")
            args = get_flavor(opts.flavor)
        if opts.max_seq_len:  # rope tables only: no weight depends on it
            args = ModelArgs.from_config_json(args.to_dict(), max_seq_len=opts.max_seq_len)
        self.tokenizer = Tokenizer.default()
        if self.tokenizer.vocab_size > args.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids, the model {args.vocab_size}")
        self.template = ChatTemplate(self.tokenizer)
        model = Transformer(args, engram_hasher=EngramHasher(args, self.tokenizer) if args.engram_layer_ids else None)
        load_checkpoint(model, opts.checkpoint)  # strict: every tensor of the model, shapes checked
        self.engine = InferenceEngine(model, self.template, device=opts.device)
        self.max_seq_len = self.engine.max_seq_len
        self.name = f"policy:{Path(opts.checkpoint).stem}"
        self.lock = threading.Lock()
        self.open_sessions: set[int] = set()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def policy(self, seed: int, tools: list[str] | None = None) -> EnginePolicy:
        """One episode's policy, offered the task's `tools` (envs.task.Task.tools; None: every tool)."""
        return EnginePolicy(self, seed, tools)


class EnginePolicy:
    """One episode's policy (`policy(messages) -> text`); `close()` frees its engine session."""

    def __init__(self, model: CheckpointModel, seed: int, tools: list[str] | None = None):
        self.model, self.seed, self.tools = model, seed, tool_schemas(tools)
        self.session: int | None = None
        self.length = 0  # tokens in the session
        self.n_messages = 0  # messages of the conversation already in the session
        self.turns = 0
        self.generated_tokens = 0

    def __call__(self, messages: list[Message]) -> str:
        m, t = self.model, self.model.template
        with m.lock:
            if self.session is None:
                ids = t.render(messages, tools=self.tools, add_generation_prompt=True).token_ids
                self._check_room(len(ids))
                self.session = m.engine.start(ids)
                m.open_sessions.add(self.session)
            else:
                ids = t.render_continuation(messages[self.n_messages:]).token_ids
                self._check_room(len(ids))
                m.engine.extend(self.session, ids)
            self.length += len(ids)
            budget = min(m.opts.max_new_tokens, m.max_seq_len - self.length)
            gen = m.engine.generate([self.session], max_new_tokens=budget, temperature=m.opts.temperature,
                                    seed=self.seed * 1_000_003 + self.turns)[0]
            self.length += len(gen.token_ids)
            if gen.finish_reason == "length" and self.length < m.max_seq_len:
                m.engine.extend(self.session, [m.tokenizer.end_id])  # close the truncated turn as rendered
                self.length += 1
        self.n_messages = len(messages) + 1  # + the assistant message the episode appends
        self.turns += 1
        self.generated_tokens += len(gen.token_ids)
        ids = [i for i in gen.token_ids if i not in t.stop_ids]
        return m.tokenizer.decode(ids)  # tool-call tags decode to the envs/protocol.py text

    def _check_room(self, adding: int) -> None:
        if self.length + adding + 1 > self.model.max_seq_len:
            raise ContextFull(f"{self.length} + {adding} tokens leave no room to generate in "
                              f"{self.model.max_seq_len}")

    def close(self) -> None:
        if self.session is not None:
            with self.model.lock:
                self.model.engine.close(self.session)
                self.model.open_sessions.discard(self.session)
            self.session = None
