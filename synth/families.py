"""The demo's task families: one-function repair problems with a short edit as the fix.

Each instance is a template of TEMPLATES (bottom of this file: short pure functions with assert tests, in the style of
synth/sample_repo) with its identifiers renamed at random and one bug injected by a
synth/mutations.py operator. Templates are split into family A (has demonstrations: the gold
edit) and family B (tests only), each with train and held-out instances (held-out instances are
fresh draws, never equal to a train instance). The prompt is the numbered buggy source plus the
first failing assert with the value it actually produced (observed by running the tests here, on
the factory side, on our own template code). The action is ` <line>|<old>=><new>`: replace the
first occurrence of `old` on that line (DEMO_NOTES: ~8-byte edits are what a tiny policy learns).

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

    @property
    def prompt(self) -> str:
        lines = self.buggy.splitlines()
        return "\n".join(f"{i} {line}" for i, line in enumerate(lines, 1)) + "\n" + self.first_fail

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Instance:
        return cls(**{**d, "tests": tuple(d["tests"])})


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


def gold_action(buggy: str, correct: str) -> str | None:
    """The shortest edit (unique `old`, at least one char) that turns buggy into correct, or None."""
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
    if "not (" in b:  # an inserted `not (...)`: dropping "not " is the short, AST-equal fix
        action = f" {i + 1}|not (=>("
        fixed = apply_action(buggy, action)
        if fixed is not None and _same_code(fixed, want):
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


def module_path(inst: Instance) -> str:
    return f"{MODULE_DIR}/{inst.iid}.py"


def module_tests_path(inst: Instance) -> str:
    return f"tests/test_{inst.iid}.py"


def render_tests(inst: Instance) -> str:
    body = "".join(f"\n\ndef test_{k}():\n    {t}\n" for k, t in enumerate(inst.tests))
    return f"from {MODULE_DIR}.{inst.iid} import {inst.func}\n{body}"


def repo_files(instances: list[Instance]) -> dict[str, bytes]:
    files = {f"{MODULE_DIR}/__init__.py": b"", "tests/__init__.py": b""}
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
            image_digest=digest, problem_statement=inst.prompt, test_command="python3 -m pytest -q",
            test_parser="junit", f2p=[ids[k] for k in sorted(failing)],
            p2p=[ids[k] for k in range(len(ids)) if k not in failing],
            gold_patch=unified_diff(module_path(inst), inst.buggy, fixed), test_files=[module_tests_path(inst)],
            verification={"source": "synth.families", "sources": [module_path(inst)], "family": inst.family,
                          "split": inst.split, "template": inst.template, "kind": inst.kind, "action": inst.action},
        ))  # fmt: skip
    return tasks


def _failing(inst: Instance) -> list[int]:
    source, calls = TEMPLATES[inst.template]
    expected, _ = template_bugs(inst.template)
    got = run_calls(inst.buggy, inst.func, calls)
    return [k for k, (g, e) in enumerate(zip(got, expected)) if g[0] != "ok" or repr(g[1]) != e]


# ----------------------------------------------------------------------------- the templates
# Short pure functions in the style of synth/sample_repo/minikit. Expected values are not written here:
# `template_bugs` computes them by running the correct function, so a template cannot carry a wrong test.
# (source, calls): `calls` are argument tuples written as Python source, one assert each.
TEMPLATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        """def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
""",
        ("5, 0, 10", "-3, 0, 10", "12, 0, 10", "0, 0, 10", "10, 0, 10", "7, 7, 9"),
    ),
    (
        """def sign(x):
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
""",
        ("5", "-2", "0", "1", "-1"),
    ),
    (
        """def count_above(items, limit):
    total = 0
    for item in items:
        if item > limit:
            total += 1
    return total
""",
        ("[1, 5, 7], 4", "[], 3", "[3, 3, 4], 3", "[9, 1, 8, 2], 2", "[0], 0"),
    ),
    (
        """def sum_even(items):
    total = 0
    for item in items:
        if item % 2 == 0:
            total += item
    return total
""",
        ("[1, 2, 3, 4]", "[]", "[5, 7]", "[6, 6, 1]", "[0, 10, 3]"),
    ),
    (
        """def first_index(items, target):
    for i in range(len(items)):
        if items[i] == target:
            return i
    return -1
""",
        ("[4, 5, 6], 5", "[4, 5, 6], 9", "[], 1", "[2, 2, 2], 2", "[7, 8, 9], 9"),
    ),
    (
        """def running_total(items):
    out = []
    acc = 0
    for item in items:
        acc += item
        out.append(acc)
    return out
""",
        ("[1, 2, 3]", "[]", "[5]", "[2, -2, 4]", "[0, 0, 1]"),
    ),
    (
        """def is_between(x, low, high):
    return low <= x and x <= high
