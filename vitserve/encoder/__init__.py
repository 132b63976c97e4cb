"""vitserve's library: Qwen-VL vision towers, preprocessing and the graph-cached runner (no HTTP in here).

Imports are lazy so that preprocessing worker processes can load `encoder.preprocess` without torch."""

from .config import BUILTIN_CONFIGS, VisionConfig, builtin_config

__all__ = ["VisionEncoder", "EncodedImage", "EncodedVideo", "VisionConfig", "BUILTIN_CONFIGS", "builtin_config"]


def __getattr__(name: str):
    if name in ("VisionEncoder", "EncodedImage", "EncodedVideo"):
        from . import vision_encoder

        return getattr(vision_encoder, name)
    raise AttributeError(f"module 'encoder' has no attribute {name!r}")
