"""On-policy distillation (OPD) of the demo's RL'd policy into a smaller student, on 2 CPU threads.

The student samples its own answers to training prompts (families A and B; no grading: the teacher's
full distribution is the signal) and is trained on them with the full-vocabulary per-token reverse
KL(student || teacher) of rl.losses.opd_reverse_kl, the loss the Learner's kind "opd" uses. The
student starts from a short SFT on family-A demonstrations (rl.demo_learning.run_sft); the baseline
it is compared with is the same student trained by SFT alone for the same total budget.
Not here: the stage wiring (rl/demo_stages.py) or grading (envs/batch_grading.py).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.chat_template import ChatTemplate
from model.engine import InferenceEngine
from model.transformer import Transformer
from rl.config import OptimConfig
from rl.losses import opd_reverse_kl
from rl.optim import build_optimizer
from synth.families import Instance

# Half the teacher's width (dim and expert width); the layer schedule needs n_layers >= 4.
STUDENT_OVERRIDES: dict = {"n_layers": 4, "hc_mult": 2, "dim": 64, "moe_inter_dim": 64}


@dataclass
class OPDConfig:
    seconds: float = 120.0  # wall-clock cap
    steps: int = 0  # step budget (0: none)
    prompts_per_step: int = 16
    samples: int = 2  # student samples per prompt
    temperature: float = 1.0  # the student samples from its own distribution
    share_b: float = 0.5  # share of prompts from family B (the rest from family A)
    lr: float = 1e-3
    muon_lr: float = 0.01


def _rows(prompts: list[list[int]], gens, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N,S], mask [N,S]): mask[n, s] is True where token s was sampled by the student."""
    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), S), dtype=torch.bool)
    for k, (p, s) in enumerate(zip(prompts, seqs)):
        ids[k, : len(s)] = torch.tensor(s)
        mask[k, len(p) : len(s)] = True
    return ids, mask


def run_opd(
    student: Transformer,
    teacher: Transformer,
    template: ChatTemplate,
    a_train: list[Instance],
    b_train: list[Instance],
    cfg: OPDConfig,
    seed: int = 0,
    log: Callable[[dict], None] = print,
) -> dict:
    """OPD for cfg.steps steps (at most cfg.seconds of wall time): sample from the student, minimise
    reverse KL to the teacher on the sampled tokens (the logits at s-1 predict token s)."""
    from rl.demo_learning import generate, prompt_ids

    opt = build_optimizer(student, OptimConfig(lr=cfg.lr, sinkhorn_lr=cfg.lr, muon_lr=cfg.muon_lr))
    rng = random.Random(seed)
    pad = template.tokenizer.eos_id
    engine = InferenceEngine(student, template, max_sessions=64)
    teacher.eval()
    t0, step, tokens, kls = time.perf_counter(), 0, 0, []
    gen_s = train_s = 0.0
    while time.perf_counter() - t0 < cfg.seconds and (not cfg.steps or step < cfg.steps):
        n_b = round(cfg.prompts_per_step * cfg.share_b)
        insts = rng.sample(b_train, n_b) + rng.sample(a_train, cfg.prompts_per_step - n_b)
        prompts = [prompt_ids(template, i) for i in insts for _ in range(cfg.samples)]
        ta = time.perf_counter()
        student.eval()
        gens = generate(engine, template, insts, cfg.samples, cfg.temperature, seed=seed * 7919 + step)
        tb = time.perf_counter()
        ids, mask = _rows(prompts, gens, pad)
        with torch.no_grad():
            t_logits = teacher(ids, compute_indexer_loss=False).logits
        student.train()
        out = student(ids)
        loss, D = opd_reverse_kl(out.logits[:, :-1], t_logits[:, :-1], mask[:, 1:])
        opt.zero_grad(set_to_none=True)
        (loss + out.indexer_loss).backward()
        opt.step()
        tc = time.perf_counter()
        gen_s, train_s = gen_s + tb - ta, train_s + tc - tb
        kls.append(float(loss.detach()))
        tokens += int(mask.sum())
        step += 1
        if step % 5 == 0:
            el = time.perf_counter() - t0
            log(
                {
                    "phase": "opd",
                    "step": step,
                    "reverse_kl": round(sum(kls[-5:]) / 5, 4),
                    "s": round(el, 1),
                    "sampled_tok_s": round(tokens / el, 1),
                    "load": round(os.getloadavg()[0], 2),
                }
            )
    student.eval()
    el = time.perf_counter() - t0
    return {
        "steps": step,
        "seconds": el,
        "sampled_tokens": tokens,
        "sampled_tok_s": tokens / el,
        "gen_s": gen_s,
        "train_s": train_s,
        "first_kl": sum(kls[:5]) / max(1, len(kls[:5])),
        "last_kl": sum(kls[-5:]) / max(1, len(kls[-5:])),
    }
