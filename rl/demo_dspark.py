"""The demo's DSpark drafter: its alignment term in the demo's SFT/RL steps, and its acceptance measured
by real speculative decoding (model.engine.InferenceEngine.generate_speculative).

The term is rl.learner.dspark_term (the Learner's own: drafts from DETACHED backbone features learn the
policy's distribution on generated tokens, so it trains `mtp.*` only and never moves the policy).
Not here: the drafter itself (model/dspark.py) or the speculative step (model/speculative.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from model.chat_template import ChatTemplate
from model.engine import InferenceEngine
from model.speculative import CostModel, SpeculativeConfig
from model.transformer import Transformer, TransformerOutput
from synth.families import Instance


def dspark_train_term(
    model: Transformer, out: TransformerOutput, ids: torch.Tensor, doc_ids: torch.Tensor | None, generated: torch.Tensor
):
    """rl.learner.dspark_term on a demo batch: ids/doc_ids [B,S], generated [B,S] bool (token s was
    produced by the policy: an assistant token in SFT, a sampled one in RL). None without a drafter."""
    from rl.learner import dspark_term

    docs = torch.zeros_like(ids) if doc_ids is None else doc_ids
    return dspark_term(model, out, SimpleNamespace(input_ids=ids, doc_ids=docs, loss_mask=generated))


def speculative_acceptance(
    model: Transformer, template: ChatTemplate, insts: list[Instance], max_new_tokens: int = 16
) -> dict:
    """Greedy speculative decoding of insts' prompts; drafted/accepted draft tokens summed over sessions.

    The engine drafts at every step (flat cost model, no switch-off), so acceptance is that of full
    k = dspark_block_size drafts, comparable between checkpoints and independent of CPU timings."""
    from rl.demo_learning import prompt_ids

    if getattr(model, "mtp", None) is None:
        return {"acceptance": None}
    k = model.args.dspark_block_size
    spec = SpeculativeConfig(cost=CostModel(t_verify=[1.0] * (k + 1), t_draft=0.0), min_speedup=0.0)
    engine = InferenceEngine(model, template, max_sessions=4, speculative=spec, device=next(model.parameters()).device)
    model.eval()
    tot = {"drafted": 0, "accepted": 0, "emitted": 0, "steps": 0}
    for inst in insts:  # one session per call: the rows of one call share one emitted length
        sid = engine.start(prompt_ids(template, inst))
        try:
            engine.generate_speculative([sid], max_new_tokens, temperature=0.0)
            st = engine.speculation_stats(sid)
        finally:
            engine.close(sid)
        for key in tot:
            tot[key] += st[key]
    return {
        **tot,
        "acceptance": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
        "tokens_per_step": tot["emitted"] / tot["steps"] if tot["steps"] else None,
        "n": len(insts),
    }
