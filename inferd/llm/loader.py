"""Build an engine for one replica from a Hugging Face GPT-2 folder and the LLM settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.lora import LoRABank
from inferd.llm.model import GPT2
from inferd.llm.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(spec: Any) -> LLMEngine:
    """``spec`` is a ReplicaSpec: artifact_dir, threads, and its ``llm`` settings dict."""
    llm: dict[str, Any] = dict(getattr(spec, "llm", None) or {})
    torch.set_num_threads(max(1, int(spec.threads)))
    folder = Path(spec.artifact_dir)
    dtype = DTYPES[llm.get("dtype", "float32")]
    model = GPT2.load(folder, dtype=dtype)
    tokenizer = TextTokenizer.load(folder)
    cfg = model.config
    block_size = int(llm.get("block_size", 16))
    bytes_per_block = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * block_size * dtype.itemsize
    full_context = -(-cfg.n_positions // block_size)
    num_blocks = max(int(llm.get("kv_cache_mb", 256)) * 2**20 // bytes_per_block, full_context)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=int(llm.get("max_num_seqs", 128)),
        max_batched_tokens=int(llm.get("max_batched_tokens", 512)),
        max_waiting=int(llm.get("max_waiting", 1024)),
        dtype=dtype,
        queue_timeout_s=float(llm.get("queue_timeout_s", 600.0)),
        max_prompt_tokens=llm.get("max_prompt_tokens"),
    )
    lora = LoRABank(
        cfg, int(llm.get("max_adapters", 4)), int(llm.get("max_lora_rank", 16)), dtype=dtype
    )
    engine = LLMEngine(model, tokenizer, config, lora)
    for name, path in (llm.get("adapters") or {}).items():
        engine.load_adapter(name, folder / path)  # relative to the version folder
    logger.info(
        "engine: %d KV blocks of %d tokens (%.0f MiB), dtype %s",
        num_blocks,
        block_size,
        num_blocks * bytes_per_block / 2**20,
        dtype,
    )
    return engine
