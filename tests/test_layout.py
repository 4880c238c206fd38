"""The generic top-level packages resolve to this repository and respect the import rules."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["model", "kernels", "envs", "synth", "rl"])
def test_package_resolves_to_this_repo(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == ROOT / name


def _python_sources(pkg: str):
    return [p for p in (ROOT / pkg).rglob("*.py") if "fixtures" not in p.parts]


def test_model_is_framework_free():
    banned = re.compile(r"^\s*(import|from)\s+(ray|hydra|omegaconf|deepspeed|envs|rl|synth)\b|torch\.distributed")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _python_sources("model")
        if p.name != "parallelize.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert not offenders, f"model/ must stay single-device torch: {offenders}"


def test_envs_imports_neither_torch_nor_rl():
    banned = re.compile(r"^\s*(import|from)\s+(torch|rl|model|kernels)\b")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _python_sources("envs")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert not offenders, f"envs/ must not import torch or trainer code: {offenders}"
