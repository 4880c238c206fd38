"""Agent tools: schema validation (pure) and each tool against a real sandbox (marked docker)."""

import json
import time

import pytest

from envs import engine
from envs.protocol import ToolCall
from envs.sandbox import Sandbox
from envs.tools import (
    TOOLS,
    ToolConfig,
    ToolContext,
    drop_run_time,
    execute_tool_call,
    tool_schemas,
    validate_arguments,
)

# ------------------------------------------------------------------------------------ pure


def test_schemas_are_openai_function_style_and_strict():
    schemas = tool_schemas()
    assert [s["name"] for s in schemas] == list(TOOLS) == ["bash", "view", "edit", "create", "run_tests",
                                                            "submit"]
    for s in schemas:
        assert set(s) == {"name", "description", "parameters"} and s["description"]
        params = s["parameters"]
        assert params["type"] == "object" and set(params.get("required", [])) <= set(params["properties"])
        # strict without `additionalProperties: false` in the rendered schema: unknown keys are refused
        assert validate_arguments(params, {"no_such_argument": 1}) != []
        json.dumps(s)


def test_the_schemas_fit_a_small_policy_s_context():
    # every episode's system turn carries them (model/chat_template.py): the demo's 1024-token `tiny`
    # needs room for the task and several turns after them
    from envs.episode import EpisodeConfig, initial_messages
    from envs.task import Task
    from model.chat_template import ChatTemplate
    from model.tokenizer import Tokenizer

    task = Task(task_id="t", repo="r", base_revision="", image="i", image_digest="", problem_statement="p",
                test_command="true", test_parser="junit", f2p=["a::b"], p2p=[], gold_patch="", test_files=[])
    system = initial_messages(task, EpisodeConfig())[:1]
    n = len(ChatTemplate(Tokenizer.default()).render(system, tools=tool_schemas()).token_ids)
    assert n < 400, n  # six signature lines (279 tokens) and the instructions


def test_a_task_s_tool_subset_renders_only_those_schemas_in_tools_order():
    from model.chat_template import ChatTemplate
    from model.tokenizer import Tokenizer
    from synth.families import FAMILY_TOOLS

    assert [s["name"] for s in tool_schemas(["submit", "edit", "run_tests"])] == ["edit", "run_tests", "submit"]
    assert [s["name"] for s in tool_schemas(FAMILY_TOOLS)] == ["view", "edit", "run_tests", "submit"]
    assert tool_schemas([]) == tool_schemas(None) == tool_schemas()  # no subset: every tool
    with pytest.raises(ValueError, match=r"unknown tools \['grep'\].*available tools: bash, view"):
        tool_schemas(["edit", "grep"])
    # the family tasks' four signatures: about 70 tokens fewer than the six
    template, system = ChatTemplate(Tokenizer.default()), [{"role": "system", "content": "s"}]
    n_all = len(template.render(system, tools=tool_schemas()).token_ids)
    n_family = len(template.render(system, tools=tool_schemas(FAMILY_TOOLS)).token_ids)
    assert n_family < n_all - 60, (n_family, n_all)


@pytest.mark.parametrize(
    ("name", "arguments", "fragment"),
    [
        ("rm_rf", {}, "unknown tool 'rm_rf'; available tools: bash, view"),
        ("bash", {}, "missing required argument arguments.command"),
        ("bash", {"command": 5}, "arguments.command must be string, got integer"),
        ("bash", {"command": "ls", "timeout": True}, "arguments.timeout must be integer, got boolean"),
        ("bash", {"command": "ls", "timeout": 0}, "arguments.timeout must be >= 1"),
        ("bash", {"command": "ls", "cwd": "/"}, "unexpected argument arguments.cwd"),
        ("view", {"path": "a", "view_range": [1]}, "at least 2 items, got 1"),
        ("view", {"path": "a", "view_range": [1, "x"]}, "view_range[1] must be integer, got string"),
        ("edit", {"path": "a", "old_str": "x"}, "missing required argument arguments.new_str"),
        ("edit", {"line": 0, "old_str": "x", "new_str": "y"}, "arguments.line must be >= 1"),
        ("create", {"path": "a", "content": None}, "arguments.content must be string, got null"),
        ("submit", {"now": True}, "unexpected argument arguments.now (allowed: none)"),
    ],
)
def test_malformed_calls_become_error_observations_without_touching_the_sandbox(name, arguments, fragment):
    # sb=None: validation must answer before any sandbox access.
    res = execute_tool_call(None, ToolCall(name, arguments), ToolContext(config=ToolConfig()))
    assert not res.ok and not res.ends_episode
    assert res.output.startswith("error: ") and fragment in res.output, res.output


