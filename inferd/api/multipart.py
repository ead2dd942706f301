"""Predict from a multipart upload (``curl -F image=@cat.jpg``): the form's fields are
the model's inputs, a field given k times gives k rows, and a ``params`` field holds the
JSON ``params`` of a predict body.

A file's bytes go to a binary input (an image) as they are, to a text input as UTF-8;
a text field goes to a text or image input as its string (an image's may be base64 or
an ``s3://`` URI), to a numeric one as JSON (``features=[5.1, 3.5, 1.4, 0.2]``). The
body is read within ``max_body_bytes`` first, like a JSON body.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from inferd.api.http import read_body
from inferd.errors import BadRequest, InvalidInput
from inferd.shapes.tensors import Signature


def is_multipart(request: Request) -> bool:
    for name, value in request.scope["headers"]:
        if name == b"content-type":
            return value.lower().startswith(b"multipart/form-data")
    return False


async def form_body(request: Request, limit: int, signature_of: Any) -> dict[str, Any]:
    """The predict body a multipart request stands for; ``signature_of()``: the target
    version's signature (which inputs are binary)."""
    body = await read_body(request, limit)

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(request.headers, stream(), max_files=4096, max_part_size=limit)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"invalid multipart body: {exc.message}") from None
    signature: Signature = signature_of()
    specs = {spec.name: spec for spec in signature.inputs}
    values: dict[str, list[Any]] = {}
    params: Any = None
    for name, value in form.multi_items():
        if name == "params":
            params = _json(await _text(value, name), name)
        elif name not in specs:
            raise InvalidInput(
                f"form field {name!r} is not an input of the model; it takes "
                f"{', '.join(repr(n) for n in specs)} (and 'params')"
            )
        else:
            values.setdefault(name, []).append(await _value(value, specs[name]))
    counts = {name: len(v) for name, v in values.items()}
    if not counts:
        raise InvalidInput(f"the form names no input of the model ({', '.join(specs)})")
    if len(set(counts.values())) != 1:
        raise InvalidInput(f"each input must be given as many times as the others: {counts}")
    rows = [{name: v[i] for name, v in values.items()} for i in range(next(iter(counts.values())))]
    return {"inputs": rows, **({"params": params} if params is not None else {})}


async def _value(value: UploadFile | str, spec: Any) -> Any:
    if spec.datatype == "BYTES" and spec.media is not None:
        return await value.read() if isinstance(value, UploadFile) else value
    text = await _text(value, spec.name)
    return text if spec.datatype == "BYTES" else _json(text, spec.name)


async def _text(value: UploadFile | str, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return (await value.read()).decode()
    except UnicodeDecodeError:
        raise InvalidInput(f"form field {name!r}: the file is not UTF-8 text") from None


def _json(text: str, name: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        raise InvalidInput(f"form field {name!r} is not JSON") from None
