"""Stage 4, build & sanitize: a specified candidate -> a task image (base image + the broken tree as a
fresh single-commit git repository, caches and bytecode purged), then a leak audit that searches
the built image (workspace files, every git object, site-packages, scratch dirs) for the gold fix
text and fails the task on any hit.

`build_tree_image` is the general form of envs/fixtures/build.py (any file tree, any history
script, content-addressed so an unchanged tree is not rebuilt); feasibility uses it for the
pristine repository image too. Not here: deciding F2P/P2P (specify) or grading (inspect).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from envs import engine
from envs.sandbox import Sandbox
from envs.task import Task
from synth import mutations, testenv
from synth.config import Context
from synth.records import SpecRecord, TaskRecord
from synth.testrun import TEST_COMMAND

NAME = "build"
BUDGET_S = 900.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = TaskRecord
CONTENT_LABEL = "flashpost.content"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "flashpost", "GIT_AUTHOR_EMAIL": "flashpost@localhost",
    "GIT_COMMITTER_NAME": "flashpost", "GIT_COMMITTER_EMAIL": "flashpost@localhost",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+0000",
}
PURGE = ("find . \\( -name __pycache__ -o -name .pytest_cache -o -name '*.egg-info' -o -name .mypy_cache \\) "
         "-prune -exec rm -rf {} + ; find . \\( -name '*.pyc' -o -name '*.pyo' -o -name '*.orig' -o -name '*.rej' "
         "\\) -delete; rm -rf .git")
FRESH_HISTORY = f"{PURGE}; git init -q -b main && git add -A && git commit -q -m 'Initial commit'"

# Run by each interpreter of the image (-I, from /): where would `import NAME` load from, with the
# workspace off the path? Any answer is a copy of the library outside the workspace: a working oracle.
FIND_SCRIPT = r'''
import importlib.machinery, json, os, sys
path = [p for p in sys.path if p and not os.path.realpath(p).startswith("/workspace")]
found = {}
for name in sys.argv[1:]:
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None:
        where = spec.origin if spec.origin not in (None, "namespace") else \
            next(iter(spec.submodule_search_locations or []), "")
        if where and not os.path.realpath(where).startswith("/workspace/"):
            found[name] = where
print(json.dumps(found))
'''

AUDIT_SCRIPT = r'''
import json, os, site, subprocess, sys
needles = [n.encode() for n in json.load(open("/tmp/.audit-needles.json"))]
names = json.load(open("/tmp/.audit-imports.json"))
importable = {}
for python in sorted({p for p in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable) if os.path.exists(p)}):
    r = subprocess.run([python, "-I", "/tmp/.audit-find.py", *names], capture_output=True, text=True, cwd="/")
    for name, where in (json.loads(r.stdout) if r.returncode == 0 else {}).items():
        importable.setdefault(name, where)
roots = ["/workspace", "/tmp", "/root", "/home", "/opt", "/srv", "/var/tmp", "/usr/local/lib",
         *site.getsitepackages(), "/usr/lib/python3/dist-packages"]
hits, scanned, seen = [], 0, set()
def scan(name, data):
    for n in needles:
        if n in data:
            hits.append(name)
            return
for root in roots:
    for d, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            real = os.path.realpath(p)
            if real in seen or p.startswith("/tmp/.audit"):
                continue
            seen.add(real)
            try:
                if os.path.isfile(p) and os.path.getsize(p) < 4 << 20:
                    scanned += 1
                    scan(p, open(p, "rb").read())
            except OSError:
                pass
git = ["git", "-c", "safe.directory=*", "-C", "/workspace"]
objs = subprocess.run(git + ["cat-file", "--batch-all-objects", "--batch"], capture_output=True).stdout
scan("git objects", objs)
count = subprocess.run(git + ["rev-list", "--all", "--count"], capture_output=True, text=True).stdout.strip()
head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
status = subprocess.run(git + ["status", "--porcelain", "--ignored"], capture_output=True, text=True).stdout
stash = subprocess.run(git + ["stash", "list"], capture_output=True, text=True).stdout
bytecode = [os.path.join(d, f) for d, _, fs in os.walk("/workspace") for f in fs if f.endswith((".pyc", ".pyo"))]
print(json.dumps({"hits": hits, "importable": importable, "scanned": scanned, "commits": count, "head": head,
                  "dirty": status.splitlines(),
                  "stash": stash.splitlines(), "bytecode": bytecode, "objects_bytes": len(objs)}))
'''


def units(specs: list[SpecRecord], ctx: Context) -> list[SpecRecord]:
    return [s for s in specs if s.ok]


def unit_key(spec: SpecRecord) -> str:
    return spec.task_id


def repo_files(repo_dir: str | Path) -> dict[str, bytes]:
    root = Path(repo_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")}


def build_tree_image(files: dict[str, bytes], image: str, *, script: str = FRESH_HISTORY) -> str:
    """Build (or find cached by content) `image` = the tree's test environment (synth/testenv.py: the
    base image, plus the test wheels the tree declares) + files at /workspace + script; its id."""
    base = testenv.env_image(files)
    h = hashlib.sha256(engine.image_id(base).encode() + script.encode())
    for rel, content in sorted(files.items()):
        h.update(rel.encode() + b"\0" + hashlib.sha256(content).digest())
    content = h.hexdigest()[:16]
    if engine.image_labels(image).get(CONTENT_LABEL) != content:
        repository, _, tag = image.rpartition(":")
        engine.build_image(base, files=engine.tar_files(files), dest="/workspace", script=script, env=GIT_ENV,
                           repository=repository, tag=tag, labels={CONTENT_LABEL: content})
    return engine.image_id(image)


def library_names(paths: list[str]) -> list[str]:
    """Top-level import names of the library in a tree (flat or src/ layout): packages and modules,
    not tests, docs or build scripts."""
    names = set()
    for path in paths:
        parts = path.split("/")
        if parts[0] == "src" and len(parts) > 1:
            parts = parts[1:]
        if len(parts) == 2 and parts[1] == "__init__.py":
            names.add(parts[0])
        elif len(parts) == 1 and parts[0].endswith(".py") and parts[0] not in _NOT_MODULES \
                and not parts[0].startswith("test_"):
            names.add(parts[0][:-3])
    return sorted(n for n in names if n.isidentifier() and n not in ("tests", "test", "testing", "docs"))


_NOT_MODULES = {"setup.py", "conftest.py", "noxfile.py", "tasks.py", "fabfile.py"}


def audit_image(image: str, needles: list[str], timeout: float = 180, import_names: list[str] = ()) -> dict:
    """Search the image for any needle, and for a copy of `import_names` importable from outside the
    workspace; also report history, dirt and bytecode. Raises on no answer."""
    with Sandbox(image, labels={"flashpost.purpose": "leak-audit"}) as sb:
        sb.write_file("/tmp/.audit-needles.json", json.dumps(needles))
        sb.write_file("/tmp/.audit-imports.json", json.dumps(list(import_names)))
        sb.write_file("/tmp/.audit-find.py", FIND_SCRIPT)
        sb.write_file("/tmp/.audit.py", AUDIT_SCRIPT)
        r = sb.exec("python3 /tmp/.audit.py", timeout=timeout, user="root", max_output_bytes=1_000_000)
    if r.exit_code != 0:
        raise RuntimeError(f"leak audit failed to run: {r.output[-1500:]}")
    return json.loads(r.output.strip().splitlines()[-1])


def audit_problems(report: dict) -> list[str]:
    problems = [f"fix text found in {h}" for h in report["hits"]]
    problems += [f"{name} importable from outside the workspace: {where}"
                 for name, where in report.get("importable", {}).items()]
    if report["commits"] != "1":
        problems.append(f"history has {report['commits']} commits, not 1")
    if report["dirty"]:
        problems.append(f"workspace not clean: {report['dirty'][:5]}")
    if report["stash"]:
        problems.append("a stash exists")
    if report["bytecode"]:
        problems.append(f"bytecode left: {report['bytecode'][:3]}")
    return problems


def task_files(rec: SpecRecord | TaskRecord) -> dict[str, bytes]:
    """The shipped (broken) tree: the fixed tree at repo_path, the mutation applied, the overrides written."""
    files = repo_files(rec.repo_path)
    if rec.mutation:
        m = mutations.Mutation(**rec.mutation)
        files[m.path] = mutations.apply(files[m.path].decode(), m).encode()
    for path, text in rec.overrides.items():
        if text is None:
            files.pop(path, None)
        else:
            files[path] = text.encode()
    return files


def build_task(spec: SpecRecord, ctx: Context, *, files: dict[str, bytes] | None = None,
               script: str = FRESH_HISTORY) -> TaskRecord:
    """Build and audit one task; `files`/`script` default to the broken tree with a fresh history."""
    t0 = time.monotonic()
    image = f"flashpost/synth-task:{spec.task_id}"
    rec = TaskRecord(key=spec.task_id, repo_path=spec.repo_path, origin=spec.origin, mutation=spec.mutation,
                     overrides=spec.overrides, quoted=spec.quoted, needles=spec.needles)
    try:
        ctx.note("building the task image")
        tree = files if files is not None else task_files(spec)
        digest = build_tree_image(tree, image, script=script)
        ctx.note("leak audit")
        report = audit_image(image, spec.needles, import_names=library_names(sorted(tree)))
    except RuntimeError as e:
        return rec.drop(f"build failed: {e}"[:2000])
    rec.audit = {k: v for k, v in report.items() if k != "dirty"} | {"needles": len(spec.needles)}
    task = Task(task_id=spec.task_id, repo=spec.repo_key, base_revision=report["head"], image=image,
                image_digest=digest, problem_statement=spec.problem_statement, test_command=TEST_COMMAND,
                test_parser="junit", f2p=spec.f2p, p2p=spec.p2p, gold_patch=spec.gold_patch,
                test_files=spec.test_files)
    rec.task, rec.seconds = task.to_dict(), time.monotonic() - t0
    problems = audit_problems(report)
    return rec.drop("image leak: " + "; ".join(problems)) if problems else rec


def process(spec: SpecRecord, ctx: Context) -> TaskRecord:
    return build_task(spec, ctx)
