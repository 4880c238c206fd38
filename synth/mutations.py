"""AST mutation operators: find the sites in a Python source where a small, plausible bug can be
injected, and apply one by rewriting only that span of text (the rest of the file is untouched).

Pure functions over source text; no files, no containers. The specification stage uses these to
make bugs, and the search-based solver uses the same operators as candidate *inverse* edits on
the lines it suspects. Also here: `unified_diff`, a git-apply compatible diff of two file texts.
Not here: deciding whether a mutant is a good task (synth/stages/specify.py).
"""

from __future__ import annotations
import __future__

import ast
import bisect
import difflib
import re
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


def split_lines(source: str) -> list[str]:
    """Lines as ast numbers them (ends kept): only \n, \r\n and \r end a line (not form feeds, unlike
    str.splitlines, which would shift every later line number)."""
    lines = _LINE_END.findall(source)
    tail = source[sum(map(len, lines)):]
    return lines + [tail] if tail else lines


_LINE_END = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)")


def _apply_lines(lines: list[str], m: Mutation, first: int = 1) -> list[str]:
    """`lines` (line `first` of the file first) with m's span replaced; a line left blank is deleted."""
    i = m.lineno - first
    line = lines[i]
    if line[m.col:m.end_col] != m.old:
        raise ValueError(f"mutation does not match the source: {m.description}")
    new_line = line[:m.col] + m.new + line[m.end_col:]
    return [*lines[:i], "" if not new_line.strip() else new_line, *lines[i + 1:]]


def apply(source: str, m: Mutation) -> str:
    """The source with m's span replaced; an empty `new` spanning a whole line deletes the line."""
    return "".join(_apply_lines(split_lines(source), m))


def _segment(line: str, node: ast.AST) -> tuple[int, int] | None:
    """Character span of a single-line node (ast offsets are UTF-8 bytes)."""
    if node.lineno != node.end_lineno:
        return None
    if line.isascii():
        return node.col_offset, node.end_col_offset
    raw = line.encode()
    return len(raw[:node.col_offset].decode()), len(raw[:node.end_col_offset].decode())


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


class _Finder(ast.NodeVisitor):
    """Collects mutations; with `wanted` lines it enters only the nodes whose line range meets one."""

    def __init__(self, path: str, lines: list[str], wanted: list[int] | None):
        self.path, self.lines, self.wanted, self.out = path, lines, wanted, []
        self.function = ""
        self.locals: list[str] = []
        self.docstrings: set[int] = set()

    def _meets(self, first: int, last: int) -> bool:
        if self.wanted is None:
            return True
        i = bisect.bisect_left(self.wanted, first)
        return i < len(self.wanted) and self.wanted[i] <= last

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.stmt, ast.expr)) and not self._meets(
                _first_line(node) if isinstance(node, ast.stmt) else node.lineno, node.end_lineno or node.lineno):
            return
        if isinstance(node, (ast.Module, ast.ClassDef)) and node.body and isinstance(node.body[0], ast.Expr):
            self.docstrings.add(id(node.body[0].value))  # module and class docstrings are not constants to mutate
        super().visit(node)

    def _text(self, node: ast.AST) -> str | None:
        line = self.lines[node.lineno - 1]
        span = _segment(line, node)
        return None if span is None else line[span[0]:span[1]]

    def add(self, kind: str, node: ast.AST, new_node: ast.AST | str) -> None:
        if not self._meets(node.lineno, node.lineno):
            return
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
        if len(body) >= 2 and self._meets(body[0].lineno, body[0].lineno):
            first = body[0]  # early return: the function returns its first argument (or None) at once
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
            if isinstance(st, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return)) and st.lineno == st.end_lineno \
                    and self._meets(st.lineno, st.lineno):
                if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                    continue
                line = self.lines[st.lineno - 1]
                if line.strip() == self._text(st):
                    self.out.append(Mutation(self.path, "removed_statement", st.lineno, 0, len(line.rstrip("\r\n")),
                                             line.rstrip("\r\n"), "", self.function))

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
        self.add("inverted_condition", node.test, f"not ({self._text(node.test)})")
        self.generic_visit(node)

    visit_While = visit_If


