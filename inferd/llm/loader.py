"""Build an engine for one replica from a Hugging Face GPT-2 folder and the LLM settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferd.llm import native
from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.guides import GuideCompiler
from inferd.llm.lora import LoRABank
from inferd.llm.model import GPT2
from inferd.llm.tokenizer import TextTokenizer
from inferd.replica_config import LLMConfig

if TYPE_CHECKING:
    from inferd.serving.spec import ReplicaSpec

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(spec: ReplicaSpec) -> LLMEngine:
    """The engine of a replica: its version folder, threads, ``llm`` settings and the
    LoRA adapters that load with it."""
    return engine_for(Path(spec.artifact_dir), spec.threads, spec.llm, spec.adapters)


def engine_for(
    folder: Path, threads: int, llm: LLMConfig, adapters: dict[str, str] | None = None
) -> LLMEngine:
    torch.set_num_threads(max(1, threads))
    native.enable(llm.native)
    dtype = DTYPES[llm.dtype]
    model = GPT2.load(folder, dtype=dtype)
    tokenizer = TextTokenizer.load(folder)
    cfg = model.config
    block_size = llm.block_size
    bytes_per_block = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * block_size * dtype.itemsize
    full_context = -(-cfg.n_positions // block_size)
    num_blocks = max(llm.kv_cache_mb * 2**20 // bytes_per_block, full_context)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=llm.max_num_seqs,
        max_batched_tokens=llm.max_batched_tokens,
        max_waiting=llm.max_waiting,
        dtype=dtype,
        queue_timeout_s=llm.queue_timeout_s,
        max_prompt_tokens=llm.max_prompt_tokens,
    )
    lora = LoRABank(cfg, llm.max_adapters, llm.max_lora_rank, dtype=dtype)
    vocab = getattr(cfg, "vocab_size", None) or tokenizer.vocab_size
    guides = GuideCompiler(folder / "tokenizer.json", vocab, tokenizer.eos_token_id)
    engine = LLMEngine(model, tokenizer, config, lora, guides)
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, folder / path)  # relative to the version folder
    logger.info(
        "engine: %d KV blocks of %d tokens (%.0f MiB), dtype %s",
        num_blocks,
        block_size,
        num_blocks * bytes_per_block / 2**20,
        dtype,
    )
    return engine
