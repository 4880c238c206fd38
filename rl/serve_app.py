"""flashpost-serve's HTTP side: the FastAPI app (OpenAI routes, token-exact session routes, weight
updates by version), the `Server` state behind it, and `ServerThread` (uvicorn on a loopback socket in a
background thread, for rollout workers, tests and benches).

Routes: POST /v1/chat/completions, POST /v1/completions (both with `stream`), GET /v1/models[/{id}],
GET /health; GET|DELETE /v1/sessions/{id} (the recorded trajectory of a `session_id`); GET|POST
/v1/weights (policy version; POST {"checkpoint": path, "version": v} loads new weights between engine
calls). Every error is an OpenAI error body (rl/serve_protocol.py). Not here: batching and the engine
(rl/serve_engine.py), the Hydra entry point (rl/serve.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from model.chat_template import ChatTemplate
from model.engine import InferenceEngine
from rl.serve_engine import Conversation, EngineLoop, Job, ServeConfig, extend_conversation, finish_turn
from rl.serve_protocol import (
    ApiError,
    ChatRequest,
    GenParams,
    bad,
    cut_at_stop,
    finish_reason,
    openai_tool_calls,
    parse_chat_request,
    parse_completion_request,
)


@dataclass
class Opened:
    """A choice ready to generate: its engine session, prompt ids and token budget."""

    sid: int
    prompt_ids: list[int]
    max_tokens: int
    conversation: Conversation | None


class Run:
    """The choices of one request; engine-thread snapshots arrive on `queue` as (index, Job copy)."""

    def __init__(self, opened: list[Opened], params: GenParams, aloop: asyncio.AbstractEventLoop):
        self.opened, self.params, self.aloop = opened, params, aloop
        self.queue: asyncio.Queue = asyncio.Queue()

    def notify(self, index: int):
        def on_chunk(job: Job) -> None:
            snap = Job(**{**vars(job), "token_ids": list(job.token_ids), "logprobs": list(job.logprobs),
                          "versions": list(job.versions)})  # fmt: skip
            try:
                self.aloop.call_soon_threadsafe(self.queue.put_nowait, (index, snap))
            except RuntimeError:  # the HTTP loop is gone (server shutting down): nobody listens
                pass

        return on_chunk

    async def results(self) -> list[Job]:
        done: dict[int, Job] = {}
        while len(done) < len(self.opened):
            i, job = await self.queue.get()
            if job.finish is not None:
                done[i] = job
        return [done[i] for i in range(len(self.opened))]


class Server:
    """The served policy: engine loop, chat template and the open conversations."""

    def __init__(self, engine: InferenceEngine, template: ChatTemplate, cfg: ServeConfig):
        self.template, self.cfg = template, cfg
        self.tokenizer = template.tokenizer
        self.loop = EngineLoop(engine, cfg)
        self.max_seq_len, self.vocab_size = engine.max_seq_len, engine.model.args.vocab_size
        self.conversations: dict[str, Conversation] = {}
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise ApiError(404, f"The model {name!r} does not exist; this server serves {self.cfg.model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")  # fmt: skip

    # ------------------------------------------------------------------ opening choices (engine thread)
    def _budget(self, used: int, params: GenParams) -> int:
        """Tokens this generation may take. A prompt that leaves no room is refused (400); a max_tokens beyond
        the room is cut to it (the reply then ends with finish_reason "length"), because clients written for
        large contexts send fixed budgets (synth/llm.py: 2048) that a small model's context cannot hold."""
        room = self.max_seq_len - used
        if room < 1:
            raise bad(f"this model's maximum context length is {self.max_seq_len} tokens and the prompt has {used}: "
                      "shorten the conversation", "messages", "context_length_exceeded")  # fmt: skip
        return min(room, self.cfg.default_max_tokens if params.max_tokens is None else params.max_tokens)

    def _start(self, engine: InferenceEngine, ids: list[int], n: int) -> list[int]:
        sids = []
        try:
            for _ in range(n):
                sids.append(engine.start(ids))
        except RuntimeError as e:  # max_sessions open
            for sid in sids:
                engine.close(sid)
            raise ApiError(429, f"{e}: finished conversations free theirs with DELETE /v1/sessions/{{id}}",
                           code="rate_limit_exceeded", kind="rate_limit_error") from e  # fmt: skip
        return sids

    def _open_chat(self, engine: InferenceEngine, req: ChatRequest) -> list[Opened]:
        p, key = req.params, req.session_id
        conv = self.conversations.get(key) if key is not None else None
        if conv is None:
            ids = self.template.render(req.messages, tools=req.tools, add_generation_prompt=True).token_ids
            budget = self._budget(len(ids), p)
            sids = self._start(engine, ids, p.n)
            if key is None:
                return [Opened(sid, ids, budget, None) for sid in sids]
            conv = Conversation(key=key, sid=sids[0], tools=req.tools, messages=[dict(m) for m in req.messages],
                                roles=[m["role"] for m in req.messages], logprobs=[float("nan")] * len(ids))
            self.conversations[key] = conv
        else:
            if conv.busy:
                raise ApiError(409, f"session {key!r} is still generating its previous reply", "session_id")
            if req.tools != conv.tools:
                raise bad(f"session {key!r} was started with other tools; a session keeps its tools", "tools")
            n = len(conv.roles)
            roles = [m["role"] for m in req.messages]
            if len(roles) <= n or roles[:n] != conv.roles:
                raise bad(f"session {key!r}: the messages must extend the session's conversation ({n} messages, the "
                          "last the server's reply) by new turns; start a new session_id for another conversation",
                          "messages", "session_diverged")  # fmt: skip
            new = req.messages[n:]
            close = [] if conv.turn_closed else [self.tokenizer.end_id]  # a truncated reply gets its <|end|>
            ids = close + self.template.render_continuation(new).token_ids
            budget = self._budget(len(engine.tokens(conv.sid)) + len(ids), p)
            if close:
                conv.messages[-1]["token_ids"].append(self.tokenizer.end_id)
            extend_conversation(engine, conv, ids)
            conv.messages += [dict(m) for m in new]
            conv.roles += roles[n:]
        conv.busy, conv.last_used = True, time.monotonic()
        prompt = engine.tokens(conv.sid)
        conv.turn_starts.append(len(prompt))
        return [Opened(conv.sid, prompt, budget, conv)]

    def _open_completion(self, engine: InferenceEngine, prompt: str | list[int], p: GenParams) -> list[Opened]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad("the prompt encodes to no tokens", "prompt")
        budget = self._budget(len(ids), p)
        return [Opened(sid, ids, budget, None) for sid in self._start(engine, ids, p.n)]

    # ------------------------------------------------------------------ running choices
    async def run(self, opener, params: GenParams) -> Run:
        """Reserve capacity, open the choices on the engine thread, queue their generation."""
        self.loop.reserve(params.n)
        try:
            opened = await self.loop.acall(lambda e: self._expire(e) or opener(e))
        except BaseException:
            self.loop.release(params.n)
            raise
        run = Run(opened, params, asyncio.get_running_loop())
        seeds = _seeds(params, len(opened))
        jobs = [Job(sid=o.sid, max_tokens=o.max_tokens, temperature=params.temperature, top_p=params.top_p,
                    stop=params.stop, seed=seeds[i], on_chunk=run.notify(i), on_finish=self._finisher(o),
                    prompt_len=len(o.prompt_ids)) for i, o in enumerate(opened)]  # fmt: skip
        self.loop.submit(jobs)
        return run

    def _expire(self, engine: InferenceEngine) -> None:
        """Close conversations idle for longer than serve.session_ttl_s (engine thread)."""
        now = time.monotonic()
        for key, conv in list(self.conversations.items()):
            if not conv.busy and now - conv.last_used > self.cfg.session_ttl_s:
                engine.close(conv.sid)
                del self.conversations[key]

    def _finisher(self, o: Opened):
        engine, stop_ids = self.loop.engine, self.template.stop_ids
        if o.conversation is not None:
            return lambda job: finish_turn(engine, o.conversation, job, stop_ids)
        return lambda job: engine.close(job.sid)

    async def record(self, key: str) -> dict[str, Any]:
        conv = self.conversations.get(key)
        if conv is None:
            raise ApiError(404, f"no session {key!r}", "session_id", "session_not_found")
        return await self.loop.acall(lambda e: conv.record(e))

    async def delete(self, key: str) -> None:
        def drop(engine: InferenceEngine) -> None:
            conv = self.conversations.get(key)
            if conv is None:
                raise ApiError(404, f"no session {key!r}", "session_id", "session_not_found")
            if conv.busy:
                raise ApiError(409, f"session {key!r} is still generating", "session_id")
            engine.close(conv.sid)
            del self.conversations[key]

        await self.loop.acall(drop)

    @property
    def policy_version(self) -> int:
        return self.loop.engine.policy_version


