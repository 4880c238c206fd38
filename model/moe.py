"""Mixture of experts of V4.1 (spec §3.11): Gate, SwiGLU Expert, MoE, and the balancing rules.

Routing: sqrt(softplus) scores (softmax/sigmoid also available), top-k selected on scores plus a
correction bias (`bias`, or `bias_vl` for image-span tokens), weights from the unbiased scores.
The MoE groups tokens by expert and runs each expert on its own tokens only. Also here: the
DeepSeek-V3 sequence-wise balance loss and the aux-loss-free bias update, as pure functions.
Routing record/replay (`routing_record`, `routing_replay`): a rollout records each token's experts
per MoE layer, a training forward routes by them (the learner's weights still come from its own
scores, so the gate trains); everything else, the indexer's top-k included, is recomputed.
With `impl: triton` the routed experts run as grouped GEMMs (kernels/moe.py, one launch per GEMM for
all experts, no host sync); the loop below stays the reference. Not here: expert parallelism and
fp8/fp4 weight storage.

Shape legend: T tokens (B·S flattened), D model dim, F expert inter dim, E routed experts,
K experts per token, N = T·K token-expert assignments, B batch, S sequence.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelArgs

SCORE_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda s: F.softplus(s).sqrt(),
    "softmax": lambda s: s.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


@dataclass
class RouterStats:
    """What one MoE call routed, for balancing losses and bias updates.

    counts    int64 [E]       tokens assigned to each expert (selection includes the bias)
    mean_prob fp32  [E]       mean over tokens of the normalised unbiased score s/Σs (has grad)
    topk_idx  int64 [..., K]  selected experts per token, ascending expert id; leading dims as x
    scores    fp32  [..., E]  unbiased routing scores (has grad); input of `sequence_balance_loss`
    """

    counts: torch.Tensor
    mean_prob: torch.Tensor
    topk_idx: torch.Tensor
    scores: torch.Tensor


# routing replay: layer id -> forced experts [..., K] (-1 rows: route as usual); routing record:
# layer id -> the topk_idx [..., K] of every MoE call of that layer, in call order
_REPLAY: ContextVar[Mapping[int, torch.Tensor] | None] = ContextVar("moe_routing_replay", default=None)
_RECORD: ContextVar[dict[int, list[torch.Tensor]] | None] = ContextVar("moe_routing_record", default=None)


@contextmanager
def routing_replay(routing: torch.Tensor, layer_ids: Sequence[int]) -> Iterator[None]:
    """Inside, MoE layer `layer_ids[j]` routes token t by routing[..., j, :] instead of its own top-k
    (routing int [..., n_layers, K], leading dims those of the forward's tokens, e.g. [B,S]: as
    `stack_routing` returns them). A token whose row is all -1 (not recorded) routes as usual. The
    routing weights are the layer's own scores at the forced experts (normalised as usual), so the
    gate keeps its gradient; the correction bias is not consulted. Only the MoE choice is replayed:
    attention, the indexer's top-k and the DSpark stages (other layer ids) run as always."""
    forced = {int(layer): routing[..., j, :] for j, layer in enumerate(layer_ids)}
    token = _REPLAY.set(forced)
    try:
        yield
    finally:
        _REPLAY.reset(token)


@contextmanager
def routing_record() -> Iterator[dict[int, list[torch.Tensor]]]:
    """Collects, per MoE layer id, the experts [..., K] (int64, ascending) of every call made inside,
    in call order (detached; leading dims as the call's tokens)."""
    record: dict[int, list[torch.Tensor]] = {}
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def stack_routing(stats: Sequence["RouterStats"]) -> torch.Tensor:
    """The routing of one forward as `routing_replay` takes it: [..., n_layers, K] from the forward's
    router stats (TransformerOutput.router_stats, one per backbone layer in layer order)."""
    return torch.stack([s.topk_idx for s in stats], dim=-2)


def _frozen_fp32(n: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)


