"""What every inferd child process does at start."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: no orphaned replicas."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
