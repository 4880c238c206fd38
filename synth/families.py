"""The demo's task families: one-function repair problems with a short edit as the fix.

Each instance is a template of TEMPLATES (synth/family_templates.py: short pure functions with
assert tests, in the style of synth/sample_repo) with its identifiers renamed at random and one bug
injected by a synth/mutations.py operator. Templates are split into family A (has demonstrations: the gold
edit) and family B (tests only), each with train and held-out instances (held-out instances are
fresh draws, never equal to a train instance). The task statement (`Instance.statement`) names the
function, its file and the line, and says what is wrong there in words; the agent views the line, edits
it and runs the tests (tests/check.py, envs/check_runner.py: the first failing assert and the value it
got) to see whether its edit was the right one. The fix is ` <line>|<old>=><new>`: replace the first
occurrence of `old` on that line, the
edit tool's {"line", "old_str", "new_str"} call (DEMO_NOTES: ~8-byte edits are what a tiny policy
learns); `wrong_edits` gives plausible failed first edits and their corrections for demonstrations.
`Instance.prompt` (source plus first failing assert) is the single-turn form.

`family_tasks` turns instances into real envs Tasks in one image (flashpost/demo-family:<hash>,
one module and one test file per instance), so they are graded like any task: in a pristine
grader container, never in the agent's. Not here: grading (envs/grading.py, envs/batch_grading.py)
or training.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import keyword
import random
import signal
import subprocess
import tempfile
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from synth.family_templates import TEMPLATES
from synth.mutations import Mutation, apply, find_mutations, unified_diff

# DEMO_NOTES' bug kinds: comparison flips (incl. in/not in), arithmetic swaps, and/or and True/False
# flips, dropped or inserted `not`, integer constant +-1.
BUG_KINDS = (
    "comparison_flip",
    "arithmetic_swap",
    "boolean_flip",
    "dropped_negation",
    "inverted_condition",
    "off_by_one",
)
# The task statement says what is wrong in words, on which line (an issue that points at the code, as
# reviewers' reports do): what the agent learns is a skill that carries over to templates it never saw
# fixed (family B), not which line of which template is buggy; which replacement is right it finds by
# editing and running the tests.
BUG_WORDS = {
    "comparison_flip": "a comparison is wrong",
    "arithmetic_swap": "an arithmetic operator is wrong",
    "boolean_flip": "a boolean operator or constant is wrong",
    "dropped_negation": "a negation is missing",
    "inverted_condition": "a condition is inverted",
    "off_by_one": "a number is off by one",
}
# Plausible wrong replacements of a gold edit's token, for demonstrations that recover from a failed edit.
SIBLINGS = (("<", "<=", ">", ">=", "==", "!="), ("+", "-", "*", "//"), ("and", "or"), ("True", "False"))
B_SHARE = 0.25  # share of templates in family B (tests only)
SPLIT_SEED = 0
_BUILTINS = {"len", "range", "sum", "min", "max", "str", "round", "list", "sorted", "True", "False", "None", "_"}
NAMES = (
    "val",
    "num",
    "data",
    "arr",
    "seq",
    "vals",
    "nums",
    "xs",
    "ys",
    "buf",
    "src",
    "lst",
    "acc",
    "res",
    "cur",
    "tmp",
    "idx",
    "pos",
    "cnt",
    "size",
    "left",
    "right",
    "top",
    "lim",
    "k",
    "m",
    "p",
    "q",
    "r",
    "u",
    "v",
    "w",
    "z",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "foo",
    "bar",
    "baz",
    "qux",
    "elem",
    "node",
    "key",
    "word",
    "row",
    "col",
    "step",
    "span",
    "mark",
    "part",
    "piece",
    "token",
    "chunk",
    "amount",
    "level",
    "limit",
    "bound",
)
VERBS = ("get", "calc", "find", "make", "do", "check", "eval", "take", "run", "pick", "fold", "scan", "tally")
NOUNS = ("value", "result", "items", "thing", "stuff", "answer", "output", "count", "info", "score", "entry")


@dataclass(frozen=True)
class Instance:
    iid: str
    family: str  # "A" (demonstrations) or "B" (tests only)
    split: str  # "train" or "heldout"
    template: int
    func: str  # the (renamed) function's name
    correct: str
    buggy: str
    tests: tuple[str, ...]  # one `assert` statement each
    first_fail: str  # the first failing assert and what it got
    action: str  # the gold edit, " <line>|<old>=><new>"
    kind: str  # mutation kind of the injected bug
    # an instance cut from a repository file: the file the function is in, the function's first line in
    # it (0-based) and the whole broken file; "" / 0 / "" for the generated families
    path: str = ""
    offset: int = 0
    file: str = ""

    @property
    def line(self) -> int:
        """The line of the file that holds the bug (1-based; the gold edit's line)."""
        return self.offset + int(self.action.split("|", 1)[0])

    @property
    def statement(self) -> str:
        """The multi-turn task: the function, its file, the line and what is wrong there in words; the
        line's text and the test results are for the agent to see (`view`, `run_tests`)."""
        return f"Fix `{self.func}` ({module_path(self)}): on line {self.line}, {BUG_WORDS[self.kind]}."

    @property
    def prompt(self) -> str:
        return numbered(self.buggy) + "\n" + self.first_fail

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Instance:
        return cls(**{**d, "tests": tuple(d["tests"])})


def numbered(source: str) -> str:
    return "\n".join(f"{i} {line}" for i, line in enumerate(source.splitlines(), 1))


# ----------------------------------------------------------------------------- the edit action
def parse_action(text: str) -> tuple[int, str, str] | None:
    """` <line>|<old>=><new>` -> (line, old, new), or None when malformed. `=>` may also occur inside
    old/new: `apply_action` tries every split and takes the first whose `old` is on the line."""
    head, sep, rest = text.strip("\n").lstrip(" ").partition("|")
    if not sep or not head.isdigit() or "=>" not in rest:
        return None
    return int(head), rest, ""  # split decided against the source in apply_action


def action_ruled_out(prefix: str) -> bool:
    """True when no text starting with `prefix` parses as an action: the part before the first `|`
    already holds a character that is not a digit (after the leading newlines and spaces that
    `parse_action` strips), or the text starts with `|`. Never True while that part holds `\\ufffd`
    (a byte token not yet completed to its character). Greedy evaluation stops an answer as soon as
    this holds; the answer scores 0 either way, so pass@1 is unchanged and the untrained policy
    stops after a token or two instead of running to the token limit."""
    head, sep, _ = prefix.lstrip("\n").lstrip(" ").partition("|")
    if "\ufffd" in head:
        return False
    return (bool(head) or bool(sep)) and not head.isdigit()


def apply_action(source: str, text: str) -> str | None:
    """The source with the edit applied, or None if the action is malformed or does not apply."""
    parsed = parse_action(text)
    if parsed is None:
        return None
    lineno, rest, _ = parsed
    lines = source.splitlines(keepends=True)
    if not 1 <= lineno <= len(lines):
        return None
    line = lines[lineno - 1]
    i = rest.find("=>")
    while i >= 0:
        old, new = rest[:i], rest[i + 2 :]
        if old and old in line:
            lines[lineno - 1] = line.replace(old, new, 1)
            return "".join(lines)
        i = rest.find("=>", i + 1)
    return None


def _run_class(ch: str) -> str | None:
    """What a BPE token of code runs over: a word, an operator, or neither (a bracket, a space)."""
    return "word" if ch.isalnum() or ch == "_" else "op" if ch in "<>=!+-*/%&|^~" else None


def _token_edit(b: str, c: str, p: int, s: int) -> tuple[str, str] | None:
    """(old, new) of the change between line b and line c (common prefix p, common suffix s) widened to
    whole tokens as the tokenizer cuts code: each end extended over the word or operator it cuts into, the
    space in front kept (`" !="` -> `" =="`, `" 2"` -> `" 1"`, `" and"` -> `" or"`), and an insertion
    anchored on the token after it. old_str is then the very tokens of the viewed line, which a small policy
    copies far sooner than a fragment such as `"!"` -> `"="` whose tokens appear nowhere in the source."""
    lo, eb, ec = p, len(b) - s, len(c) - s
    if eb == lo or ec == lo:  # an insertion or a deletion: slide it left over the space it ends with
        while lo > 0 and b[lo - 1] == " " and (b[lo:eb] or c[lo:ec]).endswith(" "):
            lo, eb, ec = lo - 1, eb - 1, ec - 1
    region = b[lo:eb] or c[lo:ec]
    while lo > 0 and _run_class(b[lo - 1]) is not None and _run_class(b[lo - 1]) == _run_class(region[0]):
        lo -= 1
    last = (b[lo:eb] or c[lo:ec])[-1]
    while eb < len(b) and _run_class(b[eb]) is not None and _run_class(b[eb]) == _run_class(last):
        eb, ec = eb + 1, ec + 1
    if lo > 0 and b[lo - 1] == " " and not b[lo:eb].startswith(" ") and not c[lo:ec].startswith(" "):
        lo -= 1
    if not b[lo:eb].strip():  # nothing of the line to replace: take the next token along
        while eb < len(b) and b[eb] == " ":
            eb, ec = eb + 1, ec + 1
        kind = _run_class(b[eb]) if eb < len(b) else None
        if kind is None:
            return None
        while eb < len(b) and _run_class(b[eb]) == kind:
            eb, ec = eb + 1, ec + 1
    return b[lo:eb], c[lo:ec]


def gold_action(buggy: str, correct: str) -> str | None:
    """The edit that turns buggy into correct, or None: `_token_edit`'s whole tokens when that edit is
    right (its `old` first occurs where the change is), else the shortest (at least one char) that is."""
    b_lines, c_lines = buggy.splitlines(keepends=True), correct.splitlines(keepends=True)
    if len(b_lines) != len(c_lines):
        return None
    diff = [i for i, (x, y) in enumerate(zip(b_lines, c_lines)) if x != y]
    if len(diff) != 1:
        return None
    i = diff[0]
    b, c = b_lines[i].rstrip("\n"), c_lines[i].rstrip("\n")
    p = 0
    while p < min(len(b), len(c)) and b[p] == c[p]:
        p += 1
    s = 0
    while s < min(len(b), len(c)) - p and b[len(b) - 1 - s] == c[len(c) - 1 - s]:
        s += 1
    # whole words only: "True=>False", not "Tru=>Fals" (a tiny BPE policy learns whole tokens faster)
    while p > 0 and (b[p - 1].isalnum() or b[p - 1] == "_") and (b[p : p + 1] + c[p : p + 1]).strip("=<>!+-*/%() "):
        p -= 1
    while (
        s > 0
        and (b[len(b) - s].isalnum() or b[len(b) - s] == "_")
        and (b[len(b) - s - 1 : len(b) - s] + c[len(c) - s - 1 : len(c) - s]).strip("=<>!+-*/%() ")
    ):
        s -= 1
    want = ast.dump(ast.parse(correct))
    # an inserted `not (...)`: dropping "not" is the short, AST-equal fix
    candidates = [(" not (", " (")] if " not (" in b else []
    candidates.append(_token_edit(b, c, p, s))
    for old_new in candidates:
        if old_new is None:
            continue
        action = f" {i + 1}|{old_new[0]}=>{old_new[1]}"
        fixed = apply_action(buggy, action)
        if split_action(buggy, action) == (i + 1, *old_new) and fixed is not None and _same_code(fixed, want):
            return action
    for extra in range(len(b) + 1):  # shortest first; at equal length, more context on the left
        for left in range(min(extra, p), -1, -1):
            right = extra - left
            if right > s or len(b) - s + right <= p - left:
                continue
            action = f" {i + 1}|{b[p - left : len(b) - s + right]}=>{c[p - left : len(c) - s + right]}"
            fixed = apply_action(buggy, action)
            if fixed == correct or (fixed is not None and _same_code(fixed, want)):
                return action
    return None


def split_action(source: str, action: str) -> tuple[int, str, str] | None:
    """(line, old, new) of an action as `apply_action` reads it against `source`: the edit tool's
    {"line", "old_str", "new_str"} call."""
    parsed = parse_action(action)
    if parsed is None or apply_action(source, action) is None:
        return None
    lineno, rest, _ = parsed
    line = source.splitlines()[lineno - 1]
    i = rest.find("=>")
    while i >= 0:
        if rest[:i] and rest[:i] in line:
            return lineno, rest[:i], rest[i + 2 :]
        i = rest.find("=>", i + 1)
    return None


def wrong_edits(inst: Instance) -> list[tuple[str, str]]:
    """(wrong action, correcting action) pairs: the gold edit's token swapped for a sibling (`<` for
    `<=`, `-` for `+`, a constant one further off) so the tests still fail, then the edit from there to
    the correct source. Checked on our own template code (factory side)."""
    parts = split_action(inst.buggy, inst.action)
    if parts is None:
        return []
    lineno, old, new = parts
    wrong = set()
    for group in SIBLINGS:
        for tok in group:
            if f" {tok} " in f" {new} ":
                wrong |= {f" {new} ".replace(f" {tok} ", f" {o} ", 1)[1:-1] for o in group if o != tok}
    for tok in new.split():
        if tok.isdigit():
            wrong |= {f" {new} ".replace(f" {tok} ", f" {int(tok) + d} ", 1)[1:-1] for d in (-1, 1)
                      if int(tok) + d >= 0}  # fmt: skip
    source, calls = TEMPLATES[inst.template]
    expected, _ = template_bugs(inst.template)
    out = []
    for w in sorted(wrong - {old, new}):
        bad = apply_action(inst.buggy, f" {lineno}|{old}=>{w}")
        fix = f" {lineno}|{w}=>{new}"
        if bad is None or apply_action(bad, fix) != inst.correct:
            continue
        try:
            got = run_calls(bad, inst.func, calls)
        except SyntaxError:
            continue
        if any(k != "ok" or repr(v) != e for (k, v), e in zip(got, expected)):
            out.append((f" {lineno}|{old}=>{w}", fix))
    return out


def _same_code(source: str, want_dump: str) -> bool:
    try:
        return ast.dump(ast.parse(source)) == want_dump
    except SyntaxError:
        return False


# ----------------------------------------------------------------------------- templates
def _rename(source: str, mapping: dict[str, str]) -> str:
    out, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in mapping and not (prev and prev.string == "."):
            tok = tok._replace(string=mapping[tok.string])
        out.append(tok)
        prev = tok
    return tokenize.untokenize(out)


def _local_names(source: str) -> tuple[str, list[str]]:
    fn = ast.parse(source).body[0]
    names = [a.arg for a in fn.args.args]
    names += [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return fn.name, [n for n in dict.fromkeys(names) if n not in _BUILTINS]


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def run_calls(source: str, func: str, calls: tuple[str, ...], timeout_s: float = 0.2) -> list[tuple[str, object]]:
    """Run `func(call)` for each call on our own template code; ("ok", value) | ("raise", name) |
    ("timeout", None) per call. Factory side only: candidates from a policy are never run here."""
    ns: dict = {}
    exec(compile(source, "<template>", "exec"), ns)
    out = []
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for call in calls:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                out.append(("ok", eval(f"{func}({call})", ns)))
            except _Timeout:
                out.append(("timeout", None))
            except Exception as e:  # noqa: BLE001 - any exception is an observed outcome
                out.append(("raise", type(e).__name__))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return out


@dataclass(frozen=True)
class _Bug:
    mutation: Mutation
    fail_index: int  # first failing call
    got: str  # what that call produced


@cache
def template_bugs(t: int) -> tuple[tuple[str, ...], tuple[_Bug, ...]]:
    """(expected values as repr, bugs that make a test fail without hanging) of template t.
    Renaming is alpha-equivalent, so this holds for every renamed instance."""
    source, calls = TEMPLATES[t]
    func, _ = _local_names(source)
    want = run_calls(source, func, calls)
    if any(kind != "ok" for kind, _ in want):
        raise ValueError(f"template {t} ({func}) does not run on its own calls: {want}")
    bugs = []
    for m in find_mutations("m.py", source):
        if m.kind not in BUG_KINDS:
            continue
        got = run_calls(apply(source, m), func, calls)
        if any(kind == "timeout" for kind, _ in got):
            continue
        fails = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if fails:
            kind, value = got[fails[0]]
            bugs.append(_Bug(m, fails[0], repr(value) if kind == "ok" else f"raises {value}"))
    return tuple(repr(v) for _, v in want), tuple(bugs)


def families(seed: int = SPLIT_SEED) -> dict[str, list[int]]:
    """Template indices of family A and family B (a fixed split by template)."""
    order = list(range(len(TEMPLATES)))
    random.Random(seed).shuffle(order)
    n_b = round(B_SHARE * len(order))
    return {"A": sorted(order[n_b:]), "B": sorted(order[:n_b])}


def make_instance(t: int, rng: random.Random, family: str, split: str, iid: str) -> Instance | None:
    """A random renaming of template t with one random bug, or None if that draw has no clean edit."""
    source, calls = TEMPLATES[t]
    expected, bugs = template_bugs(t)
    if not bugs:
        return None
    bug = rng.choice(bugs)
    func, names = _local_names(source)
    pool = [n for n in NAMES if n not in names and n != func]
    new_names = rng.sample(pool, len(names))
    new_func = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    mapping = {func: new_func, **dict(zip(names, new_names))}
    assert not any(keyword.iskeyword(n) for n in mapping.values())
    correct = _rename(source, mapping)
    buggy = _rename(apply(source, bug.mutation), mapping)
    action = gold_action(buggy, correct)
    if action is None:
        return None
    tests = tuple(f"assert {new_func}({c}) == {e}" for c, e in zip(calls, expected))
    first_fail = f"{tests[bug.fail_index]}  # got {bug.got}"
    return Instance(iid, family, split, t, new_func, correct, buggy, tests, first_fail, action, bug.mutation.kind)


def make_instances(
    family: str, split: str, n: int, seed: int = 0, exclude: set[str] | None = None, prefix: str = ""
) -> list[Instance]:
    """n instances of a family, round-robin over its templates; `exclude` holds buggy sources that
    must not be drawn again (held-out instances exclude every train instance)."""
    templates = families()[family]
    rng = random.Random(f"{family}/{split}/{seed}")
    seen = set(exclude or ())
    out: list[Instance] = []
    tries = 0
    while len(out) < n and tries < 50 * n + 100:
        t = templates[tries % len(templates)]
        tries += 1
        inst = make_instance(t, rng, family, split, f"{prefix}{family.lower()}{split[0]}{seed}_{len(out):05d}")
        if inst is None or inst.buggy in seen:
            continue
        seen.add(inst.buggy)
        out.append(inst)
    return out


def demo_splits(n_train_a: int, n_train_b: int, n_heldout: int, seed: int = 0) -> dict[str, list[Instance]]:
    """The demo's four sets: A/B train and A/B held-out (held-out never repeats a train instance)."""
    out = {}
    for fam, n_train in (("A", n_train_a), ("B", n_train_b)):
        train = make_instances(fam, "train", n_train, seed)
        out[f"{fam}_train"] = train
        out[f"{fam}_heldout"] = make_instances(fam, "heldout", n_heldout, seed, exclude={i.buggy for i in train})
    return out


# ----------------------------------------------------------------------------- as real envs Tasks
MODULE_DIR = "fam"
IMAGE_REPO = "flashpost/demo-family"
# The tools a family task offers (the system turn carries only their signatures). The statement names the
# file and line without its text: the agent views that line, so what the edit copies (its number and the
# text to replace) sits in the few tokens right before it, inside the demo policy's 64-token sliding window
FAMILY_TOOLS = ("view", "edit", "run_tests", "submit")


def module_path(inst: Instance) -> str:
    return inst.path or f"{MODULE_DIR}/{inst.iid}.py"


def module_source(inst: Instance, function: str) -> str:
    """The module to grade when the instance's function reads `function`: the function itself for
    the generated families, the broken file with the function's lines replaced for family F."""
    if not inst.file:
        return function
    lines = inst.file.splitlines(keepends=True)
    n = len(inst.buggy.splitlines())
    return "".join(lines[: inst.offset]) + function + "".join(lines[inst.offset + n :])


def module_tests_path(inst: Instance) -> str:
    return f"tests/test_{inst.iid}.py"


def render_tests(inst: Instance) -> str:
    body = "".join(f"\n\ndef test_{k}():\n    {t}\n" for k, t in enumerate(inst.tests))
    return f"from {MODULE_DIR}.{inst.iid} import {inst.func}\n{body}"


CHECK_PATH = "tests/check.py"  # envs/check_runner.py, the agent's quick test runner


def test_command(inst: Instance) -> str:
    return f"python3 {CHECK_PATH} {module_tests_path(inst)}"


def repo_files(instances: list[Instance]) -> dict[str, bytes]:
    check = (Path(__file__).resolve().parent.parent / "envs" / "check_runner.py").read_bytes()
    files = {f"{MODULE_DIR}/__init__.py": b"", "tests/__init__.py": b"", CHECK_PATH: check}
    for inst in instances:
        files[module_path(inst)] = inst.buggy.encode()
        files[module_tests_path(inst)] = render_tests(inst).encode()
    return files


def _git_commit(files: dict[str, bytes]) -> str:
    """The commit id the image's build script will produce (fixed identity and dates)."""
    from envs.fixtures.build import GIT_ENV

    with tempfile.TemporaryDirectory() as d:
        for rel, body in files.items():
            (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / rel).write_bytes(body)
        env = {**GIT_ENV, "PATH": "/usr/bin:/bin", "HOME": d}
        run = dict(cwd=d, env=env, check=True, capture_output=True, text=True)
        subprocess.run(["git", "init", "-q", "-b", "main"], **run)
        subprocess.run(["git", "add", "-A"], **run)
        subprocess.run(["git", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "base"], **run)
        return subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()


def family_tasks(instances: list[Instance], build: bool = True) -> list:
    """One envs Task per instance, all in one image holding every instance's buggy module and tests
    (built once per distinct instance set; cached by a content label)."""
    from envs import engine
    from envs.fixtures.build import CONTENT_LABEL, GIT_ENV
    from envs.task import Task

    files = repo_files(instances)
    h = hashlib.sha256()
    for rel, body in sorted(files.items()):
        h.update(rel.encode() + b"\0" + hashlib.sha256(body).digest())
    content = h.hexdigest()[:16]
    image = f"{IMAGE_REPO}:{content}"
    rev = _git_commit(files) if build else ""  # no image, no commit to point at
    digest = ""
    if build:
        base = engine.ensure_base_image()
        if engine.image_labels(image).get(CONTENT_LABEL) != content:
            script = (
                f"git init -q -b main && git add -A && git -c commit.gpgsign=false commit -q -m base && "
                f'test "$(git rev-parse HEAD)" = "{rev}"'
            )
            engine.build_image(
                base,
                files=engine.tar_files(files),
                dest="/workspace",
                script=script,
                env=GIT_ENV,
                repository=IMAGE_REPO,
                tag=content,
                labels={CONTENT_LABEL: content},
            )
        digest = engine.image_id(image)
    tasks = []
    for inst in instances:
        fixed = apply_action(inst.buggy, inst.action)
        ids = [f"{module_tests_path(inst)}::test_{k}" for k in range(len(inst.tests))]
        failing = set(_failing(inst))
        tasks.append(Task(
            task_id=f"demo-{inst.iid}", repo="flashpost/demo-family", base_revision=rev, image=image,
            image_digest=digest, problem_statement=inst.statement, test_command=test_command(inst),
            test_parser="junit", f2p=[ids[k] for k in sorted(failing)],
            p2p=[ids[k] for k in range(len(ids)) if k not in failing],
            gold_patch=unified_diff(module_path(inst), inst.buggy, fixed), test_files=[module_tests_path(inst)],
            verification={"source": "synth.families", "sources": [module_path(inst)], "file": module_path(inst),
                          "family": inst.family,
                          "split": inst.split, "template": inst.template, "kind": inst.kind, "action": inst.action},
            tools=list(FAMILY_TOOLS),
        ))  # fmt: skip
    return tasks


def _failing(inst: Instance) -> list[int]:
    source, calls = TEMPLATES[inst.template]
    expected, _ = template_bugs(inst.template)
    got = run_calls(inst.buggy, inst.func, calls)
    return [k for k, (g, e) in enumerate(zip(got, expected)) if g[0] != "ok" or repr(g[1]) != e]
