"""vitserve: Qwen-VL vision towers as a service. `vitserve.encoder` is the library (no HTTP), `vitserve.service` the
HTTP service over it; the library's main names are importable from here: `from vitserve import VisionEncoder`.

Importing this package imports no torch: the names below load on first use."""

from __future__ import annotations

__version__ = "0.2.0"
__all__ = ["VisionEncoder", "EncodedImage", "VisionConfig", "BUILTIN_CONFIGS", "builtin_config", "__version__"]


def __getattr__(name: str):
    if name in __all__ and name != "__version__":
        from . import encoder

        return getattr(encoder, name)
    raise AttributeError(f"module 'vitserve' has no attribute {name!r}")
