"""GPT-2-family checkpoints (Hugging Face folder: config.json, safetensors, tokenizer.json).

Served by the LLM engine in a generation replica (``inferd.serving.generation``); this
runtime is what ``inferd models push`` uses to check such a folder and record its
signature: a prompt in, generated text out. ``predict_batch`` runs a short greedy
generation through the same engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature, TensorSpec


class GPT2Runtime(Runtime):
    framework = "gpt2"
    file_suffixes = (".safetensors",)
    max_new_tokens = 8

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        config = artifact_dir / "config.json"
        if not config.is_file() or not any(artifact_dir.glob("*.safetensors")):
            return False
        try:
            found = json.loads(config.read_text())
        except (OSError, ValueError):
            return False
        # a GPT-2 sequence classifier is the transformers runtime's
        architectures = found.get("architectures") or ()
        classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
        return found.get("model_type") == "gpt2" and not classifier

    def load(self) -> None:
        from inferd.config import LLMConfig
        from inferd.llm.chat import ChatTemplate
        from inferd.llm.engines import check_supported
        from inferd.llm.loader import engine_for

        ChatTemplate.load(self.artifact_dir).check()
        check_supported(self.artifact_dir, "gpt2", self.config.metadata)
        llm = LLMConfig(kv_cache_mb=16, max_num_seqs=8)
        self.engine = engine_for(self.artifact_dir, self.config.threads, llm)

    def infer_signature(self) -> Signature:
        return Signature(
            inputs=(TensorSpec("prompt", "BYTES"),), outputs=(TensorSpec("text", "BYTES"),)
        )

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from inferd.shapes.llm import SamplingParams

        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=0)
        texts: dict[str, list[str]] = {}
        for i, prompt in enumerate(inputs["prompt"]):
            rid = f"push-check-{i}"
            texts[rid] = []
            self.engine.add_request(rid, str(prompt) or " ", params)
        while self.engine.has_work():
            for out in self.engine.step():
                texts[out.request_id].append(out.text)
        result = np.empty(len(texts), dtype=object)
        result[:] = ["".join(parts) for parts in texts.values()]
        return {"text": result}

    def unload(self) -> None:
        self.engine = None  # type: ignore[assignment]
