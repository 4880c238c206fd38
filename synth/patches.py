"""`git diff`-style patches between in-memory file trees: file edits, creations and deletions, in the
form `git apply` (and so the grader) accepts. One file's edit is `synth.mutations.unified_diff`.

Not here: applying patches (the grader does, in its container) or deciding what to change.
"""

from __future__ import annotations

from synth.mutations import unified_diff


def _body(lines: list[str], sign: str) -> str:
    return "".join(sign + ln if ln.endswith("\n") else sign + ln + "\n\\ No newline at end of file\n" for ln in lines)


def edits_to_patch(files: dict[str, bytes], edits: dict[str, str | None]) -> str:
    """A git diff against `files` that writes each `edits[path]` (None: deletes the file)."""
    parts = []
    for path, content in sorted(edits.items()):
        before = files[path].decode(errors="replace") if path in files else None
        if content is None and before is not None and not before:
            parts.append(f"diff --git a/{path} b/{path}\ndeleted file mode 100644\n")
        elif content is not None and before is None and not content:
            parts.append(f"diff --git a/{path} b/{path}\nnew file mode 100644\n")
        elif content is None and before is not None:
            lines = before.splitlines(keepends=True)
            parts.append(f"diff --git a/{path} b/{path}\ndeleted file mode 100644\n--- a/{path}\n+++ /dev/null\n"
                         f"@@ -1,{len(lines)} +0,0 @@\n" + _body(lines, "-"))
        elif content is not None and before is None:
            lines = content.splitlines(keepends=True)
            parts.append(f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
                         f"@@ -0,0 +1,{len(lines)} @@\n" + _body(lines, "+"))
        elif content is not None:
            parts.append(unified_diff(path, before, content))
    return "".join(parts)
