"""vLLM behind inferd vs vLLM's own OpenAI server; inferd's engine vs vLLM; structured outputs.

    .venv/bin/python bench/vllm_engine.py [--requests 500] [--dtype bfloat16] [--rate-seconds 30]

Needs ``make vllm`` (vLLM's CPU build in .venv-vllm). One GPT-2-small-shaped model
(124M, random weights: speed does not depend on values), 2 CPU threads, prompts of 32
token ids, 64 new tokens each, greedy, EOS ignored, streamed, through ``/v1/completions``
on both servers (the same request bodies). One server at a time, in this order:

1. **vllm-server**: ``python -m vllm.entrypoints.openai.api_server`` (vLLM's own);
2. **inferd-vllm**: ``inferd serve`` with the version on ``engine: vllm`` and the
   platform on: API-key auth, the inference log, metrics, one gateway process;
3. **inferd-own**: ``inferd serve`` with inferd's own engine (same dtype).

Both vLLM runs use the same engine settings (max 256 sequences, eager mode, prefix
caching, 4 GiB of KV cache). For each: a closed loop of ``--requests`` requests at 64
and at 256 concurrent streams (output tokens/s), and an open loop at 2 requests/s for
``--rate-seconds`` (TTFT p50/p99). Then, on inferd with each engine, structured outputs:
chat completions at 64 streams, every request with a JSON schema (a string of 200+
characters, so every answer is 64 tokens, as unconstrained ones are) vs none.

Writes bench/results/vllm_engine_<dtype>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from servers import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NEW_TOKENS = 64
PROMPT_TOKENS = 32
MODEL = "gpt2s"
MAX_SEQS = 256
KV_GIB = 4
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 200, "maxLength": 400}},
    "required": ["text"],
    "additionalProperties": False,
}


def payloads(path: Path, count: int, **extra: Any) -> Path:
    rng = random.Random(1)
    with path.open("w") as out:
        for _ in range(count):
            body = {
                "model": MODEL,
                "prompt": [rng.randrange(50000) for _ in range(PROMPT_TOKENS)],
                "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, **extra,
            }  # fmt: skip
            out.write(json.dumps(body) + "\n")
    return path


def chat_payloads(path: Path, count: int, schema: dict[str, Any] | None) -> Path:
    rng = random.Random(2)
    words = ["server", "model", "token", "batch", "stream", "engine", "cache", "replica"]
    with path.open("w") as out:
        for _ in range(count):
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": " ".join(rng.choices(words, k=24))}],
                "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            if schema is not None:
                body["response_format"] = {
                    "type": "json_schema", "json_schema": {"name": "text", "schema": schema}
                }  # fmt: skip
            out.write(json.dumps(body) + "\n")
    return path


def bench(url: str, path: str, bodies: Path, headers: list[str], *args: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "r.json"
    hdr = [x for h in headers for x in ("-H", h)]
    subprocess.run(
        [sys.executable, "-m", "inferd", "bench", url, "--path", path, "--payloads", str(bodies),
         "--warmup", "0s", "--timeout", "1800s", "--seed", "1", "--json", str(out), *hdr, *args],
        check=True, cwd=ROOT,
    )  # fmt: skip
    return dict(json.loads(out.read_text())["levels"][0])


def loops(url: str, bodies: Path, headers: list[str], n: int, rate_s: int) -> dict[str, Any]:
    path = "/v1/completions"
    return {
        "c64": bench(url, path, bodies, headers, "-c", "64", "-n", str(n)),
        "c256": bench(url, path, bodies, headers, "-c", "256", "-n", str(n)),
        "rate2": bench(url, path, bodies, headers, "--rate", "2", "-d", f"{rate_s}s"),
    }


def vllm_env() -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": "2",
    }


def vllm_server(model_dir: Path, dtype: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--dtype", dtype, "--max-num-seqs", str(MAX_SEQS),
        "--enforce-eager", "--enable-prefix-caching", "--seed", "0", "--port", str(port),
        "--host", "127.0.0.1",
    ]  # fmt: skip
    proc = start(cmd, vllm_env(), work / "vllm-server.log")
    return proc, f"http://127.0.0.1:{port}"


def inferd_server(
    data: Path, dtype: str, work: Path, name: str
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **vllm_env(),
        "INFERD_LOG_LEVEL": "WARNING",
        "INFERD_REPLICA_THREADS": "2",
        "INFERD_GATEWAY_WORKERS": "1",
        "INFERD_LLM__DTYPE": dtype,
        "INFERD_LLM__MAX_NUM_SEQS": str(MAX_SEQS),
        "INFERD_LLM__KV_CACHE_MB": str(KV_GIB * 1024),
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_INFERENCE_LOG__ENABLED": "true",
    }
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--grpc-port", "-1",
           "--data-dir", str(data)]  # fmt: skip
    return start(cmd, env, work / f"{name}.log"), f"http://127.0.0.1:{port}"


def register(work: Path, model_dir: Path, engine: str) -> tuple[Path, str]:
    """A data folder with the model registered on ``engine``, and an API key for it."""
    from inferd.registry import Registry
    from inferd.shapes.tensors import Signature, TensorSpec

    data = work / f"data-{engine}"
    registry = Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts")
    signature = Signature((TensorSpec("prompt", "BYTES"),), (TensorSpec("text", "BYTES"),))
    registry.push(MODEL, model_dir, "v1", framework="gpt2", signature=signature,
                  metadata={"engine": engine})  # fmt: skip
    _, key = registry.keys.create("bench", ["infer"], None, "bench")
    registry.close()
    return data, key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--structured-requests", type=int, default=256)
    parser.add_argument("--rate-seconds", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        sys.exit("vLLM is not installed: run `make vllm` first")
    from inferd.demo.llm import random_gpt2_small

    work = Path(tempfile.mkdtemp(prefix="inferd-vllm-bench-"))
    model_dir = random_gpt2_small(work)
    bodies = payloads(work / "completions.jsonl", max(args.requests, 256))
    free = chat_payloads(work / "chat-free.jsonl", args.structured_requests, None)
    guided = chat_payloads(work / "chat-schema.jsonl", args.structured_requests, LONG_TEXT)
    results: dict[str, Any] = {"args": vars(args), "cpu_count": os.cpu_count()}
    n, s = args.requests, str(args.structured_requests)

    proc, url = vllm_server(model_dir, args.dtype, work)
    try:
        wait_ready(f"{url}/health", timeout_s=600, poll_s=1)
        results["vllm-server"] = loops(url, bodies, [], n, args.rate_seconds)
    finally:
        stop(proc)

    for engine, name in (("vllm", "inferd-vllm"), ("inferd", "inferd-own")):
        data, key = register(work, model_dir, engine)
        auth = [f"Authorization: Bearer {key}"]
        proc, url = inferd_server(data, args.dtype, work, name)
        try:
            wait_ready(f"{url}/health/ready", timeout_s=600, poll_s=1)
            if engine == "vllm":
                results[name] = loops(url, bodies, auth, n, args.rate_seconds)
            else:
                c64 = bench(url, "/v1/completions", bodies, auth, "-c", "64", "-n", str(n))
                results[name] = {"c64": c64}
            chat = "/v1/chat/completions"
            results[name]["chat_free_c64"] = bench(url, chat, free, auth, "-c", "64", "-n", s)
            results[name]["chat_schema_c64"] = bench(url, chat, guided, auth, "-c", "64", "-n", s)
        finally:
            stop(proc)
    write(results)


def _tps(level: dict[str, Any]) -> float:
    return float(level["output_tokens_per_s"])


def write(results: dict[str, Any]) -> None:
    server, ours, own = results["vllm-server"], results["inferd-vllm"], results["inferd-own"]
    summary = {
        "inferd_vllm_vs_vllm_server_tokens_per_s_c64": _tps(ours["c64"]) / _tps(server["c64"]),
        "inferd_vllm_vs_vllm_server_tokens_per_s_c256": _tps(ours["c256"]) / _tps(server["c256"]),
        "ttft_ms_rate2": {
            name: {"p50": r["rate2"]["ttft"]["p50"], "p99": r["rate2"]["ttft"]["p99"]}
            for name, r in (("vllm-server", server), ("inferd-vllm", ours))
        },
        "own_engine_vs_vllm_server_tokens_per_s_c64": _tps(own["c64"]) / _tps(server["c64"]),
        "structured_vs_free_tokens_per_s": {
            name: _tps(r["chat_schema_c64"]) / _tps(r["chat_free_c64"])
            for name, r in (("inferd-vllm", ours), ("inferd-own", own))
        },
    }
    results["summary"] = summary
    RESULTS.mkdir(parents=True, exist_ok=True)
    dtype = results["args"]["dtype"]
    (RESULTS / f"vllm_engine_{dtype}.json").write_text(json.dumps(results, indent=2))
    print(f"{'run':<32}{'tokens/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'errors':>8}")
    for name in ("vllm-server", "inferd-vllm", "inferd-own"):
        for level, r in results[name].items():
            ttft = r.get("ttft") or {}
            print(f"{name + ' ' + level:<32}{_tps(r):>10.1f}{ttft.get('p50', 0):>13.1f}"
                  f"{ttft.get('p99', 0):>13.1f}{r['errors']:>8}")  # fmt: skip
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
