"""Starting a replica of a 500 MB version on a cold host vs a warm one (#38): the host's
artifact cache, by content, against an S3-compatible store (moto's standalone server on
127.0.0.1).

    .venv/bin/python bench/artifact_cache.py [--rounds 3] [--size-mb 500]

The version: a Python model whose folder holds a ``--size-mb`` file of random bytes (it
reads only its size at load, so the figures are the files' way to the replica, not a
framework's load), registered with ``inferd models push`` into the store. Per round, in
alternating order:

- cold host: ``inferd serve`` with a fresh data folder and a fresh artifact cache
  (``artifact_cache.dir``), the same database and store: from its start until the
  version's replica is ready (it downloads the files and checks them file by file and
  as a whole against the registered sha256);
- warm host: another ``inferd serve`` with a fresh data folder but the cache folder a
  cold server of this round filled (another server, joined replica or pod of the same
  host): from its start until ready.

Reports the medians of the start times and of the replicas' own ``fetch_s`` (from their
stats). Writes bench/results/artifact_cache.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, moto_s3  # noqa: E402

BUCKET = "inferd-bench-cache"
RESULTS = ROOT / "bench" / "results"
MODEL = """
import os


class Big:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        self.size = os.path.getsize(os.path.join(artifact_dir, "weights.bin"))

    def predict(self, batch):
        return {"y": batch["x"] * 2}
"""


def build(folder: Path, size_mb: int) -> None:
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(MODEL)
    with (folder / "weights.bin").open("wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))


def push(folder: Path, env: dict[str, str], data: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "inferd", "models", "push", "big", str(folder), "--version",
         "v1", "--data-dir", str(data)],
        check=True, capture_output=True, cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip


def start_until_ready(data: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """Seconds from the server's start until the version's replica is ready; the
    replica's own time from its start to its model loaded (``load_s``: the fetch
    included), and its fetch time."""
    began = time.perf_counter()
    server = InferdServer(data, workers=1, env=env)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(server.log()[-3000:])
            try:
                reply = server.client.get("/api/v1/models/big/versions/v1")
            except Exception:  # not listening yet
                time.sleep(0.02)
                continue
            ready = [r for r in reply.json().get("replicas", []) if r["state"] == "ready"]
            if ready and "stats" in ready[0]:
                stats = ready[0]["stats"]
                return time.perf_counter() - began, stats["load_s"], stats["fetch_s"]
            time.sleep(0.02)
        raise RuntimeError(f"not ready in 600 s:\n{server.log()[-3000:]}")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=500)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {"cold host": [], "warm host": []}
    with tempfile.TemporaryDirectory(prefix="inferd-bench-cache-") as tmp:
        work = Path(tmp)
        build(work / "model", args.size_mb)
        with moto_s3(BUCKET) as s3:
            env = {
                **s3,
                "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/models",
                "INFERD_DATABASE_URL": f"sqlite:///{work / 'db' / 'inferd.db'}",
                "INFERD_REGISTRY__INSPECT_TIMEOUT_S": "600",
            }
            (work / "db").mkdir()
            push(work / "model", env, work / "pusher")
            shutil.rmtree(work / "pusher")  # its copy and its cache: no host has it now
            for r in range(args.rounds):
                cache = work / f"cache-{r}"
                shared = {**env, "INFERD_ARTIFACT_CACHE__DIR": str(cache)}
                # the warm host needs a cold one first; alternate which is measured first
                # by warming a spare cache for the warm host in odd rounds
                if r % 2:
                    start_until_ready(work / f"prewarm-{r}", shared)
                    runs["warm host"].append(start_until_ready(work / f"warm-{r}", shared))
                    cold = {**env, "INFERD_ARTIFACT_CACHE__DIR": str(work / f"cold-{r}")}
                    runs["cold host"].append(start_until_ready(work / f"b-{r}", cold))
                else:
                    runs["cold host"].append(start_until_ready(work / f"b-{r}", shared))
                    runs["warm host"].append(start_until_ready(work / f"warm-{r}", shared))
                print(f"round {r + 1}: cold {runs['cold host'][-1]}, warm {runs['warm host'][-1]}",
                      file=sys.stderr, flush=True)  # fmt: skip
                for path in work.glob(f"*-{r}"):
                    shutil.rmtree(path, ignore_errors=True)
    summary = {
        name: {
            "start_s": round(statistics.median(s for s, _, _ in got), 2),
            "load_s": round(statistics.median(s for _, s, _ in got), 3),
            "fetch_s": round(statistics.median(f for _, _, f in got), 3),
        }
        for name, got in runs.items()
    }
    cold, warm = summary["cold host"], summary["warm host"]
    lines = [
        f"Starting a replica of a {args.size_mb} MB version (S3 store, moto on 127.0.0.1): "
        f"`bench/artifact_cache.py --rounds {args.rounds} --size-mb {args.size_mb}`, medians",
        "",
        "| host | server start to ready s | replica start to loaded s | of which fetch s |",
        "|---|---|---|---|",
        f"| cold (empty cache) | {cold['start_s']:.2f} | {cold['load_s']:.3f} "
        f"| {cold['fetch_s']:.3f} |",
        f"| warm (another server of the host fetched it) | {warm['start_s']:.2f} "
        f"| {warm['load_s']:.3f} | {warm['fetch_s']:.3f} |",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "artifact_cache.json").write_text(
        json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=2)
    )
    (RESULTS / "artifact_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
