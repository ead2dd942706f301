"""The demo models ``inferd serve`` starts with, trained here in seconds.

Nothing is downloaded: the data are synthetic, bundled with scikit-learn, or the small
review set in ``data/sentiment.csv``. Seeds are fixed, so two builds give the same
models. Each model lands in ``out_dir/<name>/`` holding only its artifact files;
what a registry needs besides (metrics, labels, a declared signature) is returned.
"""

from __future__ import annotations

import csv
import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from inferd.shapes.tensors import Signature, TensorSpec

SEED = 0
DATA_DIR = Path(__file__).parent / "data"
FRAUD_FEATURES = (
    "amount", "hour_of_day", "day_of_week", "merchant_category", "merchant_risk_score",
    "distance_from_home_km", "distance_from_last_txn_km", "amount_to_median_ratio",
    "txn_count_1h", "txn_count_24h", "amount_sum_24h", "card_age_days", "account_age_days",
    "is_online", "is_international", "used_chip", "used_pin", "device_risk_score",
    "ip_risk_score", "email_domain_risk", "failed_attempts_24h", "velocity_score",
    "avg_amount_30d", "std_amount_30d", "minutes_since_last_txn", "new_merchant",
    "new_device", "billing_shipping_mismatch", "customer_age", "credit_utilisation",
)  # fmt: skip


@dataclass(frozen=True)
class DemoModel:
    name: str
    version: str
    path: Path
    """Folder holding exactly the artifact files."""
    framework: str
    description: str
    metadata: dict[str, Any]
    signature: Signature | None = None
    """Declared at push time; None where the runtime infers it (or reads it from the file)."""


def build_demo_models(
    out_dir: Path, progress: Callable[[str], None] | None = None
) -> list[DemoModel]:
    return [build_demo_model(name, out_dir, progress) for name in _BUILDERS]


def build_demo_model(
    name: str, out_dir: Path, progress: Callable[[str], None] | None = None
) -> DemoModel:
    """Build one demo model (fraud, sentiment, iris, digits or image-classifier) into
    ``out_dir/<name>/``."""
    folder = Path(out_dir) / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    started = time.monotonic()
    model = _BUILDERS[name](folder)
    if progress is not None:
        progress(f"built demo model {name} in {time.monotonic() - started:.1f}s")
    return model


def _metadata(dataset: str, **metrics: Any) -> dict[str, Any]:
    trained = datetime.now(UTC).isoformat(timespec="seconds")
    return {**metrics, "dataset": dataset, "training_date": trained}


def fraud_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fraud demo's synthetic transactions: x_train, x_test, y_train, y_test (the
    fraud graph's screening model learns from the same ones)."""
    from sklearn.datasets import make_classification
    from sklearn.model_selection import train_test_split

    x, y = make_classification(
        n_samples=20_000, n_features=len(FRAUD_FEATURES), n_informative=12, n_redundant=6,
        weights=[0.95], flip_y=0.005, class_sep=1.2, random_state=SEED,
    )  # fmt: skip
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32), y, test_size=0.25, stratify=y, random_state=SEED
    )
    return x_train, x_test, y_train, y_test


def _build_fraud(folder: Path) -> DemoModel:
    import xgboost
    from sklearn.metrics import roc_auc_score

    x_train, x_test, y_train, y_test = fraud_data()
    train = xgboost.DMatrix(x_train, label=y_train, feature_names=list(FRAUD_FEATURES))
    params = {"objective": "binary:logistic", "max_depth": 6, "eta": 0.2, "seed": SEED}
    booster = xgboost.train({**params, "nthread": 2, "tree_method": "hist"}, train, 100)
    booster.save_model(folder / "model.json")
    p = booster.inplace_predict(x_test, validate_features=False)
    return DemoModel(
        "fraud", "v1", folder, "xgboost",
        "Card-transaction fraud classifier (XGBoost, 100 trees) over 30 transaction features.",
        {
            "labels": ["legit", "fraud"],
            "features": list(FRAUD_FEATURES),
            **_metadata(
                "synthetic card transactions (sklearn make_classification, 5% fraud)",
                accuracy=round(float(np.mean((p > 0.5) == y_test)), 4),
                roc_auc=round(float(roc_auc_score(y_test, p)), 4),
            ),
        },
    )  # fmt: skip


