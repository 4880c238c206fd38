"""The demo's learning loops on synth/families tasks, small enough for 2 CPU threads: chat-rendered
SFT on family-A demonstrations, greedy held-out pass@1 through model.engine.InferenceEngine and the
real grader (envs/batch_grading.py), and asynchronous GRPO on family B with real grading (samples
from a rollout worker process, rl/demo_rollout.py).

Plain loops over the V4.1 Transformer with the project's family optimiser (rl.optim), not the
DeepSpeed Learner: one learner process (and RL's rollout worker), no engine start-up, nothing to
shard (the Learner's loss terms are the same: rl.losses.sft_loss / rl.losses.policy_loss, plus the
indexer alignment loss). RL follows
DEMO_NOTES: sampling at T = 0.7 with log-probs at the same temperature, 4 tasks x 8 samples per
update, group-normalised advantages, zero-spread groups skipped, one update per batch, the batch
sampled one version back (max_policy_lag 1, truncated importance weights); tasks are drawn by
template where the recent sampled reward has spread (TemplateSampler).
Not here: the stage wiring (rl/demo.py) or the measurement script (bench/demo_learning.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
from collections.abc import Callable

import torch

from envs.batch_grading import grade_batch, screen_edit
from model.chat_template import ChatTemplate
from model.config import ModelArgs, default_tokenizer_fit, get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from rl.config import OptimConfig, PolicyLossConfig
from rl.demo_config import DEMO_OVERRIDES, RLConfig, SFTConfig
from rl.demo_dspark import dspark_train_term
from rl.losses import policy_loss, sft_loss
from rl.optim import build_optimizer
from synth.families import Instance, action_ruled_out, apply_action, module_path, module_source

MAX_ACTION_TOKENS = 16
GRADE_TIMEOUT_S = 0.5


def demo_args(flavor: str = "tiny", overrides: dict | None = None, shrink: int = 1) -> ModelArgs:
    """The demo policy's ModelArgs: get_flavor(flavor, **overrides) fitted to the shipped tokenizer
    (the demo's prompts and grader use model/assets/tokenizer.json; `small`/`flash` are sized for
    the released one: their vocabulary, Engram compressed vocabulary and special ids are replaced by
    the tiny flavor's, which are that tokenizer's), at 1/shrink of its width (the OPD student)."""
    args = get_flavor(flavor, **(DEMO_OVERRIDES if overrides is None else overrides))
    fit = default_tokenizer_fit()
    if shrink > 1:
        fit |= {"dim": args.dim // shrink, "moe_inter_dim": args.moe_inter_dim // shrink}
    return dataclasses.replace(args, **fit)


def build_policy(
    overrides: dict | None = None, seed: int = 0, flavor: str = "tiny", shrink: int = 1
) -> tuple[Transformer, ChatTemplate, ModelArgs]:
    """A seeded demo policy on the CPU (demo_args; callers move it with .to(device))."""
    args = demo_args(flavor, overrides, shrink)
    model, template = policy_of_args(args, seed)
    return model, template, args


def policy_of_args(args: ModelArgs, seed: int | None = 0) -> tuple[Transformer, ChatTemplate]:
    """The policy of `args` with seeded weights; seed None leaves them uninitialised, for a model whose
    every weight is loaded (strictly) before use, like the rollout worker's."""
    tok = Tokenizer.default()
    model = Transformer(args, engram_hasher=EngramHasher(args, tok) if args.engram_layer_ids else None)
    if seed is not None:
        model.init_weights(seed=seed)
    return model, ChatTemplate(tok)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


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


def demo_optimizer(model: Transformer, lr: float, muon_lr: float):
    """The demo's optimiser (rl.optim's families; AdamW and Sinkhorn at `lr`, Muon at `muon_lr`). Muon
    runs eager: compiling it per matrix shape on a GPU would eat a minutes-long stage."""
    return build_optimizer(model, OptimConfig(lr=lr, sinkhorn_lr=lr, muon_lr=muon_lr, compile_muon=False))


