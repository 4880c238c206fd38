"""The demo's learning loops on synth/families tasks, small enough for 2 CPU threads: chat-rendered
SFT on family-A demonstrations, greedy held-out pass@1 through model.engine.InferenceEngine and the
real grader (envs/batch_grading.py), and GRPO on family B with real grading.

Plain loops over the V4.1 Transformer with the project's family optimiser (rl.optim), not the
DeepSpeed Learner: one process, no engine start-up, nothing to shard (the Learner's loss terms are
the same: rl.losses.sft_loss / token log-probs, plus the indexer alignment loss). RL follows
DEMO_NOTES: sampling at T = 0.7 with log-probs at the same temperature, 4 tasks x 8 samples per
update, group-normalised advantages, zero-spread groups skipped, one on-policy update per batch; tasks
are drawn by template where the recent sampled reward has spread (TemplateSampler).
Not here: the stage wiring (rl/demo.py) or the measurement script (bench/demo_learning.py).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from envs.batch_grading import grade_batch, screen_edit
from model.chat_template import ChatTemplate
from model.config import ModelArgs, get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from rl.config import OptimConfig
from rl.demo_dspark import dspark_train_term
from rl.losses import sft_loss
from rl.optim import build_optimizer
from synth.families import Instance, apply_action, module_path

# The recommended demo policy: `tiny` with 4 layers and 2 mHC streams (the V4.1 parts stay on).
DEMO_OVERRIDES: dict = {"n_layers": 4, "hc_mult": 2}
MAX_ACTION_TOKENS = 16
GRADE_TIMEOUT_S = 0.5


def build_policy(overrides: dict | None = None, seed: int = 0) -> tuple[Transformer, ChatTemplate, ModelArgs]:
    args = get_flavor("tiny", **(DEMO_OVERRIDES if overrides is None else overrides))
    tok = Tokenizer.default()
    model = Transformer(args, engram_hasher=EngramHasher(args, tok) if args.engram_layer_ids else None)
    model.init_weights(seed=seed)
    return model, ChatTemplate(tok), args


def prompt_ids(template: ChatTemplate, inst: Instance) -> list[int]:
    return template.render([{"role": "user", "content": inst.prompt}], add_generation_prompt=True).token_ids


def sft_example(template: ChatTemplate, inst: Instance) -> tuple[list[int], list[bool]]:
    chat = template.render([{"role": "user", "content": inst.prompt}, {"role": "assistant", "content": inst.action}])
    return chat.token_ids, chat.loss_mask


def pack(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
    """Greedy packing into rows of seq_len: (ids [B,S], doc_ids [B,S], mask [B,S]); each example
    is its own document (attention, compression and positions restart at its first token)."""
    rows, row = [], []
    for ex in examples:
        if len(ex[0]) > seq_len:
            continue
        if sum(len(e[0]) for e in row) + len(ex[0]) > seq_len:
            rows.append(row)
            row = []
        row.append(ex)
    if row:
        rows.append(row)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    docs = torch.zeros((len(rows), seq_len), dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    for r, row in enumerate(rows):
        pos = 0
        for d, (t, m) in enumerate(row):
            ids[r, pos : pos + len(t)] = torch.tensor(t)
            docs[r, pos : pos + len(t)] = d
            mask[r, pos : pos + len(t)] = torch.tensor(m)
            pos += len(t)
        docs[r, pos:] = len(row)  # padding: a document of its own, never in the loss
    return ids, docs, mask


@dataclass
class SFTConfig:
    seconds: float = 240.0  # wall-clock cap
    steps: int = 0  # step budget (0: none); with a cap above the quiet machine's time, load cannot change results
    seq_len: int = 256
    rows: int = 8  # rows per optimiser step
    lr: float = 2e-3
    muon_lr: float = 0.02
    dspark_weight: float = 1.0  # the DSpark drafter learns the policy on assistant tokens (0: untouched)
    dspark_every: int = 4  # ...on every n-th step: its k-token drafts over every position cost ~half a step


def run_sft(
    model: Transformer,
    template: ChatTemplate,
    make_batch: Callable[[int], list[Instance]],
    cfg: SFTConfig,
    log: Callable[[dict], None] = print,
    snapshot_step: int = 0,
    snapshot: Callable[[Transformer, int], None] | None = None,
) -> dict:
    """SFT for cfg.steps steps (at most cfg.seconds of wall time) on batches drawn by make_batch(step);
    `snapshot(model, step)` is called once, before step snapshot_step or, if the time cap binds, once the same
    share of cfg.seconds has passed (a checkpoint part-way through the budget, same run)."""
    opt = build_optimizer(model, OptimConfig(lr=cfg.lr, sinkhorn_lr=cfg.lr, muon_lr=cfg.muon_lr))
    model.train()
    pad = template.tokenizer.eos_id
    t0, step, tokens, losses, accept = time.perf_counter(), 0, 0, [], []
    snap_s = cfg.seconds * snapshot_step / cfg.steps if cfg.steps else float("inf")
    while time.perf_counter() - t0 < cfg.seconds and (not cfg.steps or step < cfg.steps):
        if snapshot is not None and (step >= snapshot_step or time.perf_counter() - t0 >= snap_s):
            snapshot(model, step)
            snapshot = None
        insts = make_batch(step)
        ids, docs, mask = pack([sft_example(template, i) for i in insts], cfg.seq_len, pad)
        ids, docs, mask = ids[: cfg.rows], docs[: cfg.rows], mask[: cfg.rows]
        out = model(ids, docs)
        loss = sft_loss(out.logits, ids, mask) + out.indexer_loss
        ds = dspark_train_term(model, out, ids, docs, mask) if _dspark_now(cfg, step) else None
        if ds is not None:
            loss = loss + cfg.dspark_weight * ds.loss
            accept.append(float(ds.acceptance))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        tokens += ids.numel()
        step += 1
        if step % 10 == 0:
            el = time.perf_counter() - t0
            log(
                {
                    "phase": "sft",
                    "step": step,
                    "loss": round(sum(losses[-10:]) / 10, 4),
                    "s": round(el, 1),
                    "tok_s": round(tokens / el),
                    "load": round(os.getloadavg()[0], 2),
                    "dspark_acceptance": round(sum(accept[-10:]) / len(accept[-10:]), 4) if accept else None,
                }
            )
    if snapshot is not None:
        snapshot(model, step)
    el = time.perf_counter() - t0
    return {
        "steps": step,
        "tokens": tokens,
        "seconds": el,
        "tok_s": tokens / el,
        "dspark_acceptance": sum(accept[-10:]) / len(accept[-10:]) if accept else None,
        "first_loss": sum(losses[:5]) / max(1, len(losses[:5])),
        "last_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
    }


def generate(
    engine: InferenceEngine,
    template: ChatTemplate,
    insts: list[Instance],
    n: int,
    temperature: float,
    seed: int,
    chunk: int = 32,
):
    """n generations per instance (token ids, logprobs, text) in engine batches of <= chunk sessions."""
    prompts = [prompt_ids(template, inst) for inst in insts]
    # equal-length prompts prefill and decode as one batch in the engine: order jobs by length
    jobs = sorted(((i, k) for i in range(len(insts)) for k in range(n)), key=lambda j: len(prompts[j[0]]))
    out: dict = {}
    for lo in range(0, len(jobs), chunk):
        part = jobs[lo : lo + chunk]
        sids = [engine.start(prompts[i]) for i, _ in part]
        try:
            gens = engine.generate(sids, MAX_ACTION_TOKENS, temperature=temperature, seed=seed + lo)
        finally:
            for s in sids:
                engine.close(s)
        for job, g in zip(part, gens):
            out[job] = g
    return [out[(i, k)] for i in range(len(insts)) for k in range(n)]


def action_of(template: ChatTemplate, gen) -> str:
    return template.parse_assistant(gen.token_ids).content


def reward_files(inst: Instance, action: str) -> tuple[dict[str, str] | None, str]:
    """The module the action produces, or None (and why) when it cannot be graded."""
    fixed = apply_action(inst.buggy, action)
    if fixed is None:
        return None, "malformed or non-applying action"
    why = screen_edit(inst.buggy, fixed)
    if why:
        return None, why
    return {module_path(inst): fixed}, ""


def grade_actions(pairs: list[tuple[Instance, str]], tasks: dict, pool) -> tuple[list[float], dict]:
    """Rewards of (instance, action) pairs; gradable ones go to the real grader in one batch."""
    rewards = [0.0] * len(pairs)
    items, where = [], []
    for k, (inst, action) in enumerate(pairs):
        files, _ = reward_files(inst, action)
        if files is not None:
            items.append((tasks[inst.iid], files))
            where.append(k)
    t0 = time.perf_counter()
    local = getattr(pool, "workspace", None)  # bench.demo_learning's container-less LocalHarness
    kw = {"workspace": local, "sweep": False} if local else {}
    # template functions run in microseconds: a candidate still running after GRADE_TIMEOUT_S loops
    for k, g in zip(where, grade_batch(items, pool=pool, timeout_s=GRADE_TIMEOUT_S, **kw)):
        rewards[k] = g.reward
    return rewards, {"graded": len(items), "grade_s": time.perf_counter() - t0}


def evaluate(model: Transformer, template: ChatTemplate, insts: list[Instance], tasks: dict, pool) -> dict:
    """Greedy pass@1 on held-out instances, graded by the real grader."""
    t0 = time.perf_counter()
    engine = InferenceEngine(model, template, max_sessions=64)
    gens = generate(engine, template, insts, 1, 0.0, seed=0)
    gen_s = time.perf_counter() - t0
    rewards, info = grade_actions([(i, action_of(template, g)) for i, g in zip(insts, gens)], tasks, pool)
    model.train()
    n_tok = sum(len(g.token_ids) for g in gens)
    return {
        "pass@1": sum(rewards) / len(insts),
        "n": len(insts),
        "gen_s": round(gen_s, 1),
        "gen_tok_s": round(n_tok / max(gen_s, 1e-9), 1),
        **info,
        "examples": [action_of(template, g) for g in gens[:3]],
    }


@dataclass
class RLConfig:
    seconds: float = 240.0  # wall-clock cap
    steps: int = 0  # step budget (0: none)
    tasks_per_step: int = 4
    samples: int = 8
    temperature: float = 0.7
    # DEMO_NOTES' AdamW lr 3e-5 moved the greedy policy too little in the ~50-100 updates 2 cores
    # allow; Muon (matrices) needs a larger lr than AdamW for a similar step.
    lr: float = 1e-4
    muon_lr: float = 2e-3
    dspark_weight: float = 1.0  # keeps the drafter aligned with the moving policy
    dspark_every: int = 4  # on every n-th update
    # Task choice by template: weight p(1-p) + floor, p = the template's recent sampled reward, so
    # groups land where they have reward spread (all-0 or all-1 groups carry no GRPO signal).
    adaptive: bool = True
    adaptive_floor: float = 0.03
    adaptive_decay: float = 0.7  # EMA keep-factor of a template's p per group seen


class TemplateSampler:
    """Draws instances whose template's recent sampled reward p is nearest 0.5 more often."""

    def __init__(self, train: list[Instance], cfg: RLConfig, rng: random.Random):
        self.by_t: dict[int, list[Instance]] = {}
        for inst in train:
            self.by_t.setdefault(inst.template, []).append(inst)
        self.p = {t: 0.5 for t in self.by_t}
        self.cfg, self.rng = cfg, rng

    def draw(self, n: int) -> list[Instance]:
        ts = sorted(self.by_t)
        if not self.cfg.adaptive:
            return self.rng.sample([i for t in ts for i in self.by_t[t]], n)
        w = [self.p[t] * (1 - self.p[t]) + self.cfg.adaptive_floor for t in ts]
        return [self.rng.choice(self.by_t[t]) for t in self.rng.choices(ts, weights=w, k=n)]

    def update(self, inst: Instance, mean_reward: float) -> None:
        d = self.cfg.adaptive_decay
        self.p[inst.template] = d * self.p[inst.template] + (1 - d) * mean_reward


