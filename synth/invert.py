"""Real-commit inversion: a fix commit of the repository's history -> the broken state it fixed.

The fixed state is the commit's tree; the broken state is that tree with every non-test file the
commit changed put back as it was in the parent (so the commit's own tests, new regression tests
included, run against the parent's code). The gold patch is broken -> fixed over those files. Which
commits become tasks is decided by running both states (synth/stages/specify.py), not here.
Not here: git plumbing (synth/history.py) or sandboxes.
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from envs.grading import is_protected
from synth import history
from synth.patches import edits_to_patch
from synth.stages.build import repo_files
from synth.stages.feasibility import is_test_file
from synth.stages.ingest import _copy_tree

MIN_NEEDLE_CHARS = 16  # a single fixed line shorter than this is too common to be evidence of a leak


def is_source(path: str) -> bool:
    """A library file a fix can change (not a test, fixture, or protected path)."""
    return PurePosixPath(path).suffix == ".py" and not is_test_file(path) and not is_protected(path, [])


def candidates(git_dir: str, max_commits: int) -> list[history.Commit]:
    return history.candidate_commits(git_dir, max_commits, is_source) if git_dir else []


@dataclass
class Inversion:
    fixed: dict[str, bytes]  # the commit's tree
    test_files: list[str]
    overrides: dict[str, str | None]  # path -> the parent's text (None: the parent has no such file)
    bug_patch: str  # fixed -> broken
    gold_patch: str  # broken -> fixed

    @property
    def broken(self) -> dict[str, bytes]:
        files = dict(self.fixed)
        for path, text in self.overrides.items():
            if text is None:
                files.pop(path, None)
            else:
                files[path] = text.encode()
        return files


def invert(git_dir: str, commit: history.Commit, dest: Path) -> Inversion:
    """Export the commit's tree to `dest` and compute the broken state. Raises ValueError for a change
    that cannot be shipped as text (binary files)."""
    shutil.rmtree(dest, ignore_errors=True)  # a rerun after an interruption starts from an empty folder
    history.export_tree(git_dir, commit.sha, dest, _copy_tree)
    fixed = repo_files(dest)
    test_files = sorted(p for p in fixed if is_test_file(p))
    overrides: dict[str, str | None] = {}
    for path in commit.changed:
        if is_protected(path, test_files) or is_test_file(path):
            continue  # the commit's tests stay: they are the verifier
        old = history.file_at(git_dir, commit.parent, path)
        if (old is None and path not in fixed) or (old is not None and fixed.get(path) == old):
            continue  # not in either tree as a plain file (e.g. skipped by ingest's filter), or unchanged
        try:
            overrides[path] = None if old is None else old.decode()
            if path in fixed:
                fixed[path].decode()
        except UnicodeDecodeError as e:
            raise ValueError(f"binary change in {path}") from e
    after = {p: (fixed[p].decode() if p in fixed else None) for p in overrides}
    broken = Inversion(fixed, test_files, overrides, "", "").broken
    return Inversion(fixed, test_files, overrides, edits_to_patch(fixed, overrides), edits_to_patch(broken, after))


def needles(inv: Inversion, commit: history.Commit) -> list[str]:
    """What the leak audit searches the task image for: the commit's identity (its hash and its
    parent's) and each fixed line (with a line of context each side) that the broken tree lacks."""
    blobs = list(inv.broken.values())
    out = [commit.sha, commit.parent]
    for path in sorted(inv.overrides):
        if path not in inv.fixed:
            continue
        new = inv.fixed[path].decode().splitlines()
        old = (inv.overrides[path] or "").splitlines()
        for tag, _, _, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            # each changed line with its neighbours; a pure deletion: the two lines that now meet
            spans = [(j - 1, j + 2, new[j].strip()) for j in range(j1, j2)] or [(j1 - 1, j1 + 1, "")]
            for lo, hi, line in spans:
                window = "\n".join(new[max(lo, 0):hi])
                for text in (window, line if len(line) >= MIN_NEEDLE_CHARS else ""):
                    if text.strip() and text not in out and not any(text.encode() in b for b in blobs):
                        out.append(text)
    return out
