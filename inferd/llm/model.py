"""GPT-2 for the engine: one forward pass over a mixed batch of prefill chunks and decode tokens.

Design rule: the model owns no per-sequence state. Keys and values live in the paged
:class:`~inferd.llm.batch.KVCache` the engine passes in, adapters in a
:class:`~inferd.llm.lora.LoRABank`, and everything a step needs arrives in
:class:`~inferd.llm.batch.ModelInput`; so one set of base weights serves every sequence and
every adapter at once.

Weights are stored in ``nn.Linear`` layout (``[out, in]``): HF GPT-2 uses ``Conv1D``
(``[in, out]``), transposed once at load, because ``F.linear`` is the fast path for every
dtype on CPU (``addmm`` with an ``[in, out]`` bf16 weight measured ~6x slower on AVX2).
Logits are computed only for ``logits_indices``: the LM head is the largest matmul.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from inferd.llm.attention import AttentionPlan, paged_attention
from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.lora import DenseLoRAStep, LoRABank, LoRAStep

logger = logging.getLogger(__name__)

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True)
class GPT2Config:
    """The fields of a HF GPT-2 ``config.json`` this model uses (defaults: GPT-2 small)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int = 50256
    eos_token_id: int = 50256

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPT2Config:
        """Known fields of ``data``; unknown keys are ignored, unsupported variants rejected."""
        if data.get("model_type", "gpt2") != "gpt2" or data.get("add_cross_attention"):
            raise ValueError(f"not a decoder-only GPT-2 config: {data.get('model_type')!r}")
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in data.items() if k in known and v is not None})
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation_function {config.activation_function!r}")
        if config.n_embd % config.n_head:
            raise ValueError("n_embd must be divisible by n_head")
        return config

    @classmethod
    def from_file(cls, path: Path | str) -> GPT2Config:
        return cls.from_dict(json.loads(Path(path).read_text()))


class _Attention(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)


class _MLP(nn.Module):
    def __init__(self, n_embd: int, inner: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, inner)
        self.c_proj = nn.Linear(inner, n_embd)


