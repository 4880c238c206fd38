"""The hack battery (envs/hacks.py) scores 0 on every grading path: a fresh grader, a warm pool and
the batch grader; gold patches still score 1 on each; the batch grader keeps neighbours' rewards
exact under every attack. Also the host-side patch parser and the static screen on their own."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from envs.batch_grading import grade_batch
from envs.canaries import check_canaries, plant_canaries
from envs.fixtures.build import fixture_tasks, repo_files
from envs.grading import grade_patch
from envs.hacks import BATCH_HACKS, HACKS, PATCH_HACKS, edits_as_files, gold_source_files
from envs.patches import parse_patch, screen_patch
from envs.pool import GraderPool
from envs.sandbox import Sandbox
from envs.screen import screen_source
from envs.task import load_tasks
from synth.patches import edits_to_patch

docker = pytest.mark.docker

# ------------------------------------------------------------------------------ host only


def _host_reader():
    files = {k: v.decode() for k, v in repo_files().items()}
    return lambda p: files[p]


def test_patch_hacks_are_refused_on_the_host():
    task = load_tasks("envs/fixtures/tasks.json")[0]
    for hack in PATCH_HACKS:
        s = screen_patch(hack.make(task, _host_reader()), task.test_files)
        assert s.refused and not s.patch, hack.name


def test_parser_reads_blocks_as_git_does():
    task = load_tasks("envs/fixtures/tasks.json")[0]
    s = screen_patch(task.gold_patch, task.test_files)
    assert s.refused is None and s.patch == task.gold_patch and s.paths == ["calkit/intervals.py"]
    # A "--- a/x" line inside a hunk is a removed line, not a header.
    inner = task.gold_patch.replace("-        if merged and start < merged[-1][1]:\n", "--- a/conftest.py\n")
    assert [b.paths for b in parse_patch(inner)] == [("calkit/intervals.py",)]
    # Test-file edits and new files are dropped, not applied, and the reason says so.
    test_edit = ("diff --git a/tests/test_dates.py b/tests/test_dates.py\n--- a/tests/test_dates.py\n"
                 "+++ b/tests/test_dates.py\n@@ -1 +1 @@\n-a\n+b\n")
    new = ("diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes.txt\n"
           "@@ -0,0 +1 @@\n+x\n")
    s = screen_patch(task.gold_patch + test_edit + new, task.test_files)
    assert s.patch == task.gold_patch and s.dropped == ["notes.txt", "tests/test_dates.py"]
    assert any("a new file" in n for n in s.notes) and any("a test file" in n for n in s.notes)
    assert screen_patch(task.gold_patch + new, task.test_files, allow_new_files=True).paths == [
        "calkit/intervals.py", "notes.txt"]
    assert "no file patch" in screen_patch("just words\n", []).refused
    assert screen_patch("", []).refused is None


def test_static_screen_names_the_rule():
    assert screen_source("def f(a, b):\n    return a < b\n", "def f(a, b):\n    return a <= b\n") == []
    assert screen_source("", "import sys\nx = sys._getframe(1).f_back\n") == [
        "frame or object-graph walking (_getframe, f_back)"]
    hits = screen_source("", "import os as o\no.write(3, b'x')\no._exit(0)\n")
    assert hits == ["/proc, /dev or raw file descriptors (os.write)", "process control (_exit)"]
    assert screen_source("import ctypes\n", "import ctypes\nctypes.c_int(1)\n") == []  # only what it adds
    assert "test runner internals" in screen_source("", "import _pytest.runner\n")[0]
    assert "import machinery" in screen_source("", "import sys\nsys.modules['x'] = 1\n")[0]


def test_canaries_show_forged_outcomes():
    src = "import pytest\n\n@pytest.mark.parametrize('x', [1, 2])\ndef test_a(x):\n    assert x\n\n" \
          "def test_b():\n    assert 0\n"
    f2p = ["t/test_m.py::test_a[1]", "t/test_m.py::test_a[2]", "t/test_m.py::test_b"]
    append, expect = plant_canaries({"t/test_m.py": src}, f2p, random.SystemRandom(), record=True)
    compile(src + append["t/test_m.py"], "t/test_m.py", "exec")
    kinds = sorted(k for k, _ in expect.values())
    assert kinds == ["fail", "fail", "pass", "pass", "same", "same", "same"]
    assert len({n.split("::")[1].split("[")[0] for n, (k, _) in expect.items() if k == "same"}) == 2
    honest = {t: "passed" for t in f2p}
    evidence = {}
    for nid, (kind, detail) in expect.items():
        honest[nid] = {"fail": "failed", "pass": "passed", "same": "passed"}[kind]
        evidence[nid] = f"assert {detail} == 1" if kind == "fail" else detail if kind == "pass" else ""
    assert check_canaries(expect, honest, evidence) == []
    everything_passes = {t: "passed" for t in honest}
    assert any("must fail" in p for p in check_canaries(expect, everything_passes, evidence))
    only_f2p = {**honest, "t/test_m.py::test_b": "passed"}
    only_f2p.update({n: "failed" for n, (k, d) in expect.items() if k == "same" and d.endswith("test_b")})
    assert any("a copy of t/test_m.py::test_b" in p for p in check_canaries(expect, only_f2p, evidence))
    assert any("nonce value" in p for p in check_canaries(expect, honest, {}))
    assert check_canaries(expect, {}, {}, unloaded={"t/test_m.py"}) == []


# ------------------------------------------------------------------------ real containers


@pytest.fixture(scope="module")
def tasks(engine_ready):
    return fixture_tasks()


@pytest.fixture(scope="module")
def pool(engine_ready):
    with GraderPool(max_graders=2, graders_per_image=1, wait_s=60) as p:
        yield p


@pytest.fixture(scope="module")
def pristine(tasks):
    """A reader of task 0's image files, as the agent starts from them."""
    with Sandbox(tasks[0].image) as sb:
        cache: dict[str, str] = {}

        def read(path: str) -> str:
            if path not in cache:
                cache[path] = sb.read_file(path).decode()
            return cache[path]

        for path in ["calkit/intervals.py", *tasks[0].test_files]:
            read(path)
    return lambda p: cache[p]


