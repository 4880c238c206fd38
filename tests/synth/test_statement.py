"""Problem statements are written from behaviour and scanned for leaks (pure; no containers)."""

from __future__ import annotations

from synth import mutations
from synth.records import FeasibleRepo, SpecRecord
from synth.stages.specify import fix_needles, statement_leaks, write_statement

ORIGINAL = "def area(w, h):\n    return w * h\n"
TEST = "from geo import area\n\n\ndef test_area_rectangle():\n    assert area(2, 3) == 6\n"
FAILURE = ("tests/test_geo.py:5: in test_area_rectangle\n    assert area(2, 3) == 6\n"
           "geo.py:2: in area\n    return w / h\nE   assert 0.6666666666666666 == 6\n"
           "E    +  where 0.6666666666666666 = area(2, 3)")


def make_spec(tmp_path) -> tuple[SpecRecord, FeasibleRepo]:
    (tmp_path / "tests").mkdir()
    (tmp_path / "geo.py").write_text(ORIGINAL)
    (tmp_path / "tests" / "test_geo.py").write_text(TEST)
    m = next(m for m in mutations.find_mutations("geo.py", ORIGINAL) if m.new == "w / h")
    mutant = mutations.apply(ORIGINAL, m)
    spec = SpecRecord(key="k", task_id="k", repo_key="r", mutation=m.to_dict(),
                      gold_patch=mutations.unified_diff("geo.py", mutant, ORIGINAL),
                      f2p=["tests/test_geo.py::test_area_rectangle"],
                      failures={"tests/test_geo.py::test_area_rectangle": FAILURE})
    repo = FeasibleRepo(key="r", source="s", path=str(tmp_path))
    return spec, repo


def test_statement_shows_behaviour_not_the_fix(tmp_path):
    spec, repo = make_spec(tmp_path)
    text, quoted = write_statement(spec, repo)
    assert "assert area(2, 3) == 6" in text
    assert "assert 0.6666666666666666 == 6" in text and quoted[0] == "assert 0.6666666666666666 == 6"
    assert "return w" not in text and "test_area_rectangle" not in text
    assert statement_leaks(text, spec, spec.f2p) == []


def test_each_kind_of_leak_is_caught(tmp_path):
    spec, repo = make_spec(tmp_path)
    text, _ = write_statement(spec, repo)
    assert any("diff line" in x for x in statement_leaks(text + "\nhint: return w * h", spec, spec.f2p))
    assert any("diff line" in x for x in statement_leaks(text + "\nnow: return w / h", spec, spec.f2p))
    assert any("diff header" in x for x in statement_leaks(text + "\n" + spec.gold_patch, spec, spec.f2p))
    assert any("test name" in x for x in statement_leaks(text + " see test_area_rectangle", spec, spec.f2p))
    assert any("hash" in x for x in statement_leaks(text + " since 3f2a9c1d0b", spec, spec.f2p))


def test_needles_are_fix_text_absent_from_the_mutant_tree():
    m = next(m for m in mutations.find_mutations("geo.py", ORIGINAL) if m.new == "w / h")
    mutant = mutations.apply(ORIGINAL, m)
    needles = fix_needles(ORIGINAL, {"geo.py": mutant.encode()}, m)
    assert needles and all(n.encode() not in mutant.encode() for n in needles)
    assert any("return w * h" in n for n in needles)
