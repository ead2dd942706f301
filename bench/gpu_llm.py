"""The first design document on a GPU: inferd's engine vs Hugging Face ``generate``.

    python bench/gpu_llm.py --out DIR [--shapes small medium large] [--serve small]
                            [--demo .gpu/tiny-gpt2]

Random-weight GPT-2 shapes (speed does not depend on values), bfloat16, on the first GPU.
Every request: a 128-token prompt, 128 new tokens, greedy, EOS ignored. Per shape, in
one process, one after another on the same GPU:
1. ``hf_static``: HF ``generate`` over the 500 prompts as one static batch (its best
   throughput: every step serves all 500);
2. ``engine``: inferd's engine, the 500 requests added at once (output tokens/s, TTFT
   p50/p99 measured from the add); then with 8 LoRA adapters (rank 16, on all four
   projections) spread over the requests; then fp8 weights;
3. ``single``: one request alone: ms per output token (decode steps, prefill excluded);
4. memory: weights, the KV cache per 256-token sequence, and the largest batch of such
   sequences 90% of the GPU holds beside the weights and a 2 GiB workspace.
``--serve``: the same through ``inferd serve`` (a deployment with ``resources.gpu``):
500 concurrent streamed requests (``inferd bench -c 500``) and an open loop at 20
requests/s, TTFT p50/p99 from the client. ``--demo``: the trained demo model's
perplexity on its corpus, bfloat16 vs fp8 weights.
Writes DIR/gpu_llm.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from inferd.llm.engine import LLMEngine  # noqa: E402
from inferd.llm.loader import engine_for  # noqa: E402
from inferd.replica_config import LLMConfig  # noqa: E402
from inferd.shapes.llm import SamplingParams  # noqa: E402

SHAPES = {
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768},  # 124M
    "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},  # 355M
    "large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},  # 774M
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},  # for a dry run
}
PROMPT, NEW, REQUESTS = 128, 128, int(os.environ.get("BENCH_REQUESTS", "500"))
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")
RATE_S = int(os.environ.get("BENCH_RATE_S", "15"))
"""Seconds of the 20 requests/s open loop through ``inferd serve`` (0: none)."""
"""``cpu``: a dry run of the script's code paths on a machine without a GPU."""


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def model_folder(work: Path, shape: str, tokenizer_from: Path) -> Path:
    """A random-weight GPT-2 of ``shape`` in HF layout, with the 50257-token tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = work / f"gpt2-{shape}"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    torch.manual_seed(0)
    config = GPT2Config(**SHAPES[shape], bos_token_id=50256, eos_token_id=50256)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


SEEDS = itertools.count(100)
"""Every round draws prompts of its own: the engine caches prefixes (``llm.prefix_caching``),
and a round repeating an earlier one's prompts would find them all cached."""


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (count, PROMPT), generator=gen).tolist()


