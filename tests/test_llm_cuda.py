"""inferd's engine on a GPU (inferd/llm/cuda.py and the device-aware paths).

Three tiers:
* here, always: the dense multi-LoRA step equals the grouped one, batched sampling keeps
  the sampling rules, the ``llm.device``/``dtype``/``quantize`` settings;
* here, where Triton is importable (not in CI): the paged decode kernel and the graph
  step's fixed-shape inputs, run by Triton's interpreter on the CPU;
* on an NVIDIA GPU (marked ``gpu``; skipped without one): greedy tokens equal Hugging
  Face ``generate`` on the same GPU and dtype with and without a LoRA adapter, graphs
  equal eager steps, and 500 concurrent streams through ``inferd serve`` complete with
  no error while the replica stays inside its GPU budget.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.engine import LLMEngine
from inferd.llm.loader import engine_for, resolve_device
from inferd.llm.lora import LoRAAdapter, LoRABank
from inferd.llm.model import GPT2
from inferd.llm.sampling import _draw_rows
from inferd.llm.sequence import Sequence
from inferd.replica_config import LLMConfig
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2

CUDA = torch.cuda.is_available()
if not CUDA and importlib.util.find_spec("triton") is not None:
    # Triton's interpreter must be chosen before triton is first imported (its library
    # functions are jitted at import): whoever imports it next in this process gets it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs Triton (on GPU machines; on a CPU: pip install triton, run interpreted)",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("gpt2-tiny"))


@pytest.fixture(scope="module")
def adapter_dirs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two PEFT adapters with random (non-zero) B: c_attn rank 4; all four projections
    rank 8."""
    import peft
    from transformers import GPT2LMHeadModel

    base = GPT2LMHeadModel.from_pretrained(tiny).eval()
    specs = [
        {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]},
        {"r": 8, "lora_alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"]},
    ]
    out = []
    for seed, spec in enumerate(specs):
        torch.manual_seed(100 + seed)
        config = peft.LoraConfig(fan_in_fan_out=True, lora_dropout=0.0, **spec)
        wrapped = peft.get_peft_model(copy.deepcopy(base), config).eval()
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.3)
        folder = tmp_path_factory.mktemp(f"lora-{seed}")
        wrapped.save_pretrained(folder)
        out.append(folder)
    return out


def _decode_input(model: GPT2, cache: KVCache, lens: list[int], slots: list[int]) -> ModelInput:
    """A pure-decode step for sequences of ``lens`` (the new token included), their
    blocks shuffled across the cache, after their contexts were written at random."""
    bs = cache.block_size
    free = list(range(cache.num_blocks - 1))  # the last block is the graphs' scratch
    random.Random(7).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    gen = torch.Generator().manual_seed(3)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(cache.tensor.dtype))
    vocab = model.config.vocab_size
    return ModelInput(
        input_ids=torch.randint(0, vocab, (len(lens),), generator=gen),
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor(
            [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
        ),
        new_lens=[1] * len(lens),
        context_lens=[n - 1 for n in lens],
        block_tables=tables,
        logits_indices=torch.arange(len(lens)),
        adapter_slots=slots,
    )


# -- here, always ---------------------------------------------------------------------


def test_dense_lora_step_equals_the_grouped_one(tiny: Path, adapter_dirs: list[Path]) -> None:
    """The GPU's layout (all slots side by side, a mask per token) gives the logits the
    CPU's per-adapter loop gives, for a batch mixing two adapters and the base model,
    prefill chunks and decodes."""
    model = GPT2.load(tiny)
    banks = [LoRABank(model.config, 3, 8, dense=dense) for dense in (False, True)]
    for bank in banks:
        for slot, folder in enumerate(adapter_dirs):
            bank.load(slot, LoRAAdapter.load(folder))
    logits = []
    for bank in banks:
        cache = KVCache(model.config.n_layer, model.config.n_head, model.config.head_dim, 64, 4)
        inp = _decode_input(model, cache, [9, 3, 17, 5], [1, -1, 0, 1])
        # make the second sequence a prefill chunk of 3 tokens
        inp.input_ids = torch.cat([inp.input_ids[:1], torch.tensor([5, 6, 7]), inp.input_ids[2:]])
        table = inp.block_tables[1]
        bs = cache.block_size
        inp.positions = torch.cat([inp.positions[:1], torch.arange(3), inp.positions[2:]])
        chunk_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(3)])
        inp.slot_mapping = torch.cat([inp.slot_mapping[:1], chunk_slots, inp.slot_mapping[2:]])
        inp.new_lens, inp.context_lens[1] = [1, 3, 1, 1], 0
        inp.logits_indices = torch.tensor([0, 3, 4, 5])
        logits.append(model.forward(inp, cache, bank))
    assert banks[1].plan(inp).__class__.__name__ == "DenseLoRAStep"
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    banks[1].unload(1)
    assert not banks[1].b_dense["attn.c_attn"][:, :, 8:16].any()


