"""The fork server: a process that has imported the replica's code (and, once asked for
it, each framework's) and forks a replica process from itself on request, so a replica
starts without importing Python's half of the world again. Started by the local
backend (:mod:`inferd.control.backends.forks`), ``python -m inferd.serving.zygote FD``,
``FD`` a ``SOCK_SEQPACKET`` socket to the server.

What it answers (:mod:`inferd.shapes.fork`): a :class:`Fork` gets a :class:`Forked`
with the child's pidfd (signals and the end of the process reach the server through it,
free of pid reuse) or a :class:`Failed`; every child it reaps is an :class:`Exited`.

A child starts as ``python -m inferd.serving.replica_server`` would: its own session,
the environment the server gave (thread counts are applied to the thread pools already
loaded here, which read their variables at load), fresh random seeds, and the replica's
``main``. The fork server runs one thread and never computes: nothing is held by a
thread that is not in the child. Frameworks whose import starts threads or that
initialise devices (TensorFlow, GPU replicas, vLLM) are not forked (:func:`forkable`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import traceback

from inferd import process
from inferd.process import die_with_parent
from inferd.shapes.fork import MAX_FRAME, Exited, Failed, Fork, Forked, decode, encode

PRELOAD: dict[str, tuple[str, ...]] = {
    "sklearn": ("inferd.runtimes.sklearn", "sklearn.base", "joblib"),
    "xgboost": ("inferd.runtimes.xgboost", "xgboost"),
    "lightgbm": ("inferd.runtimes.lightgbm", "lightgbm"),
    "onnx": ("inferd.runtimes.onnx", "onnxruntime"),
    "python": ("inferd.runtimes.python",),
    "graph": ("inferd.runtimes.graph",),
    "torch": ("inferd.runtimes.torch", "torch"),
    "gpt2": ("inferd.runtimes.gpt2", "torch"),
    "transformers": ("inferd.runtimes.transformers", "torch", "transformers"),
}  # fmt: skip
"""What the fork server imports before it forks the first replica of a framework: the
runtime and the framework's package. The rest it learns: each forked replica, once
ready, tells it the modules it imported besides (:data:`LEARNED_ROOTS`), and it imports
them for the next ones. So it holds what its replicas use, no more."""
LEARNED_ROOTS = frozenset({
    "inferd", "numpy", "scipy", "sklearn", "joblib", "threadpoolctl", "xgboost", "lightgbm",
    "onnxruntime", "onnx", "torch", "transformers", "tokenizers", "safetensors",
    "huggingface_hub", "pandas", "pyarrow", "PIL", "packaging", "regex", "yaml",
}) | frozenset(sys.stdlib_module_names)  # fmt: skip
"""The packages whose modules a replica's report may make the fork server import: the
standard library and the frameworks' (never a model's own code, nor what a model put in
``sys.modules``: the fork server runs no code of a model's choosing)."""
MAX_REPORT = 1 << 16
"""The most a replica reports (bytes of module names): one pipe's buffer, written at
once without blocking."""
NOT_FORKED = frozenset({"tensorflow", "llm"})
"""Frameworks started from scratch: TensorFlow starts threads as it is imported; ``llm``
runs on vLLM, in its own interpreter."""
BASE = ("inferd.serving.replica_server", "numpy")
"""Imported when the fork server starts: what every replica imports."""


def forkable(framework: str, gpus: list[int] | None) -> bool:
    """May a replica of ``framework`` be forked (no GPU asked: a device is set up before
    the framework sees it, in a process of its own)?"""
    return gpus is None and framework not in NOT_FORKED


