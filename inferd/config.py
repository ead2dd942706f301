"""One typed settings object for the whole process tree.

Precedence (highest first): explicit arguments (CLI flags), ``INFERD_*`` environment
variables, the YAML file named by ``--config`` / ``INFERD_CONFIG``, then the defaults
below. Nothing else in inferd reads ``os.environ`` for its own settings.

A setting that does not exist is an error, never ignored: an ``INFERD_*`` variable or a
YAML key that names no setting (a typo like ``INFERD_BATCHING__MAX_BATCH_SISE``) fails
with :class:`UnknownSetting`, which names it and lists the valid ones. The few
``INFERD_*`` variables that are not server settings are :data:`NOT_SETTINGS`.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from inferd.replica_config import BatchingConfig, ExplainConfig, Group, ImagesConfig, LLMConfig


class AuthConfig(Group):
    """Authentication (see :mod:`inferd.access` and :mod:`inferd.api.auth`); off by default."""

    enabled: bool = False
    cache_s: float = Field(5.0, ge=0, le=3600)
    """How long a gateway process trusts what it read about an API key (a revocation
    takes effect within this time)."""
    lookups_per_s: float = Field(50.0, gt=0)
    """API keys a gateway process reads from the registry per second at most (each key
    not in its cache is one read; the burst is the same number): a flood of made-up
    keys costs the registry no more than this, and a credential that finds the reads
    spent gets 503 with Retry-After (the cached and JWT ones are not held up)."""
    jwt_secret_file: Path | None = None
    """A file holding the HS256 secret (32+ characters) that signs accepted JWTs."""
    jwt_public_key_file: Path | None = None
    """A PEM public key (RS256 or ES256) that signs accepted JWTs."""
    jwt_jwks_file: Path | None = None
    """A JWKS file (``{"keys": [...]}``) of public keys that sign accepted JWTs."""
    jwt_audience: str | None = None
    jwt_issuer: str | None = None
    jwt_scopes_claim: str = "scope"
    """The claim holding the token's scopes (space-separated or a list)."""
    internal_token: str | None = Field(None, repr=False)
    """Set by the server at start for its own job runner (never configure it): the
    credential with which the runner calls the gateways."""


class Limit(Group):
    """A token bucket of requests: ``requests_per_s`` sustained, ``burst`` at once."""

    requests_per_s: float = Field(gt=0)
    burst: int = Field(ge=1)

    @property
    def rate_per_s(self) -> float:
        return self.requests_per_s

    @property
    def capacity(self) -> int:
        return self.burst


class TokenLimit(Group):
    """A budget of generation tokens (prompt + completion): ``tokens_per_minute``
    sustained, up to ``burst`` saved up."""

    tokens_per_minute: int = Field(ge=1)
    burst: int | None = Field(None, ge=1)
    """Most tokens saved up; None: ``tokens_per_minute`` (one minute's worth)."""

    @property
    def rate_per_s(self) -> float:
        return self.tokens_per_minute / 60.0

    @property
    def capacity(self) -> int:
        return self.burst or self.tokens_per_minute


class RateLimitConfig(Group):
    """Per client (API key or JWT subject; the client address when anonymous), over HTTP
    and gRPC together, for every route but health and metrics (see
    :mod:`inferd.access.limits`)."""

    default: Limit | None = None
    """Every client, all routes together; None: no limit."""
    models: dict[str, Limit] = Field(default_factory=dict)
    """Per model (named in the path or the gRPC message), per client, on top of ``default``."""
    tokens: TokenLimit | None = None
    """Generation tokens per client, all generative models together; None: no limit."""
    model_tokens: dict[str, TokenLimit] = Field(default_factory=dict)
    """Generation tokens per model, per client, on top of ``tokens``."""

    @property
    def limits_requests(self) -> bool:
        return self.default is not None or bool(self.models)

    @property
    def limits_tokens(self) -> bool:
        return self.tokens is not None or bool(self.model_tokens)