def test_batched_sampling_keeps_the_rules() -> None:
    """The batched draw (a GPU's, for unseeded rows) keeps top-k, top-p and temperature:
    top_k=1 and a tiny top_p give the argmax; top_k=3 never leaves the top three."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen)
    seqs = [
        Sequence("a", [1], SamplingParams(temperature=1.0, top_k=1)),
        Sequence("b", [1], SamplingParams(temperature=0.7, top_p=1e-6)),
        Sequence("c", [1], SamplingParams(temperature=2.0, top_k=3)),
        Sequence("d", [1], SamplingParams(temperature=1.0)),
    ]
    top3 = set(logits[2].topk(3).indices.tolist())
    seen: set[int] = set()
    for _ in range(200):
        a, b, c, d = _draw_rows(logits, [0, 1, 2, 3], seqs)
        assert a == int(logits[0].argmax()) and b == int(logits[1].argmax())
        assert c in top3
        seen.add(d)
    assert len(seen) > 20  # the untruncated row really samples


def test_device_settings() -> None:
    assert LLMConfig().device == "auto" and LLMConfig().dtype == "auto"
    for bad in ({"device": "tpu"}, {"dtype": "int4"}, {"quantize": "int3"}):
        with pytest.raises(ValueError):
            LLMConfig(**bad)
    if not CUDA:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="sees no GPU"):
            resolve_device("cuda")


def test_auto_on_a_cpu_is_float32_and_fp8_is_refused_with_a_warning(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if CUDA:
        pytest.skip("checks the CPU default")
    engine = engine_for(tiny, 1, LLMConfig(quantize="fp8", kv_cache_mb=1))
    assert engine.device.type == "cpu" and engine.config.dtype == torch.float32
    assert engine.runner.graphs is None
    assert "fp8 needs a GPU" in caplog.text


def _staggered(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of ``prompts`` arriving one per step: after the first, every step
    decodes the earlier ones while it prefills the newest (the steps a burst makes)."""
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for item in engine.step():
            if item.token_id is not None:
                out[item.request_id].append(item.token_id)
    return list(out.values())


