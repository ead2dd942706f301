"""What every inferd child process does at start."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Callable

on_ready: list[Callable[[], None]] = []
"""Run once, when the process is ready to serve (:func:`freeze_heap`): a replica the fork
server forked tells it there what it imported (:mod:`inferd.serving.zygote`)."""


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: no orphaned replicas."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def freeze_heap() -> None:
    """Once a process is ready to serve: collect once, then move every object alive into
    the collector's permanent generation. Its full passes would otherwise walk the 100k+
    objects of the imported libraries (measured 130-240 ms each on this machine, the
    event loop stopped meanwhile: a request caught by one waits that long); after this
    they walk only what requests create."""
    gc.collect()
    gc.freeze()
    while on_ready:
        on_ready.pop()()