def _build_sentiment(folder: Path) -> DemoModel:
    import joblib
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import Pipeline

    with (DATA_DIR / "sentiment.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    texts = [row["text"] for row in rows]
    labels = [row["label"] for row in rows]
    x_train, x_test, y_train, y_test = train_test_split(
        texts, labels, test_size=0.25, stratify=labels, random_state=SEED
    )
    pipeline = Pipeline([
        ("tfidf", TfidfVectorizer(sublinear_tf=True)),
        ("classifier", LogisticRegression(C=20.0, max_iter=1000)),
    ])  # fmt: skip
    pipeline.fit(x_train, y_train)
    joblib.dump(pipeline, folder / "model.joblib")
    return DemoModel(
        "sentiment", "v1", folder, "sklearn",
        "Product-review sentiment (TF-IDF + logistic regression): positive or negative.",
        _metadata(
            f"inferd/demo/data/sentiment.csv ({len(rows)} labelled product reviews)",
            accuracy=round(float(pipeline.score(x_test, y_test)), 4),
        ),
    )  # fmt: skip


def _build_iris(folder: Path) -> DemoModel:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    iris = load_iris()
    x_train, x_test, y_train, y_test = train_test_split(
        iris.data.astype(np.float32), iris.target, test_size=0.3,
        stratify=iris.target, random_state=SEED,
    )  # fmt: skip
    model = LogisticRegression(max_iter=1000).fit(x_train, y_train)
    accuracy = round(float(model.score(x_test, y_test)), 4)
    onx = convert_sklearn(
        model,
        initial_types=[("features", FloatTensorType([None, 4]))],
        final_types=[
            ("label", Int64TensorType([None])),
            ("probabilities", FloatTensorType([None, 3])),
        ],
        options={id(model): {"zipmap": False}},
        target_opset=17,
    )
    # skl2onnx names the graph with a random uuid and lists opsets in set order; pin both
    # so two builds write the same bytes.
    onx.graph.name = "iris"
    opsets = sorted(onx.opset_import, key=lambda opset: opset.domain)
    del onx.opset_import[:]
    onx.opset_import.extend(opsets)
    (folder / "model.onnx").write_bytes(onx.SerializeToString())
    labels = tuple(str(name) for name in iris.target_names)
    signature = Signature(
        inputs=(TensorSpec("features", "FP32", (-1, 4)),),
        outputs=(TensorSpec("label", "INT64"), TensorSpec("probabilities", "FP32", (-1, 3))),
        labels=labels,
    )
    return DemoModel(
        "iris", "v1", folder, "onnx",
        "Iris species from sepal and petal sizes in cm (logistic regression, ONNX).",
        {
            "labels": list(labels),
            "features": ["sepal_length", "sepal_width", "petal_length", "petal_width"],
            # what explanations compare against: every third training row
            "background_samples": [
                {"features": [round(float(v), 2) for v in row]} for row in x_train[::3]
            ],
            **_metadata("iris (scikit-learn load_iris)", accuracy=accuracy),
        },
        signature,
    )  # fmt: skip


def _build_digits(folder: Path) -> DemoModel:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32), digits.target, test_size=0.25,
        stratify=digits.target, random_state=SEED,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(SEED)
        model = _train_digits(torch, torch.from_numpy(x_train), torch.from_numpy(y_train))
    signature = Signature(
        inputs=(TensorSpec("features", "FP32", (-1, 64)),),
        outputs=(TensorSpec("label", "INT64"), TensorSpec("probabilities", "FP32", (-1, 10))),
        labels=tuple(str(d) for d in range(10)),
    )
    with warnings.catch_warnings():
        # TorchScript is deprecated upstream; the demo still shows the common format.
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        scripted = torch.jit.trace(model, torch.from_numpy(x_train[:2]))
        extra = {"signature.json": json.dumps(signature.to_dict())}
        torch.jit.save(scripted, str(folder / "model.pt"), _extra_files=extra)
    with torch.inference_mode():
        label, _ = model(torch.from_numpy(x_test))
    accuracy = float((label.numpy() == y_test).mean())
    return DemoModel(
        "digits", "v1", folder, "torch",
        "Handwritten digit 0-9 from an 8x8 image of 0-16 intensities (PyTorch MLP, TorchScript).",
        _metadata("digits (scikit-learn load_digits, 8x8 images)", accuracy=round(accuracy, 4)),
    )  # fmt: skip


def _train_digits(torch: Any, x: Any, y: Any) -> Any:
    """An MLP over intensities scaled to [0, 1], wrapped to return (label, probabilities)."""
    nn = torch.nn
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    order = torch.Generator().manual_seed(SEED)
    for _ in range(20):
        for rows in torch.randperm(len(x), generator=order).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[rows] / 16.0), y[rows]).backward()
            optimizer.step()

    class DigitsClassifier(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, features: Any) -> tuple[Any, Any]:
            probabilities = torch.softmax(self.net(features / 16.0), dim=1)
            return probabilities.argmax(dim=1), probabilities

    return DigitsClassifier().eval()


def _build_images(folder: Path) -> DemoModel:
    from inferd.demo.images import build

    metadata = build(folder)
    accuracy = metadata.pop("accuracy")
    return DemoModel(
        "image-classifier", "v1", folder, "onnx",
        "Circles, squares and triangles in JPEG/PNG images (a small CNN, ONNX); "
        "send the image itself, base64 or an s3:// URI.",
        {**metadata, **_metadata("pictures drawn here (inferd/demo/images.py)", accuracy=accuracy)},
    )  # fmt: skip


_BUILDERS: dict[str, Callable[[Path], DemoModel]] = {
    "fraud": _build_fraud,
    "sentiment": _build_sentiment,
    "iris": _build_iris,
    "digits": _build_digits,
    "image-classifier": _build_images,
}
