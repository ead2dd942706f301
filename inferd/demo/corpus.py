"""The demo LLM's text and tokenizer: prose from the Python standard library's docstrings
and :mod:`pydoc_data` topics (read with :mod:`ast`, nothing imported), the demo reviews,
a byte-level BPE trained on them in GPT-2's layout, and token streams to train on.
"""

from __future__ import annotations

import ast
import csv
import functools
import hashlib
import json
import re
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
REVIEWS_CSV = Path(__file__).parent / "data" / "sentiment.csv"

# Standard-library folders that are tests, tools, GUI demos or vendored code, not prose.
_STDLIB_SKIP = frozenset({
    "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip",
    "site-packages", "dist-packages", "pydoc_data", "__pycache__", "distutils",
})  # fmt: skip
_SPACE = re.compile(r"\s+")
_PARAGRAPH = re.compile(r"\n\s*\n")
_CODE_START = (">>>", "...", "$ ", "%", "#", "::")


@dataclass(frozen=True)
class Corpus:
    """Prose paragraphs, one line each, and how many source files they came from."""

    paragraphs: tuple[str, ...]
    source_files: int

    @property
    def chars(self) -> int:
        return sum(len(p) for p in self.paragraphs)

    @property
    def sha256(self) -> str:
        return hashlib.sha256("\n".join(self.paragraphs).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> Corpus:
    """Prose paragraphs from the standard library's docstrings and pydoc topics.

    Deterministic for a given Python version: files are read in sorted order and
    docstrings in source order. Parsed, never imported, so no module runs.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path
        for path in root.rglob("*.py")
        if not _STDLIB_SKIP.intersection(path.relative_to(root).parts[:-1])
    )
    texts = [doc for path in files for doc in _docstrings(path)] + _pydoc_topics()
    paragraphs = tuple(p for text in texts for p in map(_prose, _PARAGRAPH.split(text)) if p)
    if sum(map(len, paragraphs)) < 200_000:
        raise RuntimeError(f"too little standard-library source under {root} to train on")
    return Corpus(paragraphs, len(files))


def _docstrings(path: Path) -> Iterator[str]:
    with warnings.catch_warnings():
        # Old stdlib files have invalid escapes in strings; reading them is not our bug.
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            return
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    for node in sorted(nodes, key=lambda node: getattr(node, "lineno", 0)):
        doc = ast.get_docstring(node)
        if doc:
            yield doc


def _pydoc_topics() -> list[str]:
    """The language reference's prose that ``help("if")`` shows, in name order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data off
        return []
    return [topics[name] for name in sorted(topics)]


def _prose(paragraph: str) -> str | None:
    """The paragraph as one line of whitespace-collapsed prose, or None for code,
    doctests, tables and lists of names (indented or symbol-heavy text)."""
    lines = [line for line in paragraph.splitlines() if line.strip()]
    if not lines or any(line[0].isspace() or line.startswith(_CODE_START) for line in lines):
        return None
    text = _SPACE.sub(" ", " ".join(lines)).strip()
    wordlike = sum(c.isalpha() or c == " " for c in text)
    if len(text.split()) < 4 or not text[0].isupper() or wordlike < 0.85 * len(text):
        return None
    return text


def reviews() -> list[str]:
    with REVIEWS_CSV.open(newline="") as f:
        return [row["text"] for row in csv.DictReader(f)]


# -- tokenizer ------------------------------------------------------------------------


def train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` ids, ``<|endoftext|>`` last; where the texts
    give too few merges the gap is filled with ``<|unused_N|>`` tokens no merge makes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    learned = tokenizer.get_vocab_size()
    if learned < vocab_size - 1:
        spec = json.loads(tokenizer.to_str())
        spec["model"]["vocab"].update(
            {f"<|unused_{i}|>": i for i in range(learned, vocab_size - 1)}
        )
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens([ENDOFTEXT])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path, max_length: int) -> PreTrainedTokenizerFast:
    """Write ``tokenizer`` in Hugging Face format so ``AutoTokenizer`` loads ``folder``.

    Besides tokenizer.json and tokenizer_config.json (all transformers 5 writes), also
    vocab.json, merges.txt and special_tokens_map.json, which older readers look for.
    """
    from transformers import GPT2Tokenizer  # transformers 5: the tokenizers-backed class

    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    wrapped = GPT2Tokenizer(tokenizer_object=tokenizer, model_max_length=max_length, **special)
    wrapped.save_pretrained(folder)
    tokenizer.model.save(str(folder))
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return wrapped


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one id sequence, each followed by ``<|endoftext|>``."""
    import torch

    eos = tokenizer.eos_token_id
    # The backend tokenizer, because the wrapper logs about every text over max length.
    encoded = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return torch.tensor([i for e in encoded for i in (*e.ids, eos)], dtype=torch.long)
