"""Check a version the server is asked to register, in a child process: load it, warm
it up and read its signature, as ``inferd models push`` does in its own process.

A gateway must not import a model's code or framework (memory it would keep, a crash
or a hang it would share with the traffic it serves): the check runs in
``python -m inferd.registry.inspection``, which reads a JSON request on stdin and
writes one JSON line on stdout, and is killed past its time limit. An import from
MLflow (:mod:`inferd.registry.mlflow_source`) is fetched and converted there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.errors import InferdError, InvalidInput, PayloadTooLarge, StoreUnavailable
from inferd.shapes.tensors import Signature


@dataclass
class Inspected:
    """What the check found: the version's framework and signature, and for an import
    the folder it made and the metadata the source gave (an MLflow run's metrics...)."""

    framework: str
    signature: Signature
    folder: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    description: str | None = None


async def inspect_isolated(
    folder: Path,
    framework: str | None,
    metadata: dict[str, Any],
    signature: Signature | None,
    timeout_s: float,
    mlflow: dict[str, Any] | None = None,
    scratch: Path | None = None,
) -> Inspected:
    """Check ``folder`` (or first import ``mlflow["uri"]`` into it) in a child process.

    422 with the loader's error when the version cannot be loaded, or when the check
    takes longer than ``timeout_s``; 503 when the source (MLflow) cannot be reached.
    """
    request = {
        "folder": str(folder),
        "framework": framework,
        "metadata": metadata,
        "signature": signature.to_dict() if signature is not None else None,
        "mlflow": mlflow,
        "scratch": str(scratch or folder.parent),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "inferd.registry.inspection",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), timeout_s)
    except TimeoutError:
        raise InvalidInput(
            f"checking the version (load, warm-up, signature) took longer than "
            f"registry.inspect_timeout_s ({timeout_s:g}s)"
        ) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise InvalidInput(
            f"cannot load the version: the check exited with {proc.returncode}: " + " | ".join(tail)
        ) from None
    if not answer["ok"]:
        error = _ERRORS.get(answer.get("code", ""), InvalidInput)
        prefix = "" if "code" in answer else "cannot load the version: "
        raise error(prefix + answer["error"], **answer.get("details", {}))
    return Inspected(
        str(answer["framework"]),
        Signature.from_dict(answer["signature"]),
        Path(answer["folder"]),
        answer.get("metadata", {}),
        answer.get("description"),
    )


_ERRORS: dict[str, type[InferdError]] = {
    cls.code: cls for cls in (InvalidInput, StoreUnavailable, PayloadTooLarge)
}


def main() -> None:
    request = json.loads(sys.stdin.read())
    from inferd.runtimes import inspect_artifact, prepare_artifact

    declared = request["signature"]
    signature = Signature.from_dict(declared) if declared is not None else None
    folder, framework, metadata = Path(request["folder"]), request["framework"], request["metadata"]
    found: dict[str, Any] = {}
    try:
        inputs = None
        if request.get("mlflow"):
            from inferd.registry.mlflow_source import import_model

            source = request["mlflow"]
            imported = import_model(
                source["uri"], source.get("tracking_uri"), folder, source["limit_bytes"]
            )
            folder, framework = imported.folder, framework or imported.framework
            found = {"metadata": imported.metadata, "description": imported.description}
            metadata = {**imported.metadata, **metadata}
            signature = signature or imported.signature
            inputs = imported.inputs
        folder, framework, made = prepare_artifact(folder, framework, Path(request["scratch"]))
        if made:
            found["metadata"] = {**found.get("metadata", {}), **made}
            metadata = {**made, **metadata}
        framework, signature = inspect_artifact(folder, framework, metadata, signature, inputs)
    except InferdError as exc:  # the source's answer: its own status (422, 413, 503)
        answer: dict[str, Any] = {
            "ok": False, "code": exc.code, "error": exc.message, "details": exc.details
        }  # fmt: skip
    except Exception as exc:  # any loader error: say what failed, no traceback
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    else:
        answer = {
            "ok": True,
            "framework": framework,
            "signature": signature.to_dict(),
            "folder": str(folder),
            **found,
        }
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
