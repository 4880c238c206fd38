"""A task image's test environment against real containers: the library's declared test
dependencies are installed into the image's venv (from wheels; the lock kept in the image; their
pytest plugins loaded) and nowhere else, and the repository's own pytest configuration is honoured
in each of the four places pytest reads it from (testpaths, python_functions, markers, pythonpath,
conftest, and the addopts that keep the report intact; -x dropped, a minversion this pytest cannot
meet ignored)."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from envs.sandbox import Sandbox
from synth import testenv
from synth.stages.build import build_tree_image
from synth.testrun import probe_task, run_suite

pytestmark = pytest.mark.docker

BODY = {"testpaths": "tests", "python_functions": "check_* test_*", "pythonpath": "lib",
        "addopts": "-x --strict-markers -m 'not slow' -ra", "minversion": "99"}
CONFIGS = {
    "pytest.ini": "[pytest]\n" + "".join(f"{k} = {v}\n" for k, v in BODY.items()) + "markers =\n    slow: slow\n",
    "setup.cfg": "[tool:pytest]\n" + "".join(f"{k} = {v}\n" for k, v in BODY.items()) + "markers =\n    slow: slow\n",
    "tox.ini": "[tox]\nenvlist = py3\n[pytest]\n" + "".join(f"{k} = {v}\n" for k, v in BODY.items())
               + "markers =\n    slow: slow\n",
    "pyproject.toml": '[project]\nname = "cfgkit"\nversion = "1"\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
                      'python_functions = ["check_*", "test_*"]\npythonpath = ["lib"]\nmarkers = ["slow: slow"]\n'
                      "addopts = \"-x --strict-markers -m 'not slow' -ra\"\nminversion = \"99\"\n",
}
TREE = {
    "cfgkit/__init__.py": b"def triple(x):\n    return 3 * x\n",
    "lib/helper.py": b"SEVEN = 7\n",  # importable only through the configured pythonpath
    "tests/conftest.py": b"import pytest\n\n\n@pytest.fixture\ndef four():\n    return 4\n",
    "tests/test_cfg.py": b"import pytest\nfrom helper import SEVEN\n\nfrom cfgkit import triple\n\n\n"
                         b"def test_fails():\n    assert triple(1) == 4\n\n\n"
                         b"def check_triple(four):\n    assert triple(four) == 12 and SEVEN == 7\n\n\n"
                         b"@pytest.mark.slow\ndef test_slow():\n    assert False\n",
    "other/test_outside.py": b"def test_outside():\n    assert False\n",  # not under testpaths
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_repositorys_pytest_configuration_is_honoured(engine_ready, config):
    files = {**TREE, config: CONFIGS[config].encode()}
    image = build_tree_image(files, f"flashpost/synth-repo:config-{config.replace('.', '-')}")
    run = run_suite(probe_task(image, ["tests/test_cfg.py", "tests/conftest.py", "other/test_outside.py"]), "")
    assert run.statuses == {"tests/test_cfg.py::test_fails": "failed",
                            "tests/test_cfg.py::check_triple": "passed"}, (run.why_not_run(), run.console)
    assert f"flashpost: pytest configuration: {config}" in run.console
    assert "addopts not used: -x" in run.console and run.agreement


def fake_wheel(name: str, version: str, module: str) -> bytes:
    """A pure wheel whose module is also a pytest plugin (a fixture), as pytest-* test dependencies are."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "import pytest\n\nANSWER = 42\n\n\n@pytest.fixture\n"
                                             "def one():\n    return 1\n")
        info = f"{name.replace('-', '_')}-{version}.dist-info"
        zf.writestr(f"{info}/entry_points.txt", f"[pytest11]\n{module} = {module}\n")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return buf.getvalue()


def test_declared_test_dependencies_are_installed_in_the_venv_only(engine_ready, tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    (index / "depkit_helper-1.0-py3-none-any.whl").write_bytes(fake_wheel("depkit-helper", "1.0", "depkit_helper"))
    (index / "depkit-2.0-py3-none-any.whl").write_bytes(fake_wheel("depkit", "2.0", "depkit"))  # the library itself
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # an offline index: pip reads only this folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    files = {"pyproject.toml": b'[project]\nname = "depkit"\nversion = "1"\n'
                               b'[project.optional-dependencies]\ntest = ["depkit-helper==1.0", "depkit"]\n',
             "depkit/__init__.py": b"def answer():\n    return 41\n",
             "tests/test_answer.py": b"from depkit_helper import ANSWER\n\nfrom depkit import answer\n\n\n"
                                     b"def test_answer(one):\n    assert answer() + one == ANSWER\n"}
    env = testenv.resolve(files)
    assert list(env.wheels) == ["depkit_helper-1.0-py3-none-any.whl"] and env.skipped == {}, env
    image = build_tree_image(files, "flashpost/synth-repo:testenv-deps")
    run = run_suite(probe_task(image, ["tests/test_answer.py"]), "")
    assert run.statuses == {"tests/test_answer.py::test_answer": "passed"}, run.why_not_run()
    with Sandbox(image) as sb:
        lock = json.loads(sb.exec(f"cat {testenv.LOCK_IN_IMAGE}", timeout=60).output)
        assert lock["wheels"] == env.wheels and lock["requirements"] == ["depkit-helper==1.0"]
        r = sb.exec("cd /tmp && /usr/bin/python3 -c 'import depkit_helper'", timeout=60)
        assert r.exit_code != 0, r.output  # the system interpreter does not see the test venv
        r = sb.exec("cd /tmp && python3 -c 'import depkit'", timeout=60)
        assert r.exit_code != 0, r.output  # the library's wheel (a second copy) was never installed
