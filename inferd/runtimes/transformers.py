"""Hugging Face transformer encoders: sentence embeddings and text classification.

A version folder is a Hugging Face model folder (``config.json``, ``model.safetensors``
or ``pytorch_model.bin``, ``tokenizer.json``), or a sentence-transformers folder (the
same plus ``modules.json`` naming a Transformer, a Pooling, optionally Dense and
Normalize modules). The task follows from the folder, or metadata ``task``:

- ``embedding``: a sentence-transformers folder (its modules say the pooling, dense
  layers and normalisation), or a plain encoder (mean pooling unless metadata
  ``pooling`` says cls/max/mean_sqrt_len/lasttoken/weightedmean; ``normalize``).
  Outputs ``embedding`` (FP32, one row of ``dimensions`` per text).
- ``classification``: ``*ForSequenceClassification`` checkpoints; labels from the
  config's ``id2label``. Outputs ``label`` and ``probabilities`` (softmax; sigmoid for
  ``multi_label_classification``); a one-output regression head gives ``prediction``.
- ``score`` (a cross-encoder, for reranking): a one-label ``*ForSequenceClassification``
  saved by sentence-transformers' ``CrossEncoder`` (its config names the activation),
  or any one-label classifier pushed with metadata ``task: score`` (BGE rerankers).
  Inputs ``text`` and ``text_pair`` (query and document), tokenized together as the
  model's pair template says; output ``score`` (FP32): the logit through the
  activation (sigmoid, as ``CrossEncoder.predict`` gives, unless the config or metadata
  ``activation`` says ``identity``).

Every text model also returns ``tokens`` (INT32, tokens the model saw) and
``truncated`` (BOOL: the text was longer than ``max_length`` and was cut).

Texts are tokenized once per request in :meth:`prepare` (the replica does it before
batching, so the batcher knows each text's length and groups similar ones); a batch is
padded to its longest member. Metadata: ``dtype`` (float32, bfloat16; float16 on CUDA),
``device`` (auto, cpu, cuda, cuda:N), ``max_length`` (at most the model's own),
``quantization`` (``int8``/``int8-all``: PyTorch dynamic quantization of the linear
layers, CPU; see :data:`QUANTIZATIONS`).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import InvalidInput
from inferd.runtimes.base import Runtime
from inferd.runtimes.hf_folders import (
    POOLING_MODES,
    POOLING_NAMES,
    has_weights,
    is_sequence_classifier,
    load_dense,
    model_folder,
    pad_batch,
    pool,
    quantize_int8,
    read_config,
    read_json,
    st_modules,
    st_pooling,
    text_of,
)
from inferd.shapes.tensors import Signature, TensorSpec

logger = logging.getLogger(__name__)

TASKS = ("embedding", "classification", "score")
ACTIVATIONS = ("sigmoid", "identity")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int8-all")
"""PyTorch dynamic quantization: ``int8`` every linear layer but the down-projections,
``int8-all`` every one (faster, less accurate)."""
_UNBOUNDED = 1_000_000  # tokenizer_config's "no limit" is 1e30


class TransformersRuntime(Runtime):
    framework = "transformers"
    file_suffixes = (".safetensors", ".bin")

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        try:
            folder = model_folder(artifact_dir)
        except (OSError, ValueError):
            return False
        config = read_config(folder)
        if config is None or not has_weights(folder):
            return False
        # Language models belong to the generation runtimes; their classifiers are ours.
        from inferd.runtimes.decoder import is_decoder

        if config.get("model_type") == "gpt2":
            return is_sequence_classifier(config)
        return not is_decoder(config)

    # -- loading -------------------------------------------------------------------

    def load(self) -> None:
        import torch

        self._torch = torch
        meta = self.config.metadata
        self._modules = st_modules(self.artifact_dir)
        self._folder = model_folder(self.artifact_dir)
        hf_config = read_config(self._folder)
        if hf_config is None:
            raise ValueError(f"transformers: no readable config.json in {self._folder}")
        self._hf_config = hf_config
        self.task = self._task(meta.get("task"))
        self.device = self._device(str(meta.get("device", "auto")))
        self.dtype_name = str(meta.get("dtype", "float32"))
        dtype = self._dtype(self.dtype_name)
        self.quantization = meta.get("quantization")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"transformers: quantization {self.quantization!r} is not one of {QUANTIZATIONS}"
            )
        if self.quantization and (self.device.type != "cpu" or self.dtype_name != "float32"):
            raise ValueError("transformers: int8 quantization runs on the CPU, from float32")
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.threads)

        self.model = self._load_model(dtype)
        st_config = self.artifact_dir / "sentence_bert_config.json"
        self._st_config = read_json(st_config) if st_config.is_file() else {}
        self._lower = bool(self._st_config.get("do_lower_case"))
        self._load_tokenizer(meta.get("max_length"))
        labels = self.labels()
        self._regression = len(labels) == 1 and self._hf_config.get("problem_type") in (
            None,
            "regression",
        )
        if self.task == "score" and len(labels) != 1:
            raise ValueError(
                f"transformers: task score needs a one-label classifier, this one has "
                f"{len(labels)} labels"
            )
        self._sigmoid = self._activation(meta.get("activation")) == "sigmoid"
        if self.task == "embedding":
            self._load_embedding_head(meta)
        else:
            self._pooling: str | None = None
            self._dense: list[tuple[Any, str | None]] = []
            self._normalize = False
        if self.quantization is not None:
            every = self.quantization == "int8-all"
            self.model = quantize_int8(torch, self.model, every)
            self._dense = [(quantize_int8(torch, d, every), act) for d, act in self._dense]

    def _task(self, declared: Any) -> str:
        if declared is not None:
            if declared not in TASKS:
                raise ValueError(f"transformers: task {declared!r} is not one of {TASKS}")
            return str(declared)
        if self._modules is not None:
            return "embedding"
        if is_sequence_classifier(self._hf_config):
            return "score" if _cross_encoder_activation(self._hf_config) else "classification"
        return "embedding"

    def _activation(self, declared: Any) -> str:
        """A score's activation: metadata ``activation``, else what sentence-transformers
        saved in the config, else sigmoid (``CrossEncoder``'s default for one label)."""
        if declared is not None:
            if declared not in ACTIVATIONS:
                raise ValueError(
                    f"transformers: activation {declared!r} is not one of {ACTIVATIONS}"
                )
            return str(declared)
        saved = _cross_encoder_activation(self._hf_config) or ""
        return "identity" if saved.endswith(".Identity") else "sigmoid"

    def _device(self, name: str) -> Any:
        torch = self._torch
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ValueError(f"transformers: device {name!r}: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("transformers: device cuda asked for, but CUDA is not available")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"transformers: device {name!r}: use auto, cpu, cuda or cuda:N")
        return device

    def _dtype(self, name: str) -> Any:
        torch = self._torch
        if name not in DTYPES:
            raise ValueError(f"transformers: dtype {name!r} is not one of {DTYPES}")
        if name == "float16" and self.device.type == "cpu":
            raise ValueError("transformers: float16 needs a CUDA device; on CPU use bfloat16")
        if name == "bfloat16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("transformers: this GPU does not support bfloat16; use float16")
        return getattr(torch, name)

    def _load_model(self, dtype: Any) -> Any:
        import transformers

        cls = (
            transformers.AutoModelForSequenceClassification
            if self.task in ("classification", "score")
            else transformers.AutoModel
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            model = cls.from_pretrained(str(self._folder), dtype=dtype, local_files_only=True)
        return model.to(self.device).eval()

    def _load_tokenizer(self, max_length: Any) -> None:
        from tokenizers import Tokenizer

        path = self._folder / "tokenizer.json"
        if path.is_file():
            tokenizer = Tokenizer.from_file(str(path))
        else:  # a slow-tokenizer folder (vocab.txt, spiece.model): convert it once
            import transformers

            fast = transformers.AutoTokenizer.from_pretrained(
                str(self._folder), use_fast=True, local_files_only=True
            )
            tokenizer = fast.backend_tokenizer
        limit = self._model_max_length()
        if max_length is not None:
            if not isinstance(max_length, int) or not 1 < max_length <= limit:
                raise ValueError(
                    f"transformers: max_length must be 2 to {limit}, not {max_length!r}"
                )
            limit = max_length
        self.max_length = limit
        tokenizer.no_padding()
        tokenizer.enable_truncation(limit)
        self.tokenizer = tokenizer
        pad = self._hf_config.get("pad_token_id")
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    def _model_max_length(self) -> int:
        """The longest input the model takes: sentence-transformers' max_seq_length, the
        tokenizer's model_max_length, the position embeddings -- the smallest known."""
        limits = []
        positions = self._hf_config.get("max_position_embeddings")
        if isinstance(positions, int):
            if self._hf_config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
                positions -= 2  # their position ids start after the padding index
            limits.append(positions)
        tok_config = self._folder / "tokenizer_config.json"
        if tok_config.is_file():
            value = read_json(tok_config).get("model_max_length")
            if isinstance(value, int | float) and 0 < value < _UNBOUNDED:
                limits.append(int(value))
        if isinstance(self._st_config.get("max_seq_length"), int):
            limits.append(self._st_config["max_seq_length"])
        return min(limits) if limits else 512

    def _load_embedding_head(self, meta: dict[str, Any]) -> None:
        torch = self._torch
        self._dense = []
        pooling = meta.get("pooling")
        normalize = meta.get("normalize")
        if self._modules is not None:
            found_pooling = None
            found_normalize = False
            for module in self._modules[1:]:
                if module.kind == "Pooling":
                    found_pooling = st_pooling(module.path)
                elif module.kind == "Dense":
                    self._dense.append(load_dense(module.path, self.device, self._weights_dtype()))
                elif module.kind == "Normalize":
                    found_normalize = True
                else:
                    raise ValueError(
                        f"transformers: sentence-transformers module {module.kind!r} "
                        f"({module.path.name}) is not supported; Pooling, Dense and Normalize are"
                    )
            pooling = pooling or found_pooling
            normalize = found_normalize if normalize is None else normalize
        pooling = POOLING_NAMES.get(pooling, pooling) if isinstance(pooling, str) else "mean"
        if pooling not in POOLING_MODES:
            raise ValueError(f"transformers: pooling {pooling!r} is not one of {POOLING_MODES}")
        self._pooling = pooling
        self._normalize = bool(normalize)
        hidden = self._hf_config.get("hidden_size") or self._hf_config.get("dim")
        dims = self._dense[-1][0].out_features if self._dense else hidden
        if not isinstance(dims, int):
            with torch.inference_mode():
                dims = int(self._embed_ids([np.asarray([0, 0])]).shape[1])
        self.dimensions = dims

    def _weights_dtype(self) -> Any:
        return next(self.model.parameters()).dtype

    # -- signature -----------------------------------------------------------------

    def infer_signature(self) -> Signature:
        text = (TensorSpec("text", "BYTES"),)
        extra = (TensorSpec("tokens", "INT32"), TensorSpec("truncated", "BOOL"))
        if self.task == "score":
            pair = (*text, TensorSpec("text_pair", "BYTES"))
            return Signature(pair, (TensorSpec("score", "FP32"), *extra))
        if self.task == "embedding":
            embedding = TensorSpec("embedding", "FP32", (-1, self.dimensions))
            return Signature(text, (embedding, *extra))
        if self._regression:
            return Signature(text, (TensorSpec("prediction", "FP32"), *extra))
        labels = self.labels()
        outputs = (
            TensorSpec("label", "INT64"),
            TensorSpec("probabilities", "FP32", (-1, len(labels))),
            *extra,
        )
        return Signature(text, outputs, labels=tuple(labels))

    def labels(self) -> list[str]:
        id2label = self._hf_config.get("id2label") or {}
        n = int(self._hf_config.get("num_labels") or len(id2label) or 2)
        return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]

    def generated_inputs(self, rows: int) -> dict[str, np.ndarray]:
        texts = np.full(rows, "warm up", dtype=object)
        if self.task == "score":
            return {"text": texts, "text_pair": texts.copy()}
        return {"text": texts}

    # -- inference -----------------------------------------------------------------

    def prepare(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Tokenize: ``{"ids": object array of int64 arrays, "truncated": bool array}``
        (and ``"types"``, the token type ids, for pairs) and each row's token count."""
        strings = self._strings(inputs, "text")
        pairs = self._strings(inputs, "text_pair") if self.task == "score" else None
        if pairs is not None:
            if len(pairs) != len(strings):
                raise InvalidInput("'text' and 'text_pair' must have as many rows")
            encodings = self.tokenizer.encode_batch(list(zip(strings, pairs, strict=True)))
        elif len(strings) == 1:
            encodings = [self.tokenizer.encode(strings[0])]
        else:
            encodings = self.tokenizer.encode_batch(strings)
        n = len(encodings)
        ids = np.empty(n, dtype=object)
        ids[:] = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), bool, n)
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, n)
        prepared = {"ids": ids, "truncated": truncated}
        if pairs is not None:
            types = np.empty(n, dtype=object)
            types[:] = [np.asarray(e.type_ids, dtype=np.int64) for e in encodings]
            prepared["types"] = types
        return prepared, lengths

    def _strings(self, inputs: dict[str, np.ndarray], name: str) -> list[str]:
        if name not in inputs:
            raise InvalidInput(f"missing input {name!r}")
        strings = [text_of(i, t, name) for i, t in enumerate(inputs[name].reshape(-1))]
        return [s.lower() for s in strings] if self._lower else strings

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "ids" not in inputs:  # raw texts (push-time checks): tokenize here
            inputs = self.prepare(inputs)[0]
        ids = list(inputs["ids"])
        tokens = np.fromiter((len(row) for row in ids), np.int32, len(ids))
        extra = {"tokens": tokens, "truncated": np.asarray(inputs["truncated"], dtype=bool)}
        with self._torch.inference_mode():
            if self.task == "embedding":
                return {"embedding": self._embed_ids(ids).numpy(), **extra}
            if self.task == "score":
                return {"score": self._score_ids(ids, list(inputs["types"])), **extra}
            return {**self._classify_ids(ids), **extra}

    def _batch_tensors(self, ids: list[np.ndarray]) -> tuple[Any, Any]:
        input_ids, mask = pad_batch(ids, self.pad_id)
        torch = self._torch
        return torch.from_numpy(input_ids).to(self.device), torch.from_numpy(mask).to(self.device)

    def _score_ids(self, ids: list[np.ndarray], types: list[np.ndarray]) -> np.ndarray:
        input_ids, mask = self._batch_tensors(ids)
        kwargs = {"input_ids": input_ids, "attention_mask": mask}
        if (self._hf_config.get("type_vocab_size") or 0) > 1:  # BERT: query 0, document 1
            kwargs["token_type_ids"] = self._torch.from_numpy(pad_batch(types)[0]).to(self.device)
        logits = self.model(**kwargs).logits.float()[:, 0]
        scores = self._torch.sigmoid(logits) if self._sigmoid else logits
        return np.asarray(scores.cpu().numpy(), dtype=np.float32)

    def _embed_ids(self, ids: list[np.ndarray]) -> Any:
        torch = self._torch
        input_ids, mask = self._batch_tensors(ids)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        embedding = pool(torch, self._pooling or "mean", hidden, mask)
        for layer, activation in self._dense:
            embedding = layer(embedding)
            if activation is not None:
                embedding = getattr(torch, activation)(embedding)
        if self._normalize:
            embedding = torch.nn.functional.normalize(embedding, p=2, dim=1)
        return embedding.float().cpu()

    def _classify_ids(self, ids: list[np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        input_ids, mask = self._batch_tensors(ids)
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
        if self._regression:
            return {"prediction": logits[:, 0].cpu().numpy()}
        if self._hf_config.get("problem_type") == "multi_label_classification":
            probabilities = torch.sigmoid(logits)
        else:
            probabilities = torch.softmax(logits, dim=1)
        return {
            "label": probabilities.argmax(dim=1).cpu().numpy().astype(np.int64),
            "probabilities": probabilities.cpu().numpy(),
        }

    def unload(self) -> None:
        self.model = None
        self._dense = []


def _cross_encoder_activation(config: dict[str, Any]) -> str | None:
    """The activation sentence-transformers' ``CrossEncoder`` saved with a one-label
    classifier (``sentence_transformers.activation_fn``; before v4
    ``sbert_ce_default_activation_function``), or None: not saved as a cross-encoder."""
    if int(config.get("num_labels") or len(config.get("id2label") or {}) or 2) != 1:
        return None
    saved = (config.get("sentence_transformers") or {}).get("activation_fn")
    saved = saved or config.get("sbert_ce_default_activation_function")
    return str(saved) if saved else None
