"""Tokenizer loading (Hugging Face ``tokenizer.json``) and streaming detokenization.

Streaming text must never show half a character: byte-level BPE splits multi-byte
UTF-8 characters across tokens. A byte-level tokenizer's (GPT-2's) text is the UTF-8
decoding of its tokens' bytes, so a stream feeds each token's bytes to an incremental
UTF-8 decoder (a table lookup per token: the engine detokenizes every sequence's token
every step); other tokenizers decode a small window of recent tokens each step and emit
text once it no longer ends in a replacement character.
"""

from __future__ import annotations

import codecs
import json
import random
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer, decoders


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.token_bytes = _byte_level_table(tokenizer)
        """Per id, the bytes its text is made of, and the special tokens' ids; None:
        not a byte-level tokenizer (or one whose decoding this table does not match)."""

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


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _byte_level_table(tok: Tokenizer) -> tuple[list[bytes], frozenset[int]] | None:
    """What a ``ByteLevel`` decoder makes of each token: the bytes its characters stand
    for (a token with a character outside the alphabet, an added one, as its own UTF-8).
    Checked against the tokenizer's own ``decode`` on random ids before it is used."""
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_of_char()
    vocab = tok.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        try:
            table[i] = bytes(alphabet[c] for c in token)
        except KeyError:
            table[i] = token.encode()
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    rng = random.Random(0)
    for skip in (True, False):
        for _ in range(32):
            ids = [rng.randrange(len(table)) for _ in range(12)] + sorted(special)[:1]
            rng.shuffle(ids)
            raw = b"".join(table[i] for i in ids if not (skip and i in special))
            if raw.decode("utf-8", "replace") != tok.decode(ids, skip_special_tokens=skip):
                return None
    return table, special


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
        self._bytes: list[bytes] | None = None
        table = getattr(tokenizer, "token_bytes", None)  # a test's stand-in may have none
        if table is not None:
            self._bytes, self._special = table
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        table = self._bytes
        if table is not None:
            if token_id >= len(table) or (self._skip and token_id in self._special):
                return ""
            return self._utf8.decode(table[token_id])
        self._ids.append(token_id)
        window = self._context + self._ids[self._prefix :]
        before = self._tok.decode(self._context, self._skip)
        decoded = self._tok.decode(window, self._skip)
        if decoded.endswith("\ufffd"):
            return ""  # in the middle of a multi-byte character: wait for more
        delta = decoded[len(before) :]
        self._context = window[-4:]
        self._prefix = len(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever was held back, even a broken character."""
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        if self._prefix == len(self._ids):
            return ""
        window = self._context + self._ids[self._prefix :]
        decode = self._tok.decode
        delta = decode(window, self._skip)[len(decode(self._context, self._skip)) :]
        self._prefix = len(self._ids)
        return delta
