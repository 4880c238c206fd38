"""The task image's test environment against real containers: tests run in the image's own venv
(only pytest and its dependencies, no system site-packages), a src/-layout library is imported from
the workspace, the library under test cannot be imported from outside the workspace, and the leak
audit finds a copy that is."""

from __future__ import annotations

import json

import pytest

from envs import engine
from envs.sandbox import Sandbox
from synth.stages.build import FIND_SCRIPT, audit_image, audit_problems, build_tree_image
from synth.testrun import probe_task, run_suite

pytestmark = pytest.mark.docker

FILES = {
    "pyproject.toml": b'[project]\nname = "srckit"\nversion = "0.1"\n',
    "src/srckit/__init__.py": b"def double(x):\n    return 2 * x\n",
    "tests/test_double.py": b"from srckit import double\n\n\ndef test_double():\n    assert double(2) == 4\n",
}


@pytest.fixture(scope="module")
def image():
    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    engine.ensure_base_image(build=True)
    build_tree_image(FILES, "flashpost/synth-repo:isolation-test")
    yield "flashpost/synth-repo:isolation-test"
    left = engine.list_containers({engine.LABEL_OWNER: engine.owner_id()})
    engine.reap_containers({engine.LABEL_OWNER: engine.owner_id()})
    assert not left, f"containers leaked: {[c['Id'][:12] for c in left]}"


def test_a_src_layout_library_is_tested_from_the_workspace(image):
    run = run_suite(probe_task(image, ["tests/test_double.py"]), "")
    assert run.statuses == {"tests/test_double.py::test_double": "passed"}, run.why_not_run()


def test_the_library_cannot_be_imported_from_outside_the_workspace(image):
    with Sandbox(image) as sb:
        for python in ("python3", "/usr/bin/python3"):
            r = sb.exec(f"cd /tmp && {python} -c 'import srckit'", timeout=60)
            assert r.exit_code != 0 and "No module named 'srckit'" in r.output, (python, r.output)
        r = sb.exec("python3 -c 'import sys, pytest; print(sys.prefix, pytest.__version__)'", timeout=60)
        assert r.exit_code == 0 and r.output.split()[0] == "/usr/local", r.output  # the test venv
        r = sb.exec("/usr/bin/python3 -c 'import pytest'", timeout=60)  # no Debian pytest (and its libraries)
        assert r.exit_code != 0, r.output
    report = audit_image(image, [], import_names=["srckit"])
    assert report["importable"] == {} and audit_problems(report) == []


def test_the_audit_finds_a_copy_outside_the_workspace(image):
    # the image's file system is read-only, so the planted copy sits in /tmp, put on the finder's path
    with Sandbox(image) as sb:
        sb.write_file("/tmp/find.py", FIND_SCRIPT)
        r = sb.exec("mkdir -p /tmp/copy && cp -r /workspace/src/srckit /tmp/copy/", timeout=60)
        assert r.exit_code == 0, r.output
        finder = ("import sys; sys.path.append('/tmp/copy'); sys.argv = ['find', 'srckit']; "
                  "exec(open('/tmp/find.py').read())")
        r = sb.exec(f'cd / && python3 -I -c "{finder}"', timeout=60)
        assert json.loads(r.output) == {"srckit": "/tmp/copy/srckit/__init__.py"}, r.output
        r = sb.exec("cd / && python3 -I /tmp/find.py srckit", timeout=60)
        assert json.loads(r.output) == {}, r.output  # the workspace copy is not counted
    report = {"hits": [], "importable": {"srckit": "/tmp/copy/srckit/__init__.py"}, "commits": "1", "dirty": [],
              "stash": [], "bytecode": []}
    assert audit_problems(report) == ["srckit importable from outside the workspace: /tmp/copy/srckit/__init__.py"]
