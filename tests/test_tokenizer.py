"""Streaming detokenization (inferd/llm/tokenizer.py): a byte-level tokenizer's stream is
its tokens' bytes through an incremental UTF-8 decoder; others decode a window of
recent tokens. Either way, the deltas of a stream join to the tokenizer's own decoding
of the whole output, and never end inside a multi-byte character until the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from inferd.llm.tokenizer import Detokenizer, TextTokenizer
from tests.conftest import build_tiny_gpt2


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.load(build_tiny_gpt2(tmp_path_factory.mktemp("tok")))


def stream(tok: TextTokenizer, ids: list[int], skip: bool = True) -> list[str]:
    detok = Detokenizer(tok, [5, 6, 7], skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_a_byte_level_tokenizer_streams_by_table_and_equals_its_decode(
    byte_level: TextTokenizer,
) -> None:
    assert byte_level.token_bytes is not None
    table, special = byte_level.token_bytes
    assert byte_level.eos_token_id in special
    windowed = TextTokenizer(byte_level._tok, byte_level.eos_token_id)
    windowed.token_bytes = None  # the window path, for comparison
    rng = random.Random(3)
    for trial in range(400):
        ids = [rng.randrange(len(table) + 2) for _ in range(rng.randrange(1, 30))]
        if trial % 4 == 0:
            ids.insert(rng.randrange(len(ids)), byte_level.eos_token_id)
        for skip in (True, False):
            want = byte_level.decode(ids, skip)
            assert "".join(stream(byte_level, ids, skip)) == want, ids
            assert "".join(stream(windowed, ids, skip)) == want, ids


def test_a_character_split_over_tokens_waits_for_its_last_byte(
    byte_level: TextTokenizer,
) -> None:
    table, _ = byte_level.token_bytes or ([], frozenset())
    single = {b: i for i, b in enumerate(table) if len(b) == 1}
    snowman = "\u2603".encode()  # three bytes
    ids = [single[bytes([b])] for b in b"a" + snowman + b"b"]
    assert stream(byte_level, ids) == ["a", "", "", "\u2603", "b", ""]
    cut = stream(byte_level, ids[:3])  # ends inside the character: flushed as U+FFFD
    assert cut[:3] == ["a", "", ""] and cut[-1] == "\ufffd"
    assert "".join(cut) == byte_level.decode(ids[:3])


def test_other_tokenizers_keep_the_window_path(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = TextTokenizer(raw, 3)
    assert tok.token_bytes is None
    ids = [1, 2, 1]
    assert "".join(stream(tok, ids)) == tok.decode(ids)
