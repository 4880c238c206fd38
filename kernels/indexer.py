"""Triton lightning-indexer scores (spec §3.6-3.7), forward and backward, beside the torch reference.

  scores      score[b,s,g] = Σ_i relu(q[b,s,i]·k[b,g]) · w[b,s,i], -inf where not visible, computed
              per (query tile, group tile) with heads streamed through the dot, so the [B,S,I,G]
              fp32 tensor of `index_scores_ref` (model/indexer.py, re-exported) never exists.
              Optional epilogue: per-query maxima of contiguous blocks of groups (§3.7 level one).
  backward    recomputes the dots per tile: t = dscore·w·[dot > 0]; dq = t·k and dw = Σ_g dscore·relu(dot)
              per row tile of (query, head) rows; dk = tᵀ·q per group tile over row splits (fp32
              partials summed in torch: no atomics, deterministic).
  restricted  Reindex layers: only the groups of each query's kept candidate blocks (gathered keys).
Not here: pinning and top-k of the candidate blocks and the final top-k (model/indexer.py, torch).

Shape legend: B batch, S queries, I index heads, Di index head dim, G groups, NB blocks of groups,
C kept candidate blocks per query, N = C·block_size restricted groups per query; tiles: BS queries,
HB heads per dot, BG groups, BM (query, head) rows, BN restricted groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import dot_args, launch_opts, sm_count
from kernels.quant import cast_rne
from model.indexer import index_scores_ref

__all__ = [
    "index_scores",
    "index_scores_fwd",
    "index_scores_bwd",
    "index_scores_with_block_max",
    "index_scores_ref",
    "block_max_scores_ref",
    "index_scores_restricted",
    "index_scores_restricted_ref",
    "FWD_CONFIG",
    "BWD_CONFIG",
    "RESTRICTED_CONFIG",
]

# Tiles, the best of bench/indexer.py's sweep on one H200 (32 index heads, head dim 128, bf16):
# decode B 64 x G 8192 in 51 us (8.3x the torch reference; BG 128: 55 us), prefill S 4096 x G 1024
# causal in 59 us (23x; BS 64 BG 128 with 8 warps: 89 us). A forward program scores BS queries x BG
# groups; each dot takes HB heads of those queries as BS·HB rows (query-major), so decode (S = 1)
# fills the tensor cores' M side with heads instead of 15 padded queries, while prefill streams one
# head at a time against a BG-group key tile that stays resident.
FWD_CONFIG = {
    "decode": {"BS": 1, "HB": 64, "BG": 64, "num_warps": 4, "num_stages": 2},
    "prefill": {"BS": 64, "HB": 1, "BG": 64, "num_warps": 4, "num_stages": 3},
}
_DECODE_MAX_S = 16  # fewer queries than one 16-row dot tile: put heads on the M side
# dk programs per device SM: rows are split until about this many programs run (fp32 partials)
BWD_CONFIG = {"BM": 64, "BG": 64, "num_warps": 4, "num_stages": 2, "dk_programs_per_sm": 2}
RESTRICTED_CONFIG = {"HB": 64, "BN": 64, "num_warps": 4, "num_stages": 2}


def _dp(di: int) -> int:
    return max(16, triton.next_power_of_2(di))  # padded head dim: a power of 2, >= tl.dot's 16


def _vis_args(visible_BSG: torch.Tensor | None, shape: tuple[int, int, int], dev: torch.device):
    """(uint8 view, strides) of the mask; strides let an expanded mask in without a copy."""
    if visible_BSG is None:
        return torch.empty(1, dtype=torch.uint8, device=dev), (0, 0, 0)
    if visible_BSG.dtype != torch.bool or tuple(visible_BSG.shape) != shape:
        raise ValueError(f"visible must be bool {list(shape)}, got {visible_BSG.dtype} {list(visible_BSG.shape)}")
    if torch.compiler.is_compiling():
        # inductor cannot lower a bool->uint8 view ("torch.bool is not supported by torch.iinfo"): a
        # uint8 copy holds the same 0/1 bytes, read through its own strides
        vis = visible_BSG.to(torch.uint8)
        return vis, vis.stride()
    return visible_BSG.view(torch.uint8), visible_BSG.stride()


def _check(q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor) -> None:
    if q_BSID.dim() != 4 or k_BGD.dim() != 3 or w_BSI.dim() != 3:
        raise ValueError(f"need q [B,S,I,Di], k [B,G,Di], w [B,S,I]; got {q_BSID.shape}, {k_BGD.shape}, {w_BSI.shape}")
    B, S, I, Di = q_BSID.shape
    if k_BGD.shape[0] != B or k_BGD.shape[2] != Di or tuple(w_BSI.shape) != (B, S, I):
        raise ValueError(f"shape mismatch: q {list(q_BSID.shape)}, k {list(k_BGD.shape)}, w {list(w_BSI.shape)}")
    if q_BSID.dtype != k_BGD.dtype or q_BSID.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q and k must share a bf16/fp16/fp32 dtype, got {q_BSID.dtype} and {k_BGD.dtype}")
    if w_BSI.dtype != torch.float32:
        raise ValueError(f"w must be fp32 (it carries the weight scale), got {w_BSI.dtype}")
    if not (q_BSID.is_contiguous() and k_BGD.is_contiguous() and w_BSI.is_contiguous()):
        raise ValueError("q, k and w must be contiguous")


# ------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _rows(ptr, row, mask, DI: tl.constexpr, DP: tl.constexpr):
    """[len(row), DP] tile of rows `row` of a row-major [*, DI] tensor, zero where masked or past DI."""
    d_D = tl.arange(0, DP)
    return tl.load(ptr + row[:, None] * DI + d_D[None, :], mask=mask[:, None] & (d_D < DI)[None, :], other=0.0)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, w_ptr, vis_ptr, o_ptr, bmax_ptr,
    S, G, I, NB, svb, svs, svg,
    DI: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, HB: tl.constexpr, BG: tl.constexpr,
    BLOCK: tl.constexpr, HAS_VIS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (group tile, query tile, b). Row r of a dot is query r // HB, head h0 + r % HB; the
    head sum is then a reshape to [BS, HB, BG] and a sum over HB. A tile no query may see skips
    its dots. With BLOCK > 0 also writes max over each BLOCK consecutive groups into bmax [B,S,NB]."""
    b = tl.program_id(2).to(tl.int64)
    s_S = tl.program_id(1) * BS + tl.arange(0, BS)
    g_G = tl.program_id(0) * BG + tl.arange(0, BG)
    mask_S, mask_G = s_S < S, g_G < G
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    k_GD = _rows(k_ptr, b * G + g_G, mask_G, DI, DP).to(DT)
    mask_SG = mask_S[:, None] & mask_G[None, :]
    vis_SG = mask_SG
    if HAS_VIS:
        vis_offs = b * svb + s_S[:, None] * svs + g_G[None, :] * svg
        vis_SG = (tl.load(vis_ptr + vis_offs, mask=mask_SG, other=0) != 0) & mask_SG
    acc_SG = tl.zeros((BS, BG), tl.float32)
    if tl.max(vis_SG.to(tl.int32)) > 0:
        r_R = tl.arange(0, BS * HB)
        s_R = tl.program_id(1) * BS + r_R // HB
        for h0 in range(0, I, HB):
            i_R = h0 + r_R % HB
            mask_R = (s_R < S) & (i_R < I)
            row_R = (b * S + s_R) * I + i_R
            q_RD = _rows(q_ptr, row_R, mask_R, DI, DP)
            w_R = tl.load(w_ptr + row_R, mask=mask_R, other=0.0)
            dot_RG = tl.dot(q_RD.to(DT), tl.trans(k_GD), input_precision=DOT_PREC)
            p_RG = tl.maximum(dot_RG, 0.0) * w_R[:, None]  # ReLU per head before the weighted sum
            if HB == 1:
                acc_SG += p_RG
            else:
                acc_SG += tl.sum(tl.reshape(p_RG, (BS, HB, BG)), axis=1)
    score_SG = tl.where(vis_SG, acc_SG, float("-inf"))
    tl.store(o_ptr + (b * S + s_S)[:, None] * G + g_G[None, :], score_SG, mask=mask_SG)
    if BLOCK > 0:
        NBT: tl.constexpr = BG // BLOCK
        bmax_SN = tl.max(tl.reshape(score_SG, (BS, NBT, BLOCK)), axis=2)
        n_N = tl.program_id(0) * NBT + tl.arange(0, NBT)
        bmax_offs = (b * S + s_S)[:, None] * NB + n_N[None, :]
        tl.store(bmax_ptr + bmax_offs, bmax_SN, mask=mask_S[:, None] & (n_N < NB)[None, :])


