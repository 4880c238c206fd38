"""The library's own test environment: its declared test dependencies, as wheels, in the image's venv.

A tree declares what its tests need in pyproject.toml ([project] dependencies, the test extras,
[dependency-groups]), setup.cfg, setup.py, tox.ini ([testenv] deps and extras, `-r` files) and the
usual requirement files. `resolve` collects those requirements, drops the ones the base image pins
(pytest and its dependencies: the grader runs that pytest), tooling that tests do not import
(coverage, linters, tox) and the library itself (a second copy of it would be a working oracle), and
downloads wheels for the sandbox's interpreter through the project's pip (containers have no
network). `env_image` layers them as root into the base image's /usr/local venv; the image keeps
the lock (requirements, skipped ones and why, each wheel's sha256) at LOCK_IN_IMAGE and its label,
so the same environment can be rebuilt from the record. A tree that declares nothing gets the base
image itself. Not here: importing the library under test from the workspace (envs/grade_runner.py
puts the workspace, or its src/, on the path of each test run).
"""

from __future__ import annotations

import ast
import configparser
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from envs import engine

# The sandbox's interpreter (Debian bookworm's python3): wheels are chosen for it, not for the host.
PYTHON_VERSION, ABI, PLATFORMS = "3.11", "cp311", ("manylinux2014_x86_64", "manylinux_2_17_x86_64")
TEST_EXTRAS = ("test", "tests", "testing")
# Not imported by tests: installing them only costs time (and plugins would change how pytest runs).
TOOLING = {"coverage", "pytest-cov", "tox", "nox", "pre-commit", "mypy", "flake8", "black", "ruff", "isort",
           "pylint", "codecov", "pytest-xdist", "pytest-randomly", "pytest-rerunfailures", "twine", "wheel",
           "setuptools", "build", "sphinx", "check-manifest", "pip", "pip-tools", "virtualenv"}
REQUIREMENT_FILES = ("requirements/test.txt", "requirements/tests.txt", "requirements-test.txt",
                     "requirements-tests.txt", "requirements_test.txt", "test-requirements.txt",
                     "test_requirements.txt", "tests/requirements.txt")
LOCK_IN_IMAGE = "/usr/local/share/flashpost/test-env.json"
CONTENT_LABEL = "flashpost.test-env"
# Runs as root in the image: unpack each wheel into the venv's site-packages (a wheel is a zip laid
# out for it; *.data/purelib|platlib hold more of the same), keep the lock, leave /tmp empty.
INSTALL_SCRIPT = f"""
site=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
for w in /tmp/testenv/*.whl; do python3 -m zipfile -e "$w" "$site"; done
for d in "$site"/*.data; do
    [ -d "$d" ] || continue
    for k in purelib platlib; do [ -d "$d/$k" ] && cp -a "$d/$k/." "$site/"; done
    rm -rf "$d"
done
mkdir -p {os.path.dirname(LOCK_IN_IMAGE)}
cp /tmp/testenv/lock.json {LOCK_IN_IMAGE}
chmod -R a+rX "$site" {os.path.dirname(LOCK_IN_IMAGE)}
rm -rf /tmp/testenv
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return normalize(m.group(1)) if m else ""


@functools.cache
def base_pins() -> dict[str, str]:
    """name -> version of the wheels the base image's recipe installs (TEST_WHEELS)."""
    m = re.search(r'^TEST_WHEELS="([^"]*)"', engine.RECIPE_PATH.read_text(), re.M)
    if m is None:
        raise RuntimeError(f"{engine.RECIPE_PATH} has no TEST_WHEELS line")
    return {normalize(n): v for n, _, v in (w.partition("==") for w in m.group(1).split())}


def _lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line:
            out.append(line)
    return out


def _requirement_file(files: dict[str, bytes], path: str, seen: set[str]) -> list[str]:
    if path in seen or path not in files:
        return []
    seen.add(path)
    out = []
    for line in _lines(files[path].decode(errors="replace")):
        if line.startswith(("-r ", "--requirement ")):
            ref = line.split(None, 1)[1].strip()
            out += _requirement_file(files, os.path.normpath(os.path.join(os.path.dirname(path), ref)), seen)
        elif not line.startswith("-"):
            out.append(line)
    return out


