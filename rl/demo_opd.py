"""On-policy distillation (OPD) of the demo's RL'd policy into a smaller student, on 2 CPU threads.

The student samples its own answers to training prompts (families A and B; no grading: the teacher's
full distribution is the signal) and is trained on them with the full-vocabulary per-token reverse
KL(student || teacher) of rl.losses.opd_reverse_kl, the loss the Learner's kind "opd" uses, plus an
SFT term on family-A demonstrations. The student starts from the SFT-only student's final weights
(rl.demo_learning.run_sft on family A), the baseline it is compared with.
Not here: the stage wiring (rl/demo_stages.py) or grading (envs/batch_grading.py).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable

import torch

from model.chat_template import ChatTemplate
from model.transformer import Transformer
from rl.demo_config import OPDConfig
from rl.losses import opd_reverse_kl
from synth.families import Instance


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
    reverse KL to the teacher on the sampled tokens (the logits at s-1 predict token s). Asynchronous
    like the demo's RL: a rollout worker process samples step t+1's answers with the student's current
    weights while this process trains on step t's (one version behind; the KL needs no importance
    weight, it is taken over the whole vocabulary at the visited positions)."""
    from rl.demo_learning import demo_optimizer, demo_rows, demo_sft_term, device_of, prompt_ids
    from rl.demo_rollout import RolloutProcess, worker_threads

    opt = demo_optimizer(student, cfg.lr, cfg.muon_lr)
    rng = random.Random(seed)
    pad, dev = template.tokenizer.eos_id, device_of(student)
    teacher.eval()
    step, tokens, kls = 0, 0, []
    gen_wait_s = train_s = worker_gen_s = 0.0

    def more(k: int) -> bool:
        return not cfg.steps or k < cfg.steps

    with RolloutProcess(student.args, threads=worker_threads(), device=dev) as worker:

        def submit(k: int) -> list[Instance]:
            n_b = round(cfg.prompts_per_step * cfg.share_b)
            insts = rng.sample(b_train, n_b) + rng.sample(a_train, cfg.prompts_per_step - n_b)
            worker.submit(insts, cfg.samples, cfg.temperature, seed=seed * 7919 + k)
            return insts

        worker.send_weights(0, student.state_dict())
        worker.wait_ready()  # the worker's start-up is not OPD time
        t0 = time.perf_counter()
        queued = [submit(0)]
        while time.perf_counter() - t0 < cfg.seconds and more(step):
            ta = time.perf_counter()
            gens, insts = worker.result(), queued.pop(0)
            worker_gen_s += worker.last_gen_s
            if more(step + 1):
                queued.append(submit(step + 1))
            tb = time.perf_counter()
            prompts = [p for i in insts for p in [prompt_ids(template, i)] * cfg.samples]
            ids, mask = (t.to(dev) for t in _rows(prompts, gens, pad))
            with torch.no_grad():
                t_logits = teacher(ids, compute_indexer_loss=False).logits
            student.train()
            out = student(ids)
            loss, _ = opd_reverse_kl(out.logits[:, :-1], t_logits[:, :-1], mask[:, 1:])
            total = loss + out.indexer_loss
            if cfg.ptx_weight > 0:
                ptx_total, _ = demo_sft_term(student, demo_rows(template, a_train, rng, cfg.ptx_rows))
                total = total + cfg.ptx_weight * ptx_total
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            worker.send_weights(step + 1, student.state_dict())  # version k: the weights after k steps
            tc = time.perf_counter()
            gen_wait_s, train_s = gen_wait_s + tb - ta, train_s + tc - tb
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
        "gen_s": worker_gen_s,  # the worker sampling
        "gen_wait_s": gen_wait_s,  # the learner waiting for samples (generation not hidden by training)
        "train_s": train_s,
        "first_kl": sum(kls[:5]) / max(1, len(kls[:5])),
        "last_kl": sum(kls[-5:]) / max(1, len(kls[-5:])),
    }