class _Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = _Attention(config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = _MLP(config.n_embd, config.inner_dim)


class GPT2(nn.Module):
    """GPT-2 inference over a paged KV cache; parameter names match HF's ``GPT2Model``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        )
        self._act = _ACTIVATIONS[config.activation_function]
        scale = config.head_dim**-0.5 if config.scale_attn_weights else 1.0
        inverse = config.scale_attn_by_inverse_layer_idx
        self._scales = [scale / (i + 1) if inverse else scale for i in range(config.n_layer)]
        self._packed_head: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @classmethod
    def load(
        cls,
        folder: Path | str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> GPT2:
        """A HF GPT-2 checkpoint folder: ``config.json`` + ``model.safetensors`` (or its shards)."""
        folder = Path(folder)
        config = GPT2Config.from_file(folder / "config.json")
        state = _read_safetensors(folder)
        model = cls._from_state(config, _hf_to_linear(state, config), dtype, device)
        logger.info("loaded GPT-2 %s (%d layers, %s)", folder, config.n_layer, dtype)
        return model

    @classmethod
    def random(
        cls, config: GPT2Config | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> GPT2:
        """Random weights (GPT-2 small shape by default), for speed tests."""
        config = config or GPT2Config()
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in cls(config).state_dict().items()}
        state = {}
        for name, shape in shapes.items():
            if ".ln_" in name or name.startswith("ln_f"):
                state[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
            elif name.endswith("bias"):
                state[name] = torch.zeros(shape)
            else:
                state[name] = torch.randn(shape, generator=gen) * 0.02
        return cls._from_state(config, state, dtype, "cpu")

    @classmethod
    def _from_state(
        cls,
        config: GPT2Config,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> GPT2:
        with torch.device("meta"):
            model = cls(config)
        state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model = model.eval().requires_grad_(False)
        model.pack_head()
        return model

    @torch.inference_mode()
    def forward(
        self, inp: ModelInput, cache: KVCache, lora: LoRABank | None = None
    ) -> torch.Tensor:
        """Float32 next-token logits ``[len(inp.logits_indices), vocab]``; writes the new
        tokens' keys/values into ``cache``."""
        device = self.device
        plan = AttentionPlan.build(inp, cache.block_size, device, self.dtype)
        step = lora.plan(inp) if lora is not None else None
        x = self.wte(inp.input_ids.to(device)) + self.wpe(inp.positions.to(device))

        def attend(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, scale: float) -> Tensor:
            return paged_attention(q, k, v, kv, plan, scale)

        for i, block in enumerate(self.h):
            x = self._block(i, cast(_Block, block), x, attend, cache.tensor[i], step)
        x = self.ln_f(x.index_select(0, inp.logits_indices.to(device)))
        return self._head(x).float()

    @torch.inference_mode()
    def decode(
        self,
        ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        tables: Tensor,
        lens: Tensor,
        lora_rows: Tensor | None,
        *,
        cache: KVCache,
        lora: LoRABank | None = None,
    ) -> Tensor:
        """One decode token per sequence with fixed-shape inputs, on a GPU: what a CUDA
        graph captures (:mod:`inferd.llm.cuda`). ``tables`` ``[B, max_blocks]`` and
        ``lens`` ``[B]`` (the new token included) address each sequence's keys;
        ``lora_rows`` ``[B]`` is each row's adapter slot (-1: none), None without LoRA.
        Returns float32 logits ``[B, vocab]``."""
        from inferd.llm import cuda

        step = lora.rows_step(lora_rows) if lora is not None and lora_rows is not None else None
        block_size = cache.block_size
        x = self.wte(ids) + self.wpe(positions)

        def attend(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, scale: float) -> Tensor:
            kv[0].index_copy_(0, slots, k)
            kv[1].index_copy_(0, slots, v)
            return cuda.paged_decode(q, kv, tables, lens, block_size, scale)

        for i, block in enumerate(self.h):
            x = self._block(i, cast(_Block, block), x, attend, cache.tensor[i], step)
        return self._head(self.ln_f(x)).float()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_head, None, "none", [], "")
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    def pack_head(self) -> bool:
        """Keep a oneDNN-packed copy of the LM head (float32 on CPU) for :meth:`forward`.

        The head is the largest matmul of a decode step ([tokens, 768] x [768, 50257]
        for GPT-2 small) and MKL's ``F.linear`` runs it far below the other layers'
        rate: on a 2-core AVX2 CPU, 2 threads, the packed oneDNN matmul took 37 vs 57 ms
        at 64 rows and 67 vs 104 ms at 128 (the other linears ran equally fast either
        way). Costs one more copy of the head weights. Returns whether packing is in
        use; where oneDNN is missing, fails or disagrees, ``F.linear`` stays.
        """
        self._packed_head = None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        if not torch.backends.mkldnn.is_available():
            return False
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(head, 64)
            probe = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
            want = F.linear(probe, head)
        except (RuntimeError, AttributeError) as exc:  # no such op in this torch build
            logger.info("LM head stays on F.linear: %s", exc)
            return False
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            logger.warning("oneDNN LM head disagrees with F.linear; not using it")
            return False
        self._packed_head = packed
        return True

    def _block(
        self,
        i: int,
        block: _Block,
        x: Tensor,
        attend: Attend,
        kv_layer: Tensor,
        step: LoRAStep | DenseLoRAStep | None,
    ) -> Tensor:
        n_tok, heads, dim = x.shape[0], self.config.n_head, self.config.head_dim
        qkv = _project(block.attn.c_attn, block.ln_1(x), step, i, "attn.c_attn")
        q, k, v = qkv.view(n_tok, 3, heads, dim).unbind(1)
        att = attend(q, k, v, kv_layer, self._scales[i])
        x = x + _project(block.attn.c_proj, att.reshape(n_tok, -1), step, i, "attn.c_proj")
        hidden = self._act(_project(block.mlp.c_fc, block.ln_2(x), step, i, "mlp.c_fc"))
        return x + _project(block.mlp.c_proj, hidden, step, i, "mlp.c_proj")

    def quantize_fp8(self) -> bool:
        """Put the blocks' linear weights in float8 (e4m3) with one scale per output
        channel; activations are scaled per token at each call (``torch._scaled_mm``).
        Embeddings, layer norms and the LM head stay in the model dtype. Returns False
        (weights unchanged) where the GPU or this PyTorch cannot, or the probe disagrees."""
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (8, 9):
            return False
        linears = [m for block in self.h for m in block.modules() if isinstance(m, nn.Linear)]
        if any(m.in_features % 16 or m.out_features % 16 for m in linears):
            return False
        try:
            probe = _Fp8Linear.of(linears[0])
            x = torch.randn(5, linears[0].in_features, device=self.device, dtype=self.dtype)
            got, want = probe(x).float(), F.linear(x, linears[0].weight, linears[0].bias).float()
        except (RuntimeError, AttributeError) as exc:
            logger.warning("fp8 weights unavailable here (%s): keeping %s", exc, self.dtype)
            return False
        error = float((got - want).norm() / want.norm().clamp_min(1e-6))
        if not error < 0.1:
            logger.warning("fp8 probe off by %.3f relative: keeping %s", error, self.dtype)
            return False
        for block in self.h:
            for parent in (block.attn, block.mlp):
                for name in ("c_attn", "c_proj", "c_fc"):
                    child = getattr(parent, name, None)
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, _Fp8Linear.of(child))
        torch.cuda.empty_cache()
        return True


Tensor = torch.Tensor
Attend = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]
"""``(q, k, v, kv_layer, scale) -> attention``: writes k/v to the layer's cache first."""
FP8_MAX = 448.0


class _Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W in float8 e4m3 (scale per output channel) and x
    quantized per row on the fly; the result in x's dtype."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight, self.scale, self.bias = weight, scale, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, linear: nn.Linear) -> _Fp8Linear:
        w = linear.weight.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        weight = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(weight, scale.t().contiguous(), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xs = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        xq = (rows / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale,
                             out_dtype=x.dtype)  # fmt: skip
        if self.bias is not None:
            y += self.bias  # a separate add: not every build fuses a bias with row scales
        return y.view(*x.shape[:-1], self.out_features)


def _project(
    linear: nn.Module, x: Tensor, step: LoRAStep | DenseLoRAStep | None, layer: int, module: str
) -> Tensor:
    plain = isinstance(linear, nn.Linear)
    y = F.linear(x, linear.weight, linear.bias) if plain else linear(x)  # type: ignore[arg-type]
    if step is not None:
        step.add_(layer, module, x, y)
    return y


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    single = folder / "model.safetensors"
    if single.exists():
        return load_file(single)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors (or its index)")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(folder / shard))
    return state


def _hf_to_linear(state: dict[str, torch.Tensor], config: GPT2Config) -> dict[str, torch.Tensor]:
    """HF key names (with or without ``transformer.``) to ours, Conv1D weights transposed.
    Old checkpoints' causal-mask buffers (``attn.bias``, ``attn.masked_bias``) are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[name] = tensor.t().contiguous() if name.endswith(_CONV1D) else tensor
    return out
