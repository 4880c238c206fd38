"""Safetensors checkpoints under the official V4.1 tensor names, and the HF→official rename.

Module paths are the official names (`embed.weight`, `layers.{i}.attn.wkv.weight`,
`layers.{i}.ffn.experts.{j}.w1.weight`, `mtp.{k}.main_proj.weight`, `head.weight`), so a state
dict is saved as is. Writes are atomic (temp file + os.replace). Official FP8/FP4 weights with
their block `.scale` are dequantised on load into bf16/fp32 parameters; a quantised tensor
without a scale is refused, never silently cast. No sharding across ranks here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from model.config import ModelArgs
from model.quant import e2m1_byte_values

ALIASES_KEY = "flashpost_aliases"
CONFIG_KEY = "flashpost_config"
# Low-precision storage formats whose values mean nothing without their block `.scale`.
_QUANTISED = {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")
    if hasattr(torch, n)
}
# The drafter's embedding and head ARE the backbone's (the reference ties them by module
# assignment, so its state_dict lists each twice); convert.py drops the copies.
_HF_DROP = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_HF_COMPONENTS = {
    "self_attn": "attn",
    "mlp": "ffn",
    "e_score_correction_bias": "bias",
    "weight_scale_inv": "scale",
}


def convert_hf_name(name: str) -> str | None:
    """convert.py's rename of one HF tensor name (model_reference §3.16); None means dropped."""
    if name.startswith("model."):
        name = name[len("model.") :]
    parts = name.split(".")
    in_vision = parts[0] == "vision"  # the ViT keeps its own `mlp`
    parts = [p if (in_vision and p == "mlp") else _HF_COMPONENTS.get(p, p) for p in parts]
    name = ".".join(parts)
    return None if _HF_DROP.match(name) else name


