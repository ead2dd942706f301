"""Accuracy feedback: ground truth joined to logged predictions, and the rolling
accuracy of each model version.

The inference log keeps what a single-row predict request predicted (its ``label`` —
as a class name when the model has them — or its one number). A client that learns
the truth later sends ``POST /api/v1/feedback {"request_id", "label" | "value"}``; the
row is found by its request id, and the feedback stored with whether the label was
``correct`` or how far the number was (``abs_error``). Sending it again replaces it.

``/metrics`` exports, per model version, the accuracy and mean absolute error over
the feedback of the last ``window_s`` seconds, how much feedback that is, and the
version's ``metadata.accuracy_threshold`` when it has one, so an alert fires when the
accuracy drops below it (the design documents' "model accuracy drift").
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, case, delete, func, insert, select

from inferd.errors import InvalidInput, NotFound
from inferd.registry.tables import feedback, inference_logs

WINDOW_S = 3600.0
"""The accuracy metric covers the feedback of the last hour."""


def record(
    engine: Engine,
    request_id: str,
    label: Any = None,
    value: Any = None,
    allow: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Store feedback for a logged request; its row, as the API answers it. ``allow``
    raises when the caller may not use the request's model."""
    if (label is None) == (value is None):
        raise InvalidInput("send exactly one of 'label' (a class) or 'value' (a number)")
    if label is not None and (not isinstance(label, str | int) or isinstance(label, bool)):
        raise InvalidInput("'label' must be a string (or an integer class)")
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise InvalidInput("'value' must be a number")
    t = inference_logs
    query = (
        select(t.c.model_name, t.c.version, t.c.prediction)
        .where(t.c.request_id == request_id, t.c.status_code == 200)
        .order_by(t.c.timestamp.desc())
        .limit(1)
    )
    with engine.begin() as conn:
        row = conn.execute(query).first()
        if row is None:
            raise NotFound(
                f"no answered request {request_id!r} in the inference log (rows reach it "
                "within inference_log.flush_interval_s of the answer)",
                request_id=request_id,
            )
        model, version, prediction = row
        if allow is not None:
            allow(model)
        if prediction is None:
            raise InvalidInput(
                f"request {request_id!r} has no single prediction to compare: feedback "
                "applies to predict requests of one row"
            )
        entry: dict[str, Any] = {
            "request_id": request_id,
            "model_name": model,
            "version": version,
            "prediction": prediction,
            "label": None if label is None else str(label),
            "value": None if value is None else float(value),
            "correct": None,
            "abs_error": None,
            "created_at": datetime.now(UTC),
        }
        if label is not None:
            entry["correct"] = str(label) == prediction
        else:
            try:
                entry["abs_error"] = abs(float(prediction) - float(value))  # type: ignore[arg-type]
            except ValueError:
                raise InvalidInput(
                    f"request {request_id!r} predicted {prediction!r}, not a number: send a 'label'"
                ) from None
        conn.execute(delete(feedback).where(feedback.c.request_id == request_id))
        conn.execute(insert(feedback).values(**entry))
    entry["created_at"] = entry["created_at"].isoformat()
    return entry


def accuracy(engine: Engine, window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """Per model version: labelled feedback count and accuracy, numeric feedback count
    and mean absolute error, over the last ``window_s`` seconds."""
    f = feedback
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    query = (
        select(
            f.c.model_name,
            f.c.version,
            func.count(f.c.correct),
            func.avg(case((f.c.correct.is_(True), 1.0), (f.c.correct.is_(False), 0.0))),
            func.count(f.c.abs_error),
            func.avg(f.c.abs_error),
        )
        .where(f.c.created_at >= since)
        .group_by(f.c.model_name, f.c.version)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    names = ("model", "version", "labelled", "accuracy", "numeric", "mean_abs_error")
    return [dict(zip(names, row, strict=True)) for row in rows]
