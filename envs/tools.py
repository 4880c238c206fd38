"""Agent tools (bash, view, edit, create, run_tests, submit): JSON schemas and their execution in a Sandbox.

`TOOLS` is the explicit dispatch dict; `execute_tool_call` validates a parsed call against the tool's
schema and runs it. Every failure the model caused (unknown tool, bad arguments, missing file, ambiguous
edit) comes back as an error `ToolResult` the model can read; only sandbox/engine failures raise.
File tools read with `Sandbox.read_file` but write through `exec` as the sandbox's user, so they have
exactly the privileges `bash` has. `run_tests` is feedback for the agent only: rewards come from
envs/grading.py in a pristine container, never from here. Parsing the wire format is envs/protocol.py.
"""

from __future__ import annotations

import base64
import dataclasses
import posixpath
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envs.protocol import ToolCall

if TYPE_CHECKING:
    from envs.sandbox import Sandbox


@dataclass(kw_only=True)
class ToolConfig:
    bash_timeout_s: float = 60.0  # when the call gives none
    max_timeout_s: float = 600.0  # cap on a requested bash timeout
    run_tests_timeout_s: float = 300.0
    max_observation_bytes: int = 16_000  # head + tail kept of long outputs
    max_file_bytes: int = 4_000_000  # view/edit refuse larger files (use bash)
    max_dir_entries: int = 400


@dataclass
class ToolContext:
    """Per-episode facts the tools need. `deadline` is a time.monotonic() value that clips timeouts."""

    config: ToolConfig
    test_command: str | None = None
    workdir: str = "/workspace"
    deadline: float | None = None
    default_path: str | None = None  # the task's one file (envs.episode.task_file): view/edit without a path


@dataclass
class ToolResult:
    output: str  # the observation text shown to the model
    ok: bool = True  # False: the call was invalid or the tool failed (a non-zero exit code is still ok)
    ends_episode: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0


def _error(msg: str) -> ToolResult:
    return ToolResult(output=f"error: {msg}", ok=False)


