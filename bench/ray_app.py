"""The same scikit-learn classifier behind Ray Serve, for bench/latency.py.

    .venv-ray/bin/python bench/ray_app.py --port 8080 --model model.joblib \\
        [--name tabular] [--labels negative,positive] [--replicas 2] [--replica-cpus 1]

Runs under ``.venv-ray`` (``make bench-ray``: ``ray[serve]``, scikit-learn and numpy
from PyPI), never inferd's virtualenv. Starts a local Ray cluster of its own
(``address="local"``, ``--cpus`` logical CPUs, ``include_dashboard=False``, usage stats
off, its files under ``--temp-dir``), deploys one deployment of ``--replicas`` replicas of
``--replica-cpus`` CPUs each behind Ray Serve's HTTP proxy on 127.0.0.1:``--port``, and
answers ``POST /api/v1/models/{name}/predict`` with the JSON shape of inferd's (and
bench/plain_app.py's): the model called inline per request, one BLAS thread, no
``@serve.batch``, no access log (as the plain app; ``--access-log`` keeps Serve's).
Prints ``ready`` once the deployment answers; SIGTERM or SIGINT shut Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import uuid

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves 127.0.0.1


def deployment(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    options: dict[str, object] = {"logging_config": {"enable_access_log": args.access_log}}
    if args.max_ongoing is not None:
        options["max_ongoing_requests"] = args.max_ongoing

    @serve.deployment(
        num_replicas=args.replicas, ray_actor_options={"num_cpus": args.replica_cpus}, **options
    )
    class Classifier:
        def __init__(self, path: str, name: str, labels: list[str]) -> None:
            import joblib
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=1)
            self.model = joblib.load(path)
            self.name, self.labels = name, labels

        async def __call__(self, request: Request) -> Response:
            import numpy as np

            started = time.perf_counter()
            body = json.loads(await request.body())
            x = np.asarray([row["features"] for row in body["inputs"]], dtype=np.float32)
            p = self.model.predict_proba(x)
            outputs = [
                {"label": self.labels[i], "probabilities": row}
                for i, row in zip(p.argmax(axis=1).tolist(), p.tolist(), strict=True)
            ]
            reply = {
                "model": self.name, "version": "v1", "outputs": outputs,
                "latency_ms": round((time.perf_counter() - started) * 1000, 3),
                "request_id": uuid.uuid4().hex,
            }  # fmt: skip
            return Response(json.dumps(reply).encode(), media_type="application/json")

    return Classifier.bind(args.model, args.name, args.labels.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="a joblib-pickled classifier")
    parser.add_argument("--name", default="tabular")
    parser.add_argument("--labels", default="negative,positive")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="Ray's logical CPUs")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--max-ongoing", type=int, help="per replica (default: Ray's)")
    parser.add_argument("--temp-dir", default=None, help="Ray's session files")
    parser.add_argument(
        "--access-log", action="store_true", help="Serve's per-request log lines (default off)"
    )
    args = parser.parse_args()

    import ray
    from ray import serve

    ray.init(
        address="local", num_cpus=args.cpus, include_dashboard=False,
        _temp_dir=args.temp_dir, log_to_driver=False,
    )  # fmt: skip
    serve.start(
        http_options={"host": "127.0.0.1", "port": args.port},
        logging_config={"enable_access_log": args.access_log},
    )
    serve.run(deployment(args), name="bench", route_prefix=f"/api/v1/models/{args.name}/predict")
    print("ready", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
