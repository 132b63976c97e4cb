"""Vision tower configs: one dataclass, parsed from a checkpoint's config.json or looked up by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# attention kernels a tower can run (encoder.attention); auto: the fastest that runs on the device and dtype
ATTENTION_BACKENDS = ("auto", "cudnn", "fa4", "flash", "sdpa")
# where weights come from (VisionEncoder.from_pretrained); dummy: seeded random weights in the published layout
LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Pixel normalization: OpenAI CLIP's statistics (Qwen2-VL, Qwen2.5-VL, transformers' processor default), and
# Qwen3-VL's, which maps [0, 1] onto [-1, 1].
OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
QWEN3_IMAGE_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
QWEN3_IMAGE_STD: tuple[float, float, float] = QWEN3_IMAGE_MEAN


@dataclass(frozen=True)
class VisionConfig:
    family: str  # one of FAMILIES
    depth: int
    hidden_size: int  # ViT width D
    num_heads: int
    intermediate_size: int  # MLP width as published (padded at load time when misaligned)
    out_hidden_size: int  # merger output = the LLM's hidden size
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5: window side in pixels (112); 0 = no window attention
    fullatt_block_indexes: tuple[int, ...] = ()
    deepstack_visual_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0  # Qwen3: learned position table (48 x 48)
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    head_dim = property(lambda self: self.hidden_size // self.num_heads)
    merge_unit = property(lambda self: self.spatial_merge_size**2)  # patches per output token
    patch_dim = property(lambda self: self.in_channels * self.temporal_patch_size * self.patch_size**2)
    window_tokens = property(lambda self: self.window_size // self.spatial_merge_size // self.patch_size)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown vision family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a head dim divisible by 4"
            )


_FAMILY_OF_MODEL_TYPE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_vl_vision": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_5_vl_vision": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_vl_vision": "qwen3_vl",
    "qwen3_vl_moe_vision": "qwen3_vl",
}
_QWEN3_PIXELS: dict[str, Any] = dict(
    patch_size=16, image_mean=QWEN3_IMAGE_MEAN, image_std=QWEN3_IMAGE_STD, min_pixels=65536, max_pixels=16777216
)
_QWEN2_PIXELS: dict[str, Any] = dict(min_pixels=3136, max_pixels=12845056)


def from_hf_config(cfg: dict) -> VisionConfig:
    """Parse a full checkpoint's config.json (or a bare vision_config) into a VisionConfig.

    Published configs disagree on names (`in_chans` vs `in_channels`, `embed_dim` vs `hidden_size`) and often omit
    fields, so every default here is the published checkpoints' value, never transformers' class default.
    """
    model_type = cfg.get("model_type", "")
    vision = cfg.get("vision_config", cfg)
    family = _FAMILY_OF_MODEL_TYPE.get(model_type) or _FAMILY_OF_MODEL_TYPE.get(vision.get("model_type", ""))
    if family is None:
        archs = cfg.get("architectures") or []
        raise ValueError(
            f"not a Qwen-VL checkpoint: model_type {model_type!r} (architectures {archs}); "
            f"supported families: {', '.join(FAMILIES)}"
        )
    rope = vision.get("rope_parameters") or {}
    common: dict[str, Any] = dict(
        family=family,
        depth=vision["depth"],
        num_heads=vision["num_heads"],
        patch_size=vision.get("patch_size", vision.get("spatial_patch_size", 16 if family == "qwen3_vl" else 14)),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if family == "qwen2_vl":
        d = vision.get("embed_dim", 1280)
        return VisionConfig(
            **common,
            **_QWEN2_PIXELS,
            hidden_size=d,
            intermediate_size=int(d * vision.get("mlp_ratio", 4)),
            out_hidden_size=vision["hidden_size"],
            hidden_act=vision.get("hidden_act", "quick_gelu"),
        )
    if family == "qwen2_5_vl":
        return VisionConfig(
            **common,
            **_QWEN2_PIXELS,
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            out_hidden_size=vision["out_hidden_size"],
            hidden_act=vision.get("hidden_act", "silu"),
            window_size=vision.get("window_size", 112),
            fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        )
    pixels = {k: v for k, v in _QWEN3_PIXELS.items() if k != "patch_size"}
    return VisionConfig(
        **common,
        **pixels,
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        out_hidden_size=vision["out_hidden_size"],
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", ())),
        num_position_embeddings=vision.get("num_position_embeddings", 2304),
    )


def _qwen2(out: int) -> VisionConfig:
    return VisionConfig("qwen2_vl", 32, 1280, 16, 5120, out, "quick_gelu", **_QWEN2_PIXELS)


def _qwen2_5(out: int) -> VisionConfig:
    return VisionConfig(
        "qwen2_5_vl",
        32,
        1280,
        16,
        3420,
        out,
        "silu",
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        **_QWEN2_PIXELS,
    )


def _qwen3(depth: int, d: int, mlp: int, out: int, deepstack: tuple[int, ...]) -> VisionConfig:
    return VisionConfig(
        "qwen3_vl",
        depth,
        d,
        16,
        mlp,
        out,
        "gelu_pytorch_tanh",
        deepstack_visual_indexes=deepstack,
        num_position_embeddings=2304,
        **_QWEN3_PIXELS,
    )


# Published checkpoints by hub id (values from their config.json files), plus tiny ones for tests and CPU demos.
BUILTIN_CONFIGS: dict[str, VisionConfig] = {
    "Qwen/Qwen2-VL-2B-Instruct": _qwen2(1536),
    "Qwen/Qwen2-VL-7B-Instruct": _qwen2(3584),
    "Qwen/Qwen2-VL-72B-Instruct": _qwen2(8192),
    "Qwen/Qwen2.5-VL-3B-Instruct": _qwen2_5(2048),
    "Qwen/Qwen2.5-VL-7B-Instruct": _qwen2_5(3584),
    "Qwen/Qwen2.5-VL-32B-Instruct": _qwen2_5(5120),
    "Qwen/Qwen2.5-VL-72B-Instruct": _qwen2_5(8192),
    "Qwen/Qwen3-VL-2B-Instruct": _qwen3(24, 1024, 4096, 2048, (5, 11, 17)),
    "Qwen/Qwen3-VL-4B-Instruct": _qwen3(24, 1024, 4096, 2560, (5, 11, 17)),
    "Qwen/Qwen3-VL-8B-Instruct": _qwen3(27, 1152, 4304, 4096, (8, 16, 24)),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _qwen3(27, 1152, 4304, 2048, (8, 16, 24)),
    "Qwen/Qwen3-VL-32B-Instruct": _qwen3(27, 1152, 4304, 5120, (8, 16, 24)),
    # Tiny towers: every code path of the real ones (windows not divisible by the grid, misaligned MLP widths,
    # deepstack, learned positions), small enough for CI on two CPU cores.
    "tiny-qwen2-vl": VisionConfig("qwen2_vl", 2, 64, 4, 128, 32, "quick_gelu", **_QWEN2_PIXELS),
    "tiny-qwen2.5-vl": VisionConfig(
        "qwen2_5_vl", 4, 64, 4, 90, 32, "silu", window_size=112, fullatt_block_indexes=(1, 3), **_QWEN2_PIXELS
    ),
    "tiny-qwen3-vl": VisionConfig(
        "qwen3_vl",
        4,
        64,
        4,
        96,
        32,
        "gelu_pytorch_tanh",
        deepstack_visual_indexes=(0, 2),
        num_position_embeddings=64,
        **_QWEN3_PIXELS,
    ),
}
for _name in list(BUILTIN_CONFIGS):  # "-Thinking" variants share the tower of their "-Instruct" sibling
    if _name.startswith("Qwen/Qwen3-VL"):
        BUILTIN_CONFIGS[_name.replace("-Instruct", "-Thinking")] = BUILTIN_CONFIGS[_name]


def builtin_config(name: str) -> VisionConfig:
    """Look a built-in config up by hub id (case-insensitive, `-Instruct` optional) or tiny name."""
    table = {k.lower(): v for k, v in BUILTIN_CONFIGS.items()}
    key = name.lower().rstrip("/")
    for candidate in (key, f"qwen/{key}", f"{key}-instruct", f"qwen/{key}-instruct"):
        if candidate in table:
            return table[candidate]
    raise KeyError(f"no built-in config named {name!r}; known: {', '.join(sorted(BUILTIN_CONFIGS))}")


__all__ = [
    "VisionConfig",
    "FAMILIES",
    "ATTENTION_BACKENDS",
    "LOAD_FORMATS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "QWEN3_IMAGE_MEAN",
    "QWEN3_IMAGE_STD",
    "BUILTIN_CONFIGS",
    "builtin_config",
    "from_hf_config",
]
