"""Build an engine for one replica from a Hugging Face GPT-2 folder and the LLM settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferd.llm import cuda, native
from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.guides import GuideCompiler
from inferd.llm.lora import LoRABank
from inferd.llm.model import GPT2
from inferd.llm.speculation import Speculation
from inferd.llm.tokenizer import TextTokenizer
from inferd.replica_config import LLMConfig

if TYPE_CHECKING:
    from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(spec: ReplicaSpec) -> LLMEngine:
    """The engine of a replica: its version folder, threads, ``llm`` settings, the
    LoRA adapters that load with it and, on a GPU, the memory budget placement planned
    for it (the version's ``gpu_memory_gb``)."""
    budget = spec.metadata.get("gpu_memory_gb")
    budget_gb = float(budget) if isinstance(budget, int | float) and budget > 0 else None
    speculation = Speculation.for_version(spec.metadata, spec.llm.speculative)
    return engine_for(Path(spec.artifact_dir), spec.threads, spec.llm, spec.adapters, budget_gb,
                      speculation)  # fmt: skip


def resolve_device(setting: str) -> torch.device:
    """``llm.device``: ``auto`` is the first GPU this process sees, else the CPU."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("llm.device is cuda but this replica sees no GPU")
    return torch.device("cuda", 0)


def engine_for(
    folder: Path,
    threads: int,
    llm: LLMConfig,
    adapters: dict[str, str] | None = None,
    gpu_budget_gb: float | None = None,
    speculation: Speculation | None = None,
) -> LLMEngine:
    torch.set_num_threads(max(1, threads))
    native.enable(llm.native)
    device = resolve_device(llm.device)
    gpu = device.type == "cuda"
    dtype = DTYPES.get(llm.dtype) or (torch.bfloat16 if gpu else torch.float32)
    model = GPT2.load(folder, dtype=dtype, device=device)
    quantized = llm.quantize == "fp8" and model.quantize_fp8()
    if llm.quantize == "fp8" and not quantized:
        logger.warning("llm.quantize fp8 needs a GPU with fp8 units; weights stay %s", dtype)
    tokenizer = TextTokenizer.load(folder)
    cfg = model.config
    block_size = llm.block_size
    bytes_per_block = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * block_size * dtype.itemsize
    full_context = -(-cfg.n_positions // block_size)
    kv_bytes = llm.kv_cache_mb * 2**20
    if gpu and gpu_budget_gb is not None:
        kv_bytes = kv_budget(gpu_budget_gb, device, llm, cfg.vocab_size)
    num_blocks = max(kv_bytes // bytes_per_block, full_context)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=llm.max_num_seqs,
        max_batched_tokens=llm.max_batched_tokens,
        max_waiting=llm.max_waiting,
        dtype=dtype,
        queue_timeout_s=llm.queue_timeout_s,
        max_prompt_tokens=llm.max_prompt_tokens,
        speculation=speculation,
        prefix_caching=llm.prefix_caching,
    )
    lora = LoRABank(cfg, llm.max_adapters, llm.max_lora_rank, dtype=dtype, device=device)
    vocab = getattr(cfg, "vocab_size", None) or tokenizer.vocab_size
    guides = GuideCompiler(folder / "tokenizer.json", vocab, tokenizer.eos_token_id)
    engine = LLMEngine(model, tokenizer, config, lora, guides)
    for name, path in (adapters or {}).items():
        if len(engine.adapters.loaded) < llm.max_adapters:  # the rest load when requests need them
            engine.adapters.load(name, folder / path)  # relative to the version folder
        else:
            engine.adapters.know(name, folder / path)
    graphs = engine.runner.capture_graphs() if gpu and llm.cuda_graphs and cuda.available() else 0
    logger.info(
        "engine on %s: %d KV blocks of %d tokens (%.0f MiB), dtype %s%s, %d decode graphs",
        device,
        num_blocks,
        block_size,
        num_blocks * bytes_per_block / 2**20,
        dtype,
        " (fp8 weights)" if quantized else "",
        graphs,
    )
    return engine


WORKSPACE_BYTES = 2**30
"""On a GPU, kept out of a budget beside the weights, the CUDA context and the KV
cache: cuBLAS workspaces, the decode graphs and a step's activations."""
CONTEXT_BYTES = 600 * 10**6
"""The CUDA context and kernel images of one process, which PyTorch's allocator does
not count (measured: ~1.6 GB beyond weights and KV cache for GPT-2 small at 256
sequences, workspace included, on an H100)."""


def kv_budget(budget_gb: float, device: torch.device, llm: LLMConfig, vocab: int) -> int:
    """KV-cache bytes that keep the replica inside ``budget_gb`` (GB, 1e9 bytes, as
    ``gpu_memory_gb``): the budget less what the process holds now (weights, and the
    CUDA context: as the driver reports it where NVML answers, else an estimate), a
    workspace and the float32 logits of the largest step."""
    held = torch.cuda.memory_reserved(device) + CONTEXT_BYTES
    held = max(held, process_gpu_bytes(device) or 0)
    logits = 3 * 4 * vocab * max(llm.max_num_seqs, llm.max_batched_tokens // 16)
    left = int(budget_gb * 1e9) - held - WORKSPACE_BYTES - logits
    if left < 64 * 2**20:
        raise RuntimeError(
            f"gpu_memory_gb {budget_gb:g} leaves no room for a KV cache beside "
            f"{held / 1e9:.2f} GB of weights and context and "
            f"{(WORKSPACE_BYTES + logits) / 1e9:.1f} GB of workspace"
        )
    return left


def process_gpu_bytes(device: torch.device) -> int | None:
    """GPU memory this process holds on ``device`` as the driver counts it (context
    included), through NVML; None where NVML is missing or does not say."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        )
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # no NVML, another driver, no permission: the estimate stands
        return None
    return None