class ModelsConfig(Group):
    """Many versions on little memory (see :mod:`inferd.control.on_demand`)."""

    memory_budget_mb: int | None = Field(None, ge=1)
    """Load versions on demand and keep their replicas' resident memory under this: a
    version that is not pinned (metadata ``pinned: true``) and whose replica count no
    deployment fixes starts with no replica, a request for it waits while one starts,
    and the least recently used such versions with nothing in flight are unloaded to
    make room. None: every serving version keeps its replicas."""
    versions_per_process: int = Field(1, ge=1, le=1000)
    """Small versions (scikit-learn, XGBoost, LightGBM, ONNX, Python models) share replica
    processes, up to this many in each: each still a replica of its own (own batcher,
    thread, socket, status), in a fraction of the memory. 1: a process per replica."""
    fork_server: bool = True
    """Replica processes are forked from a fork server that imported the replica's code
    and, once asked for it, each framework's (:mod:`inferd.serving.zygote`): a replica
    starts without importing them again. The first replica of each framework starts from
    scratch; the fork server starts at the second (a restart, a scale-up, a start from
    zero, another version), so a server whose replicas each start once holds none of its
    memory. Not for TensorFlow, vLLM or GPU replicas, which start from scratch as they
    do with this off."""
    process_memory_mb: int = Field(4096, ge=16)
    """A shared process takes no new replica once its replicas' own memory (each one's
    ``model_bytes``, measured) reaches this, nor while they compute 0.8 of a core or
    more: the next goes to another shared process."""
    predict_budget_s: float = Field(60.0, gt=0)
    """In a shared process, a batch running longer than this cuts its replica off (its
    requests fail, its neighbours go on) and its version moves to a process of its own;
    a process that stops answering altogether (a model holding the interpreter lock) is
    killed this long plus 5 s after its last beat, the versions computing in it moved to
    processes of their own."""


class ConnectionsConfig(Group):
    """What one client connection may hold of a gateway process, on the HTTP port
    (HTTP/1.1) and the gRPC port (HTTP/2); per gateway process. Each limit, and what a
    client sees at it, is listed in the security guide (docs/guides/security.md)."""

    max_per_process: int = Field(4096, ge=1, le=1_000_000)
    """Open connections one gateway process keeps on each port; a connection beyond it is
    closed at once (gRPC: after a GOAWAY)."""
    header_timeout_s: float = Field(15.0, gt=0, le=3600)
    """A request's head must arrive within this: HTTP, from the connection's first byte
    or the end of the previous answer to the end of the headers (408); gRPC, the
    connection preface and each header block (HEADERS + CONTINUATION) from its first
    byte (GOAWAY)."""
    body_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Longest gap between two reads of a request body (HTTP: 408) or of a gRPC request
    message (the call ends DEADLINE_EXCEEDED), while the server waits for more of it."""
    idle_s: float = Field(30.0, gt=0, le=86400)
    """A connection with nothing in progress is closed after this (gRPC: GOAWAY first;
    HTTP keep-alive)."""
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Largest request head: HTTP's request line and headers (431), gRPC's header list
    (its calls refused, the connection closed past it)."""
    grpc_max_streams: int = Field(100, ge=1, le=10_000)
    """Concurrent calls on one gRPC connection (SETTINGS_MAX_CONCURRENT_STREAMS); a call
    beyond it is refused (REFUSED_STREAM)."""
    grpc_buffer_mb: float = Field(256.0, gt=0)
    """Request bytes one gateway process holds for all its gRPC calls (messages being
    received and those being answered): past it, uploads wait under HTTP/2 flow
    control until calls end. At least twice ``max_body_bytes`` is used."""
    grpc_connection_buffer_mb: float = Field(64.0, gt=0)
    """The same, for one gRPC connection. At least ``max_body_bytes`` is used."""


class CacheConfig(Group):
    """The result cache of predict and deterministic generation answers (see
    :mod:`inferd.routing.cache`); off by default. Embedded, one SQLite file per machine
    shared by its gateway processes, made fresh at each start; with ``redis_url``, Redis.
    A version's ``metadata.cache_ttl_s`` overrides ``ttl_s`` (0: never cached)."""

    enabled: bool = False
    ttl_s: float = Field(3600.0, ge=0)
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    """For the whole machine (all its gateway processes; least recently used entries
    go first); Redis (``redis_url``) has its own memory policy."""
    dir: Path | None = None
    """Folder of the shared file; default a private folder on /dev/shm when it has room
    for twice ``max_bytes``, else <data_dir>/cache. The server sets it for its gateways."""


class InferenceLogConfig(Group):
    """One row per inference request in the ``inference_logs`` table of the registry's
    database (see :mod:`inferd.monitoring.inference_log`)."""

    enabled: bool = True
    flush_interval_s: float = Field(1.0, gt=0, le=60)
    """How often each gateway process writes what accumulated, in one transaction."""
    max_buffer_rows: int = Field(100_000, ge=100)
    """Rows a gateway process holds while the database is behind; more are dropped."""
    retention_days: int = Field(7, ge=1, le=3650)
    """Older rows (PostgreSQL: older daily partitions) are removed hourly."""
    partitions_ahead_days: int = Field(3, ge=1, le=60)
    """PostgreSQL: daily partitions created ahead of time."""


