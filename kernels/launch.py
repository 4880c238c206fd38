"""Launch-time rules the Triton kernels share: whether the interpreter runs them, the dot precision
their fp32 operands take, the launch options of a tile config, and the device's SM count.

Not here: any kernel or tile config (each kernel file keeps its own).
"""

from __future__ import annotations

import os

import torch

_SMS: dict[torch.device, int] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_args(dtype: torch.dtype) -> dict:
    """fp32 dot operands (F32_DOT) under the interpreter, whose 16-bit tl.dot is unreliable, and for
    fp32 inputs. fp32 inputs take TF32 tensor-core dots when torch's fp32 matmuls do
    (`torch.backends.cuda.matmul.allow_tf32`, as the demo sets on a GPU), else full-precision FMA
    dots ("ieee"): the references' precision either way. With ieee dots the fp32 demo of `small`
    trained slower with impl=triton than with torch (407 against 564 tokens/s)."""
    f32 = interpreting() or dtype == torch.float32
    ieee = interpreting() or (f32 and not torch.backends.cuda.matmul.allow_tf32)
    return {"F32_DOT": f32, "DOT_PREC": "ieee" if ieee else "tf32"}


def launch_opts(cfg: dict) -> dict:
    """num_warps / num_stages of a tile config; none under the interpreter, which takes neither."""
    return {} if interpreting() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere (the interpreter), so that
    CPU tests of launchers that size their grids by it take their multi-program paths too."""
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