def _seeds(params: GenParams, n: int) -> list[int]:
    """Choice k of a seeded request samples with seed·1000003 + k (the engine's rule); unseeded ones draw."""
    if params.seed is None:
        import random

        return [random.getrandbits(62) for _ in range(n)]
    return [params.seed] if n == 1 else [(params.seed * 1_000_003 + k) % 2**63 for k in range(n)]


# ---------------------------------------------------------------------- response bodies
def _body_ids(server: Server, ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in server.template.stop_ids else ids


def _extension(job: Job) -> dict[str, Any]:
    return {"token_ids": job.token_ids, "token_logprobs": job.logprobs, "policy_versions": job.versions}


def _openai_logprobs(server: Server, job: Job) -> dict[str, Any]:
    toks = [server.tokenizer.decode([t]) for t in job.token_ids]
    return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                        for s, lp in zip(toks, job.logprobs)]}  # fmt: skip


def chat_message(server: Server, job: Job, stop: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    parsed = server.template.parse_assistant(job.token_ids)
    calls = openai_tool_calls(parsed)
    content = cut_at_stop(parsed.content, stop)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if parsed.reasoning is not None:
        msg["reasoning_content"] = parsed.reasoning
    return msg, finish_reason(job.finish, bool(calls))


def _check_errors(jobs: list[Job]) -> None:
    failed = [j.error for j in jobs if j.finish == "error"]
    if failed:
        raise ApiError(500, f"generation failed: {failed[0]}", kind="server_error", code="engine_error")


def _usage(run: Run, jobs: list[Job]) -> dict[str, int]:
    prompt = len(run.opened[0].prompt_ids)
    completion = sum(len(j.token_ids) for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _header(server: Server, run: Run, kind: str, session_id: str | None) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
            "created": int(time.time()), "model": server.cfg.model_name,
            "prompt_token_ids": run.opened[0].prompt_ids, "policy_version": server.policy_version,
            "session_id": session_id}  # fmt: skip


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


async def _stream(server: Server, run: Run, chat: bool, session_id: str | None) -> AsyncIterator[str]:
    """SSE chunks: content deltas as chunks are decoded (text held back while it may still become a stop
    string or a partial character), tool calls and the token extension with each choice's last chunk."""
    head = _header(server, run, "chat.completion.chunk" if chat else "text_completion", session_id)
    stop, n = run.params.stop, len(run.opened)
    hold = max((len(s) for s in stop), default=1) - 1
    sent, finished, jobs = [""] * n, 0, [None] * n
    if chat:
        yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None} for i in range(n)]})  # fmt: skip
    while finished < n:
        i, job = await run.queue.get()
        if job.finish == "error":
            yield _sse({"error": {"message": f"generation failed: {job.error}", "type": "server_error"}})
            return
        if chat:
            text = server.template.parse_assistant(job.token_ids).content
        else:
            text = server.tokenizer.decode(_body_ids(server, job.token_ids))
        text = cut_at_stop(text, stop)
        if job.finish is None:
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")
        delta = text[len(sent[i]) :] if text.startswith(sent[i]) else ""
        if delta:
            sent[i] = text
            piece = {"delta": {"content": delta}} if chat else {"text": delta}
            yield _sse({**head, "choices": [{"index": i, **piece, "finish_reason": None}]})
        if job.finish is not None:
            finished, jobs[i] = finished + 1, job
            last: dict[str, Any] = {"index": i, **_extension(job)}
            if chat:
                msg, reason = chat_message(server, job, stop)
                calls = [{"index": k, **c} for k, c in enumerate(msg.get("tool_calls", []))]
                last |= {"delta": {"tool_calls": calls} if calls else {}, "finish_reason": reason}
            else:
                last |= {"text": "", "finish_reason": job.finish}
            yield _sse({**head, "choices": [last]})
    if run.params.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(run, jobs)})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- the app