# ---------------------------------------------------------------- argument validation (JSON schema subset)

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def validate_arguments(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """Check `value` against the subset of JSON schema the tool schemas use: type, properties, required,
    additionalProperties (objects reject unknown keys unless it is true), items, minItems/maxItems,
    minimum, enum. Returns readable problems; empty means valid."""
    expected = schema.get("type")
    if expected is not None and not _JSON_TYPES[expected](value):
        return [f"{where} must be {expected}, got {_json_type(value)}"]
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and value < schema["minimum"]:
        problems.append(f"{where} must be >= {schema['minimum']}, got {value}")
    if expected == "object":
        props = schema.get("properties", {})
        problems += [f"missing required argument {where}.{k}" for k in schema.get("required", [])
                     if k not in value]
        if schema.get("additionalProperties", False) is not True:
            problems += [f"unexpected argument {where}.{k} (allowed: {sorted(props) or 'none'})"
                         for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                problems += validate_arguments(props[k], v, f"{where}.{k}")
    if expected == "array":
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(f"{where} needs at least {schema['minItems']} items, got {len(value)}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{where} allows at most {schema['maxItems']} items, got {len(value)}")
        if "items" in schema:
            for i, item in enumerate(value):
                problems += validate_arguments(schema["items"], item, f"{where}[{i}]")
    return problems


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


# ---------------------------------------------------------------- helpers


def _resolve(ctx: ToolContext, path: str) -> str:
    return posixpath.normpath(posixpath.join(ctx.workdir, path))


def _timeout(ctx: ToolContext, requested: float) -> float:
    t = min(requested, ctx.config.max_timeout_s)
    if ctx.deadline is not None:
        t = min(t, ctx.deadline - time.monotonic())
    return max(t, 1.0)


# Prints "<kind> <size> <resolved path>" for a path; kind in dir, file, other, missing.
_STAT_SH = r"""p="$1"
if [ -d "$p" ]; then echo "dir 0 $p"
elif [ -f "$p" ]; then echo "file $(stat -L -c %s "$p") $(readlink -f "$p")"
elif [ -e "$p" ] || [ -L "$p" ]; then echo "other 0 $p"
else echo "missing 0 $p"; fi"""


def _stat(sb: Sandbox, path: str) -> tuple[str, int, str]:
    r = sb.exec(["sh", "-c", _STAT_SH, "sh", path], timeout=30)
    kind, size, resolved = (r.output.strip().split(" ", 2) + ["", ""])[:3]
    if r.exit_code != 0 or kind not in ("dir", "file", "other", "missing"):
        raise RuntimeError(f"stat of {path!r} failed in sandbox (exit {r.exit_code}): {r.output[:500]}")
    return kind, int(size), resolved


def _read_text(sb: Sandbox, ctx: ToolContext, path: str) -> str | ToolResult:
    kind, size, resolved = _stat(sb, path)
    if kind != "file":
        return _error(f"{path} is {'a directory' if kind == 'dir' else 'not a regular file'}"
                      if kind != "missing" else f"{path} does not exist")
    if size > ctx.config.max_file_bytes:
        return _error(f"{path} is {size} bytes (limit {ctx.config.max_file_bytes}); use bash (head/sed/grep)")
    try:
        return sb.read_file(resolved).decode("utf-8")
    except UnicodeDecodeError:
        return _error(f"{path} is not UTF-8 text; use bash to inspect it")


_WRITE_CHUNK = 48_000  # raw bytes per exec; base64 makes it 64 KB, under Linux's 128 KB per-argument cap


def _write_text(sb: Sandbox, path: str, text: str) -> ToolResult | None:
    """Write as the sandbox user (in-place truncate keeps mode and owner). None on success."""
    data = text.encode("utf-8")
    chunks = [data[i : i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        redirect = ">" if i == 0 else ">>"
        cmd = f'printf %s "$2" | base64 -d {redirect} "$1"'
        r = sb.exec(["sh", "-c", cmd, "sh", path, base64.b64encode(chunk).decode()], timeout=60)
        if r.exit_code != 0:
            return _error(f"could not write {path}: {r.output.strip()[:500]}")
    return None


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{first + i:6}\t{line}" for i, line in enumerate(lines))


# ---------------------------------------------------------------- the tools


def run_bash(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    timeout = _timeout(ctx, args.get("timeout", ctx.config.bash_timeout_s))
    return _run_shell(sb, args["command"], timeout, ctx)


# The end of pytest's summary line: " in 0.08s" or " in 61.12s (0:01:01)", then its closing "=" rule if any.
_PYTEST_RUN_TIME = re.compile(r" in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?(?=(?: =+)?$)", re.MULTILINE)


def drop_run_time(output: str) -> str:
    """`output` without pytest's run time on its summary line ("1 failed, 49 passed in 0.08s" ->
    "1 failed, 49 passed"): the time is the machine's, not the workspace's, so with it the same
    workspace would give a different observation on every run, and the demonstrations recorded from
    these observations (and every SFT run on them) would differ between two builds of one task set."""
    return _PYTEST_RUN_TIME.sub("", output)


def run_tests(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    if not ctx.test_command:
        return _error("this task has no test command; use bash to run tests")
    res = _run_shell(sb, ctx.test_command, _timeout(ctx, ctx.config.run_tests_timeout_s), ctx)
    return dataclasses.replace(res, output=drop_run_time(res.output))


def _run_shell(sb: Sandbox, command: str, timeout: float, ctx: ToolContext) -> ToolResult:
    # The sandbox keeps the head and tail of long outputs and marks how many bytes it cut.
    r = sb.exec(command, timeout=timeout, workdir=ctx.workdir,
                max_output_bytes=ctx.config.max_observation_bytes)
    status = (f"[timed out after {timeout:g} s; the command was killed]" if r.timed_out
              else f"[exit code: {r.exit_code}]")
    out = r.output.rstrip()
    return ToolResult(output=f"{out}\n{status}" if out else status, ok=not r.timed_out,
                      exit_code=r.exit_code, timed_out=r.timed_out)


def _path(args: dict[str, Any], ctx: ToolContext) -> str | ToolResult:
    if "path" in args:
        return _resolve(ctx, args["path"])
    if ctx.default_path is None:
        return _error("this task names no single file: pass path")
    return _resolve(ctx, ctx.default_path)


def run_view(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    path = _path(args, ctx)
    if isinstance(path, ToolResult):
        return path
    kind, _, _ = _stat(sb, path)
    if kind == "dir":
        if "view_range" in args:
            return _error("view_range only applies to files")
        return _list_dir(sb, path, ctx)
    text = _read_text(sb, ctx, path)
    if isinstance(text, ToolResult):
        return text
    lines = text.splitlines()
    if not lines:
        return ToolResult(output=f"{path} is empty")
    start, end = args.get("view_range", [1, -1])
    end = len(lines) if end == -1 else end
    if not 1 <= start <= len(lines) or end < start:
        return _error(f"invalid view_range {args['view_range']}: {path} has {len(lines)} lines; "
                      "use 1 <= start <= end (end -1 means the last line)")
    end = min(end, len(lines))
    budget, shown = ctx.config.max_observation_bytes, []
    for i in range(start - 1, end):
        budget -= len(lines[i].encode("utf-8", errors="replace")) + 8
        if budget < 0:
            if not shown:  # one huge line (minified code): show its start rather than nothing
                shown.append(lines[i][: ctx.config.max_observation_bytes // 2] + " [... line cut ...]")
            break
        shown.append(lines[i])
    out = _numbered(shown, start)
    if len(shown) < end - start + 1:
        last = start + len(shown) - 1
        out += (f"\n[... output limit reached; showed lines {start}-{last} of {len(lines)}; "
                "use view_range to see more ...]")
    return ToolResult(output=out)


def _list_dir(sb: Sandbox, path: str, ctx: ToolContext) -> ToolResult:
    limit = ctx.config.max_dir_entries
    script = ('find "$1" -mindepth 1 -maxdepth 2 -name ".*" -prune -o -printf "%y %P\\n"'
              f" | head -n {limit + 1}")
    r = sb.exec(["sh", "-c", script, "sh", path], timeout=30)
    if r.exit_code != 0:
        return _error(f"could not list {path}: {r.output.strip()[:500]}")
    entries = sorted(e[2:] + ("/" if e[0] == "d" else "") for e in r.output.splitlines() if e)
    more = f"\n[... more than {limit} entries; use bash to list]" if len(entries) > limit else ""
    body = "\n".join(entries[:limit]) or "(empty directory)"
    return ToolResult(output=f"{path}/ (hidden entries omitted, depth 2):\n{body}{more}")


def run_edit(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    path = _path(args, ctx)
    if isinstance(path, ToolResult):
        return path
    old, new = args["old_str"], args["new_str"]
    if not old:
        return _error("old_str must not be empty")
    text = _read_text(sb, ctx, path)
    if isinstance(text, ToolResult):
        return text
    if "line" in args:
        return _edit_line(sb, path, text, args["line"], old, new)
    n = text.count(old)
    if n == 0:
        return _error(f"old_str was found 0 times in {path}; it must match the file exactly "
                      "(whitespace and indentation included) exactly once")
    if n > 1:
        starts, i = [], text.find(old)
        while i >= 0:
            starts.append(text.count("\n", 0, i) + 1)
            i = text.find(old, i + 1)
        return _error(f"old_str was found {n} times in {path} (at lines {starts[:20]}); add surrounding "
                      "lines, or pass line, so it matches exactly once")
    at = text.index(old)
    updated = text[:at] + new + text[at + len(old) :]
    if (failed := _write_text(sb, path, updated)) is not None:
        return failed
    first = updated.count("\n", 0, at) + 1
    lines = updated.splitlines()
    lo, hi = max(first - 4, 0), min(first + new.count("\n") + 3, len(lines))
    snippet = _numbered(lines[lo:hi], lo + 1)
    return ToolResult(output=f"Edited {path}. Lines {lo + 1}-{hi} now read:\n{snippet}")


def _edit_line(sb: Sandbox, path: str, text: str, lineno: int, old: str, new: str) -> ToolResult:
    """The short form: replace the first occurrence of `old` on line `lineno` (a one-token fix is a
    one-token call; the observation is that line alone, so the agent reads what it wrote)."""
    lines = text.splitlines(keepends=True)
    if not 1 <= lineno <= len(lines):
        return _error(f"line {lineno} is not in {path} ({len(lines)} lines)")
    line = lines[lineno - 1]
    if old not in line:
        return _error(f"old_str {old!r} is not on line {lineno}: {line.strip()}")
    lines[lineno - 1] = line.replace(old, new, 1)
    if (failed := _write_text(sb, path, "".join(lines))) is not None:
        return failed
    return ToolResult(output=f"line {lineno}: {lines[lineno - 1].strip()}")


def run_create(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    path = _resolve(ctx, args["path"])
    kind, _, _ = _stat(sb, path)
    if kind == "file" and not args.get("overwrite", False):
        return _error(f"{path} already exists; use edit to change it, or pass overwrite: true to replace it")
    if kind in ("dir", "other"):
        return _error(f"{path} exists and is not a regular file")
    r = sb.exec(["mkdir", "-p", posixpath.dirname(path)], timeout=30)
    if r.exit_code != 0:
        return _error(f"could not create the parent directory of {path}: {r.output.strip()[:500]}")
    if (failed := _write_text(sb, path, args["content"])) is not None:
        return failed
    verb = "Overwrote" if kind == "file" else "Created"
    return ToolResult(output=f"{verb} {path} ({len(args['content'].splitlines())} lines)")


def run_submit(sb: Sandbox, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(output="Submitted. The episode is over.", ends_episode=True)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[Sandbox, dict[str, Any], ToolContext], ToolResult]

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling form."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def _params(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An object schema. No `additionalProperties: false` and no empty `required`: `validate_arguments`
    rejects unknown keys without it, and every schema key is prefill of every episode."""
    return {"type": "object", "properties": properties} | ({"required": required} if required else {})


# Descriptions are terse on purpose: every episode's system turn carries all schemas (model/chat_template.py),
# so each word is prefill of every episode and every demonstration.
_PATH = {"type": "string", "description": "Relative to the repository root; default: the task's file."}
_STR = {"type": "string"}

TOOLS: dict[str, Tool] = {
    "bash": Tool(
        name="bash",
        description="Run a shell command in the repository (no network); output and exit code.",
        parameters=_params({
            "command": _STR,
            "timeout": {"type": "integer", "minimum": 1, "description": "Seconds (default 60, at most 600)."},
        }, ["command"]),
        run=run_bash,
    ),
    "view": Tool(
        name="view",
        description="Show a file with line numbers (view_range [start, end], end -1: last line), or list a "
        "directory.",
        parameters=_params({
            "path": _PATH,
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        }, []),
        run=run_view,
    ),
    "edit": Tool(
        name="edit",
        description="Replace old_str by new_str: on the given line (first occurrence), or where it occurs "
        "exactly once in the file.",
        parameters=_params({
            "path": _PATH,
            "line": {"type": "integer", "minimum": 1},
            "old_str": _STR,
            "new_str": _STR,
        }, ["old_str", "new_str"]),
        run=run_edit,
    ),
    "create": Tool(
        name="create",
        description="Create a file (overwrite: true replaces an existing one).",
        parameters=_params({
            "path": _STR,
            "content": _STR,
            "overwrite": {"type": "boolean"},
        }, ["path", "content"]),
        run=run_create,
    ),
    "run_tests": Tool(
        name="run_tests",
        description="Run the task's tests: the first failure and a summary. Feedback only.",
        parameters=_params({}, []),
        run=run_tests,
    ),
    "submit": Tool(
        name="submit",
        description="Submit the working tree as your solution; ends the episode.",
        parameters=_params({}, []),
        run=run_submit,
    ),
}


def tool_schemas(names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The schemas of the tools `names` (a task's `tools`), in TOOLS order; None or empty: every tool. The
    schemas are most of a short episode's tokens, so a task offers only the tools it needs."""
    if not names:
        return [tool.schema for tool in TOOLS.values()]
    unknown = sorted(set(names) - set(TOOLS))
    if unknown:
        raise ValueError(f"unknown tools {unknown} in a task's `tools`; available tools: {', '.join(TOOLS)}")
    return [tool.schema for name, tool in TOOLS.items() if name in names]


def execute_tool_call(sb: Sandbox, call: ToolCall, ctx: ToolContext) -> ToolResult:
    """Validate and run one call. Model mistakes come back as error results; sandbox failures raise."""
    t0 = time.monotonic()
    tool = TOOLS.get(call.name)
    if tool is None:
        result = _error(f"unknown tool {call.name!r}; available tools: {', '.join(TOOLS)}")
    elif problems := validate_arguments(tool.parameters, call.arguments):
        result = _error(f"invalid arguments for {call.name}: " + "; ".join(problems))
    else:
        result = tool.run(sb, call.arguments, ctx)
    result.duration_s = time.monotonic() - t0
    return result
