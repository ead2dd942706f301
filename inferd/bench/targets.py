"""What to call: presets for inferd, Open Inference Protocol, OpenAI-compatible and any URL.

A target is a method + path + default body template; streamed replies are recognised
by their content type (see :mod:`inferd.bench.sse`).
Presets only fill defaults; ``--path``, ``--body``/``--template``/``--payloads`` and
``--header`` override them, so any HTTP JSON API can be benchmarked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Target:
    name: str
    path: str
    template: dict[str, Any] | None
    method: str = "POST"


def preset(name: str, model: str | None, max_tokens: int, stream: bool) -> Target:
    """The defaults of one target kind; ``model`` fills paths and bodies."""
    m = model or "MODEL"
    prompt_body = {"prompt": "{{prompt}}", "max_tokens": max_tokens, "stream": stream}
    presets = {
        "predict": Target("predict", f"/api/v1/models/{m}/predict", None),
        "v2": Target("v2", f"/v2/models/{m}/infer", None),
        "generate": Target(
            "generate", f"/api/v1/models/{m}/generate", prompt_body),
        "completions": Target(
            "completions", "/v1/completions",
            {"model": m, **prompt_body, **_usage(stream)},
        ),
        "chat": Target(
            "chat", "/v1/chat/completions",
            {"model": m, "messages": [{"role": "user", "content": "{{prompt}}"}],
             "max_tokens": max_tokens, "stream": stream, **_usage(stream)},
        ),
        "embed": Target("embed", "/api/v1/embed", {"model": m, "inputs": ["{{words:12}}"]}),
        "embeddings": Target("embeddings", "/v1/embeddings", {"model": m, "input": "{{words:12}}"}),
        "url": Target("url", "", None),
    }  # fmt: skip
    if name not in presets:
        raise ValueError(f"unknown target {name!r}; one of {', '.join(presets)}")
    return presets[name]


def _usage(stream: bool) -> dict[str, Any]:
    return {"stream_options": {"include_usage": True}} if stream else {}


def split_url(url: str) -> tuple[str, int, str]:
    """``http(s)://host:port/path`` -> (host, port, path)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"only http:// and https:// URLs are supported, got {parts.scheme}://")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), path
