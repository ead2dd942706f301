"""What a replica of a running version is told to serve, whoever runs it: the process
orchestrator's supervisors, the Kubernetes pod template and the replicas that join from
other hosts all get it from :func:`replica_spec`, so the same version is served the same
way wherever it runs."""

from __future__ import annotations

from inferd.config import BatchingConfig, Settings
from inferd.control.routes import adapters
from inferd.control.state import VersionSet
from inferd.shapes.replica_spec import ReplicaSpec


def replica_spec(
    settings: Settings, vset: VersionSet, replica_id: str, gpus: list[int] | None
) -> ReplicaSpec:
    """What a replica of ``vset`` is told to serve: the server's batching settings under
    the version's, under the deployment's; whoever runs it fills in its address."""
    batching = settings.batching.model_dump()
    for overrides in (vset.record.batching, vset.batching):
        batching.update({k: v for k, v in (overrides or {}).items() if k in batching})
    record = vset.record
    artifact_dir = record.artifact_path
    if record.artifact_uri.startswith("s3://"):  # fetched into this host's cache
        artifact_dir = settings.artifact_cache_dir / record.sha256
    return ReplicaSpec(
        replica_id=replica_id,
        model=vset.record.model_name,
        version=vset.record.version,
        framework=vset.record.framework,
        artifact_dir=str(artifact_dir),
        artifact_uri=vset.record.artifact_uri,
        sha256=vset.record.sha256,
        artifact_cache_dir=str(settings.artifact_cache_dir),
        artifact_cache_max_bytes=settings.artifact_cache_max_bytes,
        address="",
        batching=BatchingConfig.model_validate(batching),
        signature=vset.record.signature,
        metadata=vset.record.metadata,
        threads=settings.replica_threads,
        log_level=settings.log_level,
        log_json=settings.log_json,
        llm=settings.llm,
        images=settings.images,
        explain=settings.explain,
        adapters=adapters(vset.record),
        gpus=gpus,
    )