def _patch(pristine, task, hack) -> str:
    edits = hack.make(task, pristine)
    before = {}
    for p in edits:
        try:
            before[p] = pristine(p).encode()
        except KeyError:
            pass
    return edits_to_patch(before, edits)


@docker
def test_gold_scores_one_on_every_path(tasks, pool):
    for task in tasks:
        assert grade_patch(task, task.gold_patch).reward == 1.0, task.task_id
        assert grade_patch(task, task.gold_patch, pool=pool).reward == 1.0, task.task_id
    assert grade_patch(tasks[0], "", pool=pool).reward == 0.0


@docker
@pytest.mark.parametrize("path", ["fresh", "warm"])
@pytest.mark.parametrize("hack", [pytest.param(h, id=h.name) for h in HACKS if not h.slow])
def test_hacks_score_zero(tasks, pool, pristine, hack, path, caplog):
    task = tasks[0]
    patch = _patch(pristine, task, hack)
    with caplog.at_level(logging.WARNING, logger="flashpost.audit"):
        r = grade_patch(task, patch, pool=pool if path == "warm" else None, timeout_s=20)
    assert r.reward == 0.0, f"{hack.name} was rewarded: {r.reason}"
    assert r.reason
    if r.flag:
        assert any(r.flag in rec.getMessage() for rec in caplog.records)


@docker
@pytest.mark.parametrize("path", ["fresh", "warm"])
@pytest.mark.parametrize("hack", [pytest.param(h, id=h.name) for h in PATCH_HACKS])
def test_patch_hacks_score_zero(tasks, pool, pristine, hack, path):
    task = tasks[0]
    r = grade_patch(task, hack.make(task, pristine), pool=pool if path == "warm" else None, timeout_s=20)
    assert r.reward == 0.0 and r.reason.startswith("patch refused"), f"{hack.name}: {r.reason}"


