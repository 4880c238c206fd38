"""Problem statements are written from behaviour and scanned for leaks (pure; no containers)."""

from __future__ import annotations

from synth import mutations
from synth.records import FeasibleRepo, SpecRecord
from synth.stages.specify import fix_needles
from synth.statement import StatementIndex, body_of_test, statement_leaks, write_statement

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


CLASSES = '''from geo import area


class TestA:
    def test_strict(self):
        assert area(1, 1) == 1


class TestB:
    def test_strict(self):
        assert area(2, 2) == 4


class TestC(TestB):
    pass


def test_strict():
    assert area(3, 3) == 9
'''


def test_class_qualified_ids_show_their_own_test(tmp_path):
    (tmp_path / "test_cls.py").write_text(CLASSES)
    body = lambda tid: body_of_test(str(tmp_path), tid)  # noqa: E731
    assert body("test_cls.py::TestA::test_strict") == "assert area(1, 1) == 1"
    assert body("test_cls.py::TestB::test_strict") == "assert area(2, 2) == 4"
    assert body("test_cls.py::TestC::test_strict") == "assert area(2, 2) == 4"  # inherited from TestB
    assert body("test_cls.py::test_strict[3]") == "assert area(3, 3) == 9"  # the module-level one
    assert body("test_cls.py::TestMissing::test_strict") == ""  # never another class's test


def test_near_identical_statements_are_caught_per_repository():
    index = StatementIndex({"old": ("r", "Reproduction:\n\nassert f(1) == 2\nfails with: assert 3 == 2")})
    assert index.near_duplicate("new", "r", "Reproduction:\n  assert f(1) == 2\nfails with:  assert 3 == 2") == "old"
    assert index.near_duplicate("other", "r", "Reproduction: assert g('abc') == 'cba'; fails: 'x' != 'cba'") == ""
    assert index.near_duplicate("third", "r2", "Reproduction:\n\nassert f(1) == 2\nfails with: assert 3 == 2") == ""
    assert index.near_duplicate("old", "r", "Reproduction:\n\nassert f(1) == 2\nfails with: assert 3 == 2") == ""