def hf_static(folder: Path, batch: int) -> float:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()
    ids = torch.tensor(prompts(REQUESTS), device=DEVICE)
    with torch.inference_mode():  # warm-up
        model.generate(ids[:batch, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync()
    started = time.perf_counter()
    for i in range(0, REQUESTS, batch):
        part = ids[i : i + batch]
        with torch.inference_mode():
            model.generate(part, attention_mask=torch.ones_like(part), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
    sync()
    del model
    free_engine(None)
    return REQUESTS * NEW / (time.perf_counter() - started)


def run_engine(engine: LLMEngine, count: int, adapters: list[str | None]) -> dict[str, Any]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    hits = engine.scheduler.prefix_hits
    for i, prompt in enumerate(prompts(count, next(SEEDS))):
        name = adapters[i % len(adapters)]
        engine.add_request(f"r{i}", prompt, params, engine.adapters.slot(name))
        added[f"r{i}"] = time.perf_counter()
    started = time.perf_counter()
    tokens = steps = 0
    while engine.has_work():
        for out in engine.step():
            tokens += 1
            first.setdefault(out.request_id, time.perf_counter())
        steps += 1
    elapsed = time.perf_counter() - started
    ttft = sorted(first[r] - added[r] for r in added)
    return {
        "tokens_per_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 3),
        "steps": steps,
        "ttft_p50_ms": round(1e3 * ttft[len(ttft) // 2], 1),
        "ttft_p99_ms": round(1e3 * ttft[int(len(ttft) * 0.99) - 1], 1),
        "cached_tokens": engine.scheduler.prefix_hits - hits,
    }


def single_stream(engine: LLMEngine) -> float:
    """ms per output token of one request alone, decode steps only (median step)."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    engine.add_request("one", prompts(1, next(SEEDS))[0], params)
    times = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return round(1e3 * statistics.median(times[1:]), 3)


def lora_adapters(folder: Path, work: Path, count: int) -> dict[str, str]:
    """``count`` PEFT adapters (rank 16, c_attn/c_proj/c_fc) with random weights."""
    import peft
    from transformers import GPT2LMHeadModel

    base = GPT2LMHeadModel.from_pretrained(folder)
    out = {}
    for i in range(count):
        torch.manual_seed(10 + i)
        config = peft.LoraConfig(r=16, lora_alpha=32, fan_in_fan_out=True, lora_dropout=0.0,
                                 target_modules=["c_attn", "c_proj", "c_fc"])  # fmt: skip
        wrapped = peft.get_peft_model(base, config)
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.01)
        target = work / f"lora-{folder.name}-{i}"
        wrapped.save_pretrained(target)
        out[f"a{i}"] = str(target)
        base = wrapped.unload()
    return out


def settings(**extra: Any) -> LLMConfig:
    kv_mb = int(os.environ.get("BENCH_KV_MB", "24576"))
    base = {"device": DEVICE, "dtype": "bfloat16", "max_num_seqs": 512,
            "max_batched_tokens": 8192, "max_waiting": 4096, "kv_cache_mb": kv_mb,
            "max_adapters": 8, "max_lora_rank": 16}  # fmt: skip
    return LLMConfig(**{**base, **extra})


def free_engine(engine: LLMEngine | None) -> None:
    del engine
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def shape_figures(shape: str, folder: Path, work: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"shape": shape}
    row["hf_static"] = {str(b): round(hf_static(folder, b), 1) for b in (REQUESTS,)}
    adapters = lora_adapters(folder, work, 8)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = engine_for(folder, 4, settings(), adapters)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # type: ignore[attr-defined]
    # Warm-up at full size: Triton's and cuBLAS's first calls at each shape, the
    # allocator's growth; then the base model and 8 adapters alternate.
    run_engine(engine, REQUESTS, sorted(adapters))
    row["engine"] = run_engine(engine, REQUESTS, [None])
    row["engine_lora8"] = run_engine(engine, REQUESTS, sorted(adapters))
    row["single_ms_per_token"] = single_stream(engine)
    cfg = engine.model.config
    kv_per_seq = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * 2 * (PROMPT + NEW)
    _, total = torch.cuda.mem_get_info() if DEVICE == "cuda" else (0, 0)
    kv_now = engine.runner.cache.tensor.numel() * engine.runner.cache.tensor.element_size()
    row["memory"] = {
        "weights_mb": round(weights / 2**20, 1),
        "kv_cache_mb": round(kv_now / 2**20, 1),
        "peak_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)
        if DEVICE == "cuda"
        else None,
        "reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1) if DEVICE == "cuda" else None,
        "kv_per_256_token_seq_mb": round(kv_per_seq / 2**20, 2),
        # sequences of 256 tokens in 90% of the GPU less the weights and 2 GiB
        "largest_batch_256_tokens": int((total * 0.9 - weights - 2**31) // kv_per_seq),
        "gpu_total_mb": round(total / 2**20),
    }
    row["engine_again"] = run_engine(engine, REQUESTS, [None])  # the spread of a figure
    engine.runner.graphs = None
    run_engine(engine, 32, [None])
    row["engine_eager"] = run_engine(engine, REQUESTS, [None])
    row["single_eager_ms_per_token"] = single_stream(engine)
    free_engine(engine)
    engine = engine_for(folder, 4, settings(quantize="fp8"))
    row["fp8_active"] = any(
        type(m).__name__ == "_Fp8Linear"
        for m in engine.model.modules()  # type: ignore[attr-defined]
    )
    run_engine(engine, REQUESTS, [None])
    row["engine_fp8"] = run_engine(engine, REQUESTS, [None])
    row["single_fp8_ms_per_token"] = single_stream(engine)
    free_engine(engine)
    best_hf = max(row["hf_static"].values())
    row["vs_hf"] = round(row["engine"]["tokens_per_s"] / best_hf, 2)
    row["lora8_vs_none"] = round(
        row["engine_lora8"]["tokens_per_s"] / row["engine"]["tokens_per_s"], 2
    )
    print(json.dumps(row), flush=True)
    return row


def perplexity(folder: Path) -> dict[str, float]:
    """Perplexity of the trained demo model on its corpus (1,000 windows of 128
    tokens), bfloat16 vs fp8 weights, through inferd's model (prefill logits)."""
    from tokenizers import Tokenizer

    from inferd.demo.corpus import stdlib_corpus
    from inferd.llm.batch import KVCache, ModelInput
    from inferd.llm.model import GPT2

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.get_vocab_size() - 1
    stream: list[int] = []
    for encoded in tok.encode_batch(stdlib_corpus().paragraphs[:4000], add_special_tokens=False):
        stream += [*encoded.ids, eos]
    windows = min(1000, len(stream) // 128)
    ids = torch.tensor(stream[: 128 * windows]).view(windows, 128)
    out = {}
    for label in ("bfloat16", "fp8"):
        model = GPT2.load(folder, dtype=torch.bfloat16, device=DEVICE)
        if label == "fp8" and not model.quantize_fp8():
            out[label] = float("nan")
            continue
        cfg = model.config
        cache = KVCache(cfg.n_layer, cfg.n_head, cfg.head_dim, 8, 16, torch.bfloat16, DEVICE)
        nll, count = 0.0, 0
        for window in ids:
            inp = ModelInput(
                input_ids=window, positions=torch.arange(128), slot_mapping=torch.arange(128),
                new_lens=[128], context_lens=[0], block_tables=[list(range(8))],
                logits_indices=torch.arange(127), adapter_slots=[-1],
            )  # fmt: skip
            logits = model.forward(inp, cache)
            target = window[1:].to(DEVICE)
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += 127
        out[label] = round(float(torch.tensor(nll / count).exp()), 3)
    return out


PUSH = """
import sys
from pathlib import Path
from inferd.registry import Registry
from inferd.shapes.tensors import Signature, TensorSpec
data, folder = Path(sys.argv[1]), Path(sys.argv[2])
registry = Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts")
signature = Signature((TensorSpec("prompt", "BYTES"),), (TensorSpec("text", "BYTES"),))
registry.push("gpt2", folder, "v1", framework="gpt2", signature=signature,
              metadata={"gpu_memory_gb": 20})
registry.close()
"""
"""Registers the model in a data folder, run by the checkout that will serve it."""


def serve_figures(
    folder: Path, work: Path, out: Path, profile: bool = False, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    from servers import checkout_env, free_port, start, stop, wait_ready

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    env = {"INFERD_LOG_LEVEL": "WARNING", "INFERD_LLM__DTYPE": "bfloat16",
           "INFERD_LLM__MAX_NUM_SEQS": "512", "INFERD_LLM__MAX_BATCHED_TOKENS": "8192",
           "INFERD_LLM__MAX_WAITING": "4096",
           "LLM_STEP_TRACE": str(work / "engine-trace.jsonl"), **(extra or {})}  # fmt: skip
    checkout = Path(env.pop("CHECKOUT", ROOT))  # another checkout's inferd: an A/B
    # registered by the checkout that serves it (an older one reads only its own schema)
    subprocess.run([sys.executable, "-c", PUSH, str(data), str(folder)], check=True,
                   cwd=checkout, env={**os.environ, **checkout_env(checkout)})  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--grpc-port", "-1",
           "--data-dir", str(data)]  # fmt: skip
    proc = start(cmd, env, work / "serve.log", cwd=checkout)
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {}
    try:
        wait_ready(f"{url}/health/ready", 300, 0.5, proc, work / "serve.log")
        import httpx

        deployment: dict[str, Any] = {"model_name": "gpt2", "version": "v1"}
        if DEVICE == "cuda":
            deployment["resources"] = {"gpu": "any", "replicas": 1}
        reply = httpx.post(f"{url}/api/v1/deployments", json=deployment, timeout=60)
        reply.raise_for_status()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            versions = httpx.get(f"{url}/api/v1/deployments/gpt2").json()["versions"]
            if any(r["state"] == "ready" for v in versions for r in v["replicas"]):
                break
            time.sleep(1)
        path = "/api/v1/models/gpt2/generate"
        n = str(REQUESTS)
        bench(url, path, payloads(work, REQUESTS), "-c", n, "-n", n)  # warm-up: graphs, allocator
        before = generation_histograms(httpx.get(f"{url}/metrics").text)
        result["closed_500"] = bench(url, path, payloads(work, REQUESTS), "-c", n, "-n", n)
        after = generation_histograms(httpx.get(f"{url}/metrics").text)
        result["closed_500_replica"] = {k: after[k] - before.get(k, 0) for k in after}
        if RATE_S > 0:
            rate = payloads(work, 20 * RATE_S + 100)
            result["rate_20"] = bench(url, path, rate, "--rate", "20", "-d", f"{RATE_S}s")
        if profile:  # where the server's processes spend a 500-stream round
            spy = out / f"{work.name}.pyspy"
            result["closed_500_profiled"] = profiled(proc.pid, spy, lambda: bench(
                url, path, payloads(work, REQUESTS), "-c", n, "-n", n))  # fmt: skip
        result["cached_tokens"] = cached_tokens(httpx.get(f"{url}/metrics").text)
        pids = [r["pid"] for v in httpx.get(f"{url}/api/v1/deployments/gpt2").json()["versions"]
                for r in v["replicas"]]  # fmt: skip
        query = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        smi = subprocess.run(
            [shutil.which("nvidia-smi") or "true", *query], capture_output=True, text=True
        )
        result["nvidia_smi"] = smi.stdout.strip()
        used = dict(line.split(", ") for line in smi.stdout.strip().splitlines() if ", " in line)
        result["replica_mib"] = [int(used.get(str(pid), 0)) for pid in pids]
        result["budget_gb"] = 20
        result["replica_pids"] = pids
        metrics = httpx.get(f"{url}/metrics").text
        result["metrics_gpu"] = [line for line in metrics.splitlines() if "gpu" in line][:12]
    finally:
        stop(proc)
        trace = work / "engine-trace.jsonl"
        if trace.exists():
            shutil.copy(trace, out / f"engine-trace-{work.name}.jsonl")
    return result


def payloads(work: Path, count: int) -> Path:
    """A file of ``count`` streamed requests with prompts no earlier round sent."""
    seed = next(SEEDS)
    path = work / f"payloads-{seed}.jsonl"
    with path.open("w") as f:
        for prompt in prompts(count, seed):
            f.write(json.dumps({"prompt": prompt, "max_tokens": NEW, "stream": True,
                                "temperature": 0, "ignore_eos": True}) + "\n")  # fmt: skip
    return path


def cached_tokens(metrics: str) -> float:
    """Prompt tokens the replica found in its prefix cache (fresh prompts: about none)."""
    name = "inferd_generation_cached_tokens_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name))  # fmt: skip


def generation_histograms(metrics: str) -> dict[str, float]:
    """The replica's TTFT and queue-time buckets (cumulative counts by bound) from
    ``/metrics``: a round's are the difference of two reads."""
    out = {}
    for line in metrics.splitlines():
        for name in ("inferd_time_to_first_token_seconds_bucket",
                     "inferd_generation_queue_seconds_bucket"):  # fmt: skip
            if line.startswith(name):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                out[f"{name.split('_seconds')[0][7:]} le {bound}"] = float(line.rsplit(" ", 1)[1])
    return out


def profiled(pid: int, out: Path, run: Any, seconds: int = 6) -> Any:
    """``run()`` while py-spy samples the server and its children (gateways, replica)
    for its first ``seconds`` into ``out`` (collapsed stacks per thread, idle included)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return run()
    cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--idle",
           "--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking",
           "--duration", str(seconds)]  # fmt: skip
    sampler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)
    try:
        return run()
    finally:
        try:
            _, err = sampler.communicate(timeout=seconds + 30)
            print("py-spy:", err.decode()[-300:], flush=True)
        except subprocess.TimeoutExpired:
            sampler.kill()


def bench(url: str, path: str, payloads: Path, *args: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "r.json"
    subprocess.run(
        [sys.executable, "-m", "inferd", "bench", url, "--path", path, "--payloads",
         str(payloads), "--warmup", "0s", "--timeout", "600s", "--seed", "1", "--json",
         str(out), *args],
        check=True, cwd=ROOT,
    )  # fmt: skip
    level = dict(json.loads(out.read_text())["levels"][0])
    keep = ("requests", "successes", "errors", "errors_by_kind", "rps", "output_tokens_per_s",
            "ttft", "itl", "latency", "client_cpu")  # fmt: skip
    return {k: v for k, v in level.items() if k in keep}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VAL,KEY=VAL`` -> (``_NAME``, its environment)."""
    name, _, pairs = text.partition(":")
    return f"_{name}", dict(pair.split("=", 1) for pair in pairs.split(",") if pair)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--shapes", nargs="*", default=["small", "large", "medium"])
    parser.add_argument("--serve", nargs="*", default=["small"])
    parser.add_argument("--demo", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="a third 500-stream round under py-spy (OUT/*.pyspy)")  # fmt: skip
    parser.add_argument("--serve-variant", action="append", default=[],
                        help="NAME:KEY=VAL,...: serve again with these settings "
                             "(CHECKOUT=DIR: that checkout's inferd)")  # fmt: skip
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="inferd-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (dry run)"
    results: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__}
    from inferd.demo.llm import random_gpt2_small

    small = (
        random_gpt2_small(work)
        if not (work / "gpt2-small-random").exists()
        else work / "gpt2-small-random"
    )
    folders = {"small": small}
    for shape in {*args.shapes, *args.serve}:
        folders.setdefault(shape, model_folder(work, shape, small))

    def save() -> None:
        (args.out / "gpu_llm.json").write_text(json.dumps(results, indent=2))

    if args.demo:
        try:
            results["perplexity_demo"] = perplexity(args.demo)
        except Exception as exc:  # a figure missing must not stop the others
            results["perplexity_demo"] = repr(exc)
        print("perplexity", results["perplexity_demo"], flush=True)
        save()

    variants = [("", {}), *map(parse_variant, args.serve_variant)]

    def serve() -> None:
        for (name, extra), shape in itertools.product(variants, args.serve):
            key = f"serve_{shape}{name}"
            try:
                results[key] = serve_figures(
                    folders[shape], work / key, args.out, args.profile and not name, extra
                )
            except Exception as exc:
                results[key] = repr(exc)
            print("serve", key, json.dumps(results[key]), flush=True)
            save()

    if not args.shapes:
        serve()
    for i, shape in enumerate(args.shapes):
        try:
            results[shape] = shape_figures(shape, folders[shape], work)
        except Exception as exc:
            results[shape] = repr(exc)
            print(shape, repr(exc), flush=True)
        save()
        if i == 0:  # the first shape's figures, then the server's, then the larger shapes
            serve()
    os.sync()


if __name__ == "__main__":
    main()