class SourceIndex:
    """One Python file parsed and indexed once: its lines (as ast numbers them), its tree, and for each
    line the smallest block that compiles on its own (the outermost enclosing function, else the
    statement of a module or class body), so checking that a mutant compiles costs the size of that
    block, not of the file."""

    def __init__(self, path: str, source: str):
        self.path, self.source = path, source
        self.lines = split_lines(source)
        self.tree = ast.parse(source)
        self.flags = 0  # the file's `from __future__` imports hold for each block compiled alone
        for st in self.tree.body:
            if isinstance(st, ast.ImportFrom) and st.module == "__future__":
                for alias in st.names:
                    self.flags |= getattr(__future__, alias.name).compiler_flag
        self._blocks: list[tuple[int, int, int]] = []  # (first line, last line, indent), sorted, disjoint
        self._index_blocks(self.tree.body)
        self._starts = [b[0] for b in self._blocks]

    def _index_blocks(self, body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, ast.ClassDef):
                first = _first_line(st)
                head_end = st.body[0].lineno - 1 if st.body else st.end_lineno
                if head_end >= first:  # the class header (decorators, bases) compiles with the whole class
                    self._blocks.append((first, head_end, -1))
                self._index_blocks(st.body)
            else:
                self._blocks.append((_first_line(st), st.end_lineno, st.col_offset))

    def _block(self, lineno: int) -> tuple[int, int, int] | None:
        i = bisect.bisect_right(self._starts, lineno) - 1
        if i < 0 or self._blocks[i][1] < lineno:
            return None
        return self._blocks[i]

    def compiles(self, m: Mutation) -> bool:
        """Does the file with m applied still compile? (checked on m's block alone)"""
        block = self._block(m.lineno)
        if block is None or block[2] < 0:  # outside any statement, or a class header: the whole file
            first, last, indent, lines = 1, len(self.lines), 0, self.lines
        else:
            first, last, indent = block
            lines = self.lines[first - 1:last]
        try:
            text = "".join(_apply_lines(lines, m, first))
        except ValueError:
            return False
        if indent:  # a method or class-body statement compiles alone once dedented to column 0
            text = "".join(ln[indent:] if ln[:indent].isspace() else ln for ln in text.splitlines(keepends=True))
        try:
            compile(text, self.path, "exec", flags=self.flags, dont_inherit=True)
        except (SyntaxError, ValueError):
            return False
        return True

    def find(self, lines: set[int] | None = None) -> list[Mutation]:
        """Every single-line mutation that still compiles (on `lines` only when given), in source order;
        with `lines`, only the nodes whose range meets one of them are visited."""
        finder = _Finder(self.path, self.lines, None if lines is None else sorted(lines))
        finder.visit(self.tree)
        out, seen = [], set()
        for m in sorted(finder.out, key=lambda m: (m.lineno, m.col, m.kind, m.new)):
            key = (m.lineno, m.col, m.end_col, m.new)
            if key in seen:
                continue
            seen.add(key)
            if self.compiles(m):
                out.append(m)
        return out


def find_mutations(path: str, source: str) -> list[Mutation]:
    """Every single-line mutation of `source` that still compiles, in source order."""
    return SourceIndex(path, source).find()


def mutations_at(path: str, source: str, lines: set[int]) -> list[Mutation]:
    """Candidate edits on the given lines (the solver's inverse-mutation neighbourhood); a caller with
    several queries on one file keeps a `SourceIndex` instead."""
    return SourceIndex(path, source).find(lines)


def unified_diff(path: str, before: str, after: str) -> str:
    """A `git diff`-style patch of one file (git apply accepts it); "" when equal."""
    if before == after:
        return ""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    body = []
    for line in difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=3):
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)
