"""vitserve's library: Qwen-VL vision towers, preprocessing and the graph-cached runner (no HTTP in here)."""

from .config import BUILTIN_CONFIGS, VisionConfig, builtin_config
from .vision_encoder import EncodedImage, VisionEncoder

__all__ = ["VisionEncoder", "EncodedImage", "VisionConfig", "BUILTIN_CONFIGS", "builtin_config"]
