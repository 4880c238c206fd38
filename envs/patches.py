"""Patch screening: parse an agent's diff the way `git apply` does, and decide what may be applied.

`parse_patch` finds every file patch `git apply` would find: `diff --git` blocks with their
extended headers (renames, copies, modes, binary literals) and plain `--- a/x` / `+++ b/x` diffs
anywhere in the text (git accepts those without a `diff --git` line), counting hunk lines so a
header-looking line inside a hunk stays content. Text that is no file patch is dropped, and the
patch applied is rebuilt from the parsed blocks only, so nothing the parser did not see reaches
`git apply`; the grader re-checks the applied tree against `PatchScreen.paths` as well.

`screen_patch` applies the policy to every path a block names (old and new side, each header):
  - refused (the whole patch scores 0): paths pytest or Python load on their own (conftest.py,
    *.pth, sitecustomize/usercustomize, pytest/tox/setup.cfg/pyproject/setup.py config, pytest
    plugins, packaging metadata, bytecode), modules shadowing the stdlib or pytest, `.git*`,
    absolute or `..` paths, quoted/odd names, symlinks and submodules, malformed diffs;
  - dropped (not applied, listed): test files (the grader restores them anyway) and, by default,
    new files: only existing non-test files may change.
Not here: running tests (envs/grading.py, envs/grade_runner.py).
"""

from __future__ import annotations

import fnmatch
import re
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath

# What pytest loads on its own, or what Python runs at startup: never changed by a candidate.
AUTOLOADED_NAMES = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                    "setup.py", "sitecustomize.py", "usercustomize.py", ".pytest_cache", "__pycache__",
                    "__main__.py", ".gitattributes", ".gitignore", ".gitmodules", ".git"}
AUTOLOADED_GLOBS = ["*.pth", "*.pyc", "*.pyo", "*.dist-info", "*.egg-info", "*.egg-link", "pytest_*.py",
                    "*.so", "*.pyd"]
TEST_GLOBS = ["test_*.py", "*_test.py"]
TEST_DIRS = {"tests", "test", "testing"}
# Top-level modules that would shadow the standard library or the test runner's own packages.
SHADOWED = set(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"}

_GIT_HEADER_OPS = ("--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ",
                   "copy from ", "copy to ", "rename old ", "rename new ", "rename from ", "rename to ",
                   "similarity index ", "dissimilarity index ", "index ")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._/+@=-][A-Za-z0-9._/+@=~ -]*$")


class PatchParseError(ValueError):
    """The text is not a patch `git apply` would apply as we read it; the message says where."""


@dataclass(frozen=True)
class FilePatch:
    paths: tuple[str, ...]  # every workspace path git will touch for this block (both sides)
    new: tuple[str, ...]  # of those, the ones it creates (new file, copy or rename target)
    modes: tuple[str, ...]  # every mode the headers give
    text: str


@dataclass(frozen=True)
class PatchScreen:
    patch: str  # what may be applied: the kept blocks, exactly as parsed
    paths: list[str] = field(default_factory=list)  # every workspace path the kept blocks touch
    dropped: list[str] = field(default_factory=list)  # paths not applied
    notes: list[str] = field(default_factory=list)  # why each was dropped
    refused: str | None = None  # why the whole patch scores 0, or None


def _hunks(lines: list[str], i: int, where: str) -> int:
    """Consume the hunks starting at lines[i]; returns the index after them."""
    while i < len(lines) and (m := _HUNK.match(lines[i])):
        old = int(m.group(2) if m.group(2) is not None else 1)
        new = int(m.group(4) if m.group(4) is not None else 1)
        i += 1
        while old > 0 or new > 0:
            if i >= len(lines):
                raise PatchParseError(f"{where}: hunk ends early (the file ends {old}/{new} lines short)")
            c = lines[i][:1]
            if c in (" ", "\n", "\r"):
                old, new = old - 1, new - 1
            elif c == "-":
                old -= 1
            elif c == "+":
                new -= 1
            elif c != "\\":
                raise PatchParseError(f"{where}: corrupt hunk line {lines[i][:80]!r}")
            if old < 0 or new < 0:
                raise PatchParseError(f"{where}: hunk has more lines than its header says")
            i += 1
        while i < len(lines) and lines[i].startswith("\\"):
            i += 1
    return i


def _binary(lines: list[str], i: int, where: str) -> int:
    if lines[i].startswith("Binary files "):
        return i + 1
    i += 1  # "GIT binary patch"
    for _ in range(2):  # forward and (optional) reverse literal/delta
        if i >= len(lines) or not re.match(r"^(literal|delta) \d+$", lines[i].rstrip("\n")):
            break
        i += 1
        while i < len(lines) and lines[i].strip():
            i += 1
        if i >= len(lines):
            raise PatchParseError(f"{where}: binary patch without its closing empty line")
        i += 1
    return i