class _EagerGraphs:
    """Stands in for :class:`inferd.llm.cuda.DecodeGraphs` on a CPU (CUDA graphs need a
    GPU): takes the same pure-decode steps and computes them with the eager pass, so
    the engine's split of a mixed step (decodes from "the graph", chunks eagerly) is
    checked here; on a GPU the real graphs are (``test_cuda_mixed_steps_...``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.runs: list[int] = []

    def fits(self, inp: ModelInput) -> bool:
        n = len(inp.new_lens)
        return inp.logits_indices.numel() == n and all(k == 1 for k in inp.new_lens)

    def run(self, inp: ModelInput) -> torch.Tensor:
        self.runs.append(len(inp.new_lens))
        engine = self.engine
        return engine.model.forward(inp, engine.runner.cache, engine.lora)  # type: ignore[no-any-return]


def test_a_mixed_step_runs_its_decodes_apart_and_gives_the_same_tokens(tiny: Path) -> None:
    """With graphs, a step of decodes and prefill chunks runs its decodes in a graph and
    its chunks eagerly; the tokens are those of one eager pass over the whole step."""
    settings = LLMConfig(max_num_seqs=8, kv_cache_mb=16, max_batched_tokens=64)
    rng = random.Random(11)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 30, 12, 70, 3, 21)]
    want = _staggered(engine_for(tiny, 1, settings), prompts, 12)
    engine = engine_for(tiny, 1, settings)
    stand_in = _EagerGraphs(engine)
    engine.runner.graphs = stand_in
    got = _staggered(engine, prompts, 12)
    assert got == want
    assert len(stand_in.runs) > 12 and max(stand_in.runs) >= 5  # decodes and split steps


# -- Triton's interpreter on the CPU --------------------------------------------------


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels run by its interpreter on CPU tensors. (Its ``__index__`` of a
    loaded scalar fails under NumPy 2: patched to read the one element.)"""
    if CUDA:
        pytest.skip("the GPU runs the kernel for real (test_cuda_greedy_equals_hf_generate)")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    from inferd.llm import cuda

    cuda._kernel.cache_clear()
    yield
    cuda._kernel.cache_clear()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_decode_matches_attention(interpreted: None, dtype: torch.dtype) -> None:
    from inferd.llm import cuda

    heads, dim, bs = 3, 64, 4
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 48 * bs, heads, dim, generator=gen).to(dtype)
    lens = [1, 4, 5, 31, 70, 33]
    free = list(range(48))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = cuda.paged_decode(q, kv, table, torch.tensor(lens, dtype=torch.int32), bs, 0.125)
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(n)])
        k, v = kv[0][slots].float(), kv[1][slots].float()
        weights = (torch.einsum("hd,thd->ht", q[b].float(), k) * 0.125).softmax(-1)
        want = torch.einsum("ht,thd->hd", weights, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].float(), want, rtol=tol, atol=tol)


@needs_triton
def test_graph_step_inputs_decode_as_forward_does(
    interpreted: None, tiny: Path, adapter_dirs: list[Path]
) -> None:
    """What a decode graph computes (staged fixed-shape inputs, padding rows writing the
    scratch block, LoRA rows), run eagerly: the logits of ``forward`` for the same step."""
    from inferd.llm.cuda import DecodeGraphs

    model = GPT2.load(tiny)
    bank = LoRABank(model.config, 2, 8, dense=True)
    bank.load(0, LoRAAdapter.load(adapter_dirs[1]))
    cfg = model.config
    cache = KVCache(cfg.n_layer, cfg.n_head, cfg.head_dim, 41, 4)
    inp = _decode_input(model, cache, [1, 6, 13, 40, 8], [0, -1, 0, -1, -1])
    want = model.forward(inp, cache, bank)
    before = cache.tensor.clone()
    _decode_input(model, cache, [1], [-1])  # the same random contents again

    def forward(*args: Any) -> torch.Tensor:
        return model.decode(*args, cache=cache, lora=bank)

    graphs = DecodeGraphs(forward, cache, 8, 32, bank, scratch_block=40)
    assert graphs.fits(inp)
    bucket, with_lora = graphs.stage(inp)
    assert (bucket, with_lora) == (8, True)
    got = graphs._call(bucket, with_lora)[: len(inp.new_lens)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the padding rows wrote only the scratch block
    scratch = slice(40 * 4, 41 * 4)
    outside = torch.ones(cache.tensor.shape[2], dtype=torch.bool)
    outside[scratch] = False
    torch.testing.assert_close(cache.tensor[:, :, outside], before[:, :, outside])


# -- on a GPU -------------------------------------------------------------------------


def _greedy(
    engine: LLMEngine, prompts: list[list[int]], n: int, adapter: str | None
) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, engine.adapters.slot(adapter))
        out[f"r{i}"] = []
    while engine.has_work():
        for item in engine.step():
            if item.token_id is not None:
                out[item.request_id].append(item.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _hf_greedy(
    folder: Path, adapter: Path | None, prompts: list[list[int]], n: int, dtype: torch.dtype
) -> list[list[int]]:
    from transformers import GPT2LMHeadModel

    hf: Any = GPT2LMHeadModel.from_pretrained(folder, dtype=dtype).cuda().eval()
    if adapter is not None:
        import peft

        hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(got[0, len(prompt) :].tolist())
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA); this machine has none")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_greedy_equals_hf_generate(
    tiny: Path, adapter_dirs: list[Path], dtype: str, graphs: bool
) -> None:
    settings = LLMConfig(device="cuda", dtype=dtype, max_num_seqs=8, kv_cache_mb=16,
                         max_adapters=2, max_lora_rank=8, cuda_graphs=graphs)  # fmt: skip
    engine = engine_for(tiny, 1, settings, {"lo": str(adapter_dirs[1])})
    assert engine.device.type == "cuda" and (engine.runner.graphs is not None) == graphs
    rng = random.Random(5)
    vocab = engine.vocab_size or 300
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (3, 17, 40, 9)]
    torch_dtype = getattr(torch, dtype)
    for adapter, folder in ((None, None), ("lo", adapter_dirs[1])):
        got = _greedy(engine, prompts, 24, adapter)
        want = _hf_greedy(tiny, folder, prompts, 24, torch_dtype)
        if dtype == "float32":
            assert got == want, (adapter, got, want)
        else:  # bf16 roundings differ between kernels: a near-tie may flip late
            same = sum(g[:8] == w[:8] for g, w in zip(got, want, strict=True))
            assert same >= 3, (adapter, got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA); this machine has none")