class ForkServer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loaded: set[str] = set()
        self.children: set[int] = set()
        self.reports: dict[int, bytearray] = {}
        """Pipes from replicas that have not reported yet: what came so far."""
        self.forkable = True
        """False once an import started a thread: a fork would copy a half-held lock."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    def run(self) -> None:
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        self.selector = selector
        while True:
            for key, _ in selector.select():
                if key.fileobj is self.sock:
                    data = self.sock.recv(MAX_FRAME)
                    if not data:
                        return  # the server closed its end: stop (children stay theirs)
                    frame = decode(data)
                    if isinstance(frame, Fork):
                        self.fork(frame)
                elif key.fileobj == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 512)
                else:
                    assert isinstance(key.fileobj, int)
                    self.read_report(key.fileobj)
            self.reap()

    def read_report(self, fd: int) -> None:
        """A replica's report of the modules it imported: at its end, import them."""
        chunk = os.read(fd, MAX_REPORT)
        if chunk and len(self.reports[fd]) + len(chunk) <= MAX_REPORT:
            self.reports[fd] += chunk
            return
        self.selector.unregister(fd)
        os.close(fd)
        names = self.reports.pop(fd).decode(errors="replace").split()
        for name in filter(_learnable, names):
            with contextlib.suppress(Exception):  # a replica imports what fails here itself
                importlib.import_module(name)
        if threading.active_count() > 1:
            self.forkable = False

    def preload(self, framework: str) -> None:
        if framework in self.loaded:
            return
        self.loaded.add(framework)
        for name in PRELOAD.get(framework, ()):
            with contextlib.suppress(Exception):  # the replica imports it again, says why
                importlib.import_module(name)

    def fork(self, frame: Fork) -> None:
        self.preload(frame.framework)
        if threading.active_count() > 1:
            self.forkable = False
        if not self.forkable:
            message = "an import started a thread in the fork server: no fork is safe"
            self._send(encode(Failed(request_id=frame.request_id, message=message)))
            return
        gc.collect()
        gc.freeze()  # the objects alive now are never touched by a child's collector
        report_r, report_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(report_r)
            os.close(report_w)
            self._send(encode(Failed(request_id=frame.request_id, message=str(exc))))
            return
        if pid == 0:
            os.close(report_r)
            self._child(frame, report_w)  # never returns
        os.close(report_w)
        self.reports[report_r] = bytearray()
        self.selector.register(report_r, selectors.EVENT_READ)
        self.children.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            forked = encode(Forked(request_id=frame.request_id, pid=pid))
            socket.send_fds(self.sock, [forked], [pidfd])
        finally:
            os.close(pidfd)

    def reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.children.discard(pid)
                self._send(encode(Exited(pid=pid, code=os.waitstatus_to_exitcode(status))))

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the server is gone: so are we, soon
            self.sock.send(data)

    def _child(self, frame: Fork, report: int) -> None:
        code = 70
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.selector.close()
            self.sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            for fd in self.reports:  # other replicas' reports are theirs
                os.close(fd)
            before = set(sys.modules)
            process.on_ready.append(lambda: _report(report, before))
            os.environ.clear()
            os.environ.update(frame.env)
            _limit_threads(frame.threads)
            _reseed()
            from inferd.serving import replica_server

            replica_server.main([frame.spec, str(frame.grace_s)])  # leaves by os._exit
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # said on stderr, as an interpreter would
            traceback.print_exc()
        finally:
            os._exit(code)


def _learnable(name: str) -> bool:
    """A module name the fork server may import from a replica's report."""
    return (
        name.isascii()
        and all(part.isidentifier() for part in name.split("."))
        and name.partition(".")[0] in LEARNED_ROOTS
        and name not in sys.modules
    )


def _report(fd: int, before: set[str]) -> None:
    """Tell the fork server the modules imported since the fork (at most
    :data:`MAX_REPORT` bytes, without blocking: a pipe holds that much)."""
    names = [name for name in sys.modules if name not in before]
    data = "\n".join(names).encode()[:MAX_REPORT]
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)
        os.write(fd, data[: data.rfind(b"\n") + 1] if len(data) == MAX_REPORT else data)
    os.close(fd)


def _limit_threads(threads: int) -> None:
    """The thread pools loaded before the fork read ``OMP_NUM_THREADS`` and the like when
    they loaded: set them to the replica's count (the ones it loads itself read its
    environment)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _reseed() -> None:
    """A fork copies the random generators' states: each replica seeds its own (Python's
    ``random`` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    die_with_parent()
    for name in BASE:
        importlib.import_module(name)
    with contextlib.suppress(KeyboardInterrupt):
        ForkServer(sock).run()


if __name__ == "__main__":
    main()
