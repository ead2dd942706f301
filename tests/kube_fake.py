"""A test double of the few Kubernetes API calls inferd's backend makes, with a kubelet.

No cluster can run on these machines, so the Kubernetes backend is tested against this:
an HTTP server speaking the API's real paths and shapes (objects, lists with
``resourceVersion``, ``Status`` errors, streamed watch events, server-side apply as a
PATCH of ``application/apply-patch+yaml``, the ``scale`` subresource, optimistic
concurrency on Leases), for exactly what the backend's Role grants: deployments,
deployments/scale, pods (list, watch), leases. Shapes follow the API reference of
apps/v1, core/v1, autoscaling/v1 and coordination.k8s.io/v1; the real client library
(lightkube) parses them.

Behind it a small Deployment controller and kubelet make the pods real: each pod is a
real ``inferd replica`` process started from the pod template as a kubelet would start
its container: the environment from ``env`` (``fieldRef`` of ``metadata.name`` and
``status.podIP`` included) and ``envFrom`` (Secrets and ConfigMaps stored here),
``$(VAR)`` expanded in the arguments, its ``emptyDir`` at ``/data`` a folder of its own,
a ``hostPath`` a folder of the (one) node's that every pod mounting it shares. Init
containers run first, one at a time, each to a clean exit (restarted with a backoff
until then, ``CrashLoopBackOff`` after the second failure, in
``initContainerStatuses``). ``readOnly`` mounts are not enforced (the tests run as root,
which a folder's permissions do not stop): tests check what was written instead.
Each pod gets its own loopback address (127.0.0.N) as its pod IP, as a pod network would
give it one. The readiness, liveness and startup probes are HTTP GETs to the pod IP
(polled every 0.2 s here, not the template's periods, to keep tests short); a container
that exits is restarted with a backoff (``CrashLoopBackOff`` after the second exit);
a deleted pod gets SIGTERM, then SIGKILL after its grace. A ``nodeSelector`` that no
node here matches leaves the pod Pending and unschedulable, with the scheduler's
message.

What this double does not do: authentication and RBAC (the chart's Role is checked
separately), resource accounting, field managers' conflicts, rolling updates beyond
surge 1 / unavailable 0, events.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime as dt
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PROBE_EVERY_S = 0.2


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return JSONResponse(body, status_code=code)


def _selected(labels: dict[str, str], selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class Pod:
    """One pod and its container process."""

    def __init__(self, fake: FakeKube, obj: dict[str, Any], template_hash: str) -> None:
        self.fake = fake
        self.obj = obj
        self.template_hash = template_hash
        self.proc: subprocess.Popen[bytes] | None = None
        self.task: asyncio.Task[None] | None = None
        self.deleting = False

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def ready(self) -> bool:
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in self.obj["status"]["conditions"]
        )

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.obj["spec"]["containers"][0])

    def _condition(self, kind: str, status: bool, reason: str = "", message: str = "") -> None:
        for c in self.obj["status"]["conditions"]:
            if c["type"] == kind:
                c.update(status="True" if status else "False", lastTransitionTime=_now())
                c.pop("reason", None)
                c.pop("message", None)
                if reason:
                    c.update(reason=reason, message=message)

    def _state(self, **state: Any) -> None:
        cs = self.obj["status"]["containerStatuses"][0]
        cs["state"] = state
        cs["ready"] = self.ready

    @staticmethod
    def _status_of(container: dict[str, Any], waiting: str) -> dict[str, Any]:
        return {
            "name": container["name"],
            "image": container["image"],
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "started": False,
            "state": {"waiting": {"reason": waiting}},
        }

    def changed(self) -> None:
        self.fake.modified("pods", self.obj)

    async def run(self) -> None:
        """Schedule, then keep the container running (restarting it) until deleted."""
        selector = self.obj["spec"].get("nodeSelector") or {}
        if any(self.fake.node_labels.get(k) != v for k, v in selector.items()):
            self._condition(
                "PodScheduled", False, "Unschedulable",
                "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. "
                "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.",
            )  # fmt: skip
            self.changed()
            return
        self._condition("PodScheduled", True)
        self.obj["spec"]["nodeName"] = "fake-node"
        steps = self.obj["spec"].get("initContainers") or []
        self.obj["status"]["containerStatuses"] = [  # once scheduled, as the kubelet does
            self._status_of(self.container, "PodInitializing" if steps else "ContainerCreating")
        ]
        if steps:
            self.obj["status"]["initContainerStatuses"] = [
                self._status_of(c, "PodInitializing") for c in steps
            ]
        self.obj["status"]["podIP"] = self.obj["status"]["podIPs"][0]["ip"]
        self.changed()
        for i, step in enumerate(steps):
            if not await self._run_step(i, step):
                return
        self._condition("Initialized", True)
        backoff = 0.5
        while not self.deleting:
            code = await self._run_container()
            if self.deleting:
                break
            cs = self.obj["status"]["containerStatuses"][0]
            cs["restartCount"] += 1
            cs["lastState"] = {
                "terminated": {"exitCode": code, "reason": "Error", "finishedAt": _now()}
            }
            self._condition("Ready", False)
            self._condition("ContainersReady", False)
            if cs["restartCount"] >= 2:
                self._state(
                    waiting={
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {backoff:.1f}s restarting failed container",
                    }
                )
            self.changed()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _run_step(self, index: int, step: dict[str, Any]) -> bool:
        """One init container, run until it exits 0 (True) or the pod is deleted."""
        backoff = 0.5
        while not self.deleting:
            status = self.obj["status"]["initContainerStatuses"][index]
            status.update(started=True, state={"running": {"startedAt": _now()}})
            self.changed()
            self.proc = self._launch(step)  # what a delete stops, meanwhile
            code = await asyncio.to_thread(self.proc.wait)
            finished = {"exitCode": code, "finishedAt": _now()}
            if code == 0:
                status.update(
                    started=False, state={"terminated": {**finished, "reason": "Completed"}}
                )
                self.changed()
                return True
            status["restartCount"] += 1
            status["lastState"] = {"terminated": {**finished, "reason": "Error"}}
            status["state"] = {"waiting": {"reason": "PodInitializing"}}
            if status["restartCount"] >= 2:
                message = f"back-off {backoff:.1f}s restarting failed container"
                status["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
            self.changed()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        return False

    def _folder(self, volume: str) -> Path:
        """Where a volume of this pod lives: a ``hostPath`` in the node's folder (shared
        by the pods that mount it), anything else in the pod's own."""
        for v in self.obj["spec"].get("volumes", []):
            if v["name"] == volume and "hostPath" in v:
                return self.fake.root / "node" / v["hostPath"]["path"].strip("/")
        return self.fake.root / self.name / volume

    def _environment(self, container: dict[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERD_", "KUBECONFIG"))}
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                data = self.fake.secrets.get(source["secretRef"]["name"], {})
                env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
            if "configMapRef" in source:
                env.update(self.fake.config_maps.get(source["configMapRef"]["name"], {}))
        fields = {
            "metadata.name": self.name,
            "metadata.namespace": self.obj["metadata"]["namespace"],
            "status.podIP": self.obj["status"]["podIP"],
        }
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = re.sub(
                    r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"]
                )
            elif "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        # volumes: a folder of this pod's (of the node's), where the container mounts them
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for path, volume in mounts.items():
            folder = self._folder(volume)
            folder.mkdir(parents=True, exist_ok=True)
            for key, value in list(env.items()):
                if value == path or value.startswith(path + "/"):
                    env[key] = str(folder) + value[len(path) :]
        if "/tmp" in mounts:
            env["TMPDIR"] = str(self._folder(mounts["/tmp"]))
        return env

    def _launch(self, container: dict[str, Any]) -> subprocess.Popen[bytes]:
        env = self._environment(container)
        expand = lambda s: re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), s)  # noqa: E731
        command = [expand(a) for a in container["command"] + container.get("args", [])]
        if command[0] == "inferd":  # the image's entry point
            command = [sys.executable, "-m", "inferd", *command[1:]]
        log = open(self.fake.root / f"{self.name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.fake.processes.append(proc)
        return proc

    async def _run_container(self) -> int:
        self.proc = self._launch(self.container)
        cs = self.obj["status"]["containerStatuses"][0]
        cs["started"] = True
        cs["containerID"] = f"fake://{uuid.uuid4().hex}"
        self._state(running={"startedAt": _now()})
        self.obj["status"]["phase"] = "Running"
        self.changed()
        live_failures = 0
        while self.proc.poll() is None:
            await asyncio.sleep(PROBE_EVERY_S)
            if self.deleting:
                break
            ready = await self._probe(self.container.get("readinessProbe"))
            if ready != self.ready:
                self._condition("Ready", ready)
                self._condition("ContainersReady", ready)
                self._state(running=cs["state"].get("running", {"startedAt": _now()}))
                self.changed()
            live = await self._probe(self.container.get("livenessProbe"))
            live_failures = 0 if live else live_failures + 1
            threshold = (self.container.get("livenessProbe") or {}).get("failureThreshold", 3)
            if live_failures >= threshold * 5:  # probes here run 5x as often
                self.proc.kill()
        return await asyncio.to_thread(self.proc.wait)

    async def _probe(self, probe: dict[str, Any] | None) -> bool:
        if not probe:
            return True
        get = probe["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in self.container["ports"] if p["name"] == port)
        url = f"http://{self.obj['status']['podIP']}:{port}{get['path']}"
        try:
            async with httpx.AsyncClient(timeout=probe.get("timeoutSeconds", 1)) as client:
                return (await client.get(url)).status_code < 400
        except httpx.HTTPError:
            return False

    async def delete(self) -> None:
        """SIGTERM, the pod's grace, SIGKILL; then it is gone."""
        if self.deleting:
            return
        self.deleting = True
        self.obj["metadata"]["deletionTimestamp"] = _now()
        grace = self.obj["spec"].get("terminationGracePeriodSeconds", 30)
        self.obj["metadata"]["deletionGracePeriodSeconds"] = grace
        self._condition("Ready", False)
        self._condition("ContainersReady", False)
        self.changed()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self.task is not None:
            self.task.cancel()
        self.fake.remove_pod(self)


class FakeKube:
    """The API server, controller and kubelet; ``url`` and ``kubeconfig`` for clients."""

    def __init__(self, root: Path, namespace: str = "inferd") -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.objects: dict[str, dict[str, dict[str, Any]]] = {
            "deployments": {},
            "leases": {},
        }
        self.pods: dict[str, Pod] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.config_maps: dict[str, dict[str, str]] = {}
        self.node_labels: dict[str, str] = {"kubernetes.io/hostname": "fake-node"}
        self.requests: list[tuple[str, str, str, Any]] = []
        """(method, path, content type, body) of every call, in order."""
        self._version = itertools.count(1000)
        self._ips = itertools.count(2)
        self._watchers: list[tuple[str, str | None, asyncio.Queue[dict[str, Any]]]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.stop_watches = False
        self.forbid: set[str] = set()
        """Resources the caller's Role does not grant (403)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.processes: list[subprocess.Popen[bytes]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(
            self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake API server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self._delete_all_pods(), self.loop).result(60)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        for proc in self.processes:  # none outlives the double, whatever was in flight
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    async def _delete_all_pods(self) -> None:
        await asyncio.gather(*(p.delete() for p in list(self.pods.values())))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "fake",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's loop (objects are only touched there)."""
        assert self.loop is not None

        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    # -- what tests look at ---------------------------------------------------------------------

    def deployment(self, name: str) -> dict[str, Any] | None:
        found = self.call(lambda: self.objects["deployments"].get(name))
        return copy.deepcopy(found)

    def deployments(self) -> dict[str, dict[str, Any]]:
        return self.call(lambda: copy.deepcopy(self.objects["deployments"]))  # type: ignore[no-any-return]

    def pod_list(self) -> list[dict[str, Any]]:
        return self.call(lambda: [copy.deepcopy(p.obj) for p in self.pods.values()])  # type: ignore[no-any-return]

    def kill_container(self, pod_name: str) -> None:
        """The container crashes (SIGKILL), as an OOM kill would do."""

        def kill() -> None:
            proc = self.pods[pod_name].proc
            assert proc is not None
            proc.kill()

        self.call(kill)

    def add_owner(self, name: str) -> str:
        """A Deployment standing for the controller's own (what owns replicas); its uid."""
        body = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "c", "image": "inferd:test"}]},
                },
            },
        }
        return str(self.call(self._store, "deployments", body)["metadata"]["uid"])

    # -- the API ---------------------------------------------------------------------------------

    def app(self) -> Starlette:
        ns = "/namespaces/{ns}"
        routes = [
            Route(f"/api/v1{ns}/pods", self._pods, methods=["GET"]),
            Route(f"/apis/apps/v1{ns}/deployments", self._deployments, methods=["GET", "POST"]),
            Route(
                f"/apis/apps/v1{ns}/deployments/{{name}}",
                self._deployment,
                methods=["GET", "PATCH", "DELETE", "PUT"],
            ),
            Route(
                f"/apis/apps/v1{ns}/deployments/{{name}}/scale",
                self._scale,
                methods=["GET", "PATCH"],
            ),
            Route(f"/apis/coordination.k8s.io/v1{ns}/leases", self._leases, methods=["POST"]),
            Route(
                f"/apis/coordination.k8s.io/v1{ns}/leases/{{name}}",
                self._lease,
                methods=["GET", "PUT"],
            ),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> Any:
            self.loop = asyncio.get_running_loop()
            controller = asyncio.create_task(self._control_forever())
            yield
            controller.cancel()

        return Starlette(
            routes=routes,
            lifespan=lifespan,
            middleware=[Middleware(BaseHTTPMiddleware, dispatch=self._rbac)],
        )

    async def _rbac(self, request: Request, call_next: Any) -> Response:
        refused = self._forbidden(request)
        return refused if refused is not None else await call_next(request)

    def _forbidden(self, request: Request) -> JSONResponse | None:
        """A Role without ``resource`` (``forbid``): the API's 403, as RBAC answers."""
        parts = request.url.path.split("/")
        resource = next((r for r in ("leases", "deployments", "pods") if r in parts), "")
        if resource not in self.forbid:
            return None
        return _status(
            403, "Forbidden",
            f'{resource} is forbidden: User "system:serviceaccount:{self.namespace}:inferd" '
            f'cannot {request.method.lower()} resource "{resource}" in the namespace '
            f'"{self.namespace}"',
        )  # fmt: skip

    async def _record(self, request: Request) -> Any:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        self.requests.append(
            (request.method, request.url.path + "?" + request.url.query,
             request.headers.get("content-type", ""), body)
        )  # fmt: skip
        return body

    def _store(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = str(next(self._version))
        meta["generation"] = meta.get("generation", 0) + 1
        meta["namespace"] = self.namespace
        new = meta["name"] not in self.objects[kind]
        self.objects[kind][meta["name"]] = obj
        self._emit(kind, "ADDED" if new else "MODIFIED", obj)
        return obj

    def modified(self, kind: str, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._version))
        self._emit(kind, "MODIFIED", obj)

    def _emit(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        labels = obj["metadata"].get("labels") or {}
        for watched, selector, queue in self._watchers:
            if watched == kind and _selected(labels, selector):
                queue.put_nowait({"type": event, "object": copy.deepcopy(obj)})

    def _list(self, kind: str, items: list[dict[str, Any]], selector: str | None) -> JSONResponse:
        api = {"pods": ("v1", "PodList"), "deployments": ("apps/v1", "DeploymentList")}[kind]
        chosen = [
            copy.deepcopy(o)
            for o in items
            if _selected(o["metadata"].get("labels") or {}, selector)
        ]
        return JSONResponse(
            {
                "kind": api[1],
                "apiVersion": api[0],
                "metadata": {"resourceVersion": str(next(self._version))},
                "items": chosen,
            }
        )

    def _watch(self, kind: str, selector: str | None) -> StreamingResponse:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        entry = (kind, selector, queue)
        self._watchers.append(entry)

        async def events() -> Any:
            try:
                while not self.stop_watches:
                    try:
                        event = await asyncio.wait_for(queue.get(), 0.5)
                    except TimeoutError:
                        continue
                    yield json.dumps(event).encode() + b"\n"
            finally:
                self._watchers.remove(entry)

        return StreamingResponse(events(), media_type="application/json")

    async def _pods(self, request: Request) -> Response:
        await self._record(request)
        selector = request.query_params.get("labelSelector")
        if request.query_params.get("watch") in ("true", "1"):
            return self._watch("pods", selector)
        return self._list("pods", [p.obj for p in self.pods.values()], selector)

    async def _deployments(self, request: Request) -> Response:
        body = await self._record(request)
        selector = request.query_params.get("labelSelector")
        if request.method == "POST":
            if body["metadata"]["name"] in self.objects["deployments"]:
                return _status(409, "AlreadyExists", "deployments.apps already exists")
            return JSONResponse(self._store("deployments", body), status_code=201)
        if request.query_params.get("watch") in ("true", "1"):
            return self._watch("deployments", selector)
        return self._list("deployments", list(self.objects["deployments"].values()), selector)

    async def _deployment(self, request: Request) -> Response:
        body = await self._record(request)
        name = request.path_params["name"]
        existing = self.objects["deployments"].get(name)
        if request.method == "PATCH":
            kind = request.headers.get("content-type", "")
            if kind != "application/apply-patch+yaml":
                return _status(415, "UnsupportedMediaType", f"this double only applies, not {kind}")
            if request.query_params.get("fieldManager") is None:
                return _status(422, "Invalid", "fieldManager is required for apply patch")
            if existing is not None:
                body["metadata"] = {**existing["metadata"], **body["metadata"]}
                body["metadata"]["generation"] = existing["metadata"]["generation"]
            body["status"] = (existing or {}).get("status", {})
            return JSONResponse(self._store("deployments", body))
        if existing is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "GET":
            return JSONResponse(existing)
        if request.method == "DELETE":
            del self.objects["deployments"][name]
            self._emit("deployments", "DELETED", existing)
            return JSONResponse(
                {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}
            )
        return _status(405, "MethodNotAllowed", "PUT is not used by inferd")

    async def _scale(self, request: Request) -> Response:
        body = await self._record(request)
        name = request.path_params["name"]
        existing = self.objects["deployments"].get(name)
        if existing is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "PATCH":
            if request.headers.get("content-type") != "application/merge-patch+json":
                return _status(415, "UnsupportedMediaType", "this double takes merge patches")
            existing["spec"]["replicas"] = int(body["spec"]["replicas"])
            existing["metadata"]["generation"] += 1
            self.modified("deployments", existing)
        selector = ",".join(
            f"{k}={v}" for k, v in existing["spec"]["selector"]["matchLabels"].items()
        )
        return JSONResponse(
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {
                    k: existing["metadata"][k]
                    for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                },
                "spec": {"replicas": existing["spec"]["replicas"]},
                "status": {"replicas": len(self._pods_of(existing)), "selector": selector},
            }
        )

    async def _leases(self, request: Request) -> Response:
        body = await self._record(request)
        if body["metadata"]["name"] in self.objects["leases"]:
            return _status(409, "AlreadyExists", "leases.coordination.k8s.io already exists")
        return JSONResponse(self._store("leases", body), status_code=201)

    async def _lease(self, request: Request) -> Response:
        body = await self._record(request)
        name = request.path_params["name"]
        existing = self.objects["leases"].get(name)
        if existing is None:
            return _status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        if request.method == "GET":
            return JSONResponse(existing)
        if body["metadata"].get("resourceVersion") != existing["metadata"]["resourceVersion"]:
            return _status(
                409, "Conflict",
                f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the '
                "object has been modified; please apply your changes to the latest version "
                "and try again",
            )  # fmt: skip
        body["metadata"] = {**existing["metadata"], **body["metadata"]}
        return JSONResponse(self._store("leases", body))

    # -- the Deployment controller and the kubelet -----------------------------------------------

    def _pods_of(self, deployment: dict[str, Any]) -> list[Pod]:
        match = deployment["spec"]["selector"]["matchLabels"]
        return [
            p
            for p in self.pods.values()
            if all(p.obj["metadata"]["labels"].get(k) == v for k, v in match.items())
        ]

    async def _control_forever(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            for dep in list(self.objects["deployments"].values()):
                self._reconcile(dep)
            names = set(self.objects["deployments"])
            for pod in list(self.pods.values()):
                owner = pod.obj["metadata"]["ownerReferences"][0]["name"]
                if owner not in names and not pod.deleting:  # garbage collection
                    self._spawn(pod.delete())

    def _reconcile(self, dep: dict[str, Any]) -> None:
        """Surge one, never below the count ready: new template's pods first, then the
        old ones go; extra ones go not-ready first, newest first."""
        template = dep["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        pods = [p for p in self._pods_of(dep) if not p.deleting]
        new = [p for p in pods if p.template_hash == digest]
        old = [p for p in pods if p.template_hash != digest]
        want = int(dep["spec"].get("replicas", 1))
        ready = sum(p.ready for p in pods)
        if len(new) < want and len(pods) < want + 1:
            self._create_pod(dep, template, digest)
        if old:
            victim = min(old, key=lambda p: p.ready)  # not-ready ones first
            if not victim.ready or ready - 1 >= want:
                self._spawn(victim.delete())
        elif len(new) > want:
            extra = sorted(new, key=lambda p: (p.ready, p.obj["metadata"]["creationTimestamp"]))
            for pod in extra[: len(new) - want]:
                self._spawn(pod.delete())
        status = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": len(pods),
            "readyReplicas": ready,
            "updatedReplicas": len(new),
        }
        if dep.get("status") != status:
            dep["status"] = status
            self.modified("deployments", dep)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _create_pod(self, dep: dict[str, Any], template: dict[str, Any], digest: str) -> None:
        name = f"{dep['metadata']['name']}-{digest[:10]}-{uuid.uuid4().hex[:5]}"
        ip = f"127.0.0.{next(self._ips)}"
        obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {**template["metadata"]["labels"], "pod-template-hash": digest[:10]},
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "ReplicaSet",
                        "name": dep["metadata"]["name"],
                        "uid": dep["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": copy.deepcopy(template["spec"]),
            "status": {
                "phase": "Pending",
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": t, "status": "False", "lastTransitionTime": _now()}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
            },
        }
        pod = Pod(self, obj, digest)
        self.pods[name] = pod
        self._store_pod(pod)
        pod.task = asyncio.get_running_loop().create_task(pod.run())

    def _store_pod(self, pod: Pod) -> None:
        meta = pod.obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = str(next(self._version))
        self._emit("pods", "ADDED", pod.obj)

    def remove_pod(self, pod: Pod) -> None:
        if self.pods.pop(pod.name, None) is not None:
            pod.obj["metadata"]["resourceVersion"] = str(next(self._version))
            self._emit("pods", "DELETED", pod.obj)