def test_validator_accepts_valid_arguments():
    for name, args in [("bash", {"command": "ls", "timeout": 5}),
                       ("view", {"path": ".", "view_range": [1, -1]}),
                       ("edit", {"path": "a", "old_str": "x", "new_str": ""}), ("submit", {}),
                       ("edit", {"line": 3, "old_str": "<", "new_str": "<="}), ("view", {}),
                       ("create", {"path": "a", "content": "", "overwrite": True})]:
        assert validate_arguments(TOOLS[name].parameters, args) == []


# ------------------------------------------------------------------------- real sandbox

@pytest.fixture(scope="module")
def sb(base_image):
    with Sandbox(base_image, labels={"flashpost.test": "test_tools"}) as box:
        cid = box.container_id
        yield box
    left = engine.list_containers({engine.LABEL_OWNER: engine.owner_id(), "flashpost.test": "test_tools"})
    assert [c["Id"] for c in left if c["Id"] == cid] == []


def call(sb, name, ctx=None, **arguments):
    return execute_tool_call(sb, ToolCall(name, arguments), ctx or ToolContext(config=ToolConfig()))


TEN_LINES = "".join(f"line {i}\n" for i in range(1, 11))


@pytest.mark.docker
def test_bash_reports_output_and_exit_code(sb):
    res = call(sb, "bash", command="echo out; echo err >&2; pwd; exit 3")
    assert res.exit_code == 3 and res.ok and not res.timed_out
    *lines, status = res.output.splitlines()
    assert sorted(lines) == ["/workspace", "err", "out"] and status == "[exit code: 3]"  # streams interleave
    assert call(sb, "bash", command="true").output == "[exit code: 0]"


@pytest.mark.docker
def test_bash_timeout_kills_the_command(sb):
    t0 = time.monotonic()
    res = call(sb, "bash", command="echo started; sleep 30; echo never", timeout=1)
    assert time.monotonic() - t0 < 10
    assert res.timed_out and res.exit_code is None and not res.ok
    assert "started" in res.output and "never" not in res.output
    assert res.output.endswith("[timed out after 1 s; the command was killed]")


@pytest.mark.docker
def test_bash_timeout_is_clipped_to_the_episode_deadline(sb):
    ctx = ToolContext(config=ToolConfig(), deadline=time.monotonic() + 1.5)
    t0 = time.monotonic()
    res = call(sb, "bash", ctx, command="sleep 30", timeout=600)
    assert res.timed_out and time.monotonic() - t0 < 10


@pytest.mark.docker
def test_bash_long_output_keeps_head_and_tail_with_a_cut_marker(sb):
    ctx = ToolContext(config=ToolConfig(max_observation_bytes=2000))
    res = call(sb, "bash", ctx, command="echo HEAD; head -c 100000 /dev/zero | tr '\\0' a; echo; echo TAIL")
    assert res.output.startswith("HEAD\n") and res.output.endswith("TAIL\n[exit code: 0]")
    cut = int(res.output.split("[... ")[1].split(" bytes")[0])
    assert 100000 - 2000 < cut < 100000
    assert len(res.output) < 2200


@pytest.mark.docker
def test_view_file_with_line_numbers_and_ranges(sb):
    sb.write_file("view/ten.txt", TEN_LINES)
    full = call(sb, "view", path="view/ten.txt")
    assert full.ok and full.output.splitlines()[0] == "     1\tline 1"
    assert full.output.splitlines()[-1] == "    10\tline 10"
    part = call(sb, "view", path="/workspace/view/ten.txt", view_range=[3, 5])
    assert part.output.splitlines() == ["     3\tline 3", "     4\tline 4", "     5\tline 5"]
    tail = call(sb, "view", path="view/ten.txt", view_range=[9, -1])
    assert [ln.split("\t")[1] for ln in tail.output.splitlines()] == ["line 9", "line 10"]
    for bad in ([0, 2], [11, 12], [5, 3]):
        res = call(sb, "view", path="view/ten.txt", view_range=bad)
        assert not res.ok and "has 10 lines" in res.output, res.output


