"""Parse contract of tool calls inside assistant text (pure, no Docker)."""

import json

import pytest

from envs.protocol import ToolCall, format_tool_call, parse_tool_calls


def test_round_trip_of_canonical_block():
    args = {"path": "src/a.py", "old_str": "x = 1\n", "new_str": "x = 2 # ünïcode\n"}
    calls, errors = parse_tool_calls("I will edit.\n" + format_tool_call("edit", args) + "\ndone")
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("edit", args)]


def test_several_calls_keep_order_and_reasoning_is_ignored():
    text = ("thinking...\n" + format_tool_call("view", {"path": "a"}) + " and then "
            + format_tool_call("bash", {"command": "ls"}) + format_tool_call("submit"))
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert [c.name for c in calls] == ["view", "bash", "submit"]
    assert calls[2].arguments == {}


def test_close_tag_inside_a_json_string_does_not_cut_the_call():
    args = {"command": "echo '</tool_call>'"}
    calls, errors = parse_tool_calls(format_tool_call("bash", args))
    assert errors == [] and calls == [ToolCall("bash", args, json.dumps({"name": "bash", "arguments": args}))]


def test_arguments_as_json_string_are_accepted():
    wire = json.dumps({"name": "view", "arguments": json.dumps({"path": "a"})})
    calls, errors = parse_tool_calls(f"<tool_call>{wire}</tool_call>")
    assert errors == [] and calls[0].arguments == {"path": "a"}


def test_whitespace_around_json_is_allowed():
    calls, errors = parse_tool_calls('<tool_call>\n  {"name": "submit"}\n</tool_call>')
    assert errors == [] and calls[0].name == "submit"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', "non-empty string 'name'"),
        ('<tool_call>{"name": 3}</tool_call>', "non-empty string 'name'"),
        ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "'arguments' must be a JSON object"),
        ('<tool_call>{"name": "bash", "arguments": "{bad"}</tool_call>', "string that is not valid JSON"),
        ('<tool_call>{"name": "bash", "id": 1}</tool_call>', "unexpected keys ['id']"),
        ('<tool_call>{"name": "bash"} trailing</tool_call>', "followed directly by </tool_call>"),
        ('<tool_call>{"name": "bash"}', "followed directly by"),
        ('<tool_call>{"name": "bash", ', "unterminated"),
        ('oops </tool_call>', "without a matching <tool_call>"),
    ],
)
def test_malformed_blocks_report_one_error_and_never_raise(text, fragment):
    calls, errors = parse_tool_calls(text)
    assert calls == []
    assert len(errors) == 1 and fragment in errors[0], errors


def test_a_bad_block_does_not_hide_the_good_ones_after_it():
    text = "<tool_call>{nope}</tool_call>" + format_tool_call("view", {"path": "."})
    calls, errors = parse_tool_calls(text)
    assert [c.name for c in calls] == ["view"] and len(errors) == 1


def test_no_tags_means_no_calls_and_no_errors():
    assert parse_tool_calls("just prose, {\"name\": \"bash\"}") == ([], [])