def convert_hf_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an HF-named state dict to official names, dropping `mtp.*.embed/head.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        new = convert_hf_name(name)
        if new is None:
            continue
        if new in out:
            raise ValueError(f"HF names collide after conversion: {name!r} -> {new!r}")
        out[new] = tensor
    return out


def _looks_hf(names: Iterable[str]) -> bool:
    return any(n.startswith("model.") or ".self_attn." in n or n.endswith("weight_scale_inv") for n in names)


# -------------------------------------------------------------------- save
def _dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop exact aliases (tied weights such as a drafter's shared embed) and clone partial overlaps.

    safetensors refuses tensors that share memory; the aliases are recorded so loading fills them.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in state.items():
        t = t.detach()
        if t.device.type == "meta":
            raise ValueError(f"cannot save {name!r}: it is on the meta device (no data)")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        ptr = t.untyped_storage().data_ptr()
        t = t.cpu().contiguous()
        if t.numel() and ptr in storages:
            t = t.clone()  # overlapping view of another tensor: store its own copy
        storages.add(ptr)
        tensors[name] = t
    return tensors, aliases


def save_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    args: ModelArgs | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write one `.safetensors` file atomically; `args` is stored in the header for `read_config`."""
    state = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, nn.Module)
        else model_or_state_dict
    )
    tensors, aliases = _dedupe(state)
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases)
    if args is not None:
        meta[CONFIG_KEY] = json.dumps(args.to_dict())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # readers see the old file or the complete new one, never a torn one
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -------------------------------------------------------------------- dequantisation
def _block(size: int, n_scales: int, what: str) -> int:
    for b in (1, 16, 32, 64, 128):  # the smallest block consistent with the scale grid
        if -(-size // b) == n_scales:
            return b
    raise ValueError(f"{what}: cannot infer a block size for {size} elements and {n_scales} scales")


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """fp32 value of an official quantised 2-D weight and its UE8M0/fp32 block scale.

    FP8 e4m3 [O, I] with scales [O/bo, I/bi] (32x32 blocks for Linears, 128x128 for some `wo_a`,
    1x32 for Engram tables); FP4 E2M1 packed two per byte [O, I/2] (low nibble = even element)
    with scales [O, I/32]. Block sizes are read off the shapes.
    """
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = weight.float()
    elif weight.dtype in (torch.uint8, torch.int8) or weight.dtype in _QUANTISED:
        values = e2m1_byte_values(weight)  # packed FP4
    else:
        raise ValueError(f"{name}: {weight.dtype} is not a quantised weight format")
    if values.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"{name}: expected 2-D weight and scale, got {list(values.shape)} and {list(scale.shape)}"
        )
    bo = _block(values.size(0), scale.size(0), name)
    bi = _block(values.size(1), scale.size(1), name)
    grid = (
        scale.float().repeat_interleave(bo, 0)[: values.size(0)].repeat_interleave(bi, 1)[:, : values.size(1)]
    )
    return values * grid


def _grid_fits(shape: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    """Whether a scale of shape `grid` tiles a weight of `shape` with one of `_block`'s block sizes."""
    if len(shape) != 2 or len(grid) != 2:
        return False
    return all(any(-(-n // b) == g for b in (1, 16, 32, 64, 128)) for n, g in zip(shape, grid, strict=True))


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


# -------------------------------------------------------------------- load
@dataclass(kw_only=True)
class LoadReport:
    """What a non-strict load skipped; a strict load that returns has both lists empty."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]


def _files(path: str | os.PathLike) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        return files
    if not path.exists():
        raise FileNotFoundError(path)
    return [path]


def _header(files: list[Path]) -> tuple[dict[str, tuple[Path, str]], dict[str, str], dict[str, str]]:
    """name -> (file, stored name); aliases; metadata of the first file."""
    index: dict[str, tuple[Path, str]] = {}
    aliases: dict[str, str] = {}
    first_meta: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata() or {}
            first_meta = first_meta or meta
            aliases.update(json.loads(meta.get(ALIASES_KEY, "{}")))
            for name in fh.keys():
                if name in index:
                    raise ValueError(f"tensor {name!r} appears in both {index[name][0]} and {f}")
                index[name] = (f, name)
    if _looks_hf(index):
        converted = {}
        for name, loc in index.items():
            new = convert_hf_name(name)
            if new is not None:
                converted[new] = loc
        index = converted
    return index, aliases, first_meta


def read_config(path: str | os.PathLike) -> ModelArgs | None:
    """The ModelArgs stored by `save_checkpoint(..., args=...)`, or None."""
    _, _, meta = _header(_files(path))
    return ModelArgs.from_config_json(json.loads(meta[CONFIG_KEY])) if CONFIG_KEY in meta else None


def _listing(title: str, items: list[str], limit: int = 20) -> str:
    shown = "\n    ".join(items[:limit])
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n    {shown}{more}"


def _tied_copies(
    index: Mapping[str, tuple[Path, str]], targets: Mapping[str, torch.Tensor], reader: _Reader
) -> tuple[dict[str, str], list[str]]:
    """The drafter's copies `mtp.{k}.embed.weight` / `mtp.{k}.head.weight` of a reference state_dict
    that the model shares instead of holding: {copy: backbone name}, and the copies that are not
    bit-equal to the backbone tensor (a checkpoint whose drafter is not tied cannot load into it)."""
    shared, problems = {}, []
    for name in sorted(index):
        if name in targets or not _HF_DROP.match(name):
            continue
        canonical = name.split(".", 2)[2]  # mtp.{k}.embed.weight -> embed.weight
        if canonical not in index:
            problems.append(f"{name}: its backbone tensor {canonical} is not in the checkpoint")
            continue
        copy, base = reader.tensor(*index[name]), reader.tensor(*index[canonical])
        if copy.shape != base.shape or not torch.equal(copy.float(), base.float()):
            diff = (copy.float() - base.float()).abs().max().item() if copy.shape == base.shape else "shape"
            problems.append(f"{name}: differs from {canonical} (max |diff| {diff}); the drafter shares it")
            continue
        shared[name] = canonical
    return shared, problems


def _tied_names(targets: Mapping[str, torch.Tensor]) -> set[str]:
    """Names whose memory is another (earlier) name's: they get filled through it."""
    owner: set[tuple] = set()
    tied: set[str] = set()
    for name, t in targets.items():
        if t.device.type == "meta":
            raise ValueError(
                f"cannot load into {name!r}: it is on the meta device; build the model on a real device"
            )
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if t.numel() and key in owner:
            tied.add(name)
        owner.add(key)
    return tied


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadReport:
    """Copy tensors from a file or a directory of `.safetensors` into `model` in place.

    HF names are recognised and converted. A reference `state_dict()` loads as saved: its drafter
    copies `mtp.{k}.embed.weight` / `mtp.{k}.head.weight` are checked bit-equal to `embed.weight` /
    `head.weight` and then shared, as the model holds them once. Missing and unexpected tensors raise when `strict`;
    shape mismatches always raise. A quantised (FP8/FP4) tensor aimed at a bf16/fp32 parameter is
    dequantised with its `.scale` from the checkpoint, and raises if there is none. Other tensors
    are cast to the parameter's dtype (bit-exact when the dtypes agree).
    """
    index, aliases, _ = _header(_files(path))
    targets = model.state_dict(keep_vars=True)
    tied = _tied_names(targets)
    missing = sorted(n for n in targets if n not in index and n not in tied and aliases.get(n) not in index)
    mismatched, quantised = [], []
    dequant: dict[str, str] = {}  # weight name -> its scale's name, for quantised weights
    with _Reader() as reader:
        for name in sorted(set(index) & set(targets)):
            target, dtype = targets[name], reader.dtype(*index[name])
            shape = reader.shape(*index[name])
            packed = dtype in (torch.uint8, torch.int8) or dtype == getattr(torch, "float4_e2m1fn_x2", None)
            quant = (dtype in _QUANTISED or packed) and target.dtype != dtype and target.is_floating_point()
            scale = _scale_name(name)
            if quant and scale in index and scale not in targets:
                dequant[name] = scale
                # raw bytes hold two FP4 values each; safetensors' F4 header already counts values
                if dtype in (torch.uint8, torch.int8):
                    shape = (*shape[:-1], shape[-1] * 2)
                grid = reader.shape(*index[scale])
                if not _grid_fits(shape, grid):
                    mismatched.append(f"{scale}: {list(grid)} is no block grid of {name} {list(shape)}")
            elif quant:
                quantised.append(f"{name}: {dtype} into {target.dtype} and no {scale} in the checkpoint")
            if shape != tuple(target.shape):
                mismatched.append(f"{name}: checkpoint {list(shape)} vs model {list(target.shape)}")
        shared, untied_copies = _tied_copies(index, targets, reader)
        unexpected = sorted(
            n for n in index if n not in targets and n not in dequant.values() and n not in shared
        )
        problems = []
        if strict and missing:
            problems.append(_listing("missing from checkpoint", missing))
        if strict and unexpected:
            problems.append(_listing("unexpected in checkpoint", unexpected))
        if mismatched:
            problems.append(_listing("shape mismatch", mismatched))
        if quantised:
            problems.append(_listing("quantised tensors without a scale", quantised))
        if untied_copies:
            problems.append(_listing("drafter copies that are not the backbone's", untied_copies))
        if problems:
            raise ValueError(f"cannot load {path} into {type(model).__name__}:\n" + "\n".join(problems))
        loaded = sorted(set(index) & set(targets))
        # saved from a tied model, loaded into an untied one: fill the alias from its canonical tensor
        untied = {
            n: aliases[n] for n in targets if n not in index and n not in tied and aliases.get(n) in index
        }
        with torch.no_grad():
            for name in loaded:
                value = reader.tensor(*index[name])
                if name in dequant:
                    value = dequantize_weight(value, reader.tensor(*index[dequant[name]]), name)
                targets[name].copy_(value)
            for name, canonical in untied.items():
                targets[name].copy_(reader.tensor(*index[canonical]))
    return LoadReport(loaded=loaded, missing=missing, unexpected=unexpected)


class _Reader:
    """Keeps each shard open once while tensors are read lazily (memory-mapped)."""

    def __init__(self) -> None:
        self._open: dict[Path, object] = {}
        self._slices: dict[tuple[Path, str], object] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fh in self._open.values():
            fh.__exit__(None, None, None)

    def _fh(self, f: Path):
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt").__enter__()
        return self._open[f]

    def _slice(self, f: Path, name: str):
        if (f, name) not in self._slices:
            self._slices[(f, name)] = self._fh(f).get_slice(name)
        return self._slices[(f, name)]

    def shape(self, f: Path, name: str) -> tuple[int, ...]:
        return tuple(self._slice(f, name).get_shape())

    def dtype(self, f: Path, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES.get(self._slice(f, name).get_dtype(), torch.float32)

    def tensor(self, f: Path, name: str) -> torch.Tensor:
        return self._fh(f).get_tensor(name)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **{k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                                         ("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2"))
       if hasattr(torch, v)},
}  # fmt: skip


def iter_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) pairs of a checkpoint file or directory, HF names converted."""
    index, _, _ = _header(_files(path))
    with _Reader() as reader:
        for name, loc in index.items():
            yield name, reader.tensor(*loc)
