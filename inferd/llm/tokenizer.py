"""Tokenizer loading (Hugging Face ``tokenizer.json``) and streaming detokenization.

Streaming text must never show half a character: byte-level BPE splits multi-byte
UTF-8 characters across tokens, so each step decodes a small window of recent tokens
and only emits text once it no longer ends in a replacement character.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def load(cls, folder: Path) -> TextTokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        tok = Tokenizer.from_file(str(path))
        eos = None
        config = folder / "config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
        if eos is None:
            eos = tok.token_to_id("<|endoftext|>")
        return cls(tok, eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())


class Detokenizer:
    """Turns a growing list of token ids into text deltas, one call per new token."""

    def __init__(
        self, tokenizer: TextTokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # tokens before this are already in `text`
        self._context = prompt_ids[-4:]  # a little left context decodes spacing right
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._context + self._ids[self._prefix :]
        before = self._tok.decode(self._context, self._skip)
        decoded = self._tok.decode(window, self._skip)
        if decoded.endswith("\ufffd"):
            return ""  # in the middle of a multi-byte character: wait for more
        delta = decoded[len(before) :]
        self._context = window[-4:]
        self._prefix = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever was held back, even a broken character."""
        if self._prefix == len(self._ids):
            return ""
        window = self._context + self._ids[self._prefix :]
        decode = self._tok.decode
        delta = decode(window, self._skip)[len(decode(self._context, self._skip)) :]
        self._prefix = len(self._ids)
        self.text += delta
        return delta
