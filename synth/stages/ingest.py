"""Stage 1, ingest: a source (local path, git repository, or `pypi:NAME==VERSION` sdist) -> a clean
copy of its tree under `<out>/ingest/repos/<key>` (no VCS metadata, caches or build outputs). A git
source also keeps a bare clone under `<out>/ingest/history/<key>.git` (the last `history_commits`
commits of a remote) so specify can invert real commits; that clone never enters an image.

Not here: running anything from the tree (feasibility does that in a sandbox).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from synth import history
from synth.config import Context
from synth.records import RepoRecord

NAME = "ingest"
BUDGET_S = 900.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = RepoRecord
_SKIP_DIRS = {".git", ".hg", "__pycache__", ".pytest_cache", ".mypy_cache", ".tox", ".nox", ".venv", "venv",
              "build", "dist", ".eggs", "node_modules", ".ruff_cache"}
MAX_FILES = 2000


def units(sources: list[str], ctx: Context) -> list[tuple[str, str]]:
    return [(source_key(s), s) for s in sources]


def source_key(source: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "-", source.rstrip("/").split("/")[-1].removeprefix("pypi:")).strip("-")
    return f"{stem[:40] or 'repo'}-{hashlib.sha256(source.encode()).hexdigest()[:8]}".lower()


def _copy_tree(src: Path, dest: Path) -> int:
    n = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if p.is_file() and not p.is_symlink() and not p.name.endswith((".pyc", ".pyo")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dest / rel)
            n += 1
    return n


class FetchError(RuntimeError):
    """The source could not be fetched; the message is the fetcher's own last words."""


def fetch_pypi(spec: str, work: Path) -> Path:
    """`pip download --no-deps --no-binary :all:` the sdist and unpack it; returns its top folder."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                               "-d", str(work), spec], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {spec}: no answer in 600 s") from None
    if proc.returncode != 0:
        errors = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("ERROR:")]
        raise FetchError(f"pip download {spec}: " + (errors[-1] if errors else proc.stderr.strip()[-400:]))
    archive = next(p for p in work.iterdir() if p.is_file())
    out = work / "unpacked"
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(out)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(out, filter="data")
    tops = list(out.iterdir())
    return tops[0] if len(tops) == 1 and tops[0].is_dir() else out


def process(unit: tuple[str, str], ctx: Context) -> RepoRecord:
    key, source = unit
    t0 = time.monotonic()
    rec = RepoRecord(key=key, source=source)
    dest = ctx.out_dir / NAME / "repos" / key
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    ctx.note(f"fetching {source}")
    with tempfile.TemporaryDirectory() as tmp:
        if source.startswith("pypi:"):
            try:
                src = fetch_pypi(source[len("pypi:"):], Path(tmp))
            except FetchError as e:
                return rec.drop(f"fetch failed: {e}"[:700])
        elif Path(source).is_dir() and not (Path(source) / ".git").exists():
            src = Path(source)
        else:  # a git URL or a local repository: the committed tree at HEAD, and its history
            bare = ctx.out_dir / NAME / "history" / f"{key}.git"
            shutil.rmtree(bare, ignore_errors=True)
            try:
                rec.head = history.clone_bare(source, bare, depth=ctx.opts.history_commits)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                return rec.drop(f"fetch failed: {e}"[:700])
            if not rec.head:
                return rec.drop("empty: the repository has no commits")
            rec.history = str(bare)
            rec.n_files = history.export_tree(bare, rec.head, dest, _copy_tree)
        if not rec.history:
            rec.n_files = _copy_tree(src, dest)
    rec.path, rec.seconds = str(dest), time.monotonic() - t0
    if rec.n_files == 0:
        return rec.drop("empty: no files")
    if rec.n_files > MAX_FILES:
        return rec.drop(f"too large: {rec.n_files} files")
    if not any(p.suffix == ".py" for p in dest.rglob("*.py")):
        return rec.drop("not python: no .py files")
    return rec
