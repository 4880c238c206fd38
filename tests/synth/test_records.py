"""Stage journals: per-record persistence, torn-line tolerance, datasets round trip, funnel counts."""

from __future__ import annotations

from synth.records import RepoRecord, StageStore, TaskRecord, funnel, load_stage_dataset


def test_journal_roundtrip_and_torn_line(tmp_path):
    store = StageStore(tmp_path, "ingest", RepoRecord)
    store.append(RepoRecord(key="a", source="x", n_files=3))
    store.append(RepoRecord(key="b", source="y").drop("empty: no files"))
    with open(store.journal, "a") as f:
        f.write('{"key": "c", "sour')  # killed mid-write
    done = StageStore(tmp_path, "ingest", RepoRecord).load()
    assert set(done) == {"a", "b"}
    assert done["a"].n_files == 3 and done["a"].ok
    assert done["b"].drop_reason == "empty: no files" and not done["b"].ok


def test_finalize_writes_a_datasets_folder(tmp_path):
    store = StageStore(tmp_path, "inspect", TaskRecord)
    recs = [TaskRecord(key="t1", task={"task_id": "t1"}, pass_matrix={"search": [1.0]}),
            TaskRecord(key="t2").drop("null gate: solved by nothing")]
    store.finalize(recs)
    assert store.finished
    back = load_stage_dataset(tmp_path, "inspect", TaskRecord)
    assert [r.key for r in back] == ["t1", "t2"]
    assert back[0].pass_matrix == {"search": [1.0]} and back[1].drop_reason.startswith("null gate")


def test_funnel_groups_drop_reasons_by_category():
    recs = [RepoRecord(key=str(i), source="s") for i in range(5)]
    recs[0].drop("equivalent mutant: no test fails")
    recs[1].drop("equivalent mutant: other")
    recs[2].drop("statement leak: diff line")
    assert funnel(recs) == {"in": 5, "out": 2, "drops": {"equivalent mutant": 2, "statement leak": 1},
                            "examples": {"equivalent mutant": "0: no test fails", "statement leak": "2: diff line"}}
