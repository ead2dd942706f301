"""Validate Kubernetes objects against the OpenAPI schemas of the Kubernetes versions
inferd supports: the newest four that the ``kubernetes-validate`` package bundles
(:data:`VERSIONS`), in its strict form, so an unknown or misspelt field is an error as
``kubectl apply --validate=strict`` would make it.

    from tests.k8s_schemas import validate
    validate(deployment_dict)   # raises InvalidObject naming the version, path and problem

Validators are built once per (version, apiVersion, kind): the schemas are large and
the test suite validates hundreds of objects. Custom resources (a ServiceMonitor) have
no bundled schema: :class:`NoSchema`.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
from kubernetes_validate.utils import all_versions  # sorted, each twice (strict or not)
from referencing import Registry, Resource

VERSIONS: tuple[str, ...] = tuple(dict.fromkeys(all_versions()))[-4:]
"""Kubernetes versions (major.minor.patch) every object must be valid on."""


class InvalidObject(ValueError):
    """An object the API server of one of :data:`VERSIONS` would refuse."""


class NoSchema(InvalidObject):
    """No bundled schema for the object's apiVersion and kind (a custom resource, or an
    API group the version does not serve)."""


def validate(obj: dict[str, Any], versions: tuple[str, ...] = VERSIONS) -> None:
    """Raise :class:`InvalidObject` unless ``obj`` is valid on every one of ``versions``."""
    if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
        raise InvalidObject(f"not a Kubernetes object (no apiVersion/kind): {obj!r:.200}")
    what = f"{obj['kind']} {obj.get('metadata', {}).get('name', '<no name>')!r}"
    for version in versions:
        validator = _validator(version, obj["apiVersion"], obj["kind"])
        errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.path])
        if errors:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e.path) or '<root>'}: {e.message:.300}"
                for e in errors[:5]
            )
            raise InvalidObject(f"{what} is not valid on Kubernetes {version}: {problems}")


def _schema_file(version: str, name: str) -> Any:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = folder / f"v{version}-local-strict" / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


@cache
def _definitions(version: str) -> Registry:
    definitions = _schema_file(version, "_definitions.json")
    return Resource.from_contents(definitions) @ Registry()


@cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    # rbac.authorization.k8s.io/v1 -> rbac-v1, apps/v1 -> apps-v1, v1 -> v1
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = _schema_file(version, f"{kind.lower()}-{group_version}.json")
    if schema is None:
        raise NoSchema(f"no schema for {kind} {api_version} in Kubernetes {version}")
    registry = Resource.from_contents(schema) @ _definitions(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)
