"""BYTES inputs that are not text: images (``TensorSpec.media == "image"``).

The gateway turns each value into what the replica takes — the encoded image's bytes,
or an ``s3://`` URI (a ``str``) the replica fetches from the allowed buckets — and
refuses anything else by name: the protocols' binary forms (V2's binary extension,
gRPC's ``bytes_contents``, multipart uploads) arrive as bytes; in JSON an image is
``{"b64": "..."}``, a ``data:image/...;base64,...`` URL, a bare base64 string, or an
``s3://bucket/key`` URI. No other URL is fetched: a server that fetches any URL it is
given is a server-side request forgery hole.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from inferd.errors import InvalidInput


def media_column(values: list[Any], name: str) -> np.ndarray:
    """An object array of each value as the replica takes it (bytes, or an s3:// URI)."""
    array = np.empty(len(values), dtype=object)
    array[:] = [image_value(v, name, i) for i, v in enumerate(values)]
    return array


def image_value(value: Any, name: str, row: int) -> bytes | str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict) and isinstance(value.get("b64"), str) and len(value) == 1:
        return _b64(value["b64"], name, row)
    if isinstance(value, str):
        if value.startswith("s3://"):
            if len(value) <= 5 or "/" not in value[5:]:
                raise InvalidInput(f"{name!r} of row {row}: {value!r} names no object")
            return value
        if value.startswith("data:"):
            header, _, data = value.partition(",")
            if not header.endswith(";base64"):
                raise InvalidInput(f"{name!r} of row {row}: a data URL must be base64")
            return _b64(data, name, row)
        if "://" in value[:16]:
            scheme = value.split("://", 1)[0]
            raise InvalidInput(
                f"{name!r} of row {row}: {scheme}:// URLs are not fetched; send the image "
                "itself (bytes, base64) or an s3:// URI of an allowed bucket"
            )
        return _b64(value, name, row)
    raise InvalidInput(
        f'{name!r} of row {row} must be an image: base64 text, {{"b64": ...}}, a data: '
        f"URL or an s3:// URI; got {type(value).__name__}"
    )


def _b64(text: str, name: str, row: int) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{name!r} of row {row} is not valid base64") from None
    if not data:
        raise InvalidInput(f"{name!r} of row {row} is empty")
    return data
