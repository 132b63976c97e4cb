"""Checkpoints: resolve a directory or hub id, read only the vision tensors from only their shards, check them
strictly against the family's published layout, and turn them into our fused, padded weights. Also seeded dummy
weights (vLLM's `load_format="dummy"`), which go through the very same conversion.

transformers' tower `from_pretrained(full_checkpoint_dir)` silently keeps random weights (the checkpoint's names
start with `visual.`/`model.visual.`); here a name or shape that does not match is always an error.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from .config import VisionConfig, from_hf_config
from .models import FAMILY_MODULES
from .progress import Progress

log = logging.getLogger("vitserve.checkpoint")

VISION_PREFIXES = ("model.visual.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded faithfully: missing file, missing/unexpected tensor, wrong shape, or a
    model that is not a supported Qwen-VL family."""


def _hub_file(repo_id: str, filename: str, revision: str | None, allow_download: bool, cache_dir=None) -> Path | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(
            hf_hub_download(
                repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=not allow_download
            )
        )
    except Exception as e:  # network, auth, missing repo or file: all explained in one CheckpointError
        if filename != "config.json" and isinstance(e, (LocalEntryNotFoundError, EntryNotFoundError)):
            return None  # optional files; a missing shard is reported when it is read
        how = (
            "downloads are disabled (HF_HUB_OFFLINE=1 or allow_download=False)"
            if not allow_download
            else f"fetching {filename} failed: {type(e).__name__}: {e}"
        )
        raise CheckpointError(
            f"{repo_id!r} is not a local directory and is not in the Hugging Face cache "
            f"({cache_dir or os.environ.get('HF_HOME', '~/.cache/huggingface')}); {how}"
        ) from None