class Gate(nn.Module):
    """Router. `weight` [E, D] in the default dtype (used in fp32); `bias` and `bias_vl` [E] fp32.

    The biases only pick experts and are moved by `update_expert_bias`, never by gradients, so
    they are Parameters with requires_grad=False: they keep the official checkpoint names
    (`gate.bias`, `gate.bias_vl`) and are saved and loaded with the model, while optimisers that
    skip frozen parameters leave them alone.
    """

    def __init__(self, args: ModelArgs, n_routed_experts: int, n_activated_experts: int):
        super().__init__()
        self.n_routed_experts = n_routed_experts
        self.topk = n_activated_experts
        self.score_func = args.score_func
        self.gate_temp = args.gate_temp
        self.norm_topk_prob = args.norm_topk_prob
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(n_routed_experts, args.dim))
        self.bias = _frozen_fp32(n_routed_experts)
        vision = args.vision_n_layers > 0
        self.bias_vl: nn.Parameter | None = _frozen_fp32(n_routed_experts) if vision else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # shape-only model (accounting): nothing to initialise
            return
        # unit-variance logits for an RMS-normalised input; the biases start neutral
        nn.init.normal_(self.weight, std=self.weight.size(1) ** -0.5)
        nn.init.zeros_(self.bias)
        if self.bias_vl is not None:
            nn.init.zeros_(self.bias_vl)

    def forward(
        self, x_TD: torch.Tensor, image_mask_T: torch.Tensor | None = None, forced_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (weights_TK fp32, topk_idx_TK int64 ascending per token, scores_TE fp32). forced_TK:
        experts to use instead of the top-k (rows of -1: the top-k), see `routing_replay`."""
        scores_TE = F.linear(x_TD.float(), self.weight.float()) / self.gate_temp
        scores_TE = SCORE_FNS[self.score_func](scores_TE)
        bias_E = self.bias
        if image_mask_T is not None and self.bias_vl is not None:
            bias_E = torch.where(image_mask_T.unsqueeze(-1), self.bias_vl, self.bias)
        # the bias picks experts but does not scale them: weights come from the unbiased scores
        topk_idx_TK = (scores_TE + bias_E).topk(self.topk, dim=-1).indices
        if forced_TK is not None:
            forced_TK = forced_TK.to(topk_idx_TK.device, torch.int64)
            topk_idx_TK = torch.where((forced_TK >= 0).all(-1, keepdim=True), forced_TK, topk_idx_TK)
        # ascending expert id per token, so the fp32 accumulation order equals the reference's
        # expert-by-expert loop (bit-identical sums)
        topk_idx_TK = topk_idx_TK.sort(dim=-1).values
        weights_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk_prob and self.topk > 1:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)  # not norm_eps
        return weights_TK * self.route_scale, topk_idx_TK, scores_TE


class Expert(nn.Module):
    """SwiGLU FFN: w1 = gate, w3 = up, w2 = down, no biases.

    With `swiglu_limit` > 0 the up branch is clamped to ±limit and the gate branch only from above
    (training clamps, kept for numerics). A routing weight, when given, multiplies the hidden
    activation in fp32 before w2, as the reference does.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.swiglu_limit = swiglu_limit
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.init on meta tensors still costs ~2 ms a call: 15k experts of `flash` took minutes
        if self.w1.weight.is_meta:
            return
        for lin in (self.w1, self.w2, self.w3):
            nn.init.normal_(lin.weight, std=lin.in_features**-0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.swiglu_limit > 0:
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(dtype))


class MoE(nn.Module):
    """Routed experts plus one shared expert. Parameter names are the checkpoint's:
    `gate.weight`, `gate.bias`, `gate.bias_vl`, `experts.{j}.w{1,2,3}.weight`,
    `shared_experts.w{1,2,3}.weight`.

    `n_routed_experts` / `n_activated_experts`: None or 0 means the backbone values from `args`;
    DSpark stages pass `args.dspark_experts`.
    """

    def __init__(
        self, args: ModelArgs, n_routed_experts: int | None = None, n_activated_experts: int | None = None
    ):
        super().__init__()
        self.dim = args.dim
        self.n_routed_experts = n_routed_experts or args.n_routed_experts
        self.n_activated_experts = n_activated_experts or args.n_activated_experts
        assert 0 < self.n_activated_experts <= self.n_routed_experts
        assert args.n_shared_experts == 1, "V4.1 has exactly one shared expert"
        self.gate = Gate(args, self.n_routed_experts, self.n_activated_experts)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim, args.swiglu_limit) for _ in range(self.n_routed_experts)
        )
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
        self.swiglu_limit = args.swiglu_limit
        self.grouped_experts = None
        self.layer_id: int | None = None  # set by the owning Block: the key of routing record/replay
        # the grouped GEMMs' expert offset tables (kernels/moe.py expert_offsets), made eagerly by
        # `refresh_expert_offsets`: a compiled forward reads them here, as it cannot read the weights'
        # addresses (an eager forward refreshes them itself)
        self.expert_offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if args.impl == "triton":
            from kernels.moe import moe_experts  # chosen at construction (STYLE rule 13)

            self.grouped_experts = moe_experts

    def refresh_expert_offsets(self) -> None:
        """Make `expert_offsets` match where the experts' weights are now (impl=triton; a no-op
        otherwise). Eager only: a compiled caller runs it before each compiled call, so weights that
        moved since (a load with assign, a device move) are never read through stale offsets."""
        if self.grouped_experts is None:
            return
        from kernels.moe import expert_offsets

        self.expert_offsets = expert_offsets(*self._expert_weights())

    def _expert_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return ([ex.w1.weight for ex in self.experts], [ex.w3.weight for ex in self.experts],
                [ex.w2.weight for ex in self.experts])  # fmt: skip

    def forward(
        self, x: torch.Tensor, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RouterStats]:
        """x [B, S, D] or [T, D]; image_mask bool with x's leading shape (True = image-span token,
        routed with `bias_vl`) or None. Returns (y like x, RouterStats)."""
        lead = x.shape[:-1]
        x_TD = x.reshape(-1, self.dim)
        K, E = self.n_activated_experts, self.n_routed_experts
        mask_T = None if image_mask is None else image_mask.reshape(-1)
        # a compiled forward (the engine's compiled decode step) neither replays nor records: dynamo
        # cannot trace ContextVar.get (a graph break per layer), and the engine refuses record_routing
        # with compile_decode
        compiling = torch.compiler.is_compiling()
        replay = None if compiling else _REPLAY.get()
        forced_TK = None
        if replay is not None and self.layer_id in replay:
            forced = replay[self.layer_id]
            if forced.shape[:-1] != lead or forced.size(-1) != K:
                raise ValueError(
                    f"layer {self.layer_id}: replayed routing {tuple(forced.shape)} does not match tokens "
                    f"{tuple(lead)} x top-{K}; pass routing[..., n_layers, K] of this forward"
                )
            forced_TK = forced.reshape(-1, K)
        weights_TK, topk_idx_TK, scores_TE = self.gate(x_TD, mask_T, forced_TK)
        record = None if compiling else _RECORD.get()
        if record is not None and self.layer_id is not None:
            record.setdefault(self.layer_id, []).append(topk_idx_TK.detach().view(*lead, K))

        expert_N = topk_idx_TK.flatten()
        # scatter_add, not bincount: CUDA bincount syncs with the host (the Triton path has no other sync)
        counts_E = x.new_zeros(E, dtype=torch.int64).scatter_add_(0, expert_N, torch.ones_like(expert_N))
        if self.grouped_experts is not None:
            if not compiling:
                self.refresh_expert_offsets()
            elif self.expert_offsets is None:
                raise ValueError("a compiled MoE reads expert offsets made eagerly: call refresh_expert_offsets first")
            y_TKD = self.grouped_experts(
                x_TD, weights_TK, topk_idx_TK, *self._expert_weights(), self.swiglu_limit, self.expert_offsets
            )
        elif compiling:
            y_TKD = self._experts_dense(x_TD, weights_TK, topk_idx_TK)
        else:
            y_TKD = self._experts_loop(x_TD, weights_TK, expert_N, counts_E)
        # sum a token's K outputs in fp32, ascending expert id
        y_TD = y_TKD[:, 0].float()
        for k in range(1, K):
            y_TD = y_TD + y_TKD[:, k].float()
        y_TD = y_TD + self.shared_experts(x_TD)

        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        stats = RouterStats(
            counts=counts_E,
            mean_prob=probs_TE.mean(dim=0),
            topk_idx=topk_idx_TK.view(*lead, K),
            scores=scores_TE.view(*lead, E),
        )
        return y_TD.to(x.dtype).view(x.shape), stats

    def _experts_dense(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """The [T, K, D] slot outputs of `_experts_loop` without its host sync (a compiled forward,
        impl=torch): every expert runs on every token, unselected ones at weight 0, and each slot
        takes its expert's row. E times the expert FLOPs: meant for decode steps, where every
        expert's weights are read once anyway; a row's values are the loop's up to the GEMM's row
        blocking (rounding)."""
        T, K = weights_TK.shape
        y_TKD = x_TD.new_zeros(T, K, self.dim)
        for e, expert in enumerate(self.experts):
            hit_TK = topk_idx_TK == e
            w_T1 = (weights_TK * hit_TK).sum(-1, keepdim=True)  # a token picks an expert at most once
            y_TKD = torch.where(hit_TK[..., None], expert(x_TD, w_T1)[:, None, :], y_TKD)
        return y_TKD

    def _experts_loop(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, expert_N: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        """Reference path: group the N = T·K assignments by expert (stable, so each expert sees its
        tokens in order), run each expert on its rows, return the [T, K, D] slot outputs."""
        T, K = weights_TK.shape
        order_N = expert_N.argsort(stable=True)
        x_ND = x_TD.index_select(0, order_N // K)
        w_N1 = weights_TK.flatten().index_select(0, order_N).unsqueeze(-1)
        outs, start = [], 0
        for e, n in enumerate(counts_E.tolist()):  # one host sync per call
            if n:
                outs.append(self.experts[e](x_ND[start : start + n], w_N1[start : start + n]))
                start += n
        y_ND = torch.cat(outs, dim=0) if outs else x_ND.new_zeros(0, self.dim)
        # Back to (token, slot) order: a gather instead of index_add_, deterministic on GPU (no atomics).
        inverse_N = torch.empty_like(order_N)
        inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
        return y_ND.index_select(0, inverse_N).view(T, K, self.dim)


def sequence_balance_loss(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    n_experts: int,
    k: int,
    alpha: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise auxiliary balance loss, averaged over sequences.

    scores [B, S, E] unbiased affinities, topk_idx [B, S, K], mask [B, S] bool (True = real token).
    Per sequence with T real tokens:
        s'_{t,i} = s_{t,i} / Σ_j s_{t,j}
        f_i = E / (K·T) · Σ_t 1[i ∈ topk_t]          (no gradient)
        P_i = 1/T · Σ_t s'_{t,i}
        L   = alpha · Σ_i f_i · P_i
    Perfectly uniform routing gives L = alpha; concentrated routing gives up to alpha·E/K.
    """
    if scores.ndim == 2:  # a single sequence
        scores, topk_idx = scores.unsqueeze(0), topk_idx.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    B, S, E = scores.shape
    assert E == n_experts and topk_idx.size(-1) == k
    m_BS = torch.ones(B, S, dtype=torch.float32, device=scores.device) if mask is None else mask.float()
    n_tok_B = m_BS.sum(dim=1).clamp_min(1)
    probs_BSE = scores.float() / scores.float().sum(dim=-1, keepdim=True)
    P_BE = (probs_BSE * m_BS.unsqueeze(-1)).sum(dim=1) / n_tok_B.unsqueeze(-1)
    with torch.no_grad():
        hits_BSE = torch.zeros(B, S, E, device=scores.device).scatter_(-1, topk_idx, 1.0)
        f_BE = (hits_BSE * m_BS.unsqueeze(-1)).sum(dim=1) * (E / k) / n_tok_B.unsqueeze(-1)
    return alpha * (f_BE * P_BE).sum(dim=-1).mean()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): bias_i += rate · sign(mean_load − load_i), in place.

    Overloaded experts become less likely to be selected, underloaded ones more; routing weights
    are unaffected because they use the unbiased scores. `counts` [E] are the tokens per expert
    accumulated over the step (e.g. `RouterStats.counts`, summed over micro-batches and ranks).
    Returns `bias`.
    """
    load = counts.float().to(bias.device)
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
    return bias
