"""The baseline: a plain single-file app that calls the model inline, per request.

Run as ``INFERD_BENCH_MODEL=path/to/fraud.json uvicorn bench.plain_app:app --workers 2``.
It is the leanest honest way to serve the model from Python: Starlette, orjson, the
XGBoost booster's ``inplace_predict``, no validation beyond what indexing does. It
returns the same JSON shape as inferd's ``/api/v1/models/{model}/predict``.
"""

import os
import time

import numpy as np
import orjson
import xgboost as xgb
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

booster = xgb.Booster(model_file=os.environ["INFERD_BENCH_MODEL"])
booster.set_param({"nthread": 1})
LABELS = ("legit", "fraud")


async def predict(request: Request) -> Response:
    started = time.perf_counter()
    body = orjson.loads(await request.body())
    x = np.asarray([row["features"] for row in body["inputs"]], dtype=np.float32)
    p = booster.inplace_predict(x)
    outputs = [
        {"label": LABELS[int(v > 0.5)], "probabilities": [1.0 - float(v), float(v)]} for v in p
    ]
    latency_ms = (time.perf_counter() - started) * 1000
    return Response(
        orjson.dumps(
            {"model": "fraud", "version": "v1", "outputs": outputs, "latency_ms": latency_ms}
        ),
        media_type="application/json",
    )


app = Starlette(routes=[Route("/api/v1/models/fraud/predict", predict, methods=["POST"])])
