"""What each process of ``inferd serve`` imports, checked in a fresh interpreter: every
module a process keeps costs it memory for good (bench/rss.py measures it).

A gateway imports no ML framework, and no database layer until a route reads the
registry (the predict path never does); a replica imports its runtime's framework and no
other (scikit-learn's without pandas, which it does not need), and no pydantic-settings;
the server imports Alembic (in a child, when the schema is behind) and httpx (when a job
runs or a callback goes out) only for those.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = (
    "torch", "sklearn", "scipy", "xgboost", "lightgbm", "onnxruntime", "transformers",
    "tokenizers", "safetensors", "pandas", "pyarrow", "tensorflow", "mlflow",
)  # fmt: skip
SERVER_ONLY = ("alembic", "httpx")
"""The server migrates the registry and sends HTTP (job runner, webhooks); a gateway
does neither."""
DATABASE = ("sqlalchemy",)
"""The registry's database layer: a gateway loads it on first use."""


def imported(code: str) -> list[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a new Python."""
    script = code + "\nimport sys\nprint(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')))


def test_gateway_imports_no_framework() -> None:
    # what a gateway process imports: its module, and the gRPC service it starts
    modules = set(imported("import inferd.api.worker, inferd.grpc.service"))
    assert not modules & set(FRAMEWORKS), sorted(modules & set(FRAMEWORKS))
    assert not modules & set(SERVER_ONLY), sorted(modules & set(SERVER_ONLY))
    assert "grpc" not in modules  # gRPC is served by inferd.grpc.http2, not grpcio
    assert not modules & set(DATABASE), sorted(modules & set(DATABASE))


def test_a_gateway_opens_the_database_layer_on_first_use() -> None:
    modules = set(
        imported(
            "from inferd.api.app import create_app\n"
            "from inferd.api.worker import on_first_use\n"
            "from inferd.config import Settings\n"
            "from inferd.routing.router import Router\n"
            "from inferd.jobs import Jobs\n"
            "def refuse(): raise AssertionError('the registry was opened')\n"
            "jobs = Jobs(Settings(), on_first_use(refuse), None)  # as api/worker.py makes it\n"
            "app = create_app(Settings(), Router(), on_first_use(refuse), jobs=jobs)\n"
        )
    )
    assert not modules & set(DATABASE), sorted(modules & set(DATABASE))


def test_on_first_use_builds_once_and_closes_only_what_it_built() -> None:
    from inferd.api.worker import on_first_use

    class Thing:
        closed = False

        def close(self) -> None:
            self.closed = True

    built: list[Thing] = []

    def build() -> Thing:
        built.append(Thing())
        return built[-1]

    lazy = on_first_use(build)
    lazy.close()  # never built: nothing to close
    assert built == []
    threads = [threading.Thread(target=lambda: lazy.closed) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and lazy.closed is False
    lazy.close()
    assert built[0].closed is True


@pytest.mark.parametrize("data", ["new", "migrated"])
def test_the_server_keeps_no_alembic_nor_httpx(tmp_path: Path, data: str) -> None:
    """``inferd control`` (the server without gateways; a job runner all the same)
    started, then stopped by its own SIGTERM: on a new data folder its schema is
    migrated in a child."""
    if data == "migrated":
        from inferd.registry import Registry

        Registry(f"sqlite:///{tmp_path / 'inferd.db'}", tmp_path / "artifacts").close()
    code = (
        "import asyncio, os, signal\n"
        "from inferd import server\n"
        "from inferd.config import Settings\n"
        f"settings = Settings(data_dir={str(tmp_path)!r}, "
        "jobs={'gateway_url': 'http://127.0.0.1:9'})\n"
        "def progress(line):\n"
        "    if 'control plane' in line:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "asyncio.run(server.serve(settings, progress=progress, gateways=False))\n"
    )
    modules = set(imported(code))
    assert not modules & set(SERVER_ONLY), sorted(modules & set(SERVER_ONLY))
    from sqlalchemy import create_engine

    from inferd.registry import schema

    engine = create_engine(f"sqlite:///{tmp_path / 'inferd.db'}")
    assert schema.revision(engine) == schema.HEAD
    engine.dispose()


def _sklearn_pipeline(folder: Path) -> Path:
    import joblib
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(n_samples=200, n_features=20, random_state=0)
    model = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression())]).fit(x, y)
    folder.mkdir()
    joblib.dump(model, folder / "model.joblib")
    return folder


def _xgboost_booster(folder: Path) -> Path:
    import xgboost

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 8)), rng.integers(0, 2, 200)
    train = xgboost.DMatrix(x, label=y)
    booster = xgboost.train({"objective": "binary:logistic", "nthread": 1}, train, 5)
    folder.mkdir()
    booster.save_model(folder / "model.json")
    return folder


def _replica(framework: str, folder: Path) -> str:
    """A replica's start, as ``python -m inferd.serving.replica`` runs it: load and warm
    up the runtime; then the replica answers a batch."""
    spec = {"replica_id": "r", "model": "m", "version": "v1", "framework": framework,
            "artifact_dir": str(folder), "address": ""}  # fmt: skip
    return (
        "import asyncio, numpy as np\n"
        "import inferd.serving.replica_server\n"
        "from inferd.serving.replica import ReplicaCore\n"
        "from inferd.shapes.replica_spec import ReplicaSpec\n"
        f"core = ReplicaCore(ReplicaSpec.from_json({json.dumps(json.dumps(spec))}))\n"
        "async def main():\n"
        "    await core.load()\n"
        "    batch = core.runtime.warmup_inputs()\n"
        "    await core.submit(batch, 1, 10.0)\n"
        "asyncio.run(main())\n"
        "assert core.state == 'ready', core.message\n"
    )


@pytest.mark.parametrize(
    ("framework", "build", "its_own"),
    [
        ("sklearn", _sklearn_pipeline, {"sklearn", "scipy"}),
        # xgboost imports scikit-learn for its estimator wrappers
        ("xgboost", _xgboost_booster, {"xgboost", "sklearn", "scipy"}),
    ],
)
def test_replica_imports_its_framework_only(tmp_path: Path, framework, build, its_own) -> None:
    modules = set(imported(_replica(framework, build(tmp_path / "model"))))
    assert its_own <= modules
    others = (modules & set(FRAMEWORKS)) - its_own
    assert not others, f"a {framework} replica imports {sorted(others)}"
    assert "pydantic_settings" not in modules  # its settings come in its spec


def test_sklearn_models_that_hold_pandas_objects_still_load(tmp_path: Path) -> None:
    """Only scikit-learn's own import of pandas is skipped: a pickle that needs pandas
    imports it when it is loaded."""
    import joblib
    import pandas as pd
    from sklearn.linear_model import LogisticRegression

    x = pd.DataFrame(np.random.default_rng(0).normal(size=(50, 3)), columns=["a", "b", "c"])
    model = LogisticRegression().fit(x, (x["a"] > 0).astype(int))
    model.reference_ = x.head(2)  # a DataFrame inside the pickle
    folder = tmp_path / "model"
    folder.mkdir()
    joblib.dump(model, folder / "model.joblib")
    modules = imported(_replica("sklearn", folder))
    assert "pandas" in modules