def _dspark_now(cfg: SFTConfig | RLConfig, step: int) -> bool:
    return cfg.dspark_weight > 0 and step % cfg.dspark_every == 0


def rl_update(
    model: Transformer, opt, rows: list[list[int]], gens: list, adv: list[float], cfg: RLConfig, pad: int, step: int = 0
) -> dict:
    """One on-policy GRPO step on rows (prompt + generated ids) with group-normalised advantages.

    Loss: -Σ adv·log p_T(generated token) / #generated tokens (log-probs at the sampling temperature),
    plus the indexer term and the DSpark drafter's alignment on the sampled tokens. Also measures the
    train/rollout mismatch: the engine's log-probs of the same tokens against this forward's."""
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.bool)
    rollout = torch.zeros((len(rows), S))
    for k, (r, g) in enumerate(zip(rows, gens)):
        n = len(g.token_ids)
        ids[k, : len(r)] = torch.tensor(r)
        mask[k, len(r) - n : len(r)] = True
        rollout[k, len(r) - n : len(r)] = torch.tensor(g.logprobs, dtype=torch.float)
    model.train()
    out = model(ids)
    logp = torch.log_softmax(out.logits[:, :-1].float() / cfg.temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    loss = -(torch.tensor(adv)[:, None] * logp * m).sum() / m.sum().clamp(min=1) + out.indexer_loss
    ds = dspark_train_term(model, out, ids, None, mask) if _dspark_now(cfg, step) else None
    if ds is not None:
        loss = loss + cfg.dspark_weight * ds.loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.eval()
    log_ratio = (logp.detach() - rollout[:, 1:])[m]  # log p_train - log p_rollout per generated token
    return {
        "mismatch_abs": float(log_ratio.abs().mean()),
        # k3 = e^r - 1 - r: unbiased KL(rollout || train) on tokens sampled from the rollout policy
        "mismatch_k3": float((log_ratio.exp() - 1 - log_ratio).mean()),
        "dspark_acceptance": float(ds.acceptance) if ds is not None else None,
    }


def run_rl(
    model: Transformer,
    template: ChatTemplate,
    train: list[Instance],
    tasks: dict,
    pool,
    cfg: RLConfig,
    seed: int = 0,
    log: Callable[[dict], None] = print,
) -> dict:
    opt = build_optimizer(model, OptimConfig(lr=cfg.lr, sinkhorn_lr=cfg.lr, muon_lr=cfg.muon_lr))
    sampler = TemplateSampler(train, cfg, random.Random(seed))
    pad = template.tokenizer.eos_id
    engine = InferenceEngine(model, template, max_sessions=64)
    t0, step, samples, updates, skipped, graded = time.perf_counter(), 0, 0, 0, 0, 0
    gen_s = grade_s = train_s = 0.0
    gen_tokens, history = 0, []
    while time.perf_counter() - t0 < cfg.seconds and (not cfg.steps or step < cfg.steps):
        insts = sampler.draw(cfg.tasks_per_step)
        ta = time.perf_counter()
        gens = generate(engine, template, insts, cfg.samples, cfg.temperature, seed=seed * 100_003 + step)
        tb = time.perf_counter()
        pairs = [(insts[k // cfg.samples], action_of(template, g)) for k, g in enumerate(gens)]
        rewards, info = grade_actions(pairs, tasks, pool)
        tc = time.perf_counter()
        graded += info["graded"]
        samples += len(gens)
        gen_tokens += sum(len(g.token_ids) for g in gens)
        rows, used, adv, upd = [], [], [], None
        for gi in range(cfg.tasks_per_step):
            r = torch.tensor(rewards[gi * cfg.samples : (gi + 1) * cfg.samples])
            sampler.update(insts[gi], float(r.mean()))
            if float(r.std(unbiased=False)) == 0.0:
                skipped += 1
                continue
            a = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
            for k in range(cfg.samples):
                g = gens[gi * cfg.samples + k]
                rows.append(prompt_ids(template, insts[gi]) + g.token_ids)
                used.append(g)
                adv.append(float(a[k]))
        if rows:
            upd = rl_update(model, opt, rows, used, adv, cfg, pad, step=updates)
            updates += 1
        td = time.perf_counter()
        gen_s, grade_s, train_s = gen_s + tb - ta, grade_s + tc - tb, train_s + td - tc
        step += 1
        mean_r = sum(rewards) / len(rewards)
        history.append({"step": step, "reward": mean_r, "t": round(td - t0, 1), **(upd or {})})
        if step % 5 == 0:
            el = time.perf_counter() - t0
            recent = history[-20:]
            log(
                {
                    "phase": "rl",
                    "step": step,
                    "updates": updates,
                    "skipped_groups": skipped,
                    "reward_recent": round(sum(h["reward"] for h in recent) / len(recent), 3),
                    "samples_s": round(samples / el, 1),
                    "gen_s": round(gen_s, 1),
                    "grade_s": round(grade_s, 1),
                    "train_s": round(train_s, 1),
                    "s": round(el, 1),
                    "load": round(os.getloadavg()[0], 2),
                }
            )
    el = time.perf_counter() - t0
    return {
        "steps": step,
        "updates": updates,
        "skipped_groups": skipped,
        "samples": samples,
        "graded": graded,
        "seconds": el,
        "samples_s": samples / el,
        "gen_tokens": gen_tokens,
        "gen_tok_s": gen_tokens / max(gen_s, 1e-9),
        "gen_s": gen_s,
        "grade_s": grade_s,
        "train_s": train_s,
        "gradings_s_while_grading": graded / max(grade_s, 1e-9),
        "history": history,
        "template_p": {str(t): round(p, 3) for t, p in sampler.p.items()},
    }
