"""The default byte-level BPE: special-token ids, lossless text, no injection, reproducible training,
and loading of arbitrary HF tokenizer.json files."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from model.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    SPECIAL_TOKENS,
    TEXT,
    Tokenizer,
    default_special_token_list,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "tokenizer" / "train_tokenizer.py"


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tokenizer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


def test_special_token_ids_are_reserved_at_the_start(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.vocab_size == len(tok) == 4096
    for i, text in enumerate(default_special_token_list()):
        assert tok.token_to_id(text) == i
    for i, name in enumerate(SPECIAL_TOKENS):
        assert getattr(tok, f"{name}_id") == i
    # ordinary tokens start after the 32 reserved ids, with all 256 bytes present
    assert tok.backend.get_vocab_size(with_added_tokens=False) == 4096
    assert len(set(default_special_token_list())) == 32


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1\n",
        "naïve café — 世界 🙂 \t\r\n tabs",
        "",
        "   leading and trailing   ",
        "\x00\x01 control bytes \x7f",
    ],
)
def test_encode_decode_is_lossless(tok, text):
    ids = tok.encode(text)
    assert all(i >= 32 for i in ids)  # no special token comes out of plain text
    assert tok.decode(ids) == text


def test_bpe_compresses_python(tok):
    code = Path(os.__file__).read_text()[:20000]
    assert len(tok.encode(code)) < len(code.encode()) / 2.5


def test_special_strings_in_text_stay_text_unless_allowed(tok):
    text = "<|end|> and <tool_call>{}</tool_call> <think>"
    ids = tok.encode(text)
    assert not set(ids) & set(range(32))
    assert tok.decode(ids) == text
    allowed = tok.encode(text, allowed_special={"<tool_call>", "</tool_call>"})
    assert [i for i in allowed if i < 32] == [tok.tool_call_id, tok.tool_call_end_id]
    assert tok.decode(allowed) == text
    with pytest.raises(ValueError):
        tok.encode("x<nope>", allowed_special={"<nope>"})


def test_image_span_and_token_types(tok):
    ids, types = tok.image_span(2, 3)
    assert len(ids) == 2 * (3 + 1) + 2
    assert types == [IMAGE_START, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE] * 1 + [IMAGE] * 3 + [
        IMAGE_NEW_LINE,
        IMAGE_END,
    ]
    assert tok.token_types([5, *ids, 300]) == [TEXT, *types, TEXT]


def test_committed_tokenizer_equals_a_fresh_training_run():
    mod = _train_module()
    meta = json.loads(DEFAULT_TOKENIZER_PATH.with_name("tokenizer.meta.json").read_text())
    names, texts = mod.stdlib_corpus()
    if mod.corpus_sha256(names, texts) != meta["corpus_sha256"]:
        pytest.skip(f"this Python's stdlib is not the training corpus (trained on Python {meta['python']})")
    t0 = time.perf_counter()
    fresh = mod.train_tokenizer(texts, meta["vocab_size"])
    assert time.perf_counter() - t0 < 30
    committed = Backend.from_file(str(DEFAULT_TOKENIZER_PATH))
    assert json.loads(fresh.to_str()) == json.loads(committed.to_str())


def test_training_is_deterministic_across_processes_and_threads(tmp_path):
    """The CLI in a single-threaded subprocess equals an in-process run (all threads)."""
    mod = _train_module()
    _, texts = mod.stdlib_corpus()
    in_process = mod.train_tokenizer(texts, 600)
    out = tmp_path / "tok.json"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    subprocess.run(
        [sys.executable, "-m", "infra.tokenizer.train_tokenizer", "--vocab-size", "600", "--out", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    assert json.loads(out.read_text()) == json.loads(in_process.to_str())
    meta = json.loads((tmp_path / "tok.meta.json").read_text())
    assert meta["vocab_size"] == 600 and meta["corpus_files"] == len(texts)


def test_loads_any_hf_tokenizer_json(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))

    plain = Tokenizer.from_file(path)
    assert plain.vocab_size == 5
    assert plain.bos_id is None and plain.end_id is None  # our names are absent there
    assert plain.encode("hello world") == [2, 3]
    assert plain.decode([2, 3]) == "hello world"

    mapped = Tokenizer.from_file(path, special_tokens={"bos": "<s>", "eos": "</s>"})
    assert (mapped.bos_id, mapped.eos_id) == (0, 1)
    with pytest.raises(ValueError, match="unknown special token names"):
        Tokenizer.from_file(path, special_tokens={"begin": "<s>"})
