"""Check a version the server is asked to register, in a child process: load it, warm
it up and read its signature, as ``inferd models push`` does in its own process.

A gateway must not import a model's code or framework (memory it would keep, a crash
or a hang it would share with the traffic it serves): the check runs in
``python -m inferd.registry.inspection``, which reads a JSON request on stdin and
writes one JSON line on stdout, and is killed past its time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from inferd.errors import InvalidInput
from inferd.runtimes.base import Signature


async def inspect_isolated(
    folder: Path,
    framework: str | None,
    metadata: dict[str, Any],
    signature: Signature | None,
    timeout_s: float,
) -> tuple[str, Signature]:
    """The version's framework and signature; 422 with the loader's error when it cannot
    be loaded, or when the check takes longer than ``timeout_s``."""
    request = {
        "folder": str(folder),
        "framework": framework,
        "metadata": metadata,
        "signature": signature.to_dict() if signature is not None else None,
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
        raise InvalidInput(f"cannot load the version: {answer['error']}")
    return str(answer["framework"]), Signature.from_dict(answer["signature"])


def main() -> None:
    request = json.loads(sys.stdin.read())
    from inferd.runtimes import inspect_artifact

    declared = request["signature"]
    try:
        framework, signature = inspect_artifact(
            Path(request["folder"]),
            request["framework"],
            request["metadata"],
            Signature.from_dict(declared) if declared is not None else None,
        )
    except Exception as exc:  # any loader error: say what failed, no traceback
        answer: dict[str, Any] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    else:
        answer = {"ok": True, "framework": framework, "signature": signature.to_dict()}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