def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="flashpost-serve")
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        err = ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    async def body(request: Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from e

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_chat_request(await body(request), server.cfg.max_n)
        server.check_model(req.model)
        run = await server.run(lambda e: server._open_chat(e, req), req.params)
        if req.params.stream:
            return StreamingResponse(_stream(server, run, True, req.session_id), media_type="text/event-stream")
        jobs = await run.results()
        _check_errors(jobs)
        choices = []
        for i, job in enumerate(jobs):
            msg, reason = chat_message(server, job, req.params.stop)
            choice = {"index": i, "message": msg, "finish_reason": reason, **_extension(job)}
            choice["logprobs"] = _openai_logprobs(server, job) if req.params.logprobs else None
            choices.append(choice)
        return {**_header(server, run, "chat.completion", req.session_id), "choices": choices,
                "usage": _usage(run, jobs)}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion_request(await body(request), server.cfg.max_n, server.vocab_size)
        server.check_model(req.model)
        run = await server.run(lambda e: server._open_completion(e, req.prompt, req.params), req.params)
        if req.params.stream:
            return StreamingResponse(_stream(server, run, False, None), media_type="text/event-stream")
        jobs = await run.results()
        _check_errors(jobs)
        choices = [{"index": i, "text": cut_at_stop(server.tokenizer.decode(_body_ids(server, j.token_ids)),
                                                     req.params.stop),
                    "finish_reason": j.finish, "logprobs": None, **_extension(j)} for i, j in enumerate(jobs)]
        return {**_header(server, run, "text_completion", None), "choices": choices, "usage": _usage(run, jobs)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        server.check_model(name)
        return _model_card(server)

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": server.policy_version, "pending": server.loop.n_pending,
                "sessions": len(server.conversations), **server.loop.stats}  # fmt: skip

    @app.get("/v1/sessions/{key}")
    async def session(key: str):
        return await server.record(key)

    @app.delete("/v1/sessions/{key}")
    async def delete_session(key: str):
        await server.delete(key)
        return {"id": key, "object": "session", "deleted": True}

    @app.get("/v1/weights")
    async def weights():
        return {"policy_version": server.policy_version}

    @app.post("/v1/weights")
    async def load_weights(request: Request):
        doc = await body(request)
        path, version = (doc.get("checkpoint"), doc.get("version")) if isinstance(doc, dict) else (None, None)
        if not isinstance(path, str) or isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise bad("POST /v1/weights takes {'checkpoint': <model.safetensors path>, 'version': <int >= 0>}")
        await server.loop.acall(lambda e: _load_checkpoint(e, path, version))
        return {"policy_version": server.policy_version}

    return app


def _load_checkpoint(engine: InferenceEngine, path: str, version: int) -> None:
    from model.checkpoint import load_checkpoint

    try:
        load_checkpoint(engine.model, path)
    except (OSError, ValueError) as e:
        raise bad(f"cannot load {path}: {e}", "checkpoint") from e
    # the engine stamps generated tokens with the version it was last given through load_state_dict
    engine.load_state_dict(engine.model.state_dict(), version)


def _model_card(server: Server) -> dict[str, Any]:
    return {"id": server.cfg.model_name, "object": "model", "created": server.created, "owned_by": "flashpost",
            "max_model_len": server.max_seq_len}  # fmt: skip


class ServerThread:
    """uvicorn serving `app` on host:port (port 0: a free one) from a daemon thread; `base_url` ends in /v1."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"flashpost-serve did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Run", "Server", "ServerThread", "build_app", "chat_message"]
