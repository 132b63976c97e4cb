"""The public entry point: load a tower with its preprocessing config, encode images. `DTYPES` names the dtypes a
tower runs in, config.LOAD_FORMATS where its weights come from."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, cast

import numpy as np
import torch
from PIL import Image

from . import checkpoint, preprocess_fast, video
from .config import LOAD_FORMATS, VisionConfig, builtin_config
from .features import Features
from .image_resize import pillow_resize_images
from .pixels import frames_from_planes, slices_from_planes, upload
from .plan import Grid
from .preprocess import (
    PREPROCESS_MODES,
    ImageError,
    PreprocessConfig,
    load_for_device,
    load_image,
    normalize_lut,
    preprocess,
    resize_rgb,
    target_size,
)
from .preprocess_fast import fast_lut
from .runner import DEFAULT_BUDGETS, GraphRunner, Launch
from .video_planes import SlicePlanes

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
}
IMAGE_TYPES = (str, os.PathLike, bytes, bytearray, memoryview, Image.Image)  # one image: a path, its bytes, PIL
IMAGE_RESIZES = ("auto", "device", "host")  # where exact preprocessing resizes an image (VisionEncoder.encode)


@dataclass
class EncodedImage:
    """One image's features (the library's and vitserve.client's results). `embeddings` [tokens, width], raster
    order, on the CPU: width is out_hidden, or with the client's layout="vllm" out_hidden x (1 + deepstack layers);
    `grid_thw` in patches, before the 2x2 merge (tokens = t * h * w / merge_unit); `deepstack` always a list: one
    [tokens, out_hidden] per deepstack layer for Qwen3-VL, empty for towers without deepstack (and when the
    features were not asked for, or are on the width)."""

    embeddings: torch.Tensor
    grid_thw: tuple[int, int, int]
    deepstack: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]


def as_list(images) -> tuple[list, bool]:
    """`images` as a list, and whether it was one image (a path, encoded bytes or a PIL image) rather than a
    sequence of them: the callers give one result for one image, a list for a list."""
    if isinstance(images, IMAGE_TYPES):
        return [images], True
    return list(images), False


@dataclass
class EncodedVideo(EncodedImage):
    """One video's features: `embeddings` [tokens, width] slice after slice (each slice's tokens in raster order),
    `grid_thw` (slices, h, w) in patches; and what an LLM needs to place them: the indices of the frames sampled
    (`frame_indices`, in the source's decode order), the source's frame rate (`fps`), each slice's time in seconds
    (`timestamps`: Qwen3-VL writes them before the slices' tokens) and the seconds a slice spans
    (`second_per_grid_t`: Qwen2.5-VL's `second_per_grid_ts` entry)."""

    frame_indices: list[int] = field(default_factory=list)
    fps: float = 0.0
    timestamps: list[float] = field(default_factory=list)
    second_per_grid_t: float = 0.0


def videos_list(videos) -> tuple[list, bool]:
    """`videos` as a list, and whether it was one video (a path, its bytes or a decoded video.Video)."""
    if isinstance(videos, (str, os.PathLike, bytes, bytearray, memoryview, video.Video)):
        return [videos], True
    return list(videos), False


@dataclass
class Launched:
    """Images on their way through the device (`launch`): the runner's launch, and the images left out of it."""

    launch: Launch | None  # None when every image failed
    failed: dict  # index -> ImageError
    count: int


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    names = [str(d).removeprefix("torch.") for d in dict.fromkeys(DTYPES.values())]
    raise ValueError(f"unsupported dtype {dtype!r}; use {', '.join(names[:-1])} or {names[-1]}")


def parse_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; use cpu or cuda[:i]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device


def load_configs(
    model: str,
    load_format: str = "auto",
    revision: str | None = None,
    allow_download: bool | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    cache_dir: str | None = None,
) -> tuple[VisionConfig, PreprocessConfig, Path | None]:
    """The tower's and the preprocessing's configs, and the checkpoint directory to read weights from (None for
    dummy weights), without reading any weight: what a server needs before its devices have loaded."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    ckpt: Path | None = None
    pre: dict[str, Any] = {}
    if load_format == "dummy":
        try:
            cfg = builtin_config(model)
        except KeyError:  # a checkpoint directory: its config, random weights
            cfg, _ = checkpoint.read_config(checkpoint.resolve_checkpoint(model, revision, allow_download, cache_dir))
    else:
        ckpt = checkpoint.resolve_checkpoint(model, revision, allow_download, cache_dir)
        cfg, pre = checkpoint.read_config(ckpt)
    pcfg = PreprocessConfig(
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.spatial_merge_size,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        image_mean=cfg.image_mean,
        image_std=cfg.image_std,
    )
    pcfg = PreprocessConfig.from_hf(pre, pcfg) if pre else pcfg
    overrides = {k: v for k, v in dict(min_pixels=min_pixels, max_pixels=max_pixels).items() if v is not None}
    return cfg, pcfg.with_overrides(**overrides), ckpt


def video_config_of(
    cfg: VisionConfig,
    ckpt,
    decoder: str = "cpu",
    model: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> video.VideoConfig:
    """The video preprocessing of a checkpoint (its video processor settings over the family's defaults), decoded
    by `decoder` (video.DECODERS), its resize bounds overridden by `min_pixels` / `max_pixels` where given (as the
    family's processor counts them: per frame, or every sampled frame together). Dummy weights (`ckpt` None) of a
    built-in hub id (`model`) take its published checkpoints' settings (video.PUBLISHED), a tiny-* built-in the
    family's defaults alone."""
    hf: Mapping[str, Any] | None
    if ckpt is not None:
        hf = checkpoint.read_video_config(ckpt)
    else:
        hf = video.PUBLISHED[cfg.family] if model is not None and _is_hub_builtin(model) else None
    overrides: dict[str, Any] = {
        k: v for k, v in dict(min_pixels=min_pixels, max_pixels=max_pixels).items() if v is not None
    }
    return dataclasses.replace(video.VideoConfig.for_model(cfg, hf), decoder=decoder, **overrides)


def _is_hub_builtin(model: str) -> bool:
    """Whether `model` names a published checkpoint's built-in config (a hub id, not a tiny-* one)."""
    try:
        builtin_config(model)
    except KeyError:
        return False
    return not model.lower().startswith("tiny-")


class VisionEncoder:
    """A Qwen-VL vision tower on one device, with its preprocessing.

    >>> enc = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy")
    >>> enc.encode("examples/sample.jpg").embeddings.shape  # one image in, one result out
    >>> [r.grid_thw for r in enc.encode(["examples/sample.jpg", "examples/portrait.png"])]  # a list: a list
    """

    def __init__(
        self,
        tower,
        config: VisionConfig,
        preprocess_config: PreprocessConfig,
        device: torch.device,
        dtype: torch.dtype,
        name: str,
        budgets=DEFAULT_BUDGETS,
        preprocess: str = "exact",
        video_config: video.VideoConfig | None = None,
        image_resize: str = "auto",
    ):
        self.tower, self.config, self.preprocess_config = tower, config, preprocess_config
        self.video_config = video_config or video.VideoConfig.for_model(config)
        self.device, self.dtype, self.name = device, dtype, name
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"unknown preprocess {preprocess!r}; use {' or '.join(PREPROCESS_MODES)}")
        self.preprocess_mode = preprocess
        if image_resize not in IMAGE_RESIZES:
            raise ValueError(f"unknown image_resize {image_resize!r}; use {', '.join(IMAGE_RESIZES)}")
        # exact preprocessing resizes on the device (Pillow's arithmetic there: the same bytes) on CUDA, or when asked
        self.resize_on_device = (
            preprocess == "fast" or image_resize == "device" or (image_resize == "auto" and device.type == "cuda")
        )
        self.runner = GraphRunner(tower, config, device, dtype, budgets)

    @property
    def pixel_lut(self):
        """The (3, 256) normalization table of this encoder's preprocessing, for runner.launch_images."""
        cfg = self.preprocess_config
        table = preprocess_fast.fast_lut if self.preprocess_mode == "fast" else normalize_lut
        return table(cfg.image_mean, cfg.image_std)

    @property
    def video_lut(self):
        """The (3, 256) normalization table of video frames (the video processors' fused arithmetic)."""
        return fast_lut(self.video_config.image_mean, self.video_config.image_std)

    @property
    def attention_backend(self) -> str:
        """The attention backend the tower runs (encoder.attention)."""
        return self.tower.attention.name

    def capture(self) -> None:
        """Capture the CUDA graphs of every budget (done by from_pretrained unless capture=False). Where exact
        preprocessing resizes on a CUDA device, its resize kernel runs once too: its first launch (Triton's compile,
        or its load from Triton's cache on disk) is paid here, not by the first request's batch."""
        self.runner.capture()
        if self.resize_on_device and self.preprocess_mode == "exact" and self.device.type == "cuda":
            pillow_resize_images([np.zeros((8, 8, 3), np.uint8)], [(16, 16)], self.device)  # (both passes)
            torch.cuda.synchronize(self.device)

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        load_format: str = "auto",
        revision: str | None = None,
        allow_download: bool | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        budgets=DEFAULT_BUDGETS,
        capture: bool = True,
        attention_backend: str = "auto",
        preprocess: str = "exact",
        video_decoder: str = "cpu",
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        image_resize: str = "auto",
    ) -> VisionEncoder:
        """`model`: a checkpoint directory, a hub id (from the local HF cache, or downloaded when allowed), or with
        `load_format="dummy"` any built-in config name (hub id or `tiny-*`): seeded random weights, no file read.
        `attention_backend`: one of encoder.attention.BACKENDS; `auto` takes the fastest that runs on this device and
        dtype (exact SDPA on the CPU and in float32). `preprocess`: "exact" (bit-identical to transformers' PIL
        image processor) or "fast" (transformers' torchvision processor, on the device: preprocess_fast).
        `image_resize`: where exact preprocessing resizes an image: "host" (PIL), "device" (Pillow's integer
        arithmetic as tensor ops on the device: the same bytes, encoder.pixels), "auto" (device on CUDA).
        `video_decoder`: "cpu" (FFmpeg's software decoders, as transformers decodes) or "nvdec" (video.DECODERS).
        `min_pixels` / `max_pixels` override the images' resize bounds, `video_min_pixels` / `video_max_pixels` the
        videos' (as the family's video processor counts them).
        On CUDA in half precision the graphs of every patch budget are captured before this returns."""
        device, dtype = parse_device(device), parse_dtype(dtype)
        cfg, pcfg, ckpt = load_configs(model, load_format, revision, allow_download, min_pixels, max_pixels, cache_dir)
        if ckpt is None:
            tensors = checkpoint.dummy_tensors(cfg, seed)
        else:
            tensors = checkpoint.read_vision_tensors(ckpt)
        tower = checkpoint.build_tower(cfg, tensors, device, dtype, attention_backend)
        encoder = cls(
            tower,
            cfg,
            pcfg,
            device,
            dtype,
            model,
            budgets,
            preprocess,
            video_config_of(cfg, ckpt, video_decoder, model, video_min_pixels, video_max_pixels),
            image_resize,
        )
        if capture:
            encoder.capture()
        return encoder

    def preprocess(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """An image or a list of them (PIL images, encoded bytes or paths) -> (pixel_values [rows, patch_dim]
        float32, grid_thw [n, 3] int64), the layout of transformers' Qwen2-VL image processor, batched for one
        image too (n = 1), as its processor is: decode where needed, then resize + normalize + patchify on the host
        (preprocess.preprocess), or with "fast" preprocessing all of it on the device (preprocess_fast)."""
        images, _ = as_list(images)
        if self.preprocess_mode == "fast":
            return preprocess_fast.preprocess(images, self.preprocess_config, self.device)
        return preprocess(images, self.preprocess_config)

    def encode(self, images) -> EncodedImage | list[EncodedImage]:
        """An image (a PIL image, encoded bytes or a path) -> its EncodedImage; a list of them -> one result per
        image, in order. Exact preprocessing decodes on the host (load_image) and resizes there (resize_rgb) or on
        the device (`resize_on_device`); fast preprocessing decodes JPEGs and resizes on the device
        (preprocess_fast). Normalize + patchify run where the model does (the server's path too). The first image
        that cannot be decoded raises its ImageError."""
        images, single = as_list(images)
        cfg = self.preprocess_config
        if self.preprocess_mode == "fast":
            decoded = preprocess_fast.load(images, self.device)
        elif self.resize_on_device:
            decoded = [load_for_device(x, jpeg_on_device=False) for x in images]
        else:
            decoded = [resize_rgb(load_image(x) if not isinstance(x, Image.Image) else x, cfg) for x in images]
        launched = self.launch(decoded)
        if launched.failed:
            if launched.launch is not None:
                self.runner.collect(launched.launch)  # let the rest land before raising
            raise next(iter(launched.failed.values()))
        results = self.collect(launched.launch) if launched.launch is not None else []
        return results[0] if single else results

    def launch(
        self,
        images: list,
        sizes: list[tuple[int, int]] | None = None,
        mean_pooling: list[bool] | None = None,
        float32: list[bool] | None = None,
    ) -> Launched:
        """Start encoding images as the decode step leaves them, without waiting, each resized on the device to its
        size in `sizes` (default: smart_resize's) unless it has it: exact preprocessing takes host arrays, resized
        (preprocess.resize_rgb) or full size (preprocess.load_for_device: Pillow's arithmetic resizes them here, the
        same bytes); fast preprocessing full-size arrays or EncodedJpeg, all resized here by its own arithmetic.
        Video slices come resized ([T, h, w, 3]) or as their frames' planes (video_planes.SlicePlanes: converted and
        resized here, the same bytes). Images that cannot be decoded there are left out, with their errors
        (`Launched.failed`); `outputs` gives the rest. `mean_pooling` and `float32`: per image, as the runner's
        `launch_images` takes them."""
        failed: dict[int, ImageError] = {}
        if planes := [i for i, x in enumerate(images) if isinstance(x, SlicePlanes)]:  # their frames made here
            images = list(images)
            for i, frames in zip(planes, slices_from_planes([images[i] for i in planes], self.device)):
                images[i] = frames
        fast = self.preprocess_mode == "fast"
        slices = {i for i, x in enumerate(images) if getattr(x, "ndim", 0) == 4}  # video slices: resized already
        if not sizes:
            sizes = [(0, 0) if i in slices else target_size(x, self.preprocess_config) for i, x in enumerate(images)]
        todo = [i for i in range(len(images)) if i not in slices]  # (those at their sizes too: one upload)
        if not fast and all(tuple(images[i].shape[:2]) == tuple(sizes[i]) for i in todo):
            todo = []  # all at their sizes: the runner uploads them
        if todo:
            resized = preprocess_fast.resize_on_device(
                [images[i] for i in todo], [sizes[i] for i in todo], self.device, exact=not fast
            )
            prepared = dict(enumerate(images)) | dict(zip(todo, resized))
            if fast:  # (a slice made from its planes is on the device already)
                prepared |= {
                    i: x if torch.is_tensor(x) else upload(x, self.device) for i, x in prepared.items() if i in slices
                }
            failed = {i: x for i, x in prepared.items() if isinstance(x, ImageError)}
            images = [prepared[i] for i in range(len(images)) if i not in failed]
            if mean_pooling is not None:
                mean_pooling = [m for i, m in enumerate(mean_pooling) if i not in failed]
            if float32 is not None:
                float32 = [w for i, w in enumerate(float32) if i not in failed]
        launch = (
            self.runner.launch_images(images, self.pixel_lut, mean_pooling, self.video_lut, float32) if images else None
        )
        return Launched(launch, failed, len(images) + len(failed))

    def outputs(self, launched: Launched) -> list:
        """A launch's (tokens, deepstack list) per image, in order, once it lands; an image that failed has its
        ImageError in its place."""
        done = iter(self.runner.collect(launched.launch) if launched.launch is not None else [])
        return [launched.failed[i] if i in launched.failed else next(done) for i in range(launched.count)]

    def collect(self, launch) -> list[EncodedImage]:
        return [
            EncodedImage(tokens, grid, deepstack)
            for grid, (tokens, deepstack) in zip(launch.grids, self.runner.collect(launch))
        ]

    def preprocess_videos(
        self,
        videos,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        max_pixels: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A video or a list of them (paths, bytes or file objects) -> (pixel_values_videos [rows, patch_dim]
        float32, video_grid_thw [n, 3] int64): transformers' video processor layout and values (video.py).
        `fps` or `num_frames` sample the video (mutually exclusive); `max_frames` and `max_pixels` (per frame for
        Qwen2/2.5, all frames together for Qwen3) tighten the checkpoint's settings."""
        videos, _ = videos_list(videos)
        cfg = self.video_config.with_request(fps, num_frames, max_frames, max_pixels)
        pixels, grids, _ = video.preprocess_videos(videos, cfg)
        return pixels, grids

    def encode_videos(
        self,
        videos,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        max_pixels: int | None = None,
    ) -> EncodedVideo | list[EncodedVideo]:
        """A video (a path, its bytes or a decoded video.Video) -> its EncodedVideo; a list -> one per video, in
        order; options as for `preprocess_videos`. Each video is decoded, sampled and resized on the host (a
        decoded video.Video kept as planes, `load_video(planes=True)`, is converted and resized on the device: the
        same bytes); its slices (T frames each) go to the device as uint8 and pack into the patch
        budgets like images, so a long video spans several replays (the tower attends within a slice only). The
        first video that cannot be decoded raises its video.VideoError."""
        videos, single = videos_list(videos)
        cfg = self.video_config.with_request(fps, num_frames, max_frames, max_pixels)
        decoded = [v if isinstance(v, video.Video) else video.load_video(v, cfg) for v in videos]
        slices = [
            [s if v.layout is None else frames_from_planes(s, v.layout, v.size, self.device) for s in v.slices()]
            for v in decoded
        ]
        flat = [s for parts in slices for s in parts]
        outputs = iter(self.runner.collect(self.runner.launch_images(flat, self.video_lut)) if flat else [])
        results = []
        for v, parts in zip(decoded, slices):
            joined = Features.join([next(outputs) for _ in parts])
            p = self.config.patch_size
            results.append(
                EncodedVideo(
                    joined.tokens,
                    (len(parts), v.size[0] // p, v.size[1] // p),
                    joined.deepstack,
                    v.indices.tolist(),
                    v.info.fps,
                    v.timestamps,
                    v.second_per_grid_t,
                )
            )
        return results[0] if single else results

    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw) -> list[EncodedImage]:
        """Encode a packed batch (transformers' processor layout); one result per grid, in order."""
        grids = [tuple(int(x) for x in g) for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        outputs = self.runner.run(pixel_values, grids)
        triples = cast("list[Grid]", grids)  # (t, h, w) each: run refused any other (plan.check_grids)
        return [EncodedImage(tokens, grid, deepstack) for grid, (tokens, deepstack) in zip(triples, outputs)]