@pytest.mark.docker
def test_view_truncates_long_files_by_lines(sb):
    sb.write_file("view/long.txt", "".join(f"{i:05d} " + "x" * 90 + "\n" for i in range(1000)))
    small = ToolContext(config=ToolConfig(max_observation_bytes=5000))
    res = call(sb, "view", small, path="view/long.txt")
    shown = [ln for ln in res.output.splitlines() if "\t" in ln]
    assert 30 < len(shown) < 60 and shown[0].endswith("00000 " + "x" * 90)
    assert f"showed lines 1-{len(shown)} of 1000; use view_range" in res.output
    sb.write_file("view/minified.js", "var a=1;" * 5000 + "\nsecond\n")
    res = call(sb, "view", small, path="view/minified.js")
    assert res.output.startswith("     1\tvar a=1;") and "[... line cut ...]" in res.output
    assert "showed lines 1-1 of 2" in res.output and len(res.output) < 5000


@pytest.mark.docker
def test_view_directory_lists_two_levels_without_hidden_entries(sb):
    for path in ("tree/a.py", "tree/sub/b.py", "tree/sub/deep/c.py", "tree/.git/config", "tree/.env"):
        sb.write_file(path, "x")
    res = call(sb, "view", path="tree")
    assert res.ok
    assert res.output.splitlines()[1:] == ["a.py", "sub/", "sub/b.py", "sub/deep/"]
    assert not call(sb, "view", path="tree", view_range=[1, 2]).ok


@pytest.mark.docker
def test_view_missing_and_binary_files_are_errors(sb):
    assert call(sb, "view", path="nope.txt").output == "error: /workspace/nope.txt does not exist"
    sb.write_file("bin.dat", b"\xff\xfe\x00")
    assert "not UTF-8" in call(sb, "view", path="bin.dat").output


@pytest.mark.docker
def test_edit_replaces_a_unique_match_and_keeps_the_file_mode(sb):
    sb.write_file("edit/run.sh", "#!/bin/sh\necho old\n")
    sb.exec("chmod 755 edit/run.sh", timeout=10)
    res = call(sb, "edit", path="edit/run.sh", old_str="echo old", new_str="echo new\necho more")
    assert res.ok, res.output
    assert "     2\techo new" in res.output and "     3\techo more" in res.output
    assert sb.read_file("edit/run.sh") == b"#!/bin/sh\necho new\necho more\n"
    assert sb.exec("./edit/run.sh", timeout=10).output == "new\nmore\n"


@pytest.mark.docker
def test_edit_rejects_zero_or_several_matches_and_leaves_the_file_alone(sb):
    sb.write_file("edit/dup.py", "x = 1\ny = 2\nx = 1\n")
    none = call(sb, "edit", path="edit/dup.py", old_str="z = 3", new_str="")
    assert not none.ok and "found 0 times" in none.output
    two = call(sb, "edit", path="edit/dup.py", old_str="x = 1", new_str="x = 5")
    assert not two.ok and "found 2 times" in two.output and "[1, 3]" in two.output
    assert not call(sb, "edit", path="edit/dup.py", old_str="", new_str="a").ok
    assert "does not exist" in call(sb, "edit", path="edit/missing.py", old_str="a", new_str="b").output
    assert sb.read_file("edit/dup.py") == b"x = 1\ny = 2\nx = 1\n"
    assert call(sb, "edit", path="edit/dup.py", old_str="x = 1\ny", new_str="x = 7\ny").ok
    assert sb.read_file("edit/dup.py") == b"x = 7\ny = 2\nx = 1\n"