SINK_SCHEMES = ("http", "https", "redis", "rediss", "kafka", "s3")
"""The URI schemes ``payload_log.sinks`` may use (:mod:`inferd.monitoring.sinks`)."""


class PayloadLogConfig(Group):
    """The inference log's rows (optionally with request and response bodies) shipped as
    CloudEvents to sinks, from the server process, off the request path (see
    :mod:`inferd.monitoring.sinks`); off while ``sinks`` is empty."""

    sinks: list[str] = Field(default_factory=list, repr=False)
    """Where rows go: ``http(s)://host:port/path`` (batched CloudEvents),
    ``redis://host:port/db?stream=NAME&maxlen=N`` (Redis Streams),
    ``kafka://host:9092[,host:9092]/topic``, ``s3://bucket/prefix`` (Parquet files)."""
    payloads: bool = False
    """Also ship the request and response bodies of sampled requests (REST predicts and
    generations' requests)."""
    sample_rate: float = Field(1.0, ge=0, le=1)
    """Share of requests whose bodies are shipped (every row is, bodies or not)."""
    redact: list[str] = Field(default_factory=list)
    """Field names whose values are replaced by ``[REDACTED]`` in shipped bodies, at any
    depth (a V2 tensor so named: its data); a body that is not JSON is then not shipped."""
    max_payload_bytes: int = Field(64 * 1024, ge=0, le=16 * 1024 * 1024)
    """A body larger than this is not shipped (its size is)."""
    batch_rows: int = Field(1000, ge=1, le=100_000)
    """Most rows in one send (one HTTP request, one pipeline, one Parquet file)."""
    flush_interval_s: float = Field(1.0, gt=0, le=3600)
    """Longest a row waits for its batch to fill before it is sent."""
    max_buffer_rows: int = Field(50_000, ge=100)
    """Rows each sink holds while it is slow or down; more are dropped and counted."""
    max_buffer_mb: float = Field(64.0, gt=0)
    """Bodies each sink (and each gateway process, between shipments) holds; past it new
    rows' bodies are dropped and counted."""
    attempts: int = Field(3, ge=1, le=100)
    """Tries of one batch before it is given up (counted as failed); backoff between."""
    timeout_s: float = Field(5.0, gt=0, le=300)
    """Longest one send may take (connect, write, answer)."""
    http_headers: dict[str, str] = Field(default_factory=dict, repr=False)
    """Extra headers of HTTP sinks' requests (``Authorization: Bearer …``)."""

    @model_validator(mode="after")
    def _known_schemes(self) -> PayloadLogConfig:
        for uri in self.sinks:
            scheme, _, rest = uri.partition("://")
            if not rest or scheme.lower() not in SINK_SCHEMES:
                raise ValueError(
                    f"payload_log.sinks: {uri!r} names no known sink; "
                    f"use one of {', '.join(s + '://' for s in SINK_SCHEMES)}"
                )
            if not rest.split("/", 1)[0]:  # the host, bucket or brokers
                raise ValueError(f"payload_log.sinks: {uri!r} names no host (or bucket)")
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError("payload_log.sinks lists a sink twice")
        return self


class ConsoleConfig(Group):
    """The web console at ``/ui`` and the figures behind it (see :mod:`inferd.console`
    and :mod:`inferd.control.console`)."""

    enabled: bool = True
    """Serve the console at ``/ui`` (a browser asking for ``/`` is sent there)."""
    slot_s: float = Field(2.0, ge=0.5, le=60)
    """Resolution of the live charts: figures are summed per slot of this many seconds."""
    history_s: float = Field(900.0, ge=60, le=86400)
    """How much of those figures the server keeps (the charts' widest window)."""
    alerts: bool = True
    """Evaluate the alert rules in the server (the console's firing alerts)."""
    alert_interval_s: float = Field(15.0, ge=1, le=600)
    """How often the alert rules are evaluated over the server's own samples
    (Prometheus' default scrape and evaluation interval)."""
    alert_rules_file: Path | None = None
    """Prometheus rules to evaluate; default the shipped ``deploy/prometheus/alerts.yml``."""


