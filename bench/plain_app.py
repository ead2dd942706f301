"""The baseline: a plain single-file app that calls the model inline, per request.

    INFERD_BENCH_MODEL=path/to/fraud.json uvicorn bench.plain_app:app --workers 2
    INFERD_BENCH_MODEL=path/to/model.joblib INFERD_BENCH_NAME=tabular \\
        INFERD_BENCH_LABELS=negative,positive python bench/plain_app.py --port 8080 --workers 2

It is the leanest honest way to serve a classifier from Python: Starlette, orjson, the
model called on the event loop, no validation beyond what indexing does. The model is an
XGBoost booster (``.json``, ``inplace_predict``) or a pickled scikit-learn classifier
(``.joblib``/``.pkl``, ``predict_proba``), one BLAS/OpenMP thread either way (as inferd's
replicas run it). It answers ``POST /api/v1/models/{INFERD_BENCH_NAME}/predict`` (default
``fraud``) with the same JSON shape as inferd's: ``label`` (one of
``INFERD_BENCH_LABELS``, default ``legit,fraud``) and ``probabilities`` per row.

Run as a script, each worker is a uvicorn server (httptools + uvloop) with its own
listening socket on the port (SO_REUSEPORT), as inferd's gateways and bench/hello_app.py
do: ``uvicorn --workers`` shares one socket, and the first worker to wake may accept a
whole burst of connections.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MODEL = Path(os.environ["INFERD_BENCH_MODEL"])
NAME = os.environ.get("INFERD_BENCH_NAME", "fraud")
LABELS = tuple(os.environ.get("INFERD_BENCH_LABELS", "legit,fraud").split(","))


def load(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model as one function: rows (float32) -> class probabilities (rows x classes)."""
    if path.suffix == ".json":
        import xgboost as xgb

        booster = xgb.Booster(model_file=str(path))
        booster.set_param({"nthread": 1})

        def positive(x: np.ndarray) -> np.ndarray:
            p = booster.inplace_predict(x)
            return np.stack([1.0 - p, p], axis=1)

        return positive
    import joblib
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1)
    return joblib.load(path).predict_proba  # type: ignore[no-any-return]


predict_proba = load(MODEL)


async def predict(request: Request) -> Response:
    started = time.perf_counter()
    body = orjson.loads(await request.body())
    x = np.asarray([row["features"] for row in body["inputs"]], dtype=np.float32)
    p = predict_proba(x)
    outputs = [
        {"label": LABELS[i], "probabilities": row}
        for i, row in zip(p.argmax(axis=1).tolist(), p.tolist(), strict=True)
    ]
    latency_ms = (time.perf_counter() - started) * 1000
    return Response(
        orjson.dumps(
            {"model": NAME, "version": "v1", "outputs": outputs,
             "latency_ms": round(latency_ms, 3), "request_id": uuid.uuid4().hex}
        ),
        media_type="application/json",
    )  # fmt: skip


app = Starlette(routes=[Route(f"/api/v1/models/{NAME}/predict", predict, methods=["POST"])])


def main() -> None:
    from servers import serve_reuseport

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    serve_reuseport(app, args.port, args.workers)


if __name__ == "__main__":
    main()