@pytest.mark.docker
def test_edit_on_a_line_replaces_its_first_occurrence_in_the_task_s_file(sb):
    sb.write_file("edit/fn.py", "def f(a, b):\n    if a < b < 9:\n        return a < b\n    return 0\n")
    ctx = ToolContext(config=ToolConfig(), default_path="edit/fn.py")
    res = call(sb, "edit", ctx, line=3, old_str="<", new_str="<=")
    assert res.ok and res.output == "line 3: return a <= b"
    assert sb.read_file("edit/fn.py") == b"def f(a, b):\n    if a < b < 9:\n        return a <= b\n    return 0\n"
    assert call(sb, "edit", ctx, line=2, old_str="<", new_str=">").output == "line 2: if a > b < 9:"
    missing = call(sb, "edit", ctx, line=4, old_str="<", new_str=">")
    assert not missing.ok and "'<' is not on line 4: return 0" in missing.output
    assert not call(sb, "edit", ctx, line=9, old_str="<", new_str=">").ok
    assert call(sb, "view", ctx).output.splitlines()[1] == "     2\t    if a > b < 9:"
    no_file = call(sb, "edit", line=1, old_str="f", new_str="g")
    assert not no_file.ok and "pass path" in no_file.output


@pytest.mark.docker
def test_create_makes_parents_and_refuses_to_overwrite_by_default(sb):
    res = call(sb, "create", path="made/deep/new.py", content="print('hi')\n")
    assert res.ok and res.output == "Created /workspace/made/deep/new.py (1 lines)"
    owner_and_run = sb.exec("stat -c %U made/deep/new.py && python3 made/deep/new.py", timeout=10)
    assert owner_and_run.output == "agent\nhi\n"
    again = call(sb, "create", path="made/deep/new.py", content="oops")
    assert not again.ok and "already exists" in again.output
    assert sb.read_file("made/deep/new.py") == b"print('hi')\n"
    replaced = call(sb, "create", path="made/deep/new.py", content="v2", overwrite=True)
    assert replaced.output.startswith("Overwrote")
    assert sb.read_file("made/deep/new.py") == b"v2"
    assert not call(sb, "create", path="made", content="x").ok


@pytest.mark.docker
def test_create_round_trips_large_unicode_content(sb):
    content = "".join(f"{i} ünïcødé ✓\n" for i in range(20000))  # ~360 KB: several write chunks
    assert call(sb, "create", path="big.txt", content=content).ok
    assert sb.read_file("big.txt").decode() == content


@pytest.mark.docker
def test_create_outside_writable_mounts_fails_cleanly(sb):
    res = call(sb, "create", path="/etc/evil.conf", content="x")
    assert not res.ok and "could not" in res.output


@pytest.mark.docker
def test_run_tests_runs_the_task_command_and_is_only_feedback(sb):
    ctx = ToolContext(config=ToolConfig(), test_command="echo collected 2 items; exit 1")
    res = call(sb, "run_tests", ctx)
    assert res.exit_code == 1 and not res.ends_episode
    assert res.output == "collected 2 items\n[exit code: 1]"
    assert "no test command" in call(sb, "run_tests").output


def test_drop_run_time_keeps_the_counts_and_drops_the_seconds():
    assert drop_run_time("1 failed, 49 passed in 0.08s\n[exit code: 1]") == "1 failed, 49 passed\n[exit code: 1]"
    assert drop_run_time("===== 3 passed, 1 warning in 61.12s (0:01:01) =====") == "===== 3 passed, 1 warning ====="
    assert drop_run_time("12 passed in 2s") == "12 passed"
    # only the end of a line: a test's own text that mentions seconds stays as it was
    text = "assert wait(3) == 'done in 3.0s' (got 'done in 2.0s')\nFAILED test_wait"
    assert drop_run_time(text) == text


@pytest.mark.docker
def test_run_tests_shows_no_run_time(sb):
    ctx = ToolContext(config=ToolConfig(), test_command="echo '1 failed, 2 passed in 0.31s'; exit 1")
    assert call(sb, "run_tests", ctx).output == "1 failed, 2 passed\n[exit code: 1]"


@pytest.mark.docker
def test_submit_ends_the_episode(sb):
    res = call(sb, "submit")
    assert res.ok and res.ends_episode