class DriftConfig(Group):
    """Label-free input drift of predict models: each version's recent inputs against
    its reference profile (see :mod:`inferd.control.drift`)."""

    enabled: bool = True
    """Count inputs and score drift (off: replicas count nothing)."""
    interval_s: float = Field(10.0, ge=0.1, le=3600)
    """How often the server collects the replicas' counts (a window moves by this much)."""
    window_rows: int = Field(1000, ge=10, le=10_000_000)
    """Rows a window holds: the newest collections that reach this many."""
    window_s: float = Field(3600.0, ge=1, le=30 * 86400)
    """No collection older than this is in a window (low traffic: a shorter window)."""
    min_window_rows: int = Field(200, ge=10, le=10_000_000)
    """Fewer rows in the window: no scores (too few to tell)."""
    reference_rows: int = Field(1000, ge=100, le=100_000)
    """Rows of a version's first requests that make its reference, when no sample was
    registered with it (``drift_reference.npz`` in its folder)."""
    psi_threshold: float = Field(0.2, gt=0, le=10)
    """PSI at or over which a feature is flagged (a version's ``drift_psi_threshold``
    metadata overrides it)."""
    max_categories: int = Field(50, ge=2, le=1000)
    """A text input with at most this many distinct values in the reference is
    categorical, else it is followed by its length."""
    max_rows_per_s: int = Field(5000, ge=10, le=10_000_000)
    """Rows a replica counts a second at most; past that, one row in K (counting costs
    ~0.03 us per row and feature: 5,000 rows of 30 features, under 1 % of a core)."""


class ClusterConfig(Group):
    """Roles on several hosts: ``inferd control``, ``inferd gateway``, ``inferd replica``
    talking over TCP (see :mod:`inferd.transport`). Every TCP connection between them
    proves the token and/or mutual TLS before any frame is read."""

    token: str | None = None
    """Shared secret of the cluster's processes (16 characters or more), proven by a
    challenge-response, never sent."""
    tls_cert: str | None = None
    """This process's certificate (PEM) for mutual TLS; with ``tls_key`` and ``tls_ca``."""
    tls_key: str | None = None
    tls_ca: str | None = None
    """The CA that signed every cluster member's certificate."""
    control: str | None = None
    """The controller's address for ``inferd gateway`` and ``inferd replica``
    (``host:port``)."""
    control_listen: str | None = None
    """Where ``inferd control`` (and ``inferd serve``) also listens for gateways and
    replicas on other hosts (``host:port``); None: local gateways only."""
    local_replicas: bool = True
    """Start replicas on this host; off (``inferd control --no-local-replicas``): only
    replicas that join from other hosts serve."""
    rejoin_window_s: float = Field(3.0, ge=0)
    """A controller listening for other hosts (``control_listen``) first waits this long
    for the replicas that served its predecessor to join again, before it starts
    replicas or sends gateways a table (a failover then never routes around them)."""
    replica_timeout_s: float = Field(3.0, gt=0)
    """A joined replica whose beats (one a second) stopped this long leaves routing."""
    lost_control_after_s: float = Field(5.0, gt=0)
    """A gateway's routing table is stale, and ``/health/ready`` says so, once the
    controller has not been heard from for this long (the gateway keeps serving it)."""


class TLSConfig(Group):
    """TLS on the client-facing ports: the HTTP and gRPC ports of every gateway (see
    :mod:`inferd.tls`). Not ``cluster.tls_*``, which is between inferd's own processes."""

    cert_file: Path | None = None
    """PEM certificate chain served on the HTTP and gRPC ports (None: plain HTTP and gRPC)."""
    key_file: Path | None = None
    """The private key (PEM) of ``cert_file``."""
    client_ca_file: Path | None = None
    """Mutual TLS for API clients: both ports require a client certificate signed by this
    CA (PEM); None: no client certificate asked for."""

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "tls.cert_file and tls.key_file go together (INFERD_TLS__CERT_FILE, "
                "INFERD_TLS__KEY_FILE): give both, or neither for plain HTTP and gRPC"
            )
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("tls.client_ca_file needs tls.cert_file and tls.key_file")
        return self


