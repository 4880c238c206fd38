"""Problem statements of factory tasks: written from observed behaviour only (the failing tests'
bodies without their names, and the assertion/exception lines), scanned for what they would give
away of the fix, and compared across tasks so that near-identical statements are caught.

Pure functions over records and source files, plus `StatementIndex` (the statements seen so far in
one run, thread-safe). Not here: running tests (synth/testrun.py) or deciding F2P/P2P (specify).
"""

from __future__ import annotations

import ast
import difflib
import re
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

from synth.records import FeasibleRepo, SpecRecord

_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,64}\b")
NEAR_DUPLICATE = 0.95  # difflib ratio of normalised statements at or above which two tasks read the same
StatementWriter = Callable[[SpecRecord, FeasibleRepo], tuple[str, list[str]]]


def _test_node(tree: ast.Module, scopes: list[str], name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The test function `name` inside the classes `scopes` (outermost first): `Test::test_x` is
    Test's own test_x, not the first function of that name in the file. A method a class inherits
    from a base class of the same module is found in that base."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    if not scopes:
        return next((n for n in tree.body if isinstance(n, funcs) and n.name == name), None)
    body: list[ast.stmt] = tree.body
    cls = None
    for scope in scopes:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == scope), None)
        if cls is None:
            return None
        body = cls.body
    module_classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    todo, seen = [cls], {cls.name}
    while todo:  # the class itself, then its bases (by name, within this module)
        c = todo.pop(0)
        found = next((n for n in c.body if isinstance(n, funcs) and n.name == name), None)
        if found is not None:
            return found
        for base in c.bases:
            if isinstance(base, ast.Name) and base.id in module_classes and base.id not in seen:
                seen.add(base.id)
                todo.append(module_classes[base.id])
    return None


def body_of_test(repo_path: str, test_id: str) -> str:
    """The test's body (not its name or decorators), dedented; "" when it cannot be found."""
    file, *rest = test_id.split("::")
    if not rest:
        return ""
    name = re.sub(r"\[.*\]$", "", rest[-1])
    try:
        source = (Path(repo_path) / file).read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return ""
    node = _test_node(tree, rest[:-1], name)
    if node is None:
        return ""
    lines = source.splitlines()[node.body[0].lineno - 1:node.end_lineno]
    return textwrap.dedent("\n".join(lines)).strip()


def _observed(message: str) -> list[str]:
    """The assertion/exception lines of a failure ("E   ..."), without source frames."""
    lines = [ln[1:].strip() for ln in message.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln and not ln.startswith("Use -v to get")][:6]
    return lines or [ln.strip() for ln in message.strip().splitlines()[-2:] if ln.strip()]


def write_statement(spec: SpecRecord, repo: FeasibleRepo) -> tuple[str, list[str]]:
    """A behaviour-only issue text; returns (statement, the failure lines it quotes)."""
    parts, quoted = ["Some calls into this library give wrong results. Reproduction:"], []
    for tid in spec.f2p[:2]:
        body, seen = body_of_test(repo.path, tid), _observed(spec.failures.get(tid, ""))
        if not body:
            continue
        parts.append(f"```python\n{body}\n```\nfails with:\n```\n" + "\n".join(seen) + "\n```")
        quoted += seen
    if len(spec.f2p) > 2:
        parts.append(f"{len(spec.f2p) - 2} more check(s) of the same behaviour fail as well.")
    parts.append("Each snippet above should pass. Please fix the library code (not the checks).")
    return "\n\n".join(parts), quoted


def statement_leaks(statement: str, spec: SpecRecord, test_ids: list[str]) -> list[str]:
    """What of the fix (or of the verifier's identity) the statement gives away."""
    leaks = []
    for line in spec.gold_patch.splitlines():
        if line.startswith(("+++", "---", "diff --git", "@@")):
            if line.startswith(("diff --git", "@@ ")) and line in statement:
                leaks.append("diff header")
            continue
        text = line[1:].strip()
        if line[:1] in "+-" and len(text) >= 8 and text in statement:
            leaks.append(f"diff line {text!r}")
    old = spec.mutation.get("old", "").strip()
    if len(old) >= 6 and not old.isidentifier() and old in statement:
        leaks.append(f"fixed code {old!r}")
    subject = spec.origin.get("subject", "").strip()
    if len(subject) >= 12 and _norm(subject).lower() in _norm(statement).lower():
        leaks.append("commit subject")
    for tid in test_ids:
        name = re.sub(r"\[.*\]$", "", tid.split("::")[-1])
        if re.search(rf"\b{re.escape(name)}\b", statement):
            leaks.append(f"test name {name}")
    leaks += [f"hash {h}" for h in _HASH.findall(statement)]
    return sorted(set(leaks))


def _norm(text: str) -> str:
    return " ".join(text.split())


class StatementIndex:
    """The statements of one run's ok specs, per repository; `near_duplicate` names an earlier task whose
    statement reads the same (whitespace-normalised difflib ratio >= NEAR_DUPLICATE), so that the factory
    does not ship two tasks an agent cannot tell apart."""

    def __init__(self, known: dict[str, tuple[str, str]] | None = None):
        self._by_repo: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        for key, (repo, text) in (known or {}).items():
            self._by_repo.setdefault(repo, {})[key] = _norm(text)

    def near_duplicate(self, key: str, repo: str, statement: str) -> str:
        """The key of an earlier near-identical statement of `repo` ("" if none); else records this one."""
        text = _norm(statement)
        with self._lock:
            seen = self._by_repo.setdefault(repo, {})
            for other, earlier in seen.items():
                if other == key:
                    continue
                m = difflib.SequenceMatcher(None, text, earlier, autojunk=False)
                if m.real_quick_ratio() >= NEAR_DUPLICATE and m.quick_ratio() >= NEAR_DUPLICATE and \
                        m.ratio() >= NEAR_DUPLICATE:
                    return other
            seen[key] = text
            return ""
