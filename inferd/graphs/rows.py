"""Row arithmetic of a graph, pure numpy: which rows a switch sends where, taking those
rows out of columns and merging the branches' answers back in row order, combining an
ensemble's answers."""

from __future__ import annotations

import numpy as np

from inferd.shapes.graph import Condition

Columns = dict[str, np.ndarray]


def holds(condition: Condition, column: np.ndarray) -> np.ndarray:
    """Per row, whether ``condition`` holds of ``column`` (a boolean vector)."""
    values = np.asarray(column)
    if condition.index is not None:
        values = values.reshape(len(values), -1)[:, condition.index]
    if values.ndim != 1:
        raise ValueError(
            f"{condition.source} has {values.ndim} dimensions per request; "
            "a condition needs one value per row (give 'index')"
        )
    op, value = condition.op, condition.value
    if op == "between":
        return np.asarray((values >= value[0]) & (values <= value[1]))
    if op == "in":
        return np.isin(values, value)
    compare = {
        "gt": np.greater, "ge": np.greater_equal, "lt": np.less,
        "le": np.less_equal, "eq": np.equal, "ne": np.not_equal,
    }[op]  # fmt: skip
    return np.asarray(compare(values, value), dtype=bool)


def branch_of(masks: list[np.ndarray], rows: int) -> np.ndarray:
    """Per row, the index of the first mask that holds for it; ``len(masks)`` (the
    default branch) where none does."""
    branch = np.full(rows, len(masks), dtype=np.int64)
    for i in reversed(range(len(masks))):  # the first match wins: written last
        branch[masks[i]] = i
    return branch


def take(columns: Columns, rows: np.ndarray) -> Columns:
    """The rows ``rows`` (indices) of every column."""
    return {name: array[rows] for name, array in columns.items()}


def merge(parts: list[tuple[np.ndarray, Columns]], rows: int) -> Columns:
    """Columns of ``rows`` rows from ``parts`` (row indices, the columns of those rows),
    which together cover every row once. Every part must answer the same outputs; a
    column's type is the widest of the parts' (a float32 and a float64 branch: float64)."""
    parts = [(index, columns) for index, columns in parts if len(index)]
    if not parts:
        return {}
    names = sorted(parts[0][1])
    for _, columns in parts[1:]:
        if sorted(columns) != names:
            raise ValueError(f"branches answer different outputs: {names} and {sorted(columns)}")
    merged: Columns = {}
    for name in names:
        arrays = [columns[name] for _, columns in parts]
        dtype = np.result_type(*arrays)
        out = np.empty((rows, *arrays[0].shape[1:]), dtype=dtype)
        for index, array in zip((i for i, _ in parts), arrays, strict=True):
            out[index] = array
        merged[name] = out
    return merged


def combine(arrays: list[np.ndarray], how: str) -> np.ndarray:
    """An ensemble's answer per row: the ``mean`` or ``max`` of its members' answers, or
    their ``vote`` (the most common; the smallest value on a tie)."""
    stacked = np.stack([np.asarray(a) for a in arrays])
    if how == "mean":
        return stacked.mean(axis=0).astype(stacked.dtype, copy=False)
    if how == "max":
        return stacked.max(axis=0)
    voted = np.empty(stacked.shape[1:], dtype=stacked.dtype)
    flat, out = stacked.reshape(len(arrays), -1), voted.reshape(-1)
    for j in range(flat.shape[1]):
        values, counts = np.unique(flat[:, j], return_counts=True)
        out[j] = values[np.argmax(counts)]
    return voted