""",
        ("3, 1, 5", "1, 1, 5", "5, 1, 5", "0, 1, 5", "6, 1, 5", "9, 9, 9"),
    ),
    (
        """def max_gap(items):
    best = 0
    for i in range(1, len(items)):
        gap = items[i] - items[i - 1]
        if gap > best:
            best = gap
    return best
""",
        ("[1, 4, 6]", "[]", "[5]", "[1, 2, 10, 11]", "[3, 1, 2]"),
    ),
    (
        """def count_chars(text, ch):
    n = 0
    for c in text:
        if c == ch:
            n += 1
    return n
""",
        ("'banana', 'a'", "'', 'x'", "'abc', 'd'", "'aaa', 'a'", "'xyx', 'y'"),
    ),
    (
        """def halve_all(items):
    return [item // 2 for item in items if item > 0]
""",
        ("[4, 6, 9]", "[]", "[-2, 0, 2]", "[1, 3]", "[10]"),
    ),
    (
        """def pad_left(text, width):
    if len(text) >= width:
        return text
    return ' ' * (width - len(text)) + text
""",
        ("'ab', 4", "'abcd', 2", "'', 3", "'x', 1", "'xy', 3"),
    ),
    (
        """def is_sorted(items):
    for i in range(len(items) - 1):
        if items[i] > items[i + 1]:
            return False
    return True
""",
        ("[1, 2, 3]", "[3, 1]", "[]", "[2, 2, 5]", "[1, 3, 2]", "[4]"),
    ),
    (
        """def average(items):
    if not items:
        return 0
    return sum(items) / len(items)
""",
        ("[2, 4]", "[]", "[5]", "[1, 2, 3, 6]", "[-4, 4]"),
    ),
    (
        """def last_word(text):
    words = text.split()
    if not words:
        return ''
    return words[-1]
""",
        ("'hello big world'", "''", "'one'", "'  a b  '", "'x y z'"),
    ),
    (
        """def triangle(n):
    total = 0
    for i in range(1, n + 1):
        total += i
    return total
""",
        ("3", "0", "1", "5", "10"),
    ),
    (
        """def in_range_count(items, low, high):
    return len([x for x in items if low <= x and x < high])
""",
        ("[1, 2, 3, 4], 2, 4", "[], 0, 1", "[5, 5], 5, 6", "[0, 9], 1, 9", "[3, 7, 8], 0, 8"),
    ),
    (
        """def dedupe(items):
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
""",
        ("[1, 2, 1, 3]", "[]", "[4, 4, 4]", "[5, 6]", "[2, 1, 2, 1]"),
    ),
    (
        """def both_positive(a, b):
    return a > 0 and b > 0
""",
        ("1, 2", "0, 2", "3, -1", "-1, -1", "5, 5", "2, 0"),
    ),
    (
        """def either_empty(a, b):
    return len(a) == 0 or len(b) == 0
""",
        ("'', 'x'", "'x', ''", "'x', 'y'", "'', ''", "'ab', 'cd'"),
    ),
    (
        """def scale(items, factor):
    return [item * factor for item in items]
""",
        ("[1, 2], 3", "[], 5", "[4], 0", "[-1, 2], 2", "[3, 3], 1"),
    ),
    (
        """def count_vowels(text):
    n = 0
    for c in text.lower():
        if c in 'aeiou':
            n += 1
    return n
""",
        ("'Hello'", "''", "'xyz'", "'AEIOU'", "'banana'"),
    ),
    (
        """def min_index(items):
    best = 0
    for i in range(1, len(items)):
        if items[i] < items[best]:
            best = i
    return best
""",
        ("[3, 1, 2]", "[5]", "[1, 2, 3]", "[4, 4, 0]", "[2, 1, 1]"),
    ),
    (
        """def is_palindrome(text):
    lo = 0
    hi = len(text) - 1
    while lo < hi:
        if text[lo] != text[hi]:
            return False
        lo += 1
        hi -= 1
    return True
""",
        ("'abba'", "'abc'", "''", "'racecar'", "'ab'", "'x'"),
    ),
    (
        """def power(base, exp):
    result = 1
    for _ in range(exp):
        result *= base
    return result
""",
        ("2, 3", "5, 0", "3, 1", "1, 9", "10, 2"),
    ),
    (
        """def digits_sum(n):
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
""",
        ("123", "0", "9", "505", "1000"),
    ),
    (
        """def chunk_count(size, step):
    if step <= 0:
        return 0
    return (size + step - 1) // step
""",
        ("10, 3", "9, 3", "0, 4", "5, 0", "1, 1", "7, 10"),
    ),
    (
        """def fizz(n):
    if n % 15 == 0:
        return 'fizzbuzz'
    if n % 3 == 0:
        return 'fizz'
    if n % 5 == 0:
        return 'buzz'
    return str(n)
""",
        ("15", "9", "10", "7", "30", "1"),
    ),
    (
        """def abs_diff(a, b):
    if a > b:
        return a - b
    return b - a
""",
        ("5, 3", "3, 5", "4, 4", "-2, 2", "0, 7"),
    ),
    (
        """def longest(words):
    best = ''
    for w in words:
        if len(w) > len(best):
            best = w
    return best
""",
        ("['a', 'abc', 'ab']", "[]", "['xy', 'zw']", "['', 'q']", "['one', 'three', 'two']"),
    ),
    (
        """def capped_sum(items, cap):
    total = 0
    for item in items:
        total += min(item, cap)
    return total
""",
        ("[1, 5, 9], 4", "[], 3", "[2, 2], 2", "[10], 0", "[3, 8], 5"),
    ),
    (
        """def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
""",
        ("2000", "1900", "2024", "2023", "2100", "1600"),
    ),
    (
        """def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
""",
        ("0", "1", "3", "5", "6"),
    ),
    (
        """def grade(score):
    if score >= 90:
        return 'A'
    if score >= 75:
        return 'B'
    if score >= 50:
        return 'C'
    return 'F'
""",
        ("95", "90", "80", "75", "60", "10"),
    ),
    (
        """def positives(items):
    return [x for x in items if x > 0]
""",
        ("[1, -2, 3]", "[]", "[0, 0]", "[-1, 5]", "[7, 8]"),
    ),
    (
        """def starts_with_any(text, prefixes):
    for p in prefixes:
        if text.startswith(p):
            return True
    return False
""",
        ("'hello', ['he', 'x']", "'hello', []", "'abc', ['b', 'c']", "'', ['']", "'cat', ['ca']"),
    ),
    (
        """def mid(a, b, c):
    if a <= b <= c or c <= b <= a:
        return b
    if b <= a <= c or c <= a <= b:
        return a
    return c
""",
        ("1, 2, 3", "3, 1, 2", "2, 3, 1", "5, 5, 1", "9, 4, 6"),
    ),
    (
        """def fib(n):
    a = 0
    b = 1
    for _ in range(n):
        a, b = b, a + b
    return a
""",
        ("0", "1", "2", "6", "10"),
    ),
    (
        """def percent(part, whole):
    if whole == 0:
        return 0
    return round(100 * part / whole)
""",
        ("1, 4", "0, 5", "3, 0", "5, 5", "1, 3"),
    ),
    (
        """def is_even_len(text):
    return len(text) % 2 == 0
""",
        ("''", "'a'", "'ab'", "'abc'", "'abcd'"),
    ),
    (
        """def repeat_text(text, n):
    if n <= 0:
        return ''
    return text * n
""",
        ("'ab', 2", "'x', 0", "'', 5", "'q', 1", "'ok', -1"),
    ),
    (
        """def gcd(a, b):
    while b != 0:
        a, b = b, a % b
    return a
""",
        ("12, 8", "7, 3", "10, 0", "9, 27", "14, 21"),
    ),
    (
        """def count_runs(items):
    if not items:
        return 0
    runs = 1
    for i in range(1, len(items)):
        if items[i] != items[i - 1]:
            runs += 1
    return runs
""",
        ("[1, 1, 2, 2, 1]", "[]", "[5]", "[3, 4, 5]", "[7, 7, 7]"),
    ),
    (
        """def total_length(words):
    n = 0
    for w in words:
        n += len(w)
    return n
""",
        ("['ab', 'c']", "[]", "['']", "['xyz', 'pq', 'r']", "['hello']"),
    ),
    (
        """def any_negative(items):
    for x in items:
        if x < 0:
            return True
    return False
""",
        ("[1, -1]", "[]", "[0, 2]", "[-5]", "[3, 4, -2]"),
    ),
    (
        """def swap_pairs(items):
    out = list(items)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out
""",
        ("[1, 2, 3, 4]", "[]", "[5]", "[1, 2, 3]", "[9, 8]"),
    ),
    (
        """def ends_match(text):
    if len(text) < 2:
        return False
    return text[0] == text[-1]
""",
        ("'abca'", "'ab'", "'a'", "''", "'xx'", "'xyz'"),
    ),
    (
        """def nth_or_default(items, n, default):
    if 0 <= n < len(items):
        return items[n]
    return default
""",
        ("[1, 2, 3], 1, 0", "[1, 2, 3], 3, -1", "[], 0, 9", "[4], 0, 0", "[5, 6], -1, 7"),
    ),
    (
        """def trim_zeros(items):
    start = 0
    while start < len(items) and items[start] == 0:
        start += 1
    return items[start:]
""",
        ("[0, 0, 1, 0]", "[]", "[0, 0]", "[3, 0]", "[0, 5, 6]"),
    ),
)
