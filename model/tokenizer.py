"""Tokenizer: any HF `tokenizer.json` (via the `tokenizers` library) plus flashpost's special tokens.

The committed default (`model/assets/tokenizer.json`) is a 4096-entry byte-level BPE for the tiny
demo, trained by `infra/tokenizer/train_tokenizer.py`; its 32 special tokens hold ids 0..31
(bos 0 / eos 1 / pad 2 as the released fixtures). Plain-text encoding never produces a special
token unless the caller allows it by name, so user or tool text cannot inject control tokens.
Chat rendering and loss masks are in `model/chat_template.py`, not here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Backend

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 4096
N_RESERVED_SPECIAL = 32

# Attribute name -> token string, in id order for the default tokenizer. Image delimiters get their
# own ids (the reference writes `image_token_id` at every span position and carries the structure
# in token_types); the model never reads ids inside a span (embeddings are overwritten, Engram is
# masked), so distinct ids change no forward, and token types become recoverable from ids alone.
SPECIAL_TOKENS: dict[str, str] = {
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "pad": "<|pad|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
    "end": "<|end|>",
    "think": "<think>",
    "think_end": "</think>",
    "tool_call": "<tool_call>",
    "tool_call_end": "</tool_call>",
    "tool_result": "<tool_result>",
    "tool_result_end": "</tool_result>",
    "image_start": "<|image_start|>",
    "image": "<|image|>",
    "image_newline": "<|image_newline|>",
    "image_end": "<|image_end|>",
    # filler for the DSpark draft slots (the release uses a reserved id, dspark_noise_token_id)
    "noise": "<|noise|>",
}


def default_special_token_list() -> list[str]:
    """The N_RESERVED_SPECIAL special strings of the default tokenizer in id order; unnamed slots
    are `<|reserved_{id}|>` so later additions do not shift any id."""
    names = list(SPECIAL_TOKENS.values())
    return names + [f"<|reserved_{i}|>" for i in range(len(names), N_RESERVED_SPECIAL)]


# token_types of spec §3.1/§3.15 (same values as the reference's image_processor constants)
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


class Tokenizer:
    """A `tokenizers.Tokenizer` with named special-token ids.

    `<name>_id` attributes (`bos_id`, `end_id`, `tool_call_id`, ...) exist for every key of
    SPECIAL_TOKENS; they are None when the loaded vocabulary lacks that token. `special_tokens`
    overrides the strings (e.g. `{"bos": "<｜begin▁of▁sentence｜>"}` for the released tokenizer).
    """

    def __init__(self, backend: _Backend, special_tokens: Mapping[str, str] | None = None):
        unknown = sorted(set(special_tokens or {}) - set(SPECIAL_TOKENS))
        if unknown:
            raise ValueError(f"unknown special token names {unknown}; known: {sorted(SPECIAL_TOKENS)}")
        self.backend = backend
        # Special strings are tokenized as ordinary text by encode(); `allowed_special` opts back in.
        self.backend.encode_special_tokens = True
        self.special_tokens = {**SPECIAL_TOKENS, **(special_tokens or {})}
        for name, text in self.special_tokens.items():
            setattr(self, f"{name}_id", backend.token_to_id(text))
        self._image_types = {
            self.image_start_id: IMAGE_START,
            self.image_id: IMAGE,
            self.image_newline_id: IMAGE_NEW_LINE,
            self.image_end_id: IMAGE_END,
        }
        self._image_types.pop(None, None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_file(cls, path: str | os.PathLike, special_tokens: Mapping[str, str] | None = None) -> Tokenizer:
        """Load any HF `tokenizer.json`."""
        return cls(_Backend.from_file(str(path)), special_tokens)

    @classmethod
    def default(cls) -> Tokenizer:
        """The committed 4096-entry byte-level BPE of the demo (no download)."""
        return cls.from_file(DEFAULT_TOKENIZER_PATH)

    # ------------------------------------------------------------------ sizes, HF-compatible views
    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included (HF `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def backend_tokenizer(self) -> _Backend:
        """The raw Rust tokenizer, under the name HF's fast tokenizers give it (used by Engram)."""
        return self.backend

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, allowed_special: Collection[str] = ()) -> list[int]:
        """Token ids of `text`, no bos/eos added.

        Special-token strings in `text` are plain text unless listed in `allowed_special` (token
        strings, e.g. `{"<tool_call>", "</tool_call>"}`); each allowed occurrence becomes its id and
        the text between occurrences is encoded piece by piece.
        """
        if not allowed_special:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pattern = "|".join(re.escape(s) for s in sorted(allowed_special, key=len, reverse=True))
        pos = 0
        for m in re.finditer(pattern, text):
            if m.start() > pos:
                ids += self.backend.encode(text[pos : m.start()], add_special_tokens=False).ids
            token_id = self.backend.token_to_id(m.group())
            if token_id is None:
                raise ValueError(f"{m.group()!r} is not a token of this vocabulary")
            ids.append(token_id)
            pos = m.end()
        if pos < len(text):
            ids += self.backend.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens appear as their strings unless skipped."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ image spans
    def image_span(self, n_llm_h: int, n_llm_w: int) -> tuple[list[int], list[int]]:
        """(ids, token_types) of one image: start, n_llm_h rows of (n_llm_w slots + newline), end
        (spec §3.15: n_llm_h·(n_llm_w+1)+2 positions)."""
        if None in (self.image_start_id, self.image_id, self.image_newline_id, self.image_end_id):
            raise ValueError("this vocabulary lacks the image delimiter tokens")
        ids = [self.image_start_id]
        types = [IMAGE_START]
        for _ in range(n_llm_h):
            ids += [self.image_id] * n_llm_w + [self.image_newline_id]
            types += [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
        return ids + [self.image_end_id], types + [IMAGE_END]

    def token_types(self, ids: Sequence[int]) -> list[int]:
        """Per-id token type (TEXT = -1; image start/slot/newline/end = 0/1/2/3)."""
        return [self._image_types.get(i, TEXT) for i in ids]


__all__ = [
    "ASSETS_DIR", "DEFAULT_TOKENIZER_PATH", "DEFAULT_VOCAB_SIZE", "IMAGE", "IMAGE_END", "IMAGE_NEW_LINE",
    "IMAGE_START", "N_RESERVED_SPECIAL", "SPECIAL_TOKENS", "TEXT", "Tokenizer", "default_special_token_list",
]  # fmt: skip
