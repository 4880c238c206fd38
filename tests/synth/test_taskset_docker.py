"""Task sets against real containers: the fixture tasks and the demo's families write the same format
and load through the trainers' reader (with verified, replayed demonstrations); the gold patch cannot
be read from inside the agent's sandbox; a missing image is rebuilt from its recipe, or the reader
stops with the command that rebuilds it."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from envs import engine
from synth import taskset
from synth.taskset import TaskSetError

pytestmark = pytest.mark.docker

# Walks the whole filesystem of the container (not /proc, /sys, /dev) for any needle (argv: a JSON file).
SCAN = r'''
import json, os, sys
needles = [n.encode() for n in json.load(open(sys.argv[1]))]
hits = []
for root, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/dev")]
    for f in files:
        p = os.path.join(root, f)
        if p == sys.argv[1] or not os.path.isfile(p) or os.path.islink(p):
            continue
        try:
            data = open(p, "rb").read(8 << 20)
        except OSError:
            continue
        hits += [f"{i}:{p}" for i, n in enumerate(needles) if n in data]
print(json.dumps(hits))
'''


@pytest.fixture(scope="module")
def fixture_set(engine_ready, tmp_path_factory):
    from synth.taskset_sources import fixture_source

    path = tmp_path_factory.mktemp("fixtures") / "taskset"
    taskset.save(fixture_source(progress=False), path)
    return path


def _hunks_new_and_old(patch: str) -> tuple[list[str], list[str]]:
    """Per hunk, the text of its new side (context + added lines) and of its old side."""
    new, old, cur_new, cur_old = [], [], [], []
    for line in patch.splitlines():
        if line.startswith("@@"):
            if cur_new:
                new.append("\n".join(cur_new))
                old.append("\n".join(cur_old))
            cur_new, cur_old = [], []
        elif line.startswith(("+++", "---", "diff ", "index ")):
            continue
        elif line.startswith("+"):
            cur_new.append(line[1:])
        elif line.startswith("-"):
            cur_old.append(line[1:])
        elif line.startswith(" "):
            cur_new.append(line[1:])
            cur_old.append(line[1:])
    if cur_new:
        new.append("\n".join(cur_new))
        old.append("\n".join(cur_old))
    return new, old


def test_fixtures_and_families_load_through_the_trainers_reader(fixture_set, tmp_path, monkeypatch):
    from envs.grading import grading_timeout
    from envs.task import Task
    from rl.config import JobConfig
    from rl.rl_loop import load_tasks
    from rl.tasks import demo_conversations, read
    from synth.cli import main

    assert main(["build", "--source", "families", "--budget", "2", "--out", str(tmp_path / "fam")]) == 0
    fam_path = tmp_path / "fam" / "taskset"
    for path, families in ((fixture_set, {"fixtures"}), (fam_path, {"A", "B"})):
        ts = taskset.load(path)
        assert {r.family for r in ts.tasks} == families and {r.env for r in ts.tasks} == {"sandbox"}
        assert all(r.f2p and r.gold_patch and r.image_recipe["kind"] in ("fixture", "families") for r in ts.tasks)
        payloads = load_tasks(JobConfig(tasks=str(path)), progress=False)
        assert payloads and all(p["task"]["gold_patch"] == "" and p["env"] == "sandbox" for p in payloads)
        # a rollout worker grades a family task under its measured budget, a fixture task under the cap
        timeouts = {grading_timeout(Task(**p["task"]), 120.0) for p in payloads}
        assert timeouts == {120.0} if families == {"fixtures"} else max(timeouts) < 120.0, timeouts
        assert {p["task_id"] for p in payloads} == {r.id for r in ts.tasks if r.split == "train"}
        demos = [d for d in ts.demos]
        assert demos, "verified demonstrations are recorded"
        for d in demos:
            roles = [m["role"] for m in d.messages]
            # fixtures: tests, apply the patch, tests, submit; families: view, edit, tests, submit (a recovery
            # adds a failed edit's test result and the correcting edit)
            n_tools = (4,) if families == {"fixtures"} else (4, 6)
            assert roles[:2] == ["system", "user"] and roles.count("tool") in n_tools and d.reward == 1.0
            assert d.messages[-2]["tool_calls"][0]["name"] == "submit"
        fams = {r.id: r.family for r in ts.tasks}
        assert {fams[d.task_id] for d in demos} <= (families - {"B"}), "family B is tests only"
        try:
            convs, ids, env = demo_conversations(read(str(path), taskset.TaskFilter(), "train"), str(path))
            assert env == "sandbox" and len(convs) == len(ids)
        except TaskSetError as e:  # a train split whose every task is family B has no demonstrations
            assert "no demonstrations" in str(e)


def test_gold_patch_is_not_readable_from_the_agents_sandbox(fixture_set):
    from envs.episode import default_sandbox
    from envs.task import Task
    from rl.config import JobConfig, TaskFilter
    from rl.rl_loop import load_tasks

    ts = taskset.load(fixture_set)
    job = JobConfig(tasks=str(fixture_set), task_filter=TaskFilter())
    payloads = {p["task_id"]: p["task"] for p in load_tasks(job, progress=False)}
    for row in ts.tasks:
        if row.id not in payloads:
            continue
        new, old = _hunks_new_and_old(row.gold_patch)
        needles = [row.gold_patch, *new, *old]
        agent_task = Task(**payloads[row.id])  # what a rollout worker gets
        assert agent_task.gold_patch == ""
        with default_sandbox(agent_task) as sb:
            sb.write_file("/tmp/.needles.json", json.dumps(needles))
            sb.write_file("/tmp/.scan.py", SCAN)
            r = sb.exec("python3 /tmp/.scan.py /tmp/.needles.json", timeout=120, max_output_bytes=1_000_000)
            env = sb.exec("env", timeout=30).output
        assert r.exit_code == 0, r.output[-2000:]
        hits = json.loads(r.output.strip().splitlines()[-1])
        found = {int(h.split(":", 1)[0]) for h in hits}
        n_new = len(new)
        assert not found & set(range(1 + n_new)), f"{row.id}: fix text readable inside the sandbox: {hits}"
        # the scan does see files: the broken side of each hunk is in the workspace
        assert set(range(1 + n_new, 1 + 2 * n_new)) <= found, hits
        assert row.gold_patch not in env


def test_a_missing_image_is_rebuilt_from_its_recipe_or_the_command_is_named(engine_ready, tmp_path, capsys):
    from synth.taskset_sources import ensure_images

    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "m.py").write_text("def f():\n    return 1\n")
    (tree / "tests" / "test_m.py").write_text("from m import f\n\ndef test_f():\n    assert f() == 1\n")
    image = f"flashpost/taskset-test:{hashlib.sha256(engine.owner_id().encode()).hexdigest()[:12]}"
    recipe = {"kind": "tree", "image": image, "repo_path": str(tree), "mutation": {}, "overrides": {},
              "command": "flashpost-factory build --repo X --out Y"}
    row = taskset.TaskRow(id="t", image=image, image_recipe=recipe, f2p=["tests/test_m.py::test_f"])
    try:
        if engine.image_exists(image):
            engine.client().images.remove(image, force=True)
        ensure_images([row])
        assert engine.image_exists(image)
        assert f"image {image} of task t is missing: rebuilding it from its recipe (tree)" in capsys.readouterr().out
    finally:
        if engine.image_exists(image):
            engine.client().images.remove(image, force=True)
    gone = dataclasses.replace(row, image_recipe=recipe | {"repo_path": str(tmp_path / "gone")})
    with pytest.raises(TaskSetError, match="rebuild it with `flashpost-factory build --repo X --out Y`"):
        ensure_images([gone])
    bare = dataclasses.replace(row, image_recipe={})
    with pytest.raises(TaskSetError, match="no recipe"):
        ensure_images([bare])
