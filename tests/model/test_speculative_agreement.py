"""The decode bench's tie-aware greedy check (bench.decode.greedy_agreement): equal decodes pass, a
divergence at a token far from the top fails, and each divergence is reported with its fp32 gap.

An fp32 debug model with std-0.2 weights: its logits spread over several units, and eps (the check's
|model - fp32 copy| at the divergence) is ~0 for an fp32 model, so a token moved by +7 ids is never
within 2·eps of the argmax."""

import copy

import torch

from bench.decode import greedy_agreement
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer

ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742, qat=False)


def test_greedy_agreement_flags_only_real_divergences():
    tok = Tokenizer.default()
    model = Transformer(ARGS)
    model.init_weights(seed=0, std=0.2)
    model.eval()
    hasher = EngramHasher(ARGS, tok)
    engine = InferenceEngine(model, tok, max_sessions=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    outs = engine.generate([engine.start(p) for p in prompts], 8, stop_ids=())
    same = greedy_agreement(model, hasher, prompts, outs, copy.deepcopy(outs))
    assert same == {"greedy_equal": True, "greedy_tie_aware_equal": True, "divergences": []}
    wrong = copy.deepcopy(outs)
    wrong[1].token_ids[3] = (wrong[1].token_ids[3] + 7) % ARGS.vocab_size
    res = greedy_agreement(model, hasher, prompts, outs, wrong)
    assert not res["greedy_equal"] and not res["greedy_tie_aware_equal"]
    (d,) = res["divergences"]
    assert (d["row"], d["at"], d["near_tie"]) == (1, 3, False)
    assert d["fp32_rank_of_spec_token"] > 1 and d["fp32_gap"] > 2 * d["eps"]
