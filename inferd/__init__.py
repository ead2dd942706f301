"""inferd: a model-serving platform.

Importing ``inferd`` does nothing but define names; the server starts from the CLI
(``inferd serve``) or :func:`inferd.server.serve`.
"""

__version__ = "0.1.0"

from inferd.config import Settings  # noqa: E402
from inferd.errors import InferdError  # noqa: E402
from inferd.runtimes.base import Runtime, Signature, TensorSpec  # noqa: E402

__all__ = ["InferdError", "Runtime", "Settings", "Signature", "TensorSpec", "__version__"]
