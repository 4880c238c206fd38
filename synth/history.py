"""Git history plumbing for real-commit inversion: keep a bare clone of an ingested repository, list
the commits worth inverting, export a commit's tree, and read a file as it was at a revision.

Only `git` subprocesses on the host, on a bare clone under the run directory; nothing here runs the
repository's code (specify does that in sandboxes) or decides what a task is. The clone never reaches
a task image: build makes a fresh single-commit repository from plain files.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

_GIT_TIMEOUT_S = 600
_SEP, _FIELD = "\x1e", "\x1f"


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str
    subject: str
    changed: tuple[str, ...] = field(default_factory=tuple)  # paths added, modified or deleted

    def to_dict(self) -> dict:
        return {"sha": self.sha, "parent": self.parent, "subject": self.subject, "changed": list(self.changed)}


def git(git_dir: str | Path, *args: str, text: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", "--git-dir", str(git_dir), "-c", "core.quotePath=false", *args],
                          capture_output=True, text=text, timeout=_GIT_TIMEOUT_S)
    if check and proc.returncode != 0:
        err = proc.stderr if text else proc.stderr.decode(errors="replace")
        raise RuntimeError(f"git {' '.join(args[:3])} failed: {err[-500:]}")
    return proc


def clone_bare(source: str, dest: Path, *, depth: int) -> str:
    """A bare clone of `source` at `dest` (the last `depth` commits of a remote; all of a local
    repository, which git copies without a depth); returns the HEAD commit, "" if it has none."""
    local = Path(source).is_dir()
    cmd = ["git", "clone", "-q", "--bare", *([] if local else ["--depth", str(max(depth, 1) + 1)]), source,
           str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"git clone: {proc.stderr[-500:]}")
    head = git(dest, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False)
    return head.stdout.strip() if head.returncode == 0 else ""


def candidate_commits(git_dir: str | Path, max_commits: int, is_source) -> list[Commit]:
    """Newest first along the first-parent line: non-merge commits with a parent whose changes touch
    at least one path for which `is_source(path)` holds (a fix needs a source change to invert)."""
    if max_commits <= 0:
        return []
    log = git(git_dir, "log", "--first-parent", "--no-merges", "--no-renames", f"-n{max_commits}",
              f"--format={_SEP}%H{_FIELD}%P{_FIELD}%s", "--name-only", "HEAD").stdout
    out = []
    for block in log.split(_SEP)[1:]:
        head, _, names = block.partition("\n")
        sha, parents, subject = head.split(_FIELD)
        parents = parents.split()
        changed = tuple(sorted({n for n in names.splitlines() if n.strip()}))
        if len(parents) == 1 and any(is_source(p) for p in changed):
            out.append(Commit(sha, parents[0], subject.strip(), changed))
    return out


def export_tree(git_dir: str | Path, rev: str, dest: Path, copy_tree) -> int:
    """Write the committed tree at `rev` under `dest` through `copy_tree(src, dest)` (ingest's
    filter: no VCS metadata or caches); returns the number of files written."""
    data = git(git_dir, "archive", "--format=tar", rev, text=False).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            tf.extractall(tmp, filter="data")
        dest.mkdir(parents=True, exist_ok=True)
        return copy_tree(Path(tmp), dest)


def file_at(git_dir: str | Path, rev: str, path: str) -> bytes | None:
    """The file's bytes at `rev`, or None when it does not exist there."""
    proc = git(git_dir, "show", f"{rev}:{path}", text=False, check=False)
    return proc.stdout if proc.returncode == 0 else None
