"""The GPUs of this machine, where the local backend places replicas.

A deployment asking for ``resources.gpu`` ("A100", "H100", or "any") is honoured only
if this machine has such a GPU: the deployment is refused (422) otherwise, never
recorded as if it will run on one; its replicas start with ``CUDA_VISIBLE_DEVICES``
naming the matching devices. GPUs are read once per process from ``nvidia-smi`` (the
NVIDIA driver's own tool; none on a machine without the driver).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass

from inferd.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    """As the driver names it, e.g. ``NVIDIA A100-SXM4-80GB``."""
    memory_mib: int = 0
    """Its memory as the driver reports it (0: unknown)."""


@functools.cache
def local_gpus() -> tuple[Gpu, ...]:
    """This machine's GPUs (none when there is no NVIDIA driver, or it fails)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return ()
    try:
        out = subprocess.run(
            [tool, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_gpus(out)


def parse_gpus(out: str) -> tuple[Gpu, ...]:
    """GPUs from ``nvidia-smi --query-gpu=index,name,memory.total`` CSV (no header or
    units); a name may hold commas, the memory is the last field."""
    gpus = []
    for line in out.splitlines():
        index, _, rest = line.partition(",")
        name, _, memory = rest.rpartition(",")
        if not memory.strip().isdigit():  # no memory field (an older query)
            name, memory = rest, "0"
        if not index.strip().isdigit() or not name.strip():
            continue
        gpus.append(Gpu(int(index), name.strip(), int(memory)))
    return tuple(gpus)


def matching(gpu_type: str, gpus: tuple[Gpu, ...]) -> list[Gpu]:
    """The GPUs of ``gpu_type``: its name within theirs, ignoring case ("a100" matches
    "NVIDIA A100-SXM4-80GB"); "any" matches every GPU."""
    wanted = gpu_type.strip().lower()
    if wanted == "any":
        return list(gpus)
    return [g for g in gpus if wanted in g.name.lower()]


def place(gpu_type: str) -> list[int]:
    """The device indices a replica asking for ``gpu_type`` runs on; InvalidInput (422)
    when this machine has none of them."""
    gpus = local_gpus()
    found = matching(gpu_type, gpus)
    if not found:
        have = ", ".join(f"{g.index}: {g.name}" for g in gpus) or "no GPU"
        raise InvalidInput(
            f"resources.gpu {gpu_type!r} cannot be honoured: replicas run on this machine "
            f"(the local backend), which has {have}",
            field="resources.gpu",
        )
    return [g.index for g in found]
