"""rl/demo_stages._progress: every record is kept, a line is printed every `every` steps (what logs
keep), and on a terminal a bar shows the count against the step budget with the wall-clock cap."""

from __future__ import annotations

import io
import sys

from rl.demo_stages import _progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(steps: int) -> list[dict]:
    log: list[dict] = []
    with _progress(log, 2, lambda d: f"step {d['step']} line", "sft", 10, 60.0) as show:
        for k in range(1, steps + 1):
            show({"step": k, "s": 4.0 * k})
    return log


def test_records_kept_and_lines_every_n_steps(capsys):
    log = _run(5)
    assert [d["step"] for d in log] == [1, 2, 3, 4, 5]
    assert capsys.readouterr().out.splitlines() == ["step 2 line", "step 4 line"]


def test_bar_on_a_terminal_only(monkeypatch, capsys):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    _run(3)
    shown = term.getvalue()
    assert "sft" in shown and "3/10" in shown and "12 of 60 s cap" in shown
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: no bar, the lines still print
    _run(3)
    assert sys.stderr.getvalue() == "" and "step 2 line" in capsys.readouterr().out