def _setup_py(source: bytes) -> tuple[str, list[str]]:
    """name= and the literal install_requires / tests_require lists of a setup() call (never run)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "", []
    name, reqs = "", []
    for kw in (n for n in ast.walk(tree) if isinstance(n, ast.keyword)):
        try:
            value = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
        if kw.arg == "name" and isinstance(value, str):
            name = name or value
        elif kw.arg in ("install_requires", "tests_require") and isinstance(value, (list, tuple)):
            reqs += [r for r in value if isinstance(r, str)]
    return name, reqs


def _ini(source: bytes) -> configparser.ConfigParser:
    """setup.cfg / tox.ini parsed without interpolation; one that does not parse reads as empty."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(source.decode(errors="replace"))
    except configparser.Error:
        return configparser.ConfigParser(interpolation=None)
    return parser


def declared(files: dict[str, bytes]) -> tuple[str, list[str]]:
    """(the project's own name, every requirement its tests declare), from a tree {path: bytes}."""
    name, reqs, extras = "", [], {}
    seen: set[str] = set()
    if "pyproject.toml" in files:
        try:
            doc = tomllib.loads(files["pyproject.toml"].decode(errors="replace"))
        except tomllib.TOMLDecodeError:
            doc = {}
        project = doc.get("project", {})
        name = str(project.get("name", ""))
        reqs += [r for r in project.get("dependencies", []) if isinstance(r, str)]
        extras.update(project.get("optional-dependencies", {}))
        for group in TEST_EXTRAS + ("dev",):
            reqs += [r for r in doc.get("dependency-groups", {}).get(group, []) if isinstance(r, str)]
    if "setup.cfg" in files:
        cfg = _ini(files["setup.cfg"])
        name = name or cfg.get("metadata", "name", fallback="")
        reqs += _lines(cfg.get("options", "install_requires", fallback=""))
        if cfg.has_section("options.extras_require"):
            extras.update({k: _lines(v) for k, v in cfg.items("options.extras_require")})
    if "setup.py" in files:
        setup_name, setup_reqs = _setup_py(files["setup.py"])
        name, reqs = name or setup_name, reqs + setup_reqs
    if "tox.ini" in files:
        tox = _ini(files["tox.ini"])
        for line in _lines(tox.get("testenv", "deps", fallback="")):
            line = line.replace("{toxinidir}/", "")
            if line.startswith(("-r", "--requirement")):
                reqs += _requirement_file(files, line.removeprefix("--requirement").removeprefix("-r").strip(), seen)
            elif "{" not in line and not line.startswith("-"):
                reqs.append(line)
        for extra in re.split(r"[\s,]+", tox.get("testenv", "extras", fallback="")):
            extras.setdefault(extra, [])
            reqs += [r for r in extras.get(extra, []) if isinstance(r, str)]
    for extra in TEST_EXTRAS:
        reqs += [r for r in extras.get(extra, []) if isinstance(r, str)]
    for path in REQUIREMENT_FILES:
        reqs += _requirement_file(files, path, seen)
    if not name and "PKG-INFO" in files:
        name = next(iter(re.findall(r"^Name:\s*(\S+)", files["PKG-INFO"].decode(errors="replace"), re.M)), "")
    return name, reqs


def wanted(files: dict[str, bytes]) -> list[str]:
    """The requirements to install: declared ones, minus base pins, tooling, URLs and the library itself."""
    name, reqs = declared(files)
    own, out = normalize(name), []
    for r in reqs:
        n = requirement_name(r)
        if not n or "://" in r or n in base_pins() or n in TOOLING or n == own or r in out:
            continue
        out.append(r)
    return out


