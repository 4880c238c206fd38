"""SFT renders each demonstration with its own task's tools, as that task's episodes render their prompt."""

from __future__ import annotations

from envs.tools import tool_schemas
from model.chat_template import ChatTemplate
from model.tokenizer import Tokenizer
from rl.sft_loop import demonstrations
from synth.families import FAMILY_TOOLS


def _messages(name: str) -> list[dict]:
    return [{"role": "system", "content": "s"}, {"role": "user", "content": f"fix {name}"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "run_tests", "arguments": {}}]},
            {"role": "tool", "content": "1 failed", "name": "run_tests"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]}]  # fmt: skip


def test_each_demonstration_gets_its_task_s_tool_schemas():
    template = ChatTemplate(Tokenizer.default())
    convs = [_messages("a"), _messages("b")]
    family, repo = demonstrations(convs, ["fam", "repo"], "sandbox", template, {"fam": list(FAMILY_TOOLS), "repo": []})
    assert family.token_ids == template.render(convs[0], tools=tool_schemas(FAMILY_TOOLS)).token_ids
    assert repo.token_ids == template.render(convs[1], tools=tool_schemas()).token_ids  # no subset: every tool
    assert len(family) < len(repo) - 60  # four signatures instead of six (197 tokens against 279)
    # the loss is on the two assistant turns only, the same tokens in both renderings
    assert sum(family.loss_mask) == sum(repo.loss_mask) > 0 and len(family.turn_starts) == 2