def resolve_checkpoint(
    model: str, revision: str | None = None, allow_download: bool | None = None, cache_dir: str | None = None
) -> Path:
    """A local checkpoint directory, or the snapshot directory of a hub id in the local HF cache. When downloads are
    allowed (default: unless HF_HUB_OFFLINE is set), fetch config, the processors' settings (images' and videos'),
    index and only the shards holding vision tensors."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint directory {model!r} does not exist or is not a directory")
    if allow_download is None:
        allow_download = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes")
    fetch = lambda name: _hub_file(model, name, revision, allow_download, cache_dir)  # noqa: E731
    config = cast(Path, fetch("config.json"))  # never None: only an optional file can be missing (_hub_file)
    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"):
        fetch(name)  # the image's and the video's processor settings, where transformers looks for them
    index = fetch(INDEX_FILE)
    shards = (
        [SINGLE_FILE]
        if index is None
        else sorted(set(_vision_weight_map(json.loads(index.read_text())["weight_map"]).values()))
    )
    progress = Progress(log, f"checkpoint shards of {model} in the cache", len(shards), "shards")
    for shard in shards:
        fetch(shard)
        progress.advance(1, shard)
    return config.parent


def _vision_weight_map(weight_map: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in weight_map.items() if k.startswith(VISION_PREFIXES)}


def read_config(ckpt: Path) -> tuple[VisionConfig, dict]:
    """The vision config and the preprocessor_config.json dict (empty when the checkpoint has none)."""
    config_file = ckpt / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{ckpt} has no config.json")
    try:
        cfg = from_hf_config(json.loads(config_file.read_text()))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{config_file}: vision_config lacks or mistypes {e}") from None
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    pre = ckpt / "preprocessor_config.json"
    return cfg, (json.loads(pre.read_text()) if pre.is_file() else {})


def read_video_config(ckpt: Path) -> dict:
    """The video processor's settings as transformers finds them: `processor_config.json`'s "video_processor", else
    `video_preprocessor_config.json`, else `preprocessor_config.json` (empty when the checkpoint has none)."""
    nested = ckpt / "processor_config.json"
    if nested.is_file():
        video = json.loads(nested.read_text()).get("video_processor")
        if isinstance(video, dict):
            return video
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (ckpt / name).is_file():
            return json.loads((ckpt / name).read_text())
    return {}


def read_vision_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Vision tensors with their `visual.`/`model.visual.` prefix stripped, read only from the shards that hold them."""
    index = ckpt / INDEX_FILE
    if index.is_file():
        weight_map = _vision_weight_map(json.loads(index.read_text())["weight_map"])
    elif (ckpt / SINGLE_FILE).is_file():
        with safe_open(ckpt / SINGLE_FILE, framework="pt") as f:
            weight_map = _vision_weight_map({k: SINGLE_FILE for k in f.keys()})
    else:
        raise CheckpointError(f"{ckpt} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    if not weight_map:
        raise CheckpointError(f"{ckpt} holds no vision tensors (names starting with {' or '.join(VISION_PREFIXES)})")
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    tensors, progress = {}, Progress(log, f"checkpoint read ({len(by_shard)} shard(s))", len(weight_map), "tensors")
    for shard, keys in sorted(by_shard.items()):
        if not (ckpt / shard).is_file():
            raise CheckpointError(f"shard {shard} (holding e.g. {keys[0]}) is missing from {ckpt}")
        with safe_open(ckpt / shard, framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{key} is listed in {INDEX_FILE} under {shard} but that shard lacks it")
                name = key.removeprefix(VISION_PREFIXES[0]).removeprefix(VISION_PREFIXES[1])
                tensors[name] = _read(f.get_tensor(key))
                progress.advance(1, shard)
    return tensors


def _read(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor safetensors maps from its file, read now (one byte per page touched): the disk is read in this step,
    with its progress, not later, unannounced, by whatever first uses the weights."""
    if tensor.numel():
        tensor.reshape(-1).view(torch.uint8)[::4096].max()
    return tensor


def check_layout(tensors: dict[str, torch.Tensor], cfg: VisionConfig) -> None:
    """Strict: every published vision tensor present with its exact shape, and nothing else."""
    layout = FAMILY_MODULES[cfg.family].hf_layout(cfg)
    problems = [f"missing vision tensor visual.{k} {tuple(s)}" for k, s in layout.items() if k not in tensors]
    problems += [f"unexpected vision tensor visual.{k}" for k in tensors if k not in layout]
    problems += [
        f"shape mismatch for visual.{k}: checkpoint {tuple(t.shape)}, {cfg.family} config expects {tuple(layout[k])}"
        for k, t in tensors.items()
        if k in layout and tuple(t.shape) != tuple(layout[k])
    ]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"{cfg.family} checkpoint does not match its config: " + "; ".join(problems[:10]) + more)


DUMMY_SEED_STRIDE = 2**20  # more than any layout's tensors: no two (seed, place) pairs share a generator seed


def dummy_tensors(cfg: VisionConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights in the published layout (norm weights near 1, others ~N(0, 0.02)), on the CPU: the same
    numbers for a given seed whatever device the tower then runs on (CUDA's generator draws other numbers than the
    CPU's), realistic enough in scale that a 32-block tower stays finite in bf16. Each tensor has a generator of its
    own, seeded by `seed` and the tensor's place in the layout, so that they are drawn side by side (torch's CPU
    sampler runs on one core: 576 M values of Qwen3-VL-8B take seconds there) with the same numbers on any number of
    threads."""
    layout = list(FAMILY_MODULES[cfg.family].hf_layout(cfg).items())

    def draw(place: int) -> torch.Tensor:
        name, shape = layout[place]
        gen = torch.Generator().manual_seed(seed * DUMMY_SEED_STRIDE + place)
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
        is_norm_weight = name.endswith(".weight") and len(shape) == 1
        return (t + 1.0 if is_norm_weight else t).to(dtype)

    out, progress = {}, Progress(log, "dummy weights drawn", len(layout), "tensors")
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="vitserve-dummy") as pool:
        for (name, _), t in zip(layout, pool.map(draw, range(len(layout)))):
            out[name] = t
            progress.advance()
    return out


def build_tower(
    cfg: VisionConfig,
    tensors: dict[str, torch.Tensor],
    device: str | torch.device,
    dtype: torch.dtype,
    attention: str = "auto",
):
    """Check, convert (fuse qkv/gate-up, pad MLP widths) and load published-layout tensors into our tower, with the
    attention backend called `attention` (encoder.attention.BACKENDS). Each tensor goes to the device in `dtype`
    first and is converted there: the conversion only concatenates, pads with zeros and reshapes, which is exact in
    any dtype, and on a GPU it is microseconds where the host's copies of a float32 8B tower take seconds."""
    check_layout(tensors, cfg)
    family = FAMILY_MODULES[cfg.family]
    progress = Progress(
        log,
        f"weights to {device} as {str(dtype).removeprefix('torch.')}",
        sum(t.numel() for t in tensors.values()) * dtype.itemsize,
        "MiB",
    )
    placed = {}
    for name, t in tensors.items():
        placed[name] = t.to(device=device, dtype=dtype)
        progress.advance(placed[name].nbytes)
    log.info("building the %s tower, its weights fused and padded to its layout", cfg.family)
    state = family.convert(placed, cfg)
    del placed
    with torch.device("meta"):
        tower = family.build(cfg)
    tower.load_state_dict(state, strict=True, assign=True)
    tower.reset_buffers(device)
    tower.set_attention(attention, device, dtype)
    return tower.eval().requires_grad_(False)
