"""Train the committed default tokenizer: a byte-level BPE over the Python standard library.

    python -m infra.tokenizer.train_tokenizer                 # rewrites model/assets/tokenizer.json
    python -m infra.tokenizer.train_tokenizer --vocab-size 512 --out /tmp/tok.json

The corpus ships on every machine (the top-level `*.py` files of `sysconfig.get_paths()["stdlib"]`,
read in sorted order), so training needs no download; the result is deterministic for a given
corpus and `tokenizers` version (checked by tests/model/test_tokenizer.py). The stdlib differs
between Python versions, so a sidecar `tokenizer.meta.json` records the corpus hash it came from.
This script only trains; loading and special-token ids are model/tokenizer.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
import time
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.tokenizer import DEFAULT_TOKENIZER_PATH, DEFAULT_VOCAB_SIZE, default_special_token_list


def stdlib_corpus() -> tuple[list[str], list[str]]:
    """(relative file names, texts) of the top-level stdlib modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    return [p.name for p in files], [p.read_text(encoding="utf-8") for p in files]


def corpus_sha256(names: list[str], texts: list[str]) -> str:
    h = hashlib.sha256()
    for name, text in zip(names, texts, strict=True):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer regex, no normalizer) with the special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=default_special_token_list(),
        # all 256 bytes are in the base vocabulary, so any text encodes without an unknown token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_PATH)
    args = parser.parse_args()

    names, texts = stdlib_corpus()
    t0 = time.perf_counter()
    tok = train_tokenizer(texts, args.vocab_size)
    seconds = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    meta = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "corpus": "top-level *.py of sysconfig.get_paths()['stdlib'], sorted by name",
        "corpus_files": len(names),
        "corpus_bytes": sum(len(t.encode()) for t in texts),
        "corpus_sha256": corpus_sha256(names, texts),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "command": "python -m infra.tokenizer.train_tokenizer"
        + ("" if args.vocab_size == DEFAULT_VOCAB_SIZE else f" --vocab-size {args.vocab_size}"),
    }
    args.out.with_name(args.out.stem + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({**meta, "seconds": round(seconds, 2), "out": str(args.out)}))


if __name__ == "__main__":
    main()