def parse_patch(text: str) -> list[FilePatch]:
    """Every file patch in `text`, in order; text between them is ignored, as git does."""
    lines = text.splitlines(keepends=True)
    out: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        git = line.startswith("diff --git ")
        plain = (line.startswith("--- ") and i + 2 < len(lines) and lines[i + 1].startswith("+++ ")
                 and lines[i + 2].startswith("@@ -"))
        if not (git or plain):
            i += 1
            continue
        start, where = i, f"file patch at line {i + 1}"
        paths, new, modes = [], [], []
        if git:
            halves = line[len("diff --git "):].rstrip("\n").split(" ")
            if len(halves) != 2:
                raise PatchParseError(f"{where}: cannot tell the two paths of {line.strip()!r}")
            paths += [_strip1(h, where) for h in halves]
            i += 1
            minus = plus = None
            minus_null = False
            while i < len(lines) and lines[i].startswith(_GIT_HEADER_OPS):
                h = lines[i].rstrip("\n")
                op = next(o for o in _GIT_HEADER_OPS if h.startswith(o))
                value = h[len(op):]
                if op == "--- ":
                    minus = _side(value, where)
                    minus_null = minus is None
                elif op == "+++ ":
                    plus = _side(value, where)
                elif op in ("copy from ", "rename from ", "rename old "):
                    paths.append(value)
                elif op in ("copy to ", "rename to ", "rename new "):
                    paths.append(value)
                    new.append(value)
                elif op.endswith("mode "):
                    modes.append(value)
                    if op == "new file mode ":
                        new.append(paths[1])
                i += 1
            paths += [p for p in (minus, plus) if p]
            if minus_null and plus is not None:
                new.append(plus)
            if i < len(lines) and lines[i].startswith(("GIT binary patch", "Binary files ")):
                i = _binary(lines, i, where)
        else:
            minus, plus = _side(lines[i][4:], where), _side(lines[i + 1][4:], where)
            paths += [p for p in (minus, plus) if p]
            if minus is None and plus:
                new.append(plus)
            i += 2
        i = _hunks(lines, i, where)
        body = "".join(lines[start:i])
        out.append(FilePatch(tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(new)), tuple(modes),
                             body if body.endswith("\n") else body + "\n"))
    return out


def _strip1(name: str, where: str) -> str:
    """git apply's default -p1: drop the first path component (the a/ or b/ prefix)."""
    if "/" not in name or name.startswith('"'):
        raise PatchParseError(f"{where}: cannot tell which file {name!r} means")
    return name.split("/", 1)[1]


def _side(value: str, where: str) -> str | None:
    """The path of a ---/+++ line (None for /dev/null); git ends the name at a tab."""
    name = value.rstrip("\n").split("\t")[0]
    return None if name == "/dev/null" else _strip1(name, where)


def path_problem(path: str) -> str | None:
    """Why a path may never be written by a candidate, or None."""
    if not path or path == "/dev/null":
        return None if path else "an empty path"
    if not _SAFE_PATH.match(path) or "\\" in path:
        return f"{path!r} has characters a source path never needs"
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or path.startswith("./") or "//" in path:
        return f"{path!r} is absolute or climbs out of the workspace"
    top = p.parts[0].removesuffix(".py") if len(p.parts) > 1 or p.suffix == ".py" else ""
    if top in SHADOWED:
        return f"{path!r} would shadow the module {top!r} of the standard library or the test runner"
    for part in p.parts:
        if part in AUTOLOADED_NAMES or part.startswith(".git") or \
                any(fnmatch.fnmatch(part, g) for g in AUTOLOADED_GLOBS):
            return f"{path!r} is loaded by pytest, Python or git on its own ({part})"
    return None


def is_test_path(path: str, test_files: list[str]) -> bool:
    p = PurePosixPath(path)
    return (path in test_files or any(part in TEST_DIRS for part in p.parts[:-1])
            or any(fnmatch.fnmatch(p.name, g) for g in TEST_GLOBS))


def is_protected(path: str, test_files: list[str]) -> bool:
    """A path a candidate's change to is never applied (refused or dropped)."""
    return path_problem(path) is not None or is_test_path(path, test_files)


def screen_patch(patch: str, test_files: list[str], *, allow_new_files: bool = False) -> PatchScreen:
    """The part of `patch` that may be applied, what was dropped, or why the whole of it is refused."""
    def refuse(why: str) -> PatchScreen:
        return PatchScreen("", refused=f"patch refused: {why}")

    try:
        blocks = parse_patch(patch)
    except PatchParseError as e:
        return refuse(f"it is not a diff git would apply as written ({e})")
    if patch.strip() and not blocks:
        return refuse("it holds no file patch")
    kept, paths, dropped, notes = [], [], [], []
    for b in blocks:
        if any(m not in ("100644", "100755") for m in b.modes):
            return refuse(f"{b.paths[-1]} would get mode {b.modes} (only regular files may change)")
        for p in b.paths:
            if (why := path_problem(p)) is not None:
                return refuse(why)
        if any(is_test_path(p, test_files) for p in b.paths):
            dropped += b.paths
            notes += [f"{p}: a test file (the grader restores the task's tests)" for p in b.paths]
        elif b.new and not allow_new_files:
            dropped += b.paths
            notes += [f"{p}: a new file (only existing files may change)" for p in b.new]
        else:
            kept.append(b.text)
            paths += b.paths
    return PatchScreen("".join(kept), sorted(set(paths)), sorted(set(dropped)), notes)
