"""The library's declared test dependencies (synth/testenv.py), the repository's pytest
configuration as the grader passes it on, and the grader's report of a real library's failures
(envs/grade_runner.py), without containers; the same against real images is in test_testenv_docker.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from envs.grade_runner import filter_addopts, junit_xml
from synth import testenv


def test_requirements_come_from_each_place_a_tree_declares_them():
    files = {
        "pyproject.toml": b'[project]\nname = "My_Lib"\ndependencies = ["attrs>=22"]\n'
                          b'[project.optional-dependencies]\ntest = ["hypothesis", "pytest>=8", "coverage"]\n'
                          b'diagrams = ["jinja2"]\ndocs = ["sphinx-rtd-theme"]\n'
                          b'[dependency-groups]\ntests = ["freezegun"]\n',
        "tox.ini": b"[tox]\nenvlist = py311\n[testenv]\ndeps =\n    -r {toxinidir}/requirements/tests.txt\n"
                   b"    mock  # a comment\n    {posargs}\nextras = diagrams\ncommands = pytest\n",
        "requirements/tests.txt": b"-r base.txt\npytest==7.4.0\npluggy==1.2.0\nsimplejson\n",
        "requirements/base.txt": b"toolz; python_version >= '3'\nhttps://example.invalid/x.tar.gz\n",
        "setup.py": b"from setuptools import setup\nsetup(name='my-lib', tests_require=['six', \"my_lib\"])\n",
    }
    name, reqs = testenv.declared(files)
    assert name == "My_Lib"
    assert testenv.wanted(files) == ["attrs>=22", "freezegun", "six", "toolz; python_version >= '3'", "simplejson",
                                     "mock", "jinja2", "hypothesis"], reqs
    # pytest and its dependencies stay the base image's; tooling and the library itself are never installed
    assert {testenv.requirement_name(r) for r in testenv.wanted(files)}.isdisjoint(
        {"pytest", "pluggy", "coverage", "my-lib", "sphinx-rtd-theme"})


def test_setup_cfg_and_a_requirements_file():
    files = {"setup.cfg": b"[metadata]\nname = cfgkit\n[options]\ninstall_requires =\n    wcwidth\n"
                          b"[options.extras_require]\ntesting =\n    pytest-asyncio>=0.21\n    tox\n",
             "test-requirements.txt": b"# pinned\nparameterized==0.9.0\n-e .\n"}
    assert testenv.wanted(files) == ["wcwidth", "pytest-asyncio>=0.21", "parameterized==0.9.0"]
    assert testenv.wanted({"setup.py": b"import os\n"}) == []  # nothing declared: the base image itself


def test_addopts_keep_only_options_that_select_or_describe_tests():
    kept, dropped = filter_addopts("-ra --strict-markers -x --doctest-modules -n auto --tb=short -p xdist "
                                   "-p no:randomly -m 'not slow' tests -Werror --cov=lib -vv")
    assert kept == ["-r", "a", "--strict-markers", "--tb", "short", "-p", "no:randomly", "-m", "not slow",
                    "-W", "error"]
    # stop early, other process models, loaded plugins, doctests in files the agent edits, coverage, verbosity
    assert dropped == ["-x", "--doctest-modules", "-n", "auto", "-p", "xdist", "tests", "--cov", "lib", "-v", "v"]
    assert filter_addopts(["--import-mode=importlib", "-q"]) == (["--import-mode", "importlib"], ["-q"])


def test_the_report_holds_failure_messages_that_quote_terminal_escapes():
    # click's tests compare styled output: a failure message carries ESC (and may carry NUL), which
    # XML 1.0 cannot hold; the report must still parse, with the characters written as \xNN
    xml = junit_xml({"tests/t.py::test_style": "failed", "tests/t.py::test_ok": "passed"},
                    [{"nodeid": "tests/t.py::test_style", "message": "assert '\x1b[31mred\x1b[0m\x00' == 'red' ü"}])
    failure = ET.fromstring(xml).find(".//failure")
    assert failure is not None and failure.text == "assert '\\x1b[31mred\\x1b[0m\\x00' == 'red' ü"
