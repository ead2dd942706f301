"""Idle memory of ``inferd serve``, per process: server, gateways, a replica per model.

    .venv/bin/python bench/rss.py [--scenario tabular demo] [--workers 2] [--label after]
    .venv/bin/python bench/rss.py --checkout /tmp/inferd-head --label before

Each scenario starts ``inferd serve`` (scratch data folder, free ports; started and
stopped here), waits until it is ready, answers one request per model, lets it idle
(``--settle``), and reads each process's ``/proc/PID/smaps_rollup``: RSS; PSS (shared
pages divided among the processes that map them, so a tree's PSS adds up without
counting the interpreter's and NumPy's pages once per process); USS (private pages).
It asks only data-plane routes (``/health/ready``, V2 metadata, predict): a gateway
loads the registry's database layer (SQLAlchemy, ~20 MiB) when it first answers a
registry read such as ``GET /api/v1/models``, which serving predictions never does.

- ``tabular``: one scikit-learn model alone, Pipeline(StandardScaler,
  LogisticRegression) on ``make_classification`` (20 features), pushed before start.
- ``demo``: ``inferd serve --demo`` as ``make run`` starts it, first run (the server
  builds the demo models); the demo LLM only with ``--demo-llm`` (it trains for minutes).

Each process's row also lists the frameworks it has mapped (their shared libraries),
which shows an import that should not be there. ``--checkout DIR`` runs the inferd of
another checkout (e.g. a ``git worktree`` of the commit before a change) with this
virtualenv. Writes bench/results/rss.json and rss.md; a run keeps the other labels'
figures already there, so ``before`` and ``after`` sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port, process_tree, start, stop

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FRAMEWORKS = (
    "torch", "sklearn", "scipy", "xgboost", "lightgbm", "onnxruntime", "tokenizers",
    "safetensors", "pandas", "pyarrow", "tensorflow", "grpc", "sqlalchemy", "numpy",
)  # fmt: skip
KINDS = ("server", "gateway", "replica", "other")


def checkout_env(checkout: Path) -> dict[str, str]:
    """Python imports ``inferd`` from ``checkout`` (this one: the editable install)."""
    return {} if checkout.resolve() == ROOT else {"PYTHONPATH": str(checkout.resolve())}


def push_tabular(data: Path, work: Path, checkout: Path) -> None:
    """Train the scikit-learn pipeline and register it with the checkout's own CLI (its
    registry schema is the one its server expects)."""
    import joblib
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(n_samples=2000, n_features=20, random_state=0)
    model = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression())]).fit(x, y)
    folder = work / "src" / "tabular"
    folder.mkdir(parents=True)
    joblib.dump(model, folder / "model.joblib")
    subprocess.run(
        [sys.executable, "-m", "inferd", "models", "push", "tabular", str(folder),
         "--version", "v1", "--data-dir", str(data)],
        cwd=checkout, env={**os.environ, **checkout_env(checkout)}, check=True,
        capture_output=True,
    )  # fmt: skip


def memory_of(pid: int) -> dict[str, float]:
    """RSS, PSS and USS (MiB) and thread count of one process."""
    kib: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        kib[key] = int(rest.split()[0])
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return {
        "rss_mib": kib["Rss"] / 1024,
        "pss_mib": kib["Pss"] / 1024,
        "uss_mib": (kib["Private_Clean"] + kib["Private_Dirty"]) / 1024,
        "threads": threads,
    }


def frameworks_of(pid: int) -> list[str]:
    """The packages of FRAMEWORKS with a file mapped in the process (their extension
    modules, their bundled libraries)."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        _, sep, rest = line.partition("site-packages/")
        if sep:
            top = rest.split("/")[0].removesuffix(".libs").removeprefix("_")
            if top in FRAMEWORKS:
                found.add(top)
    return sorted(found)


def kind_of(pid: int, root: int) -> str:
    """``server``, ``gateway``, ``replica MODEL:VERSION``, or ``other COMMAND``."""
    if pid == root:
        return "server"
    args = [
        a.decode(errors="replace")
        for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if a
    ]
    if "inferd.api.worker" in args:
        return "gateway"
    if "inferd.serving.replica_server" in args:
        spec = json.loads(args[args.index("inferd.serving.replica_server") + 1])
        return f"replica {spec['model']}:{spec['version']}"
    return "other " + " ".join(args)[:80]