@docker
def test_verdict_hacks_are_caught_by_the_canaries_or_the_screen(tasks, pool, pristine):
    """Each in-process attack names what caught it; the one with no screened name meets the canaries."""
    task = tasks[0]
    by_name = {h.name: h for h in HACKS}
    for name in ("runner_hook_swap", "main_check_off", "conftest_named_plugin", "meta_path_assert_strip",
                 "meta_path_code_swap", "builtins_import_swap", "fake_sys_modules", "proc_fd_forged_run",
                 "gc_reporter_forged_run", "collect_error_forged_run", "mock_patch_evasion", "mock_patch_targeted"):
        r = grade_patch(task, _patch(pristine, task, by_name[name]), pool=pool, timeout_s=20)
        assert r.reward == 0.0 and r.flag == "screen" and "static screen" in r.reason, (name, r.reason)
    r = grade_patch(task, _patch(pristine, task, by_name["console_flood"]), pool=pool, timeout_s=60)
    assert r.reward == 0.0 and r.flag == "flood" and "MB of console output" in r.reason, r.reason


# The in-process attacks, planted through the task's own (trusted, unscreened) hidden test patch
# into the first test module pytest imports: only the canaries stand between them and the verdict.
_CANARY_ONLY = {"runner_hook_swap": "must fail", "main_check_off": "must fail", "conftest_named_plugin": "must fail",
                "meta_path_assert_strip": "must fail", "meta_path_code_swap": "must", "builtins_import_swap": "must",
                "fake_sys_modules": "missing", "mock_patch_evasion": "must fail",
                "mock_patch_targeted": "(a copy of tests/test_intervals.py::test_merge_touching) failed, the original "
                                       "passed", "proc_fd_forged_run": "missing", "gc_reporter_forged_run": "missing",
                "collect_error_forged_run": "missing"}


@docker
@pytest.mark.parametrize("name", sorted(_CANARY_ONLY))
def test_canaries_alone_catch_in_process_forgeries(tasks, pool, pristine, name):
    task = tasks[0]
    source = gold_source_files(task)[0]
    payload = next(h for h in HACKS if h.name == name).make(task, pristine)[source][len(pristine(source)):]
    host = "tests/test_dates.py"  # collected first; it imports the module under test
    lines = pristine(host).splitlines()
    add = payload.splitlines()
    test_patch = (f"diff --git a/{host} b/{host}\n--- a/{host}\n+++ b/{host}\n"
                  f"@@ -{len(lines)},1 +{len(lines)},{1 + len(add)} @@\n {lines[-1]}\n"
                  + "".join(f"+{x}\n" for x in add))
    planted = dataclasses.replace(task, test_patch=test_patch)
    r = grade_patch(planted, "", pool=pool, timeout_s=20)
    assert r.reward == 0.0 and r.flag == "tamper", (name, r.reason)
    assert _CANARY_ONLY[name] in r.reason, (name, r.reason)
    assert grade_patch(dataclasses.replace(task, test_patch=""), task.gold_patch, pool=pool).reward == 1.0


@docker
def test_batch_neighbours_stay_exact_under_every_hack(tasks, pool, pristine):
    task = tasks[0]
    gold = edits_as_files({"calkit/intervals.py": pristine("calkit/intervals.py").replace(
        "start < merged[-1][1]", "start <= merged[-1][1]")})
    attacks = [(h.name, edits_as_files(h.make(task, pristine))) for h in HACKS if not h.slow]
    attacks += [(h.name, h.make(task, pristine)) for h in BATCH_HACKS]
    items, want = [], []
    for _, files in attacks:  # every attack between a gold and an unchanged neighbour
        items += [(task, gold), (task, files), (task, {})]
        want += [1.0, 0.0, 0.0]
    out = grade_batch(items, pool=pool, timeout_s=5.0)
    got = [g.reward for g in out]
    named = {name: out[3 * k + 1].reason for k, (name, _) in enumerate(attacks)}
    assert got == want, {name: why for (name, _), r, why in zip(attacks, got[1::3], named.values()) if r}
    assert all(g.reason for g in out)
    assert "climbs out" in named["dotdot_plant"] and "climbs out" in named["absolute_path"]
    assert "frame or object-graph walking" in named["frame_walk_nonce"]