def test_cuda_mixed_steps_with_graphs_equal_eager_steps(tiny: Path) -> None:
    """Prompts arriving while others decode: with graphs, those steps run their decodes
    from a graph and their chunks eagerly; float32 tokens equal all-eager steps'."""
    settings = dict(device="cuda", dtype="float32", max_num_seqs=16, kv_cache_mb=16,
                    max_batched_tokens=64)  # fmt: skip
    rng = random.Random(12)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 30, 12, 70, 3, 21, 9, 44)]
    eager = engine_for(tiny, 1, LLMConfig(**settings, cuda_graphs=False))
    want = _staggered(eager, prompts, 16)
    graphs = engine_for(tiny, 1, LLMConfig(**settings, cuda_graphs=True))
    assert graphs.graphs is not None
    assert _staggered(graphs, prompts, 16) == want


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA); this machine has none")
def test_cuda_cached_prefixes_and_adapters_loaded_on_demand_equal_hf(
    tiny: Path, adapter_dirs: list[Path]
) -> None:
    """On the GPU, prompts sharing 70 tokens reuse each other's cached blocks (their
    first chunk attends to cached context) and two adapters take turns in one slot of
    the dense bank, loaded when a request needs them: float32 tokens equal HF's and
    PEFT's ``generate``."""
    settings = LLMConfig(device="cuda", dtype="float32", max_num_seqs=8, kv_cache_mb=16,
                         max_adapters=1, max_lora_rank=8)  # fmt: skip
    adapters = {"qkv": str(adapter_dirs[0]), "all": str(adapter_dirs[1])}
    engine = engine_for(tiny, 1, settings, adapters)
    assert engine.config.prefix_caching and engine.runner.graphs is not None
    rng = random.Random(7)
    vocab = engine.vocab_size or 300
    shared = [rng.randrange(vocab - 1) for _ in range(70)]
    prompts = [shared + [rng.randrange(vocab - 1) for _ in range(n)] for n in (1, 9, 20)]
    hits, loads = engine.scheduler.prefix_hits, engine.adapters.loads
    for adapter in (None, "qkv", "all", "qkv"):
        assert engine.adapters.ensure(adapter) is not None
        got = [_greedy(engine, [prompt], 16, adapter)[0] for prompt in prompts]
        folder = None if adapter is None else Path(adapters[adapter])
        assert got == _hf_greedy(tiny, folder, prompts, 16, torch.float32), adapter
    # each round's second and third prompts found the shared prompt's 4 full blocks
    assert engine.scheduler.prefix_hits - hits >= 4 * 2 * 64
    assert engine.adapters.loads - loads == 2  # "all", then "qkv" again


