"""inferd: a model-serving platform.

Importing ``inferd`` does nothing but define names; the server starts from the CLI
(``inferd serve``) or :func:`inferd.server.serve`. ``Settings`` loads on first use: a
replica process (which reads no settings of its own) never imports pydantic-settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from inferd.errors import InferdError
from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature, TensorSpec

if TYPE_CHECKING:
    from inferd.config import Settings

__all__ = ["InferdError", "Runtime", "Settings", "Signature", "TensorSpec", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Settings":
        from inferd.config import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