def demo_sft_term(model: Transformer, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    """(SFT loss + indexer term, SFT loss) of `model` on packed demonstration rows (ids, doc ids, loss
    mask, e.g. from demo_rows), moved to its device: the family-A term of RL and OPD updates."""
    ids, docs, mask = (t.to(device_of(model)) for t in rows)
    out = model(ids, docs)
    sft = sft_loss(out.logits, ids, mask)
    return sft + out.indexer_loss, sft


def demo_rows(template: ChatTemplate, demos: list[Instance], rng: random.Random, rows: int, seq_len: int = 256):
    """`rows` packed rows of demonstrations drawn from `demos`: (ids, doc ids, loss mask), as SFT packs them."""
    examples = [sft_example(template, i) for i in rng.sample(demos, 6 * rows)]  # ~3 fit a 256-token row
    return tuple(t[:rows] for t in pack(examples, seq_len, template.tokenizer.eos_id))


def sft_lr_scale(cfg: SFTConfig, step: int, elapsed_s: float) -> float:
    """The learning-rate factor at `step`: cosine from 1 down to cfg.lr_floor over the stage, whose
    progress is the larger of steps done / step budget and seconds spent / wall-clock cap. So the
    schedule ends where the stage ends, whichever budget binds: on a slower machine SFT runs fewer
    steps but still anneals, instead of stopping at full learning rate wherever the cap falls
    (constant lr: seed 0 scored 0.41 or 0.56 on held-out A after 80 or 85 steps of one trajectory)."""
    if not cfg.lr_floor < 1.0:
        return 1.0
    progress = min(1.0, max(step / cfg.steps if cfg.steps else 0.0, elapsed_s / cfg.seconds))
    return cfg.lr_floor + (1.0 - cfg.lr_floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def run_sft(
    model: Transformer,
    template: ChatTemplate,
    make_batch: Callable[[int], list[Instance]],
    cfg: SFTConfig,
    log: Callable[[dict], None] = print,
) -> dict:
    """SFT for cfg.steps steps (at most cfg.seconds of wall time) on batches drawn by make_batch(step)."""
    opt = demo_optimizer(model, cfg.lr, cfg.muon_lr)
    base_lrs = [g["lr"] for g in opt.param_groups]
    model.train()
    pad, dev = template.tokenizer.eos_id, device_of(model)
    t0, step, tokens, losses, accept = time.perf_counter(), 0, 0, [], []
    while time.perf_counter() - t0 < cfg.seconds and (not cfg.steps or step < cfg.steps):
        scale = sft_lr_scale(cfg, step, time.perf_counter() - t0)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * scale
        insts = make_batch(step)
        ids, docs, mask = pack([sft_example(template, i) for i in insts], cfg.seq_len, pad)
        ids, docs, mask = (t[: cfg.rows].to(dev) for t in (ids, docs, mask))
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
    stop_when: Callable[[str], bool] | None = None,
    progress: str | None = None,
):
    """n generations per instance (token ids, logprobs, text) in engine batches of <= chunk sessions;
    `stop_when` as in InferenceEngine.generate; `progress`: a console bar with this label (terminal only)."""
    from tqdm import tqdm

    prompts = [prompt_ids(template, inst) for inst in insts]
    # equal-length prompts prefill and decode as one batch in the engine: order jobs by length
    jobs = sorted(((i, k) for i in range(len(insts)) for k in range(n)), key=lambda j: len(prompts[j[0]]))
    out: dict = {}
    bar = tqdm(total=len(jobs), desc=progress, unit="answer", disable=None if progress else True, leave=False)
    for lo in range(0, len(jobs), chunk):
        part = jobs[lo : lo + chunk]
        sids = [engine.start(prompts[i]) for i, _ in part]
        try:
            gens = engine.generate(
                sids, MAX_ACTION_TOKENS, temperature=temperature, seed=seed + lo, stop_when=stop_when
            )  # fmt: skip
        finally:
            for s in sids:
                engine.close(s)
        for job, g in zip(part, gens):
            out[job] = g
        bar.update(len(part))
    bar.close()
    return [out[(i, k)] for i in range(len(insts)) for k in range(n)]


def action_of(template: ChatTemplate, gen) -> str:
    """The answer: the generated text before the first end tag, as is. The demo's answers are bare
    actions (no reasoning or tool-call blocks to parse out), which is what makes a prefix that
    `action_ruled_out` rejects final."""
    names, text = template.tokenizer.special_tokens, gen.text  # the engine decoded it, special tokens kept
    for tag in (names["end"], names["eos"]):
        text = text.split(tag, 1)[0]
    return text


def reward_files(inst: Instance, action: str) -> tuple[dict[str, str] | None, str]:
    """The module the action produces, or None (and why) when it cannot be graded."""
    fixed = apply_action(inst.buggy, action)
    if fixed is None:
        return None, "malformed or non-applying action"
    why = screen_edit(inst.buggy, fixed)
    if why:
        return None, why
    return {module_path(inst): module_source(inst, fixed)}, ""


def grade_actions(pairs: list[tuple[Instance, str]], tasks: dict, pool) -> tuple[list[float], dict]:
    """Rewards of (instance, action) pairs; gradable ones go to the real grader, one batch per image
    (the families share one image; family F grades on its repository's pristine image)."""
    rewards = [0.0] * len(pairs)
    by_image: dict[str, list[tuple[int, object, dict]]] = {}
    for k, (inst, action) in enumerate(pairs):
        files, _ = reward_files(inst, action)
        if files is not None:
            task = tasks[inst.iid]
            by_image.setdefault(task.image, []).append((k, task, files))
    t0 = time.perf_counter()
    local = getattr(pool, "workspace", None)  # bench.demo_learning's container-less LocalHarness
    kw = {"workspace": local, "sweep": False} if local else {}
    for items in by_image.values():
        # template functions run in microseconds: a candidate still running after GRADE_TIMEOUT_S loops;
        # a factory task runs its repository's whole suite (verification["timeout_s"])
        timeout = max(float(t.verification.get("timeout_s", GRADE_TIMEOUT_S)) for _, t, _ in items)
        graded = grade_batch([(t, f) for _, t, f in items], pool=pool, timeout_s=timeout, **kw)
        for (k, _, _), g in zip(items, graded):
            rewards[k] = g.reward
    return rewards, {"graded": sum(map(len, by_image.values())), "grade_s": time.perf_counter() - t0}


def evaluate(
    model: Transformer, template: ChatTemplate, insts: list[Instance], tasks: dict, pool, progress: str | None = None
) -> dict:
    """Greedy pass@1 on held-out instances, graded by the real grader. An answer stops as soon as
    `action_ruled_out` rejects it (it would score 0 at any length); `ruled_out` counts those."""
    t0 = time.perf_counter()
    gens = greedy_answers(model, template, insts, progress)
    return _score(template, insts, gens, time.perf_counter() - t0, tasks, pool)


def evaluate_families(
    model: Transformer, template: ChatTemplate, families: dict[str, list[Instance]], tasks: dict, pool,
    progress: bool = True,
) -> dict[str, dict]:  # fmt: skip
    """`evaluate` of every family, its answers generated by greedy_families (two processes)."""
    gens, gen_s = greedy_families(model, template, families, progress)
    return {f: _score(template, families[f], gens[f], gen_s[f], tasks, pool) for f in families}


def greedy_families(
    model: Transformer, template: ChatTemplate, families: dict[str, list[Instance]], progress: bool = False,
    split: bool = True,
) -> tuple[dict[str, list], dict[str, float]]:  # fmt: skip
    """Greedy answers to every family's instances (and seconds per family). With `split` (and more than
    one family, and a GPU or two cores) in two processes: the largest family in a helper process
    (rl.demo_rollout.RolloutProcess, one thread) while this process answers the others on one thread;
    else every family in turn here, on this process's threads.

    Why split: the demo policy's decode steps are bound by per-op overhead, so a second thread gains
    little while a second process nearly halves the time (bench/demo_eval.py on a seed-0 SFT policy,
    families A, B and F: 30.0 s in turn on two threads, 16.4 s split, the helper's start included; the
    same answers). Both sides decode greedily with the same weights; only a thread count can move a
    float sum in its last bit, which could break an exact tie differently."""
    from rl.demo_rollout import RolloutProcess

    big = max(families, key=lambda f: len(families[f]))
    dev = device_of(model)
    split = split and len(families) > 1 and (dev.type == "cuda" or (os.cpu_count() or 1) >= 2)
    here = [f for f in families if f != big] if split else list(families)
    gens, gen_s, threads = {}, {}, torch.get_num_threads()
    with RolloutProcess(model.args, threads=1, device=dev) if split else contextlib.nullcontext() as helper:
        if split:
            helper.send_weights(0, model.state_dict())
            helper.submit(families[big], 1, 0.0, 0, stop_when=action_ruled_out)
            torch.set_num_threads(1)
        try:
            for f in here:
                t0 = time.perf_counter()
                label = f"  family {f}" + (f" (family {big} in a helper process)" if split else "")
                gens[f] = greedy_answers(model, template, families[f], label if progress else None)
                gen_s[f] = time.perf_counter() - t0
            if split:
                gens[big], gen_s[big] = helper.result(), helper.last_gen_s
        finally:
            torch.set_num_threads(threads)
    return gens, gen_s


def greedy_answers(
    model: Transformer, template: ChatTemplate, insts: list[Instance], progress: str | None = None
) -> list:
    """Greedy answers to insts in this process (an answer stops once action_ruled_out rejects it)."""
    engine = InferenceEngine(model, template, max_sessions=64, device=device_of(model))
    gens = generate(engine, template, insts, 1, 0.0, seed=0, stop_when=action_ruled_out, progress=progress)
    model.train()
    return gens


def _score(template: ChatTemplate, insts: list[Instance], gens: list, gen_s: float, tasks: dict, pool) -> dict:
    """evaluate's record: pass@1 of the greedy answers `gens` to `insts`, generated in gen_s seconds."""
    rewards, info = grade_actions([(i, action_of(template, g)) for i, g in zip(insts, gens)], tasks, pool)
    n_tok = sum(len(g.token_ids) for g in gens)
    return {
        "pass@1": sum(rewards) / len(insts),
        "n": len(insts),
        "gen_s": round(gen_s, 1),
        "gen_tok_s": round(n_tok / max(gen_s, 1e-9), 1),
        "ruled_out": sum(g.finish_reason == "stop" and g.stop is None for g in gens),
        **info,
        "examples": [action_of(template, g) for g in gens[:3]],
    }


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
    model: Transformer,
    opt,
    rows: list[list[int]],
    gens: list,
    adv: list[float],
    cfg: RLConfig,
    pad: int,
    step: int = 0,
    ptx: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """One GRPO step on rows (prompt + generated ids) with group-normalised advantages.

    Loss: rl.losses.policy_loss (decoupled PPO, token-level mean) with π_prox = this forward (one update
    per batch, so the ratio is 1 and its gradient the policy gradient) and μ = the rollout log-probs:
    the truncated weight min(π_prox/μ, 2) corrects a batch sampled one version back (lag 1), log-probs
    at the sampling temperature; plus the indexer term, the DSpark drafter's alignment on the sampled
    tokens and, given `ptx` (packed ids, doc ids, loss mask of demonstrations), cfg.ptx_weight x their
    SFT loss. Also measures log π_θ − log μ on the generated tokens (train/rollout mismatch, which
    includes the lag's policy change when the batch is a version old)."""
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.bool)
    rollout = torch.zeros((len(rows), S))
    for k, (r, g) in enumerate(zip(rows, gens)):
        n = len(g.token_ids)
        ids[k, : len(r)] = torch.tensor(r)
        mask[k, len(r) - n : len(r)] = True
        rollout[k, len(r) - n : len(r)] = torch.tensor(g.logprobs, dtype=torch.float)
    dev = device_of(model)
    ids, mask, rollout = ids.to(dev), mask.to(dev), rollout.to(dev)
    model.train()
    out = model(ids)
    logp = torch.log_softmax(out.logits[:, :-1].float() / cfg.temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    adv_BS = torch.tensor(adv, device=dev)[:, None].expand_as(logp)
    pl_cfg = PolicyLossConfig(temperature=cfg.temperature)
    loss, pl = policy_loss(logp, logp.detach(), rollout[:, 1:], adv_BS, m, pl_cfg)
    loss = loss + out.indexer_loss
    ds = dspark_train_term(model, out, ids, None, mask) if _dspark_now(cfg, step) else None
    if ds is not None:
        loss = loss + cfg.dspark_weight * ds.loss
    ptx_loss = None
    if ptx is not None:
        ptx_total, ptx_loss = demo_sft_term(model, ptx)
        loss = loss + cfg.ptx_weight * ptx_total
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
        "ptx_loss": float(ptx_loss.detach()) if ptx_loss is not None else None,
        "is_weight_mean": pl.get("is_weight_mean"),
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
    demos: list[Instance] | None = None,
) -> dict:
    """GRPO on `train` for cfg.steps steps (at most cfg.seconds), asynchronous: a rollout worker
    process (rl/demo_rollout.py) samples the next batch with the current weights while this process
    grades the last one and trains on it (cfg.max_policy_lag 1; 0 waits for each update). `demos`:
    the demonstrations of the ptx term (None or cfg.ptx_weight 0: none)."""
    from rl.demo_rollout import RolloutProcess, worker_threads

    if cfg.max_policy_lag not in (0, 1):
        raise ValueError(f"RLConfig.max_policy_lag={cfg.max_policy_lag}: the demo's worker supports 0 or 1")
    opt = demo_optimizer(model, cfg.lr, cfg.muon_lr)
    sampler = TemplateSampler(train, cfg, random.Random(seed))
    ptx_rng = random.Random(seed + 17)
    pad = template.tokenizer.eos_id
    step, samples, updates, skipped, graded, max_lag = 0, 0, 0, 0, 0, 0
    gen_s = grade_s = train_s = worker_gen_s = 0.0
    gen_tokens, history = 0, []

    def more(k: int) -> bool:  # is step k within the step budget?
        return not cfg.steps or k < cfg.steps

    with RolloutProcess(model.args, threads=worker_threads(), device=device_of(model)) as worker:
        worker.send_weights(0, model.state_dict())
        worker.wait_ready()  # the worker's start-up (a process, torch, the model) is not RL time
        t0 = time.perf_counter()

        def submit(k: int) -> list[Instance]:
            insts = sampler.draw(cfg.tasks_per_step)
            worker.submit(insts, cfg.samples, cfg.temperature, seed=seed * 100_003 + k)
            return insts

        queued = [submit(0)]
        while time.perf_counter() - t0 < cfg.seconds and more(step):
            ta = time.perf_counter()
            gens, insts = worker.result(), queued.pop(0)
            worker_gen_s += worker.last_gen_s
            tb = time.perf_counter()
            if cfg.max_policy_lag and more(step + 1):
                queued.append(submit(step + 1))  # sampled by this version while we grade and train
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
                prompt = prompt_ids(template, insts[gi])  # rendered once per group, not per sample
                for k in range(cfg.samples):
                    g = gens[gi * cfg.samples + k]
                    rows.append(prompt + g.token_ids)
                    used.append(g)
                    adv.append(float(a[k]))
            if rows:
                lag = updates - min(v for g in used for v in g.policy_versions)
                if lag > cfg.max_policy_lag:
                    raise RuntimeError(f"a trained token is {lag} versions old (max_policy_lag {cfg.max_policy_lag})")
                max_lag = max(max_lag, lag)
                ptx = demo_rows(template, demos, ptx_rng, cfg.ptx_rows) if demos and cfg.ptx_weight > 0 else None
                upd = {**rl_update(model, opt, rows, used, adv, cfg, pad, step=updates, ptx=ptx), "lag": lag}
                updates += 1
                worker.send_weights(updates, model.state_dict())
            if not cfg.max_policy_lag and more(step + 1):
                queued.append(submit(step + 1))
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
                        "gen_wait_s": round(gen_s, 1),
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
        "gen_s": worker_gen_s,  # the worker generating
        "gen_tok_s": gen_tokens / max(worker_gen_s, 1e-9),
        "gen_wait_s": gen_s,  # the learner waiting for samples: the generation time overlap did not hide
        "max_policy_lag": max_lag,
        "grade_s": grade_s,
        "train_s": train_s,
        "gradings_s_while_grading": graded / max(grade_s, 1e-9),
        "history": history,
        "template_p": {str(t): round(p, 3) for t, p in sampler.p.items()},
    }