async def _streams(url: str, model: str, count: int, tokens: int) -> tuple[int, list[str]]:
    import httpx

    errors: list[str] = []
    done = 0
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal done
            body = {"model": model, "prompt": f"Request {i} says", "max_tokens": tokens,
                    "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
            chunks = 0
            try:
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    if reply.status_code != 200:
                        errors.append(f"{reply.status_code} {(await reply.aread())[:200]!r}")
                        return
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                if chunks < tokens // 2:
                    errors.append(f"request {i}: {chunks} chunks")
                else:
                    done += 1
            except httpx.HTTPError as exc:
                errors.append(repr(exc))

        await asyncio.gather(*(one(i) for i in range(count)))
    return done, errors


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA); this machine has none")
def test_500_streams_on_the_gpu_inside_the_budget(tmp_path: Path) -> None:
    from inferd.demo.llm import random_gpt2_small
    from tests.conftest import gpu_memory_by_pid, push_folder, served

    folder = random_gpt2_small(tmp_path / "models")
    budget_gb = 6.0
    push_folder(tmp_path / "data", "gpt2", folder, gpu_memory_gb=budget_gb)
    env = {"INFERD_LLM__MAX_NUM_SEQS": "512", "INFERD_LLM__MAX_BATCHED_TOKENS": "8192",
           "INFERD_LLM__MAX_WAITING": "2048"}  # fmt: skip
    with served(tmp_path / "data", env=env, ready_timeout_s=300) as server:
        reply = server.client.post(
            "/api/v1/deployments",
            json={"model_name": "gpt2", "version": "v1", "resources": {"gpu": "any"}},
        )
        assert reply.status_code == 201, reply.text
        server.wait_for(
            lambda: any(
                r["state"] == "ready"
                for v in server.client.get("/api/v1/deployments/gpt2").json()["versions"]
                for r in v["replicas"]
            ),
            timeout_s=300,
            what="the GPU replica",
        )
        done, errors = asyncio.run(_streams(server.url, "gpt2", 500, 32))
        assert errors == [] and done == 500, errors[:5]
        (version,) = server.client.get("/api/v1/deployments/gpt2").json()["versions"]
        pids = {r["pid"] for r in version["replicas"] if r["state"] == "ready"}
        used = gpu_memory_by_pid()
        assert pids and pids <= set(used), (pids, used)
        for pid in pids:
            assert used[pid] * 2**20 <= budget_gb * 1e9, (used[pid], budget_gb)
        metrics = server.client.get("/metrics").text
        assert "inferd_gpu_memory_used_bytes" in metrics
        print(json.dumps({"replica_mib": [used[p] for p in pids], "budget_gb": budget_gb}))


def test_batched_first_chunks_equal_per_sequence_prefill(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's batched first-chunk prefill (right-padded, one causal SDPA per group),
    run here on the CPU: the logits and cache contents of the per-sequence path, for
    prompts of different lengths beside a decode and a later chunk."""
    from inferd.llm import attention

    model = GPT2.load(tiny)
    cfg = model.config
    results = []
    for batched in (False, True):
        devices = {"cpu"} if batched else set()
        monkeypatch.setattr(attention, "BATCHED_FIRST_CHUNKS", frozenset(devices))
        cache = KVCache(cfg.n_layer, cfg.n_head, cfg.head_dim, 64, 4)
        inp = _decode_input(model, cache, [9, 2, 2, 2, 30], [-1] * 5)
        bs = cache.block_size
        # rows 1..3 become first chunks of 5, 2 and 11 tokens; row 4 a later chunk of 3
        lens = {1: 5, 2: 2, 3: 11}
        ids, pos, slots, new_lens, ctx, tables = [], [], [], [], [], []
        gen = torch.Generator().manual_seed(4)
        for row in range(5):
            table = inp.block_tables[row]
            if row in lens:
                n, c = lens[row], 0
                table = table + [60 - row] * 4  # room for the longer prompts
            elif row == 4:
                n, c = 3, 27
            else:
                n, c = 1, 8
            ids += torch.randint(0, cfg.vocab_size - 1, (n,), generator=gen).tolist()
            pos += range(c, c + n)
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            new_lens.append(n)
            ctx.append(c)
            tables.append(table)
        inp = ModelInput(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos),
            slot_mapping=torch.tensor(slots), new_lens=new_lens, context_lens=ctx,
            block_tables=tables, logits_indices=torch.cumsum(torch.tensor(new_lens), 0) - 1,
            adapter_slots=[-1] * 5,
        )  # fmt: skip
        plan = attention.AttentionPlan.build(inp, bs, torch.device("cpu"), torch.float32)
        assert len(plan.first_chunks) == (1 if batched else 0)
        results.append((model.forward(inp, cache), cache.tensor.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
