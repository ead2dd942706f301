"""A batch job's inputs: inline, or a file named by ``input_uri``, as one raw JSON text per
item (an item that is not valid JSON fails alone, when it runs).

Files: JSON Lines (``.jsonl``, ``.ndjson``, ``.json``; one input object per line, blank
lines skipped) or CSV (``.csv``; a header row), optionally gzipped (``.gz``). A CSV row
becomes ``{column: value}`` when its columns are the model's inputs, else, for a model
with one input, ``{input: [values...]}`` (a feature vector); values that parse as numbers
are numbers (``nan`` and ``inf`` too), an empty cell is null (a missing value).

Where: a local path (``/data/in.jsonl``, ``file:///data/in.jsonl``) must lie inside one of
``jobs.input_roots`` (default ``<data_dir>/inputs``) — the API never reads other files
of the server; any other URL (``s3://``, ``gs://``, ``https://``, ...) is opened with
fsspec (``pip install fsspec s3fs`` for S3), with the credentials of its usual
environment variables.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from inferd import nonfinite_json
from inferd.errors import Forbidden, InvalidInput, PayloadTooLarge


def inline_items(inputs: Any, limit: int, non_finite: bool = False) -> list[bytes]:
    """Each input as JSON; ``non_finite``: the body held NaN or ±Infinity literals, kept
    as such (the predict route refuses them, naming the element, or takes them)."""
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list of inputs")
    if len(inputs) > limit:
        raise PayloadTooLarge(f"{len(inputs)} inputs exceed the limit of {limit} per job")
    return [nonfinite_json.dumps(item, non_finite) for item in inputs]


def read_items(uri: str, roots: list[Path], limit: int, input_names: list[str]) -> list[bytes]:
    """Every item of the file ``uri`` names; 403 outside the input roots, 422 when it is
    missing, unreadable or of an unknown format, 413 past ``limit`` items."""
    name = urlsplit(uri).path if "://" in uri else uri
    suffixes = [s.lower() for s in Path(name).suffixes]
    compressed = bool(suffixes) and suffixes[-1] == ".gz"
    kind = suffixes[-2] if compressed and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if kind not in (".jsonl", ".ndjson", ".json", ".csv"):
        raise InvalidInput(f"input_uri {uri!r}: use a .jsonl, .ndjson or .csv file (or .gz)")
    with _open(uri, roots) as raw:
        stream: Any = gzip.GzipFile(fileobj=raw) if compressed else raw
        try:
            lines = _csv_items(stream, input_names) if kind == ".csv" else _json_items(stream)
            items = []
            for item in lines:
                items.append(item)
                if len(items) > limit:
                    raise PayloadTooLarge(f"input_uri {uri!r} has more than {limit} inputs")
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
            raise InvalidInput(f"input_uri {uri!r} could not be read: {exc}") from None
    if not items:
        raise InvalidInput(f"input_uri {uri!r} holds no inputs")
    return items


def _open(uri: str, roots: list[Path]) -> IO[bytes]:
    scheme = urlsplit(uri).scheme
    if scheme in ("", "file"):
        path = Path(urlsplit(uri).path if scheme else uri)
        if not path.is_absolute():
            path = roots[0] / path
        path = path.resolve()
        if not any(path.is_relative_to(root) for root in roots):
            raise Forbidden(
                f"input_uri {uri!r} is outside the job input folders "
                f"({', '.join(str(r) for r in roots)}; setting jobs.input_roots)"
            )
        try:
            return path.open("rb")
        except FileNotFoundError:
            raise InvalidInput(f"input_uri {uri!r}: no such file") from None
        except OSError as exc:
            raise InvalidInput(f"input_uri {uri!r} could not be opened: {exc.strerror}") from None
    try:
        import fsspec
    except ImportError:
        raise InvalidInput(
            f"input_uri {uri!r}: reading {scheme}:// URLs needs fsspec (pip install fsspec)"
        ) from None
    try:
        return fsspec.open(uri, "rb").open()  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise InvalidInput(f"input_uri {uri!r}: no such file") from None
    except (ImportError, ValueError) as exc:  # no driver for the scheme (e.g. s3fs)
        raise InvalidInput(f"input_uri {uri!r}: {exc}") from None
    except OSError as exc:
        raise InvalidInput(f"input_uri {uri!r} could not be opened: {exc}") from None


def _json_items(stream: IO[bytes]) -> Iterator[bytes]:
    for line in stream:
        line = line.strip()
        if line:
            yield line


def _csv_items(stream: IO[bytes], input_names: list[str]) -> Iterator[bytes]:
    reader = csv.reader(io.TextIOWrapper(stream, encoding="utf-8", newline=""))
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    named = set(header) <= set(input_names)
    if not named and len(input_names) != 1:
        raise InvalidInput(
            f"CSV columns {header} are not the model's inputs {input_names}, and the model "
            "takes more than one input: name the columns after its inputs"
        )
    for row in reader:
        if not row:
            continue
        values = [_number(v) for v in row]
        item = dict(zip(header, values, strict=False)) if named else {input_names[0]: values}
        non_finite = any(isinstance(v, float) and not math.isfinite(v) for v in values)
        yield nonfinite_json.dumps(item, non_finite)


def _number(text: str) -> Any:
    """A cell's value: an int, a float (``nan``, ``inf`` too: the model's check decides),
    None for an empty cell (a missing value: refused unless the version allows
    non-finite inputs, where it is NaN), else the text."""
    if not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
