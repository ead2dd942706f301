"""Helpers every inferd child process uses."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: no orphaned replicas."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def rss_bytes() -> int:
    """Resident memory of this process, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
