"""inferd: a model-serving platform.

Importing ``inferd`` does nothing but define names; the server starts from the CLI
(``inferd serve``) or :func:`inferd.server.serve`.
"""

__version__ = "0.1.0"

from inferd.config import Settings
from inferd.errors import InferdError
from inferd.runtimes.base import Runtime, Signature, TensorSpec

__all__ = ["InferdError", "Runtime", "Settings", "Signature", "TensorSpec", "__version__"]
