"""Hugging Face decoder LLMs other than GPT-2 (Llama, Qwen2/2.5/3, Mistral, …): a folder
with config.json (a ``…ForCausalLM`` architecture), safetensors weights and tokenizer.json.

Served by vLLM's engine in a generation replica (:mod:`inferd.serving.vllm_core`). What
a push checks here, without loading the weights (a 7B model would take minutes and
gigabytes on the pushing machine): the config, that the safetensors files' headers read
and hold tensors, that the tokenizer loads, that the chat template compiles and renders,
and that the engine the version would run on is installed and runs its architecture.
The first replica's load is the check of the weights themselves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.runtimes.hf_folders import is_sequence_classifier, read_config
from inferd.shapes.tensors import Signature, TensorSpec

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def is_decoder(config: dict[str, object]) -> bool:
    architectures = config.get("architectures") or ()
    if not isinstance(architectures, list):
        return False
    return any(str(a).endswith(CAUSAL_SUFFIXES) for a in architectures) and not (
        is_sequence_classifier(config)
    )


class DecoderRuntime(Runtime):
    framework = "llm"
    file_suffixes = (".safetensors",)
    warm_up_at_push = False

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        config = read_config(Path(artifact_dir))
        if config is None or config.get("model_type") == "gpt2":
            return False
        return is_decoder(config) and any(Path(artifact_dir).glob("*.safetensors"))

    def load(self) -> None:
        from inferd.llm.chat import ChatTemplate
        from inferd.llm.engines import check_supported

        folder = self.artifact_dir
        config = read_config(folder)
        if config is None:
            raise ValueError(f"llm: no readable config.json in {folder}")
        if not is_decoder(config):
            raise ValueError(f"llm: {config.get('architectures')} is not a decoder language model")
        self.tensors = sum(_tensor_count(path) for path in sorted(folder.glob("*.safetensors")))
        if self.tensors == 0:
            raise ValueError(f"llm: no tensors in the safetensors files of {folder}")
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"llm: no tokenizer.json in {folder}")
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(folder / "tokenizer.json"))
        ChatTemplate.load(folder).check()
        self.engine = check_supported(folder, "llm", self.config.metadata)

    def infer_signature(self) -> Signature:
        return Signature(
            inputs=(TensorSpec("prompt", "BYTES"),), outputs=(TensorSpec("text", "BYTES"),)
        )

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("an llm version generates text in its replica (use generate)")


def _tensor_count(path: Path) -> int:
    """Tensors named in a safetensors file's header (read, not loaded)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"llm: {path.name} is not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise ValueError(f"llm: {path.name} has a header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise ValueError(f"llm: {path.name} has an unreadable header: {exc}") from None
    return sum(1 for key in header if key != "__metadata__")
