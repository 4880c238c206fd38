"""AST mutation operators: find the sites in a Python source where a small, plausible bug can be
injected, and apply one by rewriting only that span of text (the rest of the file is untouched).

Pure functions over source text; no files, no containers. The specification stage uses these to
make bugs, and the search-based solver uses the same operators as candidate *inverse* edits on
the lines it suspects. Also here: `unified_diff`, a git-apply compatible diff of two file texts.
Not here: deciding whether a mutant is a good task (synth/stages/specify.py).
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import asdict, dataclass

KINDS = ("comparison_flip", "boolean_flip", "off_by_one", "changed_constant", "wrong_variable",
         "removed_statement", "swapped_arguments", "inverted_condition", "early_return",
         "arithmetic_swap", "dropped_negation")

_CMP = {ast.Lt: [ast.LtE], ast.LtE: [ast.Lt], ast.Gt: [ast.GtE], ast.GtE: [ast.Gt], ast.Eq: [ast.NotEq],
        ast.NotEq: [ast.Eq], ast.In: [ast.NotIn], ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
_ARITH = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
          ast.FloorDiv: [ast.Div, ast.Mod], ast.Mod: [ast.FloorDiv]}


@dataclass(frozen=True)
class Mutation:
    path: str
    kind: str
    lineno: int  # 1-based, like ast
    col: int  # character offsets within the line [col, end_col) replaced by `new`
    end_col: int
    old: str
    new: str
    function: str = ""  # enclosing function name ("" at module level)

    @property
    def description(self) -> str:
        return f"{self.kind} at {self.path}:{self.lineno}: {self.old!r} -> {self.new!r}"

    def to_dict(self) -> dict:
        return asdict(self)


def apply(source: str, m: Mutation) -> str:
    """The source with m's span replaced; an empty `new` spanning a whole line deletes the line."""
    lines = source.splitlines(keepends=True)
    line = lines[m.lineno - 1]
    if line[m.col:m.end_col] != m.old:
        raise ValueError(f"mutation does not match the source: {m.description}")
    new_line = line[:m.col] + m.new + line[m.end_col:]
    lines[m.lineno - 1] = "" if not new_line.strip() else new_line
    return "".join(lines)


def _segment(line: str, node: ast.AST) -> tuple[int, int] | None:
    """Character span of a single-line node (ast offsets are UTF-8 bytes)."""
    if node.lineno != node.end_lineno:
        return None
    raw = line.encode()
    return len(raw[:node.col_offset].decode()), len(raw[:node.end_col_offset].decode())


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: str):
        self.path, self.source, self.lines, self.out = path, source, source.splitlines(keepends=True), []
        self.function = ""
        self.locals: list[str] = []
        self.docstrings: set[int] = set()

    def add(self, kind: str, node: ast.AST, new_node: ast.AST | str) -> None:
        line = self.lines[node.lineno - 1]
        span = _segment(line, node)
        if span is None:
            return
        old = line[span[0]:span[1]]
        new = new_node if isinstance(new_node, str) else ast.unparse(new_node)
        if new != old:
            self.out.append(Mutation(self.path, kind, node.lineno, span[0], span[1], old, new, self.function))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, outer_locals = self.function, self.locals
        self.function = node.name
        names = [a.arg for a in node.args.args + node.args.kwonlyargs]
        names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        self.locals = sorted(set(names))
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self.docstrings.add(id(body[0].value))
            body = body[1:]
        if len(body) >= 2:  # early return: the function returns its first argument (or None) at once
            first = body[0]
            indent = self.lines[first.lineno - 1][:first.col_offset]
            value = node.args.args[0].arg if node.args.args and node.args.args[0].arg != "self" else "None"
            self.out.append(Mutation(self.path, "early_return", first.lineno, 0, len(indent), indent,
                                     f"{indent}return {value}\n{indent}", node.name))
        self.generic_visit(node)
        self.function, self.locals = outer, outer_locals

    def _statements(self, body: list[ast.stmt]) -> None:
        if len(body) < 2:
            return
        for st in body:
            if isinstance(st, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return)) and st.lineno == st.end_lineno:
                if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                    continue
                line = self.lines[st.lineno - 1]
                if line.strip() == ast.get_source_segment(self.source, st):
                    self.out.append(Mutation(self.path, "removed_statement", st.lineno, 0, len(line.rstrip("\n")),
                                             line.rstrip("\n"), "", self.function))

    def generic_visit(self, node: ast.AST) -> None:
        for name in ("body", "orelse", "finalbody"):
            if isinstance(getattr(node, name, None), list) and not isinstance(node, ast.Module):
                self._statements(getattr(node, name))
        super().generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1:
            for alt in _CMP.get(type(node.ops[0]), []):
                self.add("comparison_flip", node, ast.Compare(node.left, [alt()], node.comparators))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        alt = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add("boolean_flip", node, ast.BoolOp(alt, node.values))
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        for alt in _ARITH.get(type(node.op), []):
            self.add("arithmetic_swap", node, ast.BinOp(node.left, alt(), node.right))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        for alt in _ARITH.get(type(node.op), []):
            self.add("arithmetic_swap", node, ast.AugAssign(node.target, alt(), node.value))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, (ast.Not, ast.USub)):
            self.add("dropped_negation", node, node.operand)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if isinstance(v, bool):
            self.add("boolean_flip", node, ast.Constant(not v))
        elif isinstance(v, int):
            for alt in (v + 1, v - 1):
                if alt >= 0:
                    self.add("off_by_one", node, ast.Constant(alt))
            self.add("changed_constant", node, ast.Constant(0 if v else 2))
        elif isinstance(v, str) and id(node) not in self.docstrings and v and self.function:
            self.add("changed_constant", node, ast.Constant(v[::-1] if len(v) > 1 else v + v))

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and node.id in self.locals:
            for other in self.locals:
                if other != node.id:
                    self.add("wrong_variable", node, other)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
            args = [node.args[1], node.args[0], *node.args[2:]]
            self.add("swapped_arguments", node, ast.Call(node.func, args, node.keywords))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self.add("inverted_condition", node.test, f"not ({ast.get_source_segment(self.source, node.test)})")
        self.generic_visit(node)

    visit_While = visit_If


def find_mutations(path: str, source: str) -> list[Mutation]:
    """Every single-line mutation of `source` that still compiles, in source order."""
    tree = ast.parse(source)
    finder = _Finder(path, source)
    for node in ast.walk(tree):  # module and class docstrings are not constants to mutate
        if isinstance(node, (ast.Module, ast.ClassDef)) and node.body and isinstance(node.body[0], ast.Expr):
            finder.docstrings.add(id(node.body[0].value))
    finder.visit(tree)
    out, seen = [], set()
    for m in sorted(finder.out, key=lambda m: (m.lineno, m.col, m.kind, m.new)):
        key = (m.lineno, m.col, m.end_col, m.new)
        if key in seen:
            continue
        seen.add(key)
        try:
            compile(apply(source, m), path, "exec")
        except (SyntaxError, ValueError):
            continue
        out.append(m)
    return out


def mutations_at(path: str, source: str, lines: set[int]) -> list[Mutation]:
    """Candidate edits on the given lines (the solver's inverse-mutation neighbourhood)."""
    return [m for m in find_mutations(path, source) if m.lineno in lines]


def unified_diff(path: str, before: str, after: str) -> str:
    """A `git diff`-style patch of one file (git apply accepts it); "" when equal."""
    if before == after:
        return ""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    body = []
    for line in difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=3):
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)
