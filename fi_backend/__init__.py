"""fi-backend: a FlashInfer-style attention engine for LLM serving (see DESIGN.md)."""
from ._version import __version__

__all__ = ["__version__"]
