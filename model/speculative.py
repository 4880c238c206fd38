"""DSpark speculative decoding (DESIGN §2): draft k tokens, verify them in ONE multi-token forward of
the backbone, accept losslessly, and leave the cache for the caller to roll back to what it keeps.

Lossless acceptance (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192; Chen et al. 2023,
https://arxiv.org/abs/2302.01318). Greedy: draft i is kept iff it equals the target's argmax, and the
first mismatch (or the bonus after k matches) is the target's argmax, so the output is token for
token the greedy decode. Sampling: draft d_i ~ q_i is kept with probability min(1, p_i(d_i)/q_i(d_i));
at the first rejection the token is drawn from the residual max(0, p_i − q_i)/Σ, after k acceptances
a bonus is drawn from p_{k+1}; every emitted token then has exactly the conditional p given its
prefix. p is the target's SAMPLING distribution (temperature, top-p: model.sampling), q the drafter's
(temperature, no top-p), and the log-prob emitted with a token is log p (what `sample` returns
without speculation): the behaviour log-prob RL needs, never the drafter's.

Verification length: the confidence head's raw logits c_i give σ(c_i) = P(draft i accepted | drafts
< i accepted), so the prefix-survival S_i = Π_{j<=i} σ(c_j). For a batch of rows that must keep one
length (the engine's rows share start_pos), the expected tokens per row of a k-step is
E(k) = 1 + Σ_{i<=k} Π_rows S_i, and k maximises E(k) / (t_draft + t_verify(k)) with times from a
`CostModel` measured on the device (forward of k+1 tokens vs 1). k = 0 is a plain decode step.
Not here: sessions, grouping, stop conditions (InferenceEngine.generate_speculative), the drafter
itself (model/dspark.py). `align_drafter` is a minimal alignment stage against a frozen backbone (for
the decode benchmark and tests); the trainers' DSpark alignment runs inside their own loops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from model.dspark import DSparkCache, align_to_drafts, dspark_loss_chunked
from model.engram import EngramHasher
from model.sampling import sampling_logprobs
from model.transformer import ModelCache, Transformer, make_engram_inputs

# forward(ids [B,S], cache, context_ids [B,c]) -> (logits [B,S,V] fp32, main_hidden [B,S,X]): one
# `forward_incremental` at cache.seq_len with the tokens just before it (Engram n-gram context).
Forward = Callable[[torch.Tensor, ModelCache, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(kw_only=True)
class SpeculativeConfig:
    """max_draft: the most draft tokens verified per step (None: dspark_block_size).
    cost: a fixed CostModel (None: measured on the engine's device once per batch size).
    min_speedup / probe_every / ema: a session stops drafting while its measured speedup over plain
    decoding (modelled time, an EMA over drafting steps that starts optimistic at 1.5·min_speedup, so a
    few bad steps are needed) is below min_speedup, and drafts again after probe_every plain steps
    (DESIGN §3.1: speculation switches itself off when it measures lower throughput).
    off_calls: after a speculative call whose sessions together emitted fewer tokens than plain
    decoding would have in the same modelled time (speedup below min_speedup), the engine's next
    off_calls calls run as plain `generate`; the one after probes again."""

    max_draft: int | None = None
    cost: CostModel | None = None
    min_speedup: float = 1.0
    probe_every: int = 16
    ema: float = 0.8
    off_calls: int = 16


@dataclass
class CostModel:
    """Seconds per step of one batch: t_verify[k] = a forward of k+1 tokens per row (t_verify[0]: a
    plain one-token decode), t_draft = one draft_step. t_plain: a step of the engine's plain decode
    when that is not the speculative path's own one-token forward (CUDA-graph decode: the speculative
    path is eager), None when it is (t_verify[0])."""

    t_verify: list[float]
    t_draft: float
    t_plain: float | None = None

    def step_time(self, k: int) -> float:
        return self.t_verify[k] + (self.t_draft if k > 0 else 0.0)

    def relative(self) -> list[float]:
        """Step time of k = 0..K in units of a plain decode step."""
        return [self.step_time(k) / self.t_verify[0] for k in range(len(self.t_verify))]

    @property
    def plain_time(self) -> float:
        return self.t_verify[0] if self.t_plain is None else self.t_plain

    def break_even(self) -> list[float]:
        """Per k = 0..K: the tokens a step must emit on average (1 + accepted drafts) to match the
        engine's plain decode (step_time(k) / plain_time)."""
        return [self.step_time(k) / self.plain_time for k in range(len(self.t_verify))]

    def best_speedup(self) -> float:
        """Speculation's speedup over plain decode if every draft were accepted, at its best k: the
        most it can gain (below 1: it loses whatever the drafter's acceptance)."""
        return max((k + 1) / be for k, be in enumerate(self.break_even()))