class KubernetesConfig(Group):
    """The ``kubernetes`` replica backend (``replica_backend: kubernetes``): per deployed
    version a Deployment of ``inferd replica`` pods in one namespace, scaled by the
    controller and the autoscaler, its pods found through the Kubernetes API (see
    :mod:`inferd.control.backends.kubernetes`). The API is reached in-cluster (the pod's
    service account) or through ``KUBECONFIG``."""

    namespace: str | None = None
    """Where replica Deployments live; None: the controller pod's own namespace (else
    ``default``)."""
    image: str = "inferd:latest"
    """Image of replica pods (the controller's own image, as the Helm chart sets it)."""
    torch_image: str | None = None
    """Image of the replica pods of versions that need PyTorch (``torch``,
    ``transformers``, ``gpt2``, ``llm``: the image's ``llm`` variant); None: ``image``.
    A version's ``image`` metadata overrides both."""
    image_pull_policy: str = Field("IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Secrets replica pods pull their image with."""
    instance: str = Field("inferd", pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
    """``app.kubernetes.io/instance`` of everything it creates (the Helm release): one
    controller owns the replica Deployments carrying its instance, and only those."""
    owner: str | None = None
    """A Deployment (the controller's own) that owns the replica Deployments: deleting it
    (``helm uninstall``) garbage-collects them. None: they are left to the controller."""
    service_account: str | None = None
    """Replica pods' service account (its token is never mounted: they need no API)."""
    env_from_secrets: list[str] = Field(default_factory=list)
    """Secrets whose keys become replica pods' environment (the cluster token, the S3
    store's credentials)."""
    env_from_config_maps: list[str] = Field(default_factory=list)
    """ConfigMaps whose keys become replica pods' environment."""
    replica_port: int = Field(9000, ge=1, le=65535)
    """Port of the replica protocol in a pod (gateways and the controller connect)."""
    health_port: int = Field(9001, ge=1, le=65535)
    """Port of a pod's ``/health/live`` and ``/health/ready`` (the kubelet's probes)."""
    cpu_request: str = "500m"
    """A replica container's CPU request (a deployment's resources do not set one)."""
    memory_request: str = "1Gi"
    """A replica container's memory request (and limit: the pod is evicted beyond)."""
    data_size_limit: str = "20Gi"
    """Size limit of a pod's model cache (an ``emptyDir`` the version's files are
    fetched into)."""
    node_cache_path: str | None = None
    """A folder of each node (a ``hostPath``, writable by the pods' user 10001) that
    replica pods share as their artifact cache: a version's files are downloaded once per
    node, and a new pod of a version the node ran starts without a download. None: each
    pod fetches into its own ``emptyDir``."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels every replica pod asks for."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of every replica pod (Kubernetes' own shape)."""
    gpu_node_label: str = "nvidia.com/gpu.product"
    """The node label a deployment's ``resources.gpu`` selects (its value, as named)."""
    leader_election: bool = True
    """Controllers elect one leader through a Lease (beside the registry's lock)."""
    lease_name: str = "inferd-controller"
    lease_duration_s: float = Field(15.0, ge=2, le=300)
    """A leader that has not renewed the Lease for this long is replaced."""


class RegistryConfig(Group):
    """Registering versions over the API (``POST /api/v1/models/{model}/versions``)."""

    max_upload_bytes: int = Field(20 * 1024**3, ge=1024)
    """Largest artifact upload, and largest total its archive may unpack to (413
    beyond). Uploads stream to disk: memory does not grow with their size."""
    import_roots: list[Path] = Field(default_factory=list)
    """Folders a ``file://`` ``source_uri`` may name (none: file imports are refused,
    so an API caller cannot make the server read its own files)."""
    inspect_timeout_s: float = Field(600.0, gt=0)
    """Time the check of a new version (load it, warm it up, read its signature) may take,
    an import's download and conversion included."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server for ``models:/…`` and ``runs:/…`` sources (None: the
    ``MLFLOW_TRACKING_URI`` environment variable)."""


class ArtifactCacheConfig(Group):
    """A host's cache of versions fetched from an S3 ``artifact_store``, by content
    (see :mod:`inferd.registry.artifact_cache`)."""

    dir: Path | None = None
    """The cache folder (None: ``<data_dir>/artifact-cache``). Servers, joined replicas
    and pods of one host that name the same folder share it: a version's files are
    downloaded once per host, and one registered twice (same sha256) once."""
    max_gb: float = Field(50.0, gt=0)
    """Size bound: past it the least recently used versions that no replica runs from
    are removed (one in use never is)."""


class JobsConfig(Group):
    """Batch jobs and asynchronous requests (see :mod:`inferd.jobs`)."""

    chunk_items: int = Field(256, ge=1, le=4096)
    """Inputs per queue message (and per request the runner sends)."""
    concurrency: int = Field(4, ge=1, le=256)
    """Chunks the server's runner has in flight at once."""
    lease_s: float = Field(60.0, gt=0)
    """A chunk not acknowledged within this time (its runner died) is delivered again."""
    max_items: int = Field(1_000_000, ge=1)
    """Most inputs in one batch job (413 beyond)."""
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    """Largest ``POST /api/v1/batch`` body (inputs inline); larger jobs name a file."""
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    """Largest file ``POST /v1/files`` takes (OpenAI's limit for a batch's input): 413 as
    soon as an upload passes it, the rest unread. Uploads stream to the file store."""
    max_file_bytes_per_owner: int = Field(10 * 1024**3, ge=1024)
    """Bytes of files one owner (API key or JWT subject; everyone together with auth
    off) keeps until they expire or are deleted: 413 for an upload past it."""
    max_files_per_owner: int = Field(1000, ge=1)
    """Files one owner keeps until they expire or are deleted: 409 for one more."""
    file_keep_s: float = Field(30 * 86400.0, gt=0)
    """How long an uploaded file is kept when its upload names no ``expires_after``
    (OpenAI's default for ``purpose=batch``); then it is gone, its bytes removed."""
    upkeep_interval_s: float = Field(600.0, gt=0)
    """How often the server removes expired jobs and files (with their bytes)."""
    input_roots: list[Path] = Field(default_factory=list)
    """Folders a job's local ``input_uri`` may name files in (default: <data_dir>/inputs);
    a path elsewhere is refused (403), so the API cannot read the server's other files.
    Remote URLs (``s3://``, ``gs://``, ``https://``, ...) are read through fsspec."""
    keep_s: float = Field(7 * 86400.0, gt=0)
    """How long a finished batch job and its results are kept."""
    request_keep_s: float = Field(86400.0, gt=0)
    """How long an asynchronous request's result is kept."""
    callback_secret: str | None = None
    """Signs callbacks (HMAC-SHA256); None: they are sent unsigned."""
    callback_attempts: int = Field(8, ge=1, le=100)
    callback_timeout_s: float = Field(10.0, gt=0)
    callback_first_delay_s: float = Field(1.0, gt=0)
    """Backoff before the second attempt; it doubles (up to 5 min), with full jitter."""
    runner: bool = True
    """Run the job runner in this server (several servers may share a Redis or Kafka
    queue; each one's runner takes its share)."""
    gateway_url: str | None = None
    """Where the runner sends its requests (``http(s)://host:port`` of a gateway); None:
    this server's own gateways. ``inferd control`` has none: it runs the runner only
    with this set (``--jobs-gateway``)."""


NOT_SETTINGS = ("INFERD_CONFIG", "INFERD_API_KEY", "INFERD_URL", "INFERD_REPLICA_SPEC")
"""``INFERD_*`` variables that are not server settings: the YAML file to read, the
credential and address ``inferd`` client commands use, and the spec a replica pod is
given (``inferd replica --spec-env``)."""
NOT_SETTINGS_PREFIXES = ("INFERD_TEST_", "INFERD_SKIP_", "INFERD_BENCH_")
"""Variables of inferd's own test suite and benchmarks (never read by the server)."""


class UnknownSetting(ValueError):
    """A variable or YAML key that names no setting."""


def default_demo_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/inferd/demo``, else ``~/.cache/inferd/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferd" / "demo"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="INFERD_", env_nested_delimiter="__", extra="forbid"
    )

    data_dir: Path = Path(".inferd")
    """Folder holding the SQLite database and the artifact store."""
    database_url: str | None = None
    """SQLAlchemy URL of the registry; default sqlite:///<data_dir>/inferd.db."""
    host: str = "127.0.0.1"
    """Address the HTTP gateway binds."""
    port: int = Field(8000, ge=0, le=65535)
    """Port of the HTTP gateway (0 picks a free one)."""
    grpc_port: int = Field(8001, ge=-1, le=65535)
    """Port of the Open Inference Protocol's gRPC service (0 picks a free one, -1: no
    gRPC). Same host and gateway processes as HTTP."""
    gateway_workers: int = Field(default_factory=lambda: min(os.cpu_count() or 1, 4), ge=1, le=64)
    """HTTP gateway processes sharing the port (SO_REUSEPORT)."""
    replicas: int = Field(1, ge=1, le=64)
    """Replica processes per served model version (registry defaults may override)."""
    replica_threads: int = Field(1, ge=1, le=256)
    """Intra-op threads of each replica's runtime (torch, onnxruntime, xgboost, lightgbm)."""
    batching: BatchingConfig = Field(default_factory=lambda: BatchingConfig())
    """Default dynamic batching for versions that do not set their own."""
    images: ImagesConfig = Field(default_factory=lambda: ImagesConfig())
    """Image inputs: allowed buckets, pixel and size limits, decoding threads."""
    explain: ExplainConfig = Field(default_factory=lambda: ExplainConfig())
    """Explanations: rows, coalitions and background caps, a cost budget, a queue bound."""
    llm: LLMConfig = Field(default_factory=lambda: LLMConfig())
    """Engine settings for generative (GPT-2-family) models."""
    inference_log: InferenceLogConfig = Field(default_factory=lambda: InferenceLogConfig())
    payload_log: PayloadLogConfig = Field(default_factory=lambda: PayloadLogConfig())
    auth: AuthConfig = Field(default_factory=lambda: AuthConfig())
    rate_limits: RateLimitConfig = Field(default_factory=lambda: RateLimitConfig())
    cache: CacheConfig = Field(default_factory=lambda: CacheConfig())
    models: ModelsConfig = Field(default_factory=lambda: ModelsConfig())
    connections: ConnectionsConfig = Field(default_factory=lambda: ConnectionsConfig())
    redis_url: str | None = None
    """Redis for what gateway processes share (rate limit budgets); None: in process."""
    queue_url: str | None = None
    """The job queue: ``sqlite:///path`` (default: <data_dir>/queue.db), ``redis://…``
    (Redis Streams) or ``kafka://host:port``."""
    jobs: JobsConfig = Field(default_factory=lambda: JobsConfig())
    registry: RegistryConfig = Field(default_factory=lambda: RegistryConfig())
    artifact_cache: ArtifactCacheConfig = Field(default_factory=lambda: ArtifactCacheConfig())
    cluster: ClusterConfig = Field(default_factory=lambda: ClusterConfig())
    console: ConsoleConfig = Field(default_factory=lambda: ConsoleConfig())
    drift: DriftConfig = Field(default_factory=lambda: DriftConfig())
    replica_backend: str = Field("local", pattern="^(local|kubernetes)$")
    """Where the controller runs replicas: ``local`` child processes, or ``kubernetes``
    (a Deployment of replica pods per version, see ``kubernetes``)."""
    kubernetes: KubernetesConfig = Field(default_factory=lambda: KubernetesConfig())
    tls: TLSConfig = Field(default_factory=lambda: TLSConfig())
    """TLS (and optionally client certificates) on the HTTP and gRPC ports."""
    artifact_store: str | None = None
    """Where versions' files live: None, the data folder (``<data_dir>/artifacts``); or
    ``s3://bucket/prefix``, an S3-compatible store (endpoint and credentials the usual
    AWS way: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, …), the local folder then
    being a verified cache that replicas fetch into."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 beyond)."""
    max_rows_per_request: int = Field(4096, ge=1)
    """Most input rows in one predict request (413 beyond)."""
    request_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one inference request, from arrival at the gateway, unless it names
    its own (``X-Request-Timeout``, ``params.timeout_ms``, V2/gRPC ``timeout``)."""
    max_request_timeout_s: float = Field(300.0, gt=0)
    """The longest deadline a request may name (a longer one is cut to this)."""
    hold_timeout_s: float = Field(30.0, ge=0)
    """Longest a request waits, within its deadline, for a replica of its version that is
    starting (a crash restart, a first load) when none is ready (0: answer 503 at once)."""
    hold_max_requests: int = Field(1000, ge=0)
    """Requests one gateway process holds at once that way; more get 503 at once."""
    load_timeout_s: float = Field(300.0, gt=0)
    """Time a replica may take to load and warm up before it is killed and retried."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM, time given to in-flight requests before processes are killed."""
    restart_backoff_max_s: float = Field(30.0, gt=0)
    """Upper bound of the exponential backoff between restarts of a crashing replica."""
    reconcile_interval_s: float = Field(2.0, gt=0)
    """How often the controller compares the registry with the running replicas."""
    autoscale_interval_s: float = Field(10.0, gt=0)
    """How often autoscaled deployments' replicas are looked at (their signals)."""
    autoscale_memory_headroom: float = Field(0.1, ge=0, lt=1)
    """Share of the machine's memory autoscaling leaves free: it starts no replica that
    would not fit beside it (measured by the version's running replicas' RSS)."""
    run_dir: Path | None = None
    """Folder for replica sockets; default a short private folder under /tmp."""
    demo_llm: bool = True
    """With --demo, also build and serve the small demo GPT-2 and its LoRA adapter."""
    demo_text: bool = True
    """With --demo, also serve all-MiniLM-L6-v2 and the sentiment classifier trained over
    it (needs ``inferd[demo]``)."""
    demo_cache_dir: Path | None = Field(default_factory=default_demo_cache_dir)
    """Where --demo keeps the models it built, by the hash of their code, data and
    frameworks' versions, so that another data folder on this machine copies them
    instead of training again (``$XDG_CACHE_HOME/inferd/demo``, else
    ``~/.cache/inferd/demo``); empty: build every time."""
    log_level: str = "INFO"
    """Log level of every inferd process."""
    log_json: bool = False
    """Write logs as JSON lines instead of text."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        check_environment(os.environ)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = settings_cls.model_config.get("yaml_file") or os.environ.get("INFERD_CONFIG")
        if config_file:
            sources.append(_CheckedYaml(settings_cls, yaml_file=config_file))
        return tuple(sources)

    @field_validator("demo_cache_dir", mode="before")
    @classmethod
    def _no_demo_cache(cls, value: Any) -> Any:
        return None if value == "" else value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'inferd.db').resolve()}"

    @property
    def resolved_queue_url(self) -> str:
        if self.queue_url:
            return self.queue_url
        return f"sqlite:///{(self.data_dir / 'queue.db').resolve()}"

    @property
    def job_input_roots(self) -> list[Path]:
        return [p.resolve() for p in self.jobs.input_roots] or [
            (self.data_dir / "inputs").resolve()
        ]

    @property
    def artifact_dir(self) -> Path:
        return (self.data_dir / "artifacts").resolve()

    @property
    def artifact_cache_dir(self) -> Path:
        return (self.artifact_cache.dir or self.data_dir / "artifact-cache").resolve()

    @property
    def artifact_cache_max_bytes(self) -> int:
        return int(self.artifact_cache.max_gb * 1024**3)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings from env + an optional YAML file, with explicit overrides on top."""
    cls: type[Settings] = Settings
    if config_file is not None:
        if not config_file.is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": str(config_file)})
        cls = type("FileSettings", (Settings,), {"model_config": config})
    return cls(**{k: v for k, v in overrides.items() if v is not None})


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``INFERD_*`` variables that name no setting (:class:`UnknownSetting`)."""
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("INFERD_") or upper in NOT_SETTINGS:
            continue
        if upper.startswith(NOT_SETTINGS_PREFIXES):
            continue
        problem = _unknown(upper[len("INFERD_") :].lower().split("__"), Settings)
        if problem:
            raise UnknownSetting(f"unknown setting {name}: {problem}")


def _unknown(path: list[str], model: type[BaseModel], name: str = "") -> str | None:
    """Why ``path`` names no setting of ``model`` (the group ``name``; None: it names
    one). Keys below a setting that is not a group (a mapping such as
    ``rate_limits.models``) are its value's, not settings."""
    key, rest = path[0], path[1:]
    fields = model.model_fields
    if key not in fields:
        where = f"{name} has" if name else "settings have"
        return f"{where} no {key!r}; valid: {', '.join(sorted(fields))}"
    group = _group_of(fields[key].annotation)
    if rest and group is not None:
        return _unknown(rest, group, f"{name}.{key}" if name else key)
    return None


def _group_of(annotation: Any) -> type[Group] | None:
    """The group a field holds (``Limit | None`` holds ``Limit``), if any."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Group):
            return candidate
    return None


def _unknown_keys(data: Any, model: type[BaseModel], name: str = "") -> str | None:
    """The first YAML key under ``data`` that names no setting of ``model``, with why."""
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        problem = _unknown([str(key)], model, name)
        if problem:
            return f"{name}.{key}: {problem}" if name else f"{key}: {problem}"
        group = _group_of(model.model_fields[str(key)].annotation)
        if group is not None:
            found = _unknown_keys(value, group, f"{name}.{key}" if name else str(key))
            if found:
                return found
    return None


class _CheckedYaml(YamlConfigSettingsSource):
    """The YAML file, refused when a key names no setting."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        problem = _unknown_keys(data, Settings)
        if problem:
            raise UnknownSetting(f"unknown setting in {self.yaml_file_path}: {problem}")
        return data
