"""A C kernel for paged decode attention on CPU, compiled on first use.

Why: with PyTorch ops, a decode step must first *copy* every sequence's keys and values
out of the paged cache into a padded batch (``index_select``) and then run SDPA over
the copy: the cache is read twice and the copy written once, and at 128 sequences that
memory traffic was a quarter of the step on a 2-core CPU. This kernel reads each key
and value once, straight from the cache through the block table, one sequence at a
time (its blocks stay in the core's cache across all heads).

It is plain C99 (no PyTorch headers, so it compiles in about a second with the
system's ``cc``) loaded with :mod:`ctypes`, which releases the GIL during the call; the
caller splits the batch over threads. Where there is no compiler, the library compiled
when inferd's container image was built (:data:`PREBUILT`, portable flags) is loaded
instead. Where there is neither, or the ``llm.native`` setting is off
(``INFERD_LLM__NATIVE=0``, applied by :func:`enable` when a replica builds its engine),
:func:`kernel` returns None and the engine keeps its PyTorch path, which gives the same
results.

``CC`` and ``XDG_CACHE_HOME`` are read here: they are the system's conventions for the
compiler and the cache folder, not inferd settings.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* out[b, h, :] = softmax(q[b, h] . K[seq b, h]^T * scale) V[seq b, h], for b in [b0, b1).
   Keys of sequence b, position t: K + ((table[b][t / bs] * bs + t % bs) * H + h) * D.
   scores: scratch of at least max(lens) floats. */
void paged_decode_f32(
    const float *q, const float *K, const float *V, float *out,
    const int64_t *tables, int64_t table_stride, const int64_t *lens,
    int64_t b0, int64_t b1, int64_t H, int64_t D, int64_t bs, float scale,
    float *scores)
{
    for (int64_t b = b0; b < b1; b++) {
        const int64_t len = lens[b];
        const int64_t *table = tables + b * table_stride;
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + (b * H + h) * D;
            float top = -INFINITY;
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / bs] * bs + t % bs;
                const float *k = K + (slot * H + h) * D;
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) s += qh[d] * k[d];
                s *= scale;
                scores[t] = s;
                if (s > top) top = s;
            }
            float total = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                scores[t] = expf(scores[t] - top);
                total += scores[t];
            }
            float *o = out + (b * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / bs] * bs + t % bs;
                const float *v = V + (slot * H + h) * D;
                const float w = scores[t] / total;
                for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
            }
        }
    }
}
"""

_FLAGS = [
    "-O3", "-march=native", "-fPIC", "-shared", "-std=c99",
    # Vectorised dot products need reassociation; no -ffast-math (it assumes no inf).
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
]  # fmt: skip
PORTABLE_FLAGS = [flag for flag in _FLAGS if flag != "-march=native"]
"""For a library built on one machine and run on others (a container image)."""
PREBUILT = Path(__file__).with_name("paged_attention.so")
"""Built with :data:`PORTABLE_FLAGS` by ``python -m inferd.llm.native`` (the image's
build stage, which has a compiler its final stage lacks); loaded where no ``cc`` is."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


_enabled = True


def enable(on: bool) -> None:
    """Switch the kernel on or off for this process (the ``llm.native`` setting)."""
    global _enabled
    if on != _enabled:
        _enabled = on
        kernel.cache_clear()


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built or is switched off."""
    if not _enabled:
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None and PREBUILT.exists():
        return _load(PREBUILT)
    if compiler is None:
        logger.info("no C compiler: paged decode attention stays on PyTorch ops")
        return None
    # -march=native code must not be loaded on another CPU (a shared home directory):
    # the CPU's feature flags are part of the library's name.
    identity = SOURCE + " ".join(_FLAGS) + platform.machine() + _cpu_flags()
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferd"
    library = cache / f"paged_attention_{digest}.so"
    try:
        if not library.exists():
            build(library, compiler, _FLAGS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("paged attention kernel unavailable, using PyTorch ops: %s", exc)
        return None
    return _load(library)


def build(library: Path, compiler: str, flags: list[str]) -> None:
    """Compile the kernel into ``library`` (replaced at once: replicas may race here)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        source = Path(tmp) / "paged_attention.c"
        source.write_text(SOURCE)
        built = Path(tmp) / library.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, library)


def _load(library: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        logger.warning("paged attention kernel unavailable, using PyTorch ops: %s", exc)
        return None
    fn = lib.paged_decode_f32
    fn.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
    return lib


if __name__ == "__main__":  # the container image's build stage: python -m inferd.llm.native
    build(PREBUILT, os.environ.get("CC", "cc"), PORTABLE_FLAGS)
    print(PREBUILT)