def grouped_speedup(batch: CostModel, one_row: CostModel, n_groups: int) -> float:
    """`batch.best_speedup()` when the batch's rows sit at `n_groups` different positions: plain decode
    still feeds every row in one ragged forward (`batch.plain_time`), but verification runs one forward
    per position group, each at least a one-row step (`one_row.step_time(k)`). Multi-turn episodes
    diverge after their first observation, so their sessions rarely share a position."""
    if n_groups <= 1:
        return batch.best_speedup()
    grouped = max((k + 1) * batch.plain_time / (n_groups * one_row.step_time(k)) for k in range(len(one_row.t_verify)))
    return min(batch.best_speedup(), grouped)


@dataclass
class SpecStats:
    """Acceptance statistics of one session. steps: verification forwards with drafts (k >= 1);
    drafted: draft tokens verified; accepted: of those, accepted by verification; emitted: tokens the
    session kept from those steps (a batch shares one length, so emitted <= accepted + steps);
    plain_steps: steps without drafts (k = 0 chosen, or drafting switched off); speedup_ema: modelled
    tokens per plain-step time of the drafting steps; off_for: plain steps left before drafting again;
    off_calls: generate_speculative calls of this session that ran as plain `generate` because the
    cost model said even fully accepted drafts lose (their tokens are in none of the other counts)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_steps: int = 0
    k_hist: dict[int, int] = field(default_factory=dict)
    speedup_ema: float | None = None
    off_for: int = 0
    off_calls: int = 0

    def record(self, k: int, drafted: bool, n_accepted: int, kept: int, speedup: float, cfg: SpeculativeConfig) -> None:
        """One step: k drafts verified (drafted: whether a draft was made), n_accepted of them accepted,
        `kept` tokens kept; speedup = kept tokens per plain-step time of this step (modelled)."""
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if not drafted:
            self.plain_steps += 1
            self.off_for = max(0, self.off_for - 1)
            return
        self.steps += k > 0
        self.plain_steps += k == 0
        self.drafted, self.accepted, self.emitted = self.drafted + k, self.accepted + n_accepted, self.emitted + kept
        prev = 1.5 * cfg.min_speedup if self.speedup_ema is None else self.speedup_ema
        ema = self.speedup_ema = cfg.ema * prev + (1 - cfg.ema) * speedup
        if ema < cfg.min_speedup:  # slower than plain decoding: plain steps until the next probe
            self.off_for, self.speedup_ema = cfg.probe_every, None

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted,
            "plain_steps": self.plain_steps, "off_calls": self.off_calls, "k_hist": dict(sorted(self.k_hist.items())),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_accepted": self.accepted / self.steps if self.steps else None,
            "speedup_ema": self.speedup_ema,
        }  # fmt: skip


@dataclass
class Verification:
    """One draft+verify step of a batch. tokens [B,k+1] / logprobs [B,k+1]: per row the first
    n_emit[b] = n_accepted[b] + 1 entries are its emitted tokens (accepted drafts, then the correction
    or bonus) and their target log-probs; later entries are padding (-1 / nan). main_hidden [B,k+1,X]
    of the verified tokens (anchor first): a row that keeps m tokens keeps rows :m as drafter context.
    The cache has consumed all k+1 verified tokens; the caller truncates it."""

    k: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    n_accepted: torch.Tensor
    main_hidden: torch.Tensor
    survival: torch.Tensor | None = None


# ---------------------------------------------------------------------------- acceptance
def accept_greedy(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """target_logits [B,k+1,V] fp32 (row i: the distribution after the anchor and drafts < i);
    draft_ids [B,k]. Returns (tokens [B,k+1], logprobs [B,k+1], n_accepted [B]): the target argmax at
    every row (lowest id on ties, as `sample`) with its model log-prob; entries past n_accepted + 1 are
    padding."""
    k = draft_ids.size(1)
    argmax = target_logits.argmax(-1)
    logp = torch.log_softmax(target_logits.float(), -1).gather(-1, argmax[..., None]).squeeze(-1)
    n_acc = (draft_ids == argmax[:, :k]).long().cumprod(-1).sum(-1)
    return _pad(argmax, logp, n_acc)


def accept_sampling(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, ...]:
    """Speculative rejection sampling. target_logits [B,k+1,V]; draft_ids [B,k] drawn from
    q = softmax(draft_logits [B,k,V] / temperature); p = exp(sampling_logprobs(target, T, top_p)).
    Row b draws its k uniforms and one Exp(1) vector (the exponential race for the final token) from
    generators[b]. Returns (tokens, logprobs under p, n_accepted) as accept_greedy."""
    B, k = draft_ids.shape
    logp_BKV = sampling_logprobs(target_logits, temperature, top_p)
    p_BKV = logp_BKV.exp()
    q_BkV = torch.softmax(draft_logits.float() / temperature, -1)
    dev = target_logits.device
    u_Bk = torch.stack([torch.rand(k, generator=g, device=dev) for g in generators])
    noise_BV = torch.stack([torch.empty(p_BKV.size(-1), device=dev).exponential_(generator=g) for g in generators])
    p_d = p_BKV[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_d = q_BkV.gather(-1, draft_ids[..., None]).squeeze(-1)
    # accept with probability min(1, p/q); q_d > 0 for a token drawn from q
    n_acc = (u_Bk * q_d < p_d).long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=dev)
    p_last = p_BKV[rows, n_acc]  # [B,V] at the first rejected row, or the bonus row (n_acc == k)
    q_last = torch.cat([q_BkV, q_BkV.new_zeros(B, 1, q_BkV.size(-1))], 1)[rows, n_acc]  # bonus: q = 0, p itself
    resid = (p_last - q_last).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    # Σ max(0, p − q) = 0 only if p == q, where a rejection has probability 0: fall back to p.
    resid = torch.where(mass > 0, resid / mass.clamp_min(torch.finfo(torch.float32).tiny), p_last)
    last = (resid / noise_BV.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)
    tokens = torch.cat([draft_ids, last[:, None]], 1)
    tokens[rows, n_acc] = last
    logprobs = logp_BKV.gather(-1, tokens[..., None]).squeeze(-1)
    return _pad(tokens, logprobs, n_acc)


def _pad(tokens: torch.Tensor, logprobs: torch.Tensor, n_acc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    past = torch.arange(tokens.size(1), device=tokens.device) > n_acc[:, None]
    return tokens.masked_fill(past, -1), logprobs.masked_fill(past, float("nan")), n_acc


# ---------------------------------------------------------------------------- scheduling
def prefix_survival(confidence: torch.Tensor) -> torch.Tensor:
    """confidence [B,K] raw logits -> S [B,K], S_i = P(drafts 0..i all accepted) = Π sigmoid."""
    return torch.sigmoid(confidence.float()).cumprod(-1)


def choose_k(survival: torch.Tensor, cost: CostModel, k_max: int) -> int:
    """The k in 0..k_max maximising the batch's tokens per second E(k) / step_time(k), where
    E(k) = 1 + Σ_{i<=k} Π_rows S_i (rows keep one common length). The draft is paid for every
    k >= 1; k = 0 is a plain decode step (cost t_verify[0])."""
    k_max = min(k_max, survival.size(1), len(cost.t_verify) - 1)
    joint = survival.double().prod(0)[:k_max]
    expect = torch.cat([joint.new_ones(1), 1 + joint.cumsum(0)])
    rate = [expect[k].item() / cost.step_time(k) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rate[k], -k))


# ---------------------------------------------------------------------------- one step
@torch.no_grad()
def speculative_step(
    model: Transformer,
    forward: Forward,
    cache: ModelCache,
    anchor_ids: torch.Tensor,
    context_ids: torch.Tensor,
    new_hidden: torch.Tensor | None,
    *,
    k_max: int,
    cost: CostModel,
    temperature: float,
    top_p: float,
    generators: Sequence[torch.Generator],
) -> Verification:
    """Draft (if k_max > 0), choose k, verify anchor + k drafts in one forward, accept.

    anchor_ids [B]: each row's newest token, at position cache.seq_len, not yet consumed.
    context_ids [B,c]: the c tokens before it (Engram context for `forward`).
    new_hidden [B,n,X]: the DSpark context of the tokens consumed since the drafter's context ends
    (see `sync_drafter`); None with k_max = 0 (no draft: the drafter context is not extended)."""
    k, draft_ids, draft_logits = 0, anchor_ids.new_zeros(anchor_ids.size(0), 0), None
    survival = None
    if k_max > 0:
        gen = None if temperature == 0 else list(generators)
        step = model.draft_step(anchor_ids, new_hidden, cache, k_max, temperature=temperature, generator=gen)
        survival = prefix_survival(step.confidence)
        k = choose_k(survival, cost, k_max)
        draft_ids, draft_logits = step.out_ids[:, 1 : k + 1], step.logits[:, :k]
    ids = torch.cat([anchor_ids[:, None], draft_ids], 1)
    logits, main_hidden = forward(ids, cache, context_ids)
    if draft_logits is None:
        draft_logits = logits[:, :0]
    if temperature == 0:
        tokens, logprobs, n_acc = accept_greedy(logits, draft_ids)
    else:
        tokens, logprobs, n_acc = accept_sampling(logits, draft_ids, draft_logits, temperature, top_p, generators)
    return Verification(k, tokens, logprobs, n_acc, main_hidden, survival)


def sync_drafter(cache: ModelCache, hidden: torch.Tensor) -> torch.Tensor:
    """The part of `hidden` [B,n,X] (the DSpark context of the cache's newest n tokens) that
    `draft_step` still needs: the rows past the drafter's context. If the drafter is behind `hidden`'s
    start (speculation was off, or prefill kept only the newest positions' context), its window
    restarts empty there: exact when n >= window_size + max_rollback (all that the window keeps)."""
    start = cache.seq_len - hidden.size(1)
    if cache.dspark is None:
        cache.dspark = DSparkCache(max_rollback=cache.max_rollback)
    if cache.dspark.seq_len < start:
        cache.dspark.window_kv, cache.dspark.seq_len = [], start
    return hidden[:, cache.dspark.seq_len - start :]


# ---------------------------------------------------------------------------- drafter alignment
# vocabulary-sized fp32 values alive at once in `align_drafter` at most (a backbone forward's logits,
# one chunk of draft logits and targets): 2^28 = 1 GiB
_ALIGN_LOGITS = 1 << 28


def align_drafter(
    model: Transformer,
    sequences: torch.Tensor,
    steps: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    engram_hasher: EngramHasher | None = None,
    chunk: int | None = None,
) -> dict:
    """Align the DSpark drafter (`mtp.*` only) to the frozen backbone on `sequences` [N,S] (e.g. the
    backbone's own continuations): `steps` AdamW steps of dspark_loss_chunked with the backbone's sampling
    distribution (temperature 0: its argmax) at every position as the target. The confidence head
    learns what verification will do: at temperature 0 whether the draft is the argmax; above, a
    Bernoulli draw of the acceptance probability Σ_v min(p, q) (an unbiased label for the BCE). The
    backbone runs once, under no_grad; drafts are teacher-forced. Returns {steps, loss and
    teacher-forced acceptance (those labels' mean) first and last, seconds}.

    Memory: no [N,S,V] or [batch,S,k,V] tensor is built. The backbone runs over as many rows at a
    time as _ALIGN_LOGITS allows and keeps its DSpark context and final hidden state (dim-sized);
    targets are recomputed from that hidden state per chunk, and the loss is `dspark_loss_chunked`
    over `chunk` anchor positions at a time (default: as many as _ALIGN_LOGITS allows)."""
    t0 = time.perf_counter()
    a = model.args
    k = a.dspark_block_size
    N, S = sequences.shape
    B = min(batch, N)
    chunk = chunk or max(1, _ALIGN_LOGITS // (B * k * a.vocab_size))
    main_hidden, hidden, argmax = [], [], []
    with torch.no_grad():
        rows_per_call = max(1, _ALIGN_LOGITS // (S * a.vocab_size))
        for lo in range(0, N, rows_per_call):
            part = sequences[lo : lo + rows_per_call]
            engram = None if engram_hasher is None else make_engram_inputs(engram_hasher, part.cpu())
            out = model(part, engram_inputs=engram)
            main_hidden.append(out.main_hidden)
            if temperature == 0:
                argmax.append(out.logits.argmax(-1))
            else:
                hidden.append(out.hidden)
            del out
    main_hidden = torch.cat(main_hidden)
    hard = align_to_drafts(torch.cat(argmax), k, -1) if temperature == 0 else None
    hidden = torch.cat(hidden) if temperature > 0 else None

    def target_of(rows: torch.Tensor):
        def target(lo: int, hi: int) -> torch.Tensor:
            if hard is not None:
                return hard[rows, lo:hi]
            # the policy's probabilities at positions s..s+k-1 of every anchor s in lo..hi-1
            p = sampling_logprobs(model.head(hidden[rows, lo : min(S, hi + k - 1)].float()), temperature, top_p).exp()
            p = torch.nn.functional.pad(p, (0, 0, 0, hi - lo + k - 1 - p.size(1)))  # no policy past the end
            return p.unfold(1, k, 1).movedim(-1, 2)

        return target

    params = list(model.mtp.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    head_weight = model.head.weight.detach()
    log = []
    was_training = model.training
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, N, (B,), generator=g).to(sequences.device)
        draft = model.draft_teacher_forced(main_hidden[rows], sequences[rows], k, with_logits=False)
        target = target_of(rows)
        accepted = None
        if temperature > 0:
            u = torch.rand(draft.confidence.shape, generator=g).to(draft.confidence.device)
            accepted = torch.cat([
                u[:, lo : lo + chunk] < _p_accept(model, draft, head_weight, target, lo, min(S, lo + chunk),
                                                  temperature)
                for lo in range(0, S, chunk)
            ], 1)  # fmt: skip
        res = dspark_loss_chunked(model.mtp, draft, head_weight, target, accepted, chunk=chunk)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        opt.step()
        log.append((res.loss.item(), res.acceptance.item()))
    model.train(was_training)
    first, last = log[: max(1, steps // 10)], log[-max(1, steps // 10) :]
    return {
        "steps": steps,
        "loss_first": round(sum(x for x, _ in first) / len(first), 4),
        "loss_last": round(sum(x for x, _ in last) / len(last), 4),
        "tf_acceptance_first": round(sum(a for _, a in first) / len(first), 4),
        "tf_acceptance_last": round(sum(a for _, a in last) / len(last), 4),
        "train_s": round(time.perf_counter() - t0, 2),
    }


@torch.no_grad()
def _p_accept(model, draft, head_weight, target, lo: int, hi: int, temperature: float) -> torch.Tensor:
    """Σ_v min(q, p) [B,hi-lo,k] of anchors lo..hi-1: the probability verification accepts the draft."""
    q = torch.softmax(model.mtp.draft_logits(draft.hidden[:, lo:hi], draft.prev_ids[:, lo:hi], head_weight)
                      / temperature, -1)  # fmt: skip
    return torch.minimum(q, target(lo, hi)).sum(-1)


# ---------------------------------------------------------------------------- cost model
@torch.no_grad()
def measure_cost_model(
    model: Transformer,
    forward: Forward,
    batch: int,
    k_max: int,
    *,
    context_len: int | None = None,
    repeats: int = 5,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> CostModel:
    """Time a draft_step and forwards of 1..k_max+1 tokens for `batch` rows after `context_len`
    random tokens (default: one window plus a block): one warm-up round, then `repeats` rounds each
    timing every k once (interleaved, so a load change hits all k alike), the median per k, made
    non-decreasing in k (a forward of more tokens is not cheaper; noise must not say otherwise)."""
    device = torch.device(device)
    a = model.args
    context_len = context_len or a.window_size + k_max + 1
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, a.vocab_size, (batch, context_len + k_max + 1), generator=g).to(device)
    cache = ModelCache(max_rollback=k_max + 1)  # a timing forward is dropped whole
    c = a.engram_max_ngram_size - 1 if a.engram_layer_ids else 0
    _, hidden = forward(ids[:, :context_len], cache, ids[:, :0])
    ctx = ids[:, context_len - c : context_len]

    def timed(fn: Callable[[], None]) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def verify(k: int) -> None:
        forward(ids[:, context_len : context_len + k + 1], cache, ctx)
        cache.truncate(context_len)

    def draft() -> None:  # the drafter's context advances by one token, as in a decode step
        cache.dspark.truncate(context_len - 1)
        model.draft_step(ids[:, context_len], hidden[:, -1:], cache, k_max).out_ids.tolist()

    if k_max > 0:
        model.draft_step(ids[:, context_len], sync_drafter(cache, hidden), cache, k_max)
    fns = [lambda k=k: verify(k) for k in range(k_max + 1)] + ([draft] if k_max > 0 else [])
    rounds = [[timed(fn) for fn in fns] for _ in range(repeats + 1)][1:]
    med = [sorted(r[j] for r in rounds)[len(rounds) // 2] for j in range(len(fns))]
    t_verify = torch.tensor(med[: k_max + 1]).cummax(0).values.tolist()
    return CostModel(t_verify, med[k_max + 1] if k_max > 0 else 0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "CostModel", "Forward", "SpecStats", "SpeculativeConfig", "Verification", "accept_greedy", "accept_sampling",
    "align_drafter", "choose_k", "grouped_speedup", "measure_cost_model", "prefix_survival", "speculative_step",
    "sync_drafter",
]  # fmt: skip