def sample(root: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for pid in process_tree(root):
        try:
            kind = kind_of(pid, root)
            rows.append(
                {"kind": kind, "pid": pid, **memory_of(pid), "frameworks": frameworks_of(pid)}
            )
        except (OSError, StopIteration):
            continue  # exited meanwhile
    return sorted(rows, key=lambda r: (KINDS.index(str(r["kind"]).split()[0]), str(r["kind"])))


def ready_models(url: str, expected: int, timeout_s: float) -> list[str]:
    """The models' names, once /health/ready answers with ``expected`` models, all ready.
    Data-plane routes only (the routing table), here and in :func:`answer_once`: a
    registry read (``/api/v1/models``) loads the database layer into the gateway that
    answers it, which serving predictions does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(url + "/health/ready", timeout=5)
            models = reply.json()["models"]
            if reply.status_code == 200 and len(models) >= expected:
                return sorted(models)
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: {expected} models not ready in {timeout_s:.0f}s")


def answer_once(url: str, models: list[str]) -> None:
    """One request per model that takes rows of features or text, so every process has
    served once: what a gateway and a replica keep after their first request counts."""
    for name in models:
        signature = httpx.get(f"{url}/v2/models/{name}", timeout=10).json()
        example = _example(signature)
        if example is not None:
            reply = httpx.post(f"{url}/api/v1/models/{name}/predict", json=example, timeout=60)
            reply.raise_for_status()


def _example(signature: dict[str, list[dict[str, object]]]) -> dict[str, object] | None:
    row: dict[str, object] = {}
    for spec in signature["inputs"]:
        shape = list(spec.get("shape") or [-1])  # type: ignore[call-overload]
        if spec["datatype"] == "BYTES":
            row[str(spec["name"])] = "a fine product"
        elif len(shape) == 2 and shape[1] > 0:
            row[str(spec["name"])] = [0.1] * shape[1]
        else:
            return None  # images and the like: loaded and warmed up is enough here
    return {"inputs": [row]}


def run_scenario(name: str, args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"inferd-bench-rss-{name}-"))
    data = work / "data"
    try:
        if name == "tabular":
            push_tabular(data, work, args.checkout)
        port = free_port()
        cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port),
               "--grpc-port", str(free_port()), "--workers", str(args.workers),
               "--data-dir", str(data)]  # fmt: skip
        if name == "demo":
            cmd.append("--demo")
        env = {"INFERD_LOG_LEVEL": "WARNING", "INFERD_DEMO_LLM": "1" if args.demo_llm else "0"}
        env |= checkout_env(args.checkout) | dict(var.split("=", 1) for var in args.env)
        proc = start(cmd, env, work / "server.log", cwd=args.checkout)
        try:
            url = f"http://127.0.0.1:{port}"
            expected = 1 if name == "tabular" else args.demo_models
            models = ready_models(url, expected, args.timeout)
            answer_once(url, models)
            time.sleep(args.settle)
            rows = sample(proc.pid)
        except Exception:
            print((work / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            stop(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"scenario": name, "models": models, "processes": rows,
            "totals": totals(rows)}  # fmt: skip


def totals(rows: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per kind (the gateways together, the replicas together) and for the whole tree."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        for key in (str(row["kind"]).split()[0], "total"):
            t = out.setdefault(key, {"count": 0, "rss_mib": 0.0, "pss_mib": 0.0, "uss_mib": 0.0})
            t["count"] += 1
            for m in ("rss_mib", "pss_mib", "uss_mib"):
                t[m] += float(row[m])  # type: ignore[arg-type]
    out["total"] = out.pop("total")
    return out


def write_results(label: str, runs: list[dict[str, object]], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "rss.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept[label] = {
        "command": " ".join([".venv/bin/python", "bench/rss.py", *sys.argv[1:]]),
        "checkout": str(args.checkout),
        "cpus": os.cpu_count(),
        "workers": args.workers,
        "runs": runs,
    }
    path.write_text(json.dumps(kept, indent=2) + "\n")
    (RESULTS / "rss.md").write_text(markdown(kept))


def markdown(kept: dict[str, dict[str, object]]) -> str:
    lines = ["# Idle memory of `inferd serve`, MiB (bench/rss.py)", ""]
    for label, result in kept.items():
        lines += [f"## {label}", "", f"`{result['command']}` ({result['cpus']} CPUs)", ""]
        for run in result["runs"]:  # type: ignore[attr-defined]
            lines += [
                f"### {run['scenario']}: {', '.join(run['models'])}", "",
                "| process | RSS | PSS | USS | threads | frameworks mapped |",
                "|---|---|---|---|---|---|",
            ]  # fmt: skip
            for p in run["processes"]:
                lines.append(
                    f"| {p['kind']} | {p['rss_mib']:.0f} | {p['pss_mib']:.0f} | "
                    f"{p['uss_mib']:.0f} | {p['threads']} | {', '.join(p['frameworks'])} |"
                )
            for kind, t in run["totals"].items():
                lines.append(
                    f"| **{kind}** (x{t['count']}) | **{t['rss_mib']:.0f}** | "
                    f"**{t['pss_mib']:.0f}** | **{t['uss_mib']:.0f}** | | |"
                )
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", nargs="+", default=["tabular", "demo"],
                        choices=["tabular", "demo"])  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="gateway processes")
    parser.add_argument("--demo-llm", action="store_true", help="the demo LLM too (slow)")
    parser.add_argument("--demo-models", type=int, default=None,
                        help="models --demo serves (default 6, 8 with the LLM)")  # fmt: skip
    parser.add_argument("--settle", type=float, default=5.0, help="idle seconds before reading")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the inferd to run")
    parser.add_argument("--label", default="current")
    parser.add_argument("--env", nargs="*", default=[], metavar="VAR=VALUE",
                        help="more environment for the server (an experiment)")  # fmt: skip
    args = parser.parse_args()
    if args.demo_models is None:
        args.demo_models = 8 if args.demo_llm else 6
    runs = []
    for name in args.scenario:
        run = run_scenario(name, args)
        runs.append(run)
        for kind, t in run["totals"].items():  # type: ignore[attr-defined]
            print(
                f"{args.label} {name:>8} {kind:>8} x{t['count']:<2} RSS {t['rss_mib']:6.0f} "
                f"MiB  PSS {t['pss_mib']:6.0f} MiB  USS {t['uss_mib']:6.0f} MiB",
                flush=True,
            )
    write_results(args.label, runs, args)


if __name__ == "__main__":
    main()