@triton.jit
def _ds_tile(ds_ptr, vis_ptr, b, s_M, mask_M, g_G, mask_G, S, G, svb, svs, svg, HAS_VIS: tl.constexpr):
    """dscore [BM, BG] of rows whose queries are s_M, zero where not visible (masked_fill passes no
    gradient); the I rows of one query read the same [B,S,G] gradient row (cache hits)."""
    mask_MG = mask_M[:, None] & mask_G[None, :]
    ds_MG = tl.load(ds_ptr + (b * S + s_M)[:, None] * G + g_G[None, :], mask=mask_MG, other=0.0)
    if HAS_VIS:
        vis_MG = tl.load(vis_ptr + b * svb + s_M[:, None] * svs + g_G[None, :] * svg, mask=mask_MG, other=0)
        ds_MG = tl.where(vis_MG != 0, ds_MG, 0.0)
    return ds_MG


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, w_ptr, vis_ptr, ds_ptr, dq_ptr, dw_ptr,
    S, G, I, svb, svs, svg,
    DI: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr,
    HAS_VIS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (row tile, b) over all groups: dq = Σ_g t·k (t = dscore·w·[dot > 0], in q's dtype for
    the dot) and dw = Σ_g dscore·relu(dot) in fp32. Tiles whose dscore is all zero skip the dots."""
    b = tl.program_id(1).to(tl.int64)
    r_M = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_M = r_M < S * I
    d_D = tl.arange(0, DP)
    mask_D = d_D < DI
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    q_MD = _rows(q_ptr, b * S * I + r_M, mask_M, DI, DP).to(DT)
    w_M = tl.load(w_ptr + b * S * I + r_M, mask=mask_M, other=0.0)
    dq_MD = tl.zeros((BM, DP), tl.float32)
    dw_M = tl.zeros((BM,), tl.float32)
    for g0 in range(0, G, BG):
        g_G = g0 + tl.arange(0, BG)
        mask_G = g_G < G
        ds_MG = _ds_tile(ds_ptr, vis_ptr, b, r_M // I, mask_M, g_G, mask_G, S, G, svb, svs, svg, HAS_VIS)
        if tl.max((ds_MG != 0).to(tl.int32)) > 0:  # != 0 rather than abs > 0: a NaN still propagates
            k_GD = _rows(k_ptr, b * G + g_G, mask_G, DI, DP).to(DT)
            dot_MG = tl.dot(q_MD, tl.trans(k_GD), input_precision=DOT_PREC)
            dw_M += tl.sum(ds_MG * tl.maximum(dot_MG, 0.0), axis=1)
            t_MG = tl.where(dot_MG > 0, ds_MG * w_M[:, None], 0.0)
            dq_MD = tl.dot(t_MG.to(DT), k_GD, dq_MD, input_precision=DOT_PREC)
    dq_offs = (b * S * I + r_M)[:, None] * DI + d_D[None, :]
    tl.store(dq_ptr + dq_offs, cast_rne(dq_MD, dq_ptr.dtype.element_ty), mask=mask_M[:, None] & mask_D[None, :])
    tl.store(dw_ptr + b * S * I + r_M, dw_M, mask=mask_M)


@triton.jit
def _bwd_dk_kernel(
    q_ptr, k_ptr, w_ptr, vis_ptr, ds_ptr, dkp_ptr,
    S, G, I, B, rows_per_split, svb, svs, svg,
    DI: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr,
    HAS_VIS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (group tile, row split, b): dk partial [split, b, g] = Σ_rows tᵀ·q in fp32."""
    g_G = tl.program_id(0) * BG + tl.arange(0, BG)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    mask_G = g_G < G
    d_D = tl.arange(0, DP)
    mask_D = d_D < DI
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    k_GD = _rows(k_ptr, b * G + g_G, mask_G, DI, DP).to(DT)
    dk_GD = tl.zeros((BG, DP), tl.float32)
    r_lo = split * rows_per_split
    r_hi = tl.minimum(S * I, r_lo + rows_per_split)
    for r0 in range(r_lo, r_hi, BM):
        r_M = r0 + tl.arange(0, BM)
        mask_M = r_M < r_hi
        ds_MG = _ds_tile(ds_ptr, vis_ptr, b, r_M // I, mask_M, g_G, mask_G, S, G, svb, svs, svg, HAS_VIS)
        if tl.max((ds_MG != 0).to(tl.int32)) > 0:
            q_MD = _rows(q_ptr, b * S * I + r_M, mask_M, DI, DP).to(DT)
            w_M = tl.load(w_ptr + b * S * I + r_M, mask=mask_M, other=0.0)
            dot_MG = tl.dot(q_MD, tl.trans(k_GD), input_precision=DOT_PREC)
            t_MG = tl.where(dot_MG > 0, ds_MG * w_M[:, None], 0.0)
            dk_GD = tl.dot(tl.trans(t_MG.to(DT)), q_MD, dk_GD, input_precision=DOT_PREC)
    dk_offs = ((split * B + b) * G + g_G)[:, None] * DI + d_D[None, :]
    tl.store(dkp_ptr + dk_offs, dk_GD, mask=mask_G[:, None] & mask_D[None, :])


@triton.jit
def _restricted_kernel(
    q_ptr, k_ptr, w_ptr, bidx_ptr, vis_ptr, o_ptr, ids_ptr,
    S, G, I, C, svb, svs, svg,
    DI: tl.constexpr, DP: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr,
    HAS_VIS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (query row b·S + s, tile of its N = C·BLOCK candidate slots). Slot n is group
    block_idx[c]·BLOCK + j (c = n // BLOCK, j = n % BLOCK); its key row is gathered once and dotted
    with HB heads at a time (heads on the M side, as in decode)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    N = C * BLOCK
    n_N = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_N = n_N < N
    blk_N = tl.load(bidx_ptr + row * C + n_N // BLOCK, mask=mask_N, other=-1).to(tl.int64)
    g_N = blk_N * BLOCK + n_N % BLOCK
    valid_N = mask_N & (blk_N >= 0) & (g_N < G)
    if HAS_VIS:
        vis_N = tl.load(vis_ptr + b * svb + (row - b * S) * svs + g_N * svg, mask=valid_N, other=0)
        valid_N = valid_N & (vis_N != 0)
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    k_ND = _rows(k_ptr, b * G + tl.where(valid_N, g_N, 0), valid_N, DI, DP).to(DT)
    acc_N = tl.zeros((BN,), tl.float32)
    for h0 in range(0, I, HB):
        i_H = h0 + tl.arange(0, HB)
        mask_H = i_H < I
        q_HD = _rows(q_ptr, row * I + i_H, mask_H, DI, DP)
        w_H = tl.load(w_ptr + row * I + i_H, mask=mask_H, other=0.0)
        dot_HN = tl.dot(q_HD.to(DT), tl.trans(k_ND), input_precision=DOT_PREC)
        acc_N += tl.sum(tl.maximum(dot_HN, 0.0) * w_H[:, None], axis=0)
    tl.store(o_ptr + row * N + n_N, tl.where(valid_N, acc_N, float("-inf")), mask=mask_N)
    tl.store(ids_ptr + row * N + n_N, tl.where(valid_N, g_N, -1), mask=mask_N)


# ------------------------------------------------------------------------------------------------
# launchers


def _fwd_tiles(S: int, I: int, block_size: int, config: dict | None) -> dict:
    cfg = {**FWD_CONFIG["decode" if S < _DECODE_MAX_S else "prefill"], **(config or {})}
    hb = min(cfg["HB"], triton.next_power_of_2(max(I, 1)))
    bs = max(min(cfg["BS"], triton.next_power_of_2(max(S, 1))), 16 // hb)  # a dot needs >= 16 rows
    bg = max(cfg["BG"], block_size, 16)
    for name, v in (("HB", hb), ("BS", bs), ("BG", bg)):
        assert triton.next_power_of_2(v) == v, f"tile {name}={v} must be a power of 2"
    return {**cfg, "HB": hb, "BS": bs, "BG": bg}


def index_scores_fwd(
    q_BSID: torch.Tensor,
    k_BGD: torch.Tensor,
    w_BSI: torch.Tensor,
    visible_BSG: torch.Tensor | None = None,
    *,
    block_size: int = 0,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward only: (scores [B,S,G] fp32, block maxima [B,S,ceil(G/block_size)] fp32 or None).

    q [B,S,I,Di] and k [B,G,Di] bf16/fp16/fp32 of one dtype, w [B,S,I] fp32, all contiguous;
    visible bool [B,S,G] (any strides) or None. With `block_size` (a power of 2) > 0 the epilogue
    writes each query's max over groups [n·block_size, (n+1)·block_size): §3.7's block score for the
    contiguous layout (blocks by position; packed rows restart blocks per document and need the
    torch path)."""
    _check(q_BSID, k_BGD, w_BSI)
    B, S, I, Di = q_BSID.shape
    G = k_BGD.size(1)
    if block_size and triton.next_power_of_2(block_size) != block_size:
        raise ValueError(f"block_size={block_size} must be a power of 2")
    dev = q_BSID.device
    vis, (svb, svs, svg) = _vis_args(visible_BSG, (B, S, G), dev)
    score = torch.empty(B, S, G, dtype=torch.float32, device=dev)
    nb = -(-G // block_size) if block_size else 0
    bmax = torch.empty(B, S, nb, dtype=torch.float32, device=dev) if block_size else None
    if score.numel() == 0:
        return score, bmax
    cfg = _fwd_tiles(S, I, block_size, config)
    grid = (triton.cdiv(G, cfg["BG"]), triton.cdiv(S, cfg["BS"]), B)
    _fwd_kernel[grid](
        q_BSID, k_BGD, w_BSI, vis, score, bmax if bmax is not None else score,
        S, G, I, nb, svb, svs, svg,
        DI=Di, DP=_dp(Di), BS=cfg["BS"], HB=cfg["HB"], BG=cfg["BG"], BLOCK=block_size,
        HAS_VIS=visible_BSG is not None, **dot_args(q_BSID.dtype), **launch_opts(cfg),
    )  # fmt: skip
    return score, bmax


def index_scores_bwd(
    q_BSID: torch.Tensor,
    k_BGD: torch.Tensor,
    w_BSI: torch.Tensor,
    visible_BSG: torch.Tensor | None,
    d_score_BSG: torch.Tensor,
    *,
    need_dk: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dq, dk, dw) of `index_scores` given d_score [B,S,G]: dq/dk in q's/k's dtype, dw fp32.
    Invisible entries pass no gradient. `config` may fix "dk_splits" (row splits of the dk pass)."""
    _check(q_BSID, k_BGD, w_BSI)
    cfg = {**BWD_CONFIG, **(config or {})}
    B, S, I, Di = q_BSID.shape
    G, R = k_BGD.size(1), S * I
    dev = q_BSID.device
    ds = d_score_BSG.float().contiguous()
    vis, (svb, svs, svg) = _vis_args(visible_BSG, (B, S, G), dev)
    if B * R * G == 0:
        dk = torch.zeros_like(k_BGD) if need_dk else None
        return torch.zeros_like(q_BSID), dk, torch.zeros_like(w_BSI)
    common = {"DI": Di, "DP": _dp(Di), "BM": cfg["BM"], "BG": cfg["BG"], "HAS_VIS": visible_BSG is not None}
    common |= dot_args(q_BSID.dtype) | launch_opts(cfg)
    dq, dw = torch.empty_like(q_BSID), torch.empty_like(w_BSI)
    n_rows = triton.cdiv(R, cfg["BM"])
    _bwd_dq_kernel[(n_rows, B)](q_BSID, k_BGD, w_BSI, vis, ds, dq, dw, S, G, I, svb, svs, svg, **common)
    if not need_dk:
        return dq, None, dw
    n_g = triton.cdiv(G, cfg["BG"])
    splits = cfg.get("dk_splits")
    if splits is None:  # enough programs to fill the device; few when the group tiles already do
        splits = sm_count(dev) * cfg["dk_programs_per_sm"] // (n_g * B)
    tiles_per_split = triton.cdiv(n_rows, max(1, min(int(splits), n_rows)))
    splits = triton.cdiv(n_rows, tiles_per_split)
    dkp = torch.empty(splits, B, G, Di, dtype=torch.float32, device=dev)
    _bwd_dk_kernel[(n_g, splits, B)](
        q_BSID, k_BGD, w_BSI, vis, ds, dkp, S, G, I, B, tiles_per_split * cfg["BM"], svb, svs, svg, **common
    )
    return dq, (dkp[0] if splits == 1 else dkp.sum(0)).to(k_BGD.dtype), dw


class _IndexScores(torch.autograd.Function):
    """Triton forward and backward; the block maxima (candidate selection) carry no gradient."""

    @staticmethod
    def forward(ctx, q, k, w, visible, block_size):
        score, bmax = index_scores_fwd(q, k, w, visible, block_size=block_size)
        ctx.save_for_backward(q, k, w, visible)
        bmax = score.new_empty(0) if bmax is None else bmax
        ctx.mark_non_differentiable(bmax)
        return score, bmax

    @staticmethod
    def backward(ctx, g_score, g_bmax):
        q, k, w, visible = ctx.saved_tensors
        dq, dk, dw = index_scores_bwd(q, k, w, visible, g_score, need_dk=ctx.needs_input_grad[1])
        return dq, dk, dw, None, None


def _scores(q_BSID, k_BGD, w_BSI, visible_BSG, block_size):
    args = (q_BSID.contiguous(), k_BGD.contiguous(), w_BSI.float().contiguous(), visible_BSG)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:3]):
        return _IndexScores.apply(*args, block_size)
    return index_scores_fwd(*args, block_size=block_size)


def index_scores(
    q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor, visible_BSG: torch.Tensor | None = None
) -> torch.Tensor:
    """Drop-in for `index_scores_ref` (same signature and contract), Triton forward and backward."""
    return _scores(q_BSID, k_BGD, w_BSI, visible_BSG, 0)[0]


def index_scores_with_block_max(
    q_BSID: torch.Tensor,
    k_BGD: torch.Tensor,
    w_BSI: torch.Tensor,
    visible_BSG: torch.Tensor | None,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`index_scores` plus its block maxima [B,S,NB] (no gradient) for contiguous blocks of
    `block_size` groups: feed them with the pinned block (newest // block_size) to
    `model.indexer.top_candidate_blocks`; equals `select_candidate_blocks` with block_id = g // bs."""
    score, bmax = _scores(q_BSID, k_BGD, w_BSI, visible_BSG, block_size)
    return score, bmax


def block_max_scores_ref(score_BSG: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max over contiguous blocks of `block_size` groups -> [B,S,ceil(G/block_size)] (-inf padded)."""
    G = score_BSG.size(-1)
    padded = torch.nn.functional.pad(score_BSG, (0, -G % block_size), value=-torch.inf)
    return padded.unflatten(-1, (-1, block_size)).amax(-1)


# ------------------------------------------------------------------------------------------------
# restricted scores (Reindex layers): only the kept candidate blocks' groups


def index_scores_restricted(
    q_BSID: torch.Tensor,
    k_BGD: torch.Tensor,
    w_BSI: torch.Tensor,
    block_idx_BSC: torch.Tensor,
    block_size: int,
    visible_BSG: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the groups of each query's candidate blocks, no [B,S,G] score matrix.

    block_idx [B,S,C] int (-1 = none; `model.indexer.top_candidate_blocks` gives them ascending)
    -> (scores [B,S,C·block_size] fp32, group ids [B,S,C·block_size] int64): slot c·bs + j is group
    block_idx[c]·bs + j; -inf / -1 where the block is -1, the group is past G or not visible. With
    ascending blocks, `topk_indices` over these scores keeps the dense path's newer-wins tie rule.
    Forward only (no autograd): a training Reindex layer keeps the dense, differentiable scores."""
    _check(q_BSID, k_BGD, w_BSI)
    B, S, I, Di = q_BSID.shape
    G, C = k_BGD.size(1), block_idx_BSC.size(-1)
    if block_idx_BSC.shape != (B, S, C) or block_idx_BSC.is_floating_point():
        raise ValueError(f"block_idx must be int [B,S,C], got {block_idx_BSC.dtype} {list(block_idx_BSC.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    dev = q_BSID.device
    bidx = block_idx_BSC.contiguous()
    vis, (svb, svs, svg) = _vis_args(visible_BSG, (B, S, G), dev)
    N = C * block_size
    score = torch.empty(B, S, N, dtype=torch.float32, device=dev)
    ids = torch.empty(B, S, N, dtype=torch.long, device=dev)
    if score.numel() == 0:
        return score, ids
    cfg = {**RESTRICTED_CONFIG, **(config or {})}
    hb = max(16, min(cfg["HB"], triton.next_power_of_2(I)))
    bn = max(16, min(cfg["BN"], triton.next_power_of_2(N)))
    _restricted_kernel[(B * S, triton.cdiv(N, bn))](
        q_BSID, k_BGD, w_BSI, bidx, vis, score, ids, S, G, I, C, svb, svs, svg,
        DI=Di, DP=_dp(Di), HB=hb, BN=bn, BLOCK=block_size,
        HAS_VIS=visible_BSG is not None, **dot_args(q_BSID.dtype), **launch_opts(cfg),
    )  # fmt: skip
    return score, ids


def index_scores_restricted_ref(
    q_BSID: torch.Tensor,
    k_BGD: torch.Tensor,
    w_BSI: torch.Tensor,
    block_idx_BSC: torch.Tensor,
    block_size: int,
    visible_BSG: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `index_scores_restricted` (gathers [B,S,N,Di] keys)."""
    B, S, C = block_idx_BSC.shape
    G = k_BGD.size(1)
    j = torch.arange(block_size, device=k_BGD.device)
    g_BSN = (block_idx_BSC.long()[..., None] * block_size + j).flatten(2)
    valid_BSN = (block_idx_BSC[..., None] >= 0).expand(B, S, C, block_size).flatten(2) & (g_BSN < G)
    if G == 0:
        return torch.full(g_BSN.shape, -torch.inf, device=k_BGD.device), torch.full_like(g_BSN, -1)
    g_safe = torch.where(valid_BSN, g_BSN, 0)
    if visible_BSG is not None:
        valid_BSN &= visible_BSG.gather(-1, g_safe)
    k_BSND = k_BGD[torch.arange(B, device=k_BGD.device)[:, None, None], g_safe]
    dots_BSIN = torch.einsum("bsid,bsnd->bsin", q_BSID.float(), k_BSND.float())
    score_BSN = torch.einsum("bsin,bsi->bsn", dots_BSIN.relu(), w_BSI).masked_fill(~valid_BSN, -torch.inf)
    return score_BSN, torch.where(valid_BSN, g_BSN, -1)