@dataclass
class TestEnv:
    requirements: list[str] = field(default_factory=list)  # installed (as declared)
    skipped: dict[str, str] = field(default_factory=dict)  # requirement -> why (pip's last error)
    wheels: dict[str, str] = field(default_factory=dict)  # wheel file name -> sha256
    wheel_dir: str = ""

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "wheel_dir"}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashpost" / "test-wheels"


def _download(reqs: list[str], dest: Path) -> str:
    """pip download wheels of `reqs` (and their dependencies, with the base's pins as constraints)
    for the sandbox's interpreter into dest; "" or pip's last error line."""
    dest.mkdir(parents=True, exist_ok=True)
    constraints = dest / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in base_pins().items()))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "--python-version",
           PYTHON_VERSION, "--implementation", "cp", "--abi", ABI, *(a for p in PLATFORMS for a in ("--platform", p)),
           "-c", str(constraints), "-d", str(dest), *reqs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "pip download: no answer in 600 s"
    constraints.unlink()
    if proc.returncode == 0:
        return ""
    errors = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("ERROR:")]
    return errors[-1] if errors else proc.stderr.strip()[-300:]


@functools.cache
def _resolve(reqs: tuple[str, ...], own: str) -> TestEnv:
    key = hashlib.sha256(json.dumps([PYTHON_VERSION, PLATFORMS, base_pins(), own, reqs]).encode()).hexdigest()[:16]
    folder = cache_root() / key
    lock = folder / "lock.json"
    if lock.exists():
        return TestEnv(**json.loads(lock.read_text()), wheel_dir=str(folder))
    env = TestEnv(requirements=list(reqs))
    with tempfile.TemporaryDirectory() as tmp:
        if _download(list(reqs), Path(tmp) / "all"):
            # One bad requirement (no wheel, needs a newer pytest) must not cost the others.
            for r in reqs:
                why = _download([r], Path(tmp) / "one")
                if why:
                    env.skipped[r] = why
            env.requirements = [r for r in reqs if r not in env.skipped]
            if env.requirements and (why := _download(env.requirements, Path(tmp) / "kept")):
                env.skipped.update(dict.fromkeys(env.requirements, f"together: {why}"))
                env.requirements = []
        src = Path(tmp) / ("all" if not env.skipped else "kept")
        folder.mkdir(parents=True, exist_ok=True)
        for whl in sorted(src.glob("*.whl")) if env.requirements else []:
            n = normalize(whl.name.split("-")[0])
            if n in base_pins() or n == own:  # the base's pytest stays; no second copy of the library
                continue
            data = whl.read_bytes()
            (folder / whl.name).write_bytes(data)
            env.wheels[whl.name] = hashlib.sha256(data).hexdigest()
    if not env.skipped:  # a failure (an index that did not answer) is tried again by the next process
        lock.write_text(json.dumps(env.to_dict(), indent=1))
    env.wheel_dir = str(folder)
    return env


def resolve(files: dict[str, bytes]) -> TestEnv:
    """The tree's test environment (downloaded once per requirement set, then read from the cache)."""
    reqs = wanted(files)
    if not reqs:
        return TestEnv()
    return _resolve(tuple(reqs), normalize(declared(files)[0]))


def env_image(files: dict[str, bytes]) -> str:
    """The image a tree's test images are layered on: the base image, plus its test wheels if any."""
    base = engine.ensure_base_image()
    env = resolve(files)
    if not env.wheels:
        return base
    lock = json.dumps(env.to_dict(), indent=1, sort_keys=True)
    content = hashlib.sha256((engine.image_id(base) + INSTALL_SCRIPT + lock).encode()).hexdigest()[:16]
    image = f"flashpost/synth-env:{content}"
    if engine.image_labels(image).get(CONTENT_LABEL) != content:
        tree = {f"testenv/{name}": (Path(env.wheel_dir) / name).read_bytes() for name in env.wheels}
        tree["testenv/lock.json"] = lock.encode()
        engine.build_image(base, files=engine.tar_files(tree), dest="/tmp", script=INSTALL_SCRIPT, env={},
                           repository="flashpost/synth-env", tag=content, labels={CONTENT_LABEL: content},
                           user="root")
    return image

