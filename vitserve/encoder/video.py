"""Qwen-VL video preprocessing: what transformers' video processors do to a video (`Qwen2VLVideoProcessor` for
Qwen2/2.5-VL, `Qwen3VLVideoProcessor` for Qwen3-VL), decoded by PyAV (the `video` extra, imported lazily).

* decode: PyAV, frames in decode order, a frame's index being its place in that order (transformers' pyav reader).
  Only what the sampled frames need is decoded (video_decode.py: the frames nothing refers to and the groups of
  pictures without a sampled frame are skipped; the same bytes as a decode of every frame). Only the sampled frames
  are converted (rgb24) and each is resized as it comes, so a video never sits decoded in
  memory: the resized frames are what stays. `VideoConfig.decoder` "nvdec" decodes the same sampled frames on the
  GPU's video engines (video_nvdec: PyNvVideoCodec, the `nvdec` extra), whose planes are the software decoder's
  bytes, converted by the same integer arithmetic (pixels.py): the same frames. A stream NVDEC or the exact
  conversion cannot take, or a video it fails on, decodes in software; a process where NVDEC cannot run (no
  PyNvVideoCodec, no CUDA) decodes every video in software (`nvdec_refused`). `Video.decoder` says which decoded it.
* sample (`sample_indices`): the family's `sample_frames` (Qwen2: `fps` frames a second between `min_frames` and
  `max_frames`, floored to the temporal patch, `arange` steps; Qwen3: the same bounds, `linspace`).
* resize (`frame_size`): the family's smart_resize (Qwen2: per frame, as for images; Qwen3: the pixels of every frame
  together within `max_pixels`), with `cap_pixels_per_frame` as transformers computes it; then torchvision's
  `resize(BICUBIC, antialias=True)` arithmetic on uint8 (`preprocess_fast.resize`: torch's native kernel on the CPU).
* normalize: the fused float32 `(x - 255 * mean) / (255 * std)` (`preprocess_fast.fast_lut`).
* patchify: a video of F frames is ceil(F / T) slices of T frames (the last frame repeated to fill the last slice);
  each slice is a (1, h, w) grid whose rows, in merge-block order, are (C, T, p, p). The tower attends within a slice
  only (cu_seqlens, windows and position tables repeat per slice), so slices pack into patch budgets like images.

The timing an LLM needs to place the tokens comes with the frames (`Video`): Qwen2.5-VL's `second_per_grid_t`
(T / the sampled rate) and Qwen3-VL's timestamp of each slice (the mean of its first and last frame's times).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Mapping

import numpy as np
import torch

from .config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, VisionConfig
from .preprocess import ImageTooLarge, UndecodableImage, as_triple, check_aspect_ratio, smart_resize
from .preprocess_fast import fast_lut, resize
from .video_decode import decode_sampled, group_starts, packet_infos, rewind
from .video_planes import PlanesLayout, planes_row

log = logging.getLogger("vitserve.video")
DECODERS = ("cpu", "nvdec")  # FFmpeg's software decoders; the GPU's video engines (software where they cannot)

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


class VideoError(UndecodableImage):
    """A video that cannot be decoded or encoded (a 400 in the server); `code` names the reason."""

    code = "undecodable_video"


class VideoTooShort(VideoError):
    code = "video_too_short"


class UnsupportedCodec(VideoError):
    code = "unsupported_codec"


class VideoTooLarge(ImageTooLarge):
    """A video over a limit (`VideoLimits`: a 413 in the server)."""

    code = "video_too_large"


class VideoTooLong(VideoTooLarge):
    code = "video_too_long"


class VideoTooCostly(VideoTooLarge):
    """A video whose decode work (`decode_work`) is over its limit."""

    code = "decode_work"


# codecs whose decoders are maintained FFmpeg ones, common in uploads; others are refused before decoding
CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mpeg1video", "mjpeg", "theora", "prores")


# a sampled frame's conversion to RGB and resize counts as this many decodes of it (docs/video.md: the decode work)
CONVERT_COST = 8


def decode_work(width: int, height: int, decoded: int, kept: int) -> int:
    """The work of decoding a video, in source pixels: `decoded` frames of width x height decoded (every frame up to
    the last one sampled: decoding cannot skip), `kept` of them also converted and resized (CONVERT_COST times a
    decode)."""
    return width * height * (decoded + CONVERT_COST * kept)


@dataclass(frozen=True)
class VideoLimits:
    """What a video may cost, checked from its header before its frames are decoded (and as they are):
    `max_seconds` of declared duration, `max_frame_pixels` per source frame, `max_bytes` of resized frames kept,
    `max_work` of decode work (`decode_work`; None: no limit), `codecs` allowed."""

    max_seconds: float = 3600.0
    max_frame_pixels: int = 8192 * 8192
    max_bytes: int = 4 * 2**30
    max_work: int | None = None
    codecs: tuple[str, ...] = CODECS

    def check(self, info: VideoInfo) -> None:
        if info.codec not in self.codecs:
            raise UnsupportedCodec(f"{info.codec} videos are not accepted; send one of {', '.join(self.codecs)}")
        if info.duration > self.max_seconds:
            raise VideoTooLong(f"the video lasts {info.duration:.0f} s; the limit is {self.max_seconds:g} s")
        if info.width <= 0 or info.height <= 0:
            raise VideoError(f"the video declares no frame size ({info.width}x{info.height})")
        if info.width * info.height > self.max_frame_pixels:
            raise VideoTooLarge(
                f"the video's frames are {info.width}x{info.height}; the limit is "
                f"{self.max_frame_pixels} pixels a frame"
            )


class VideoUnavailable(RuntimeError):
    """Video decoding needs PyAV: `pip install 'vitserve[video]'`."""


@dataclass(frozen=True)
class VideoConfig:
    """The video preprocessing of one model: transformers' video processor settings (`size` as min/max pixels)."""

    family: str  # "qwen2" (Qwen2/2.5-VL rules) or "qwen3"
    patch_size: int
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    truncate_frames: bool = False  # a num_frames over the video's frames takes them all (else VideoTooShort)
    decoder: str = "cpu"  # one of DECODERS: how frames are decoded, not which frames or pixels

    def __post_init__(self) -> None:
        if self.family not in ("qwen2", "qwen3"):
            raise ValueError(f"unknown video rules {self.family!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        object.__setattr__(self, "image_mean", as_triple(self.image_mean, "image_mean"))
        object.__setattr__(self, "image_std", as_triple(self.image_std, "image_std"))
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are mutually exclusive: give one")
        if self.fps is not None and not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"fps must be positive, got {self.fps}")
        for name in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"the videos' min_pixels ({self.min_pixels}) must be <= their max_pixels ({self.max_pixels})"
            )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def for_model(cls, cfg: VisionConfig, hf: Mapping[str, Any] | None = None) -> VideoConfig:
        """The processor's class defaults for this family (sizes from the tower's config), then the checkpoint's
        `video_preprocessor_config.json` (`hf`) where it has one."""
        qwen3 = cfg.family == "qwen3_vl"
        f = cfg.patch_size * cfg.spatial_merge_size
        base = cls(
            "qwen3" if qwen3 else "qwen2",
            cfg.patch_size,
            cfg.temporal_patch_size,
            cfg.spatial_merge_size,
            min_pixels=128 * f * f,
            max_pixels=768 * f * f,
            image_mean=IMAGENET_STANDARD if qwen3 else OPENAI_CLIP_MEAN,
            image_std=IMAGENET_STANDARD if qwen3 else OPENAI_CLIP_STD,
            do_sample_frames=qwen3,
            fps=2.0 if qwen3 else None,
            max_video_tokens=768 if qwen3 else 128000,
        )
        return base.from_hf(hf) if hf else base

    def from_hf(self, d: Mapping[str, Any]) -> VideoConfig:
        """Settings from a `video_preprocessor_config.json` dict over these; the ones this module cannot reproduce
        (resize, rescale or normalize off, another filter or rescale factor) raise ValueError."""
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if d.get(flag) is False:
                raise ValueError(f"unsupported video preprocessor config: {flag}=false")
        if d.get("rescale_factor") is not None and not math.isclose(float(d["rescale_factor"]), 1 / 255):
            raise ValueError(f"unsupported video preprocessor config: rescale_factor={d['rescale_factor']}")
        if d.get("resample") not in (None, 3):
            raise ValueError(f"unsupported video preprocessor config: resample={d['resample']} (only bicubic=3)")
        size = d.get("size")
        if not isinstance(size, Mapping):
            size = {}
        kw: dict[str, Any] = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames", "max_video_tokens"):
            if d.get(key) is not None:
                kw[key] = int(d[key])
        pixels = (("min_pixels", ("min_pixels", "shortest_edge")), ("max_pixels", ("max_pixels", "longest_edge")))
        for key, names in pixels:
            value = next((v for v in (d.get(names[0]), size.get(names[1])) if v is not None), None)
            if value is not None:
                kw[key] = int(value)
        for key in ("image_mean", "image_std"):
            if d.get(key) is not None:
                kw[key] = as_triple(d[key], key)
        for key in ("do_sample_frames", "cap_pixels_per_frame"):
            if d.get(key) is not None:
                kw[key] = bool(d[key])
        if "fps" in d or "num_frames" in d:
            kw["fps"] = None if d.get("fps") is None else float(d["fps"])
            kw["num_frames"] = None if d.get("num_frames") is None else int(d["num_frames"])
        return dataclasses.replace(self, **kw)

    def with_request(
        self,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        max_pixels: int | None = None,
        truncate_frames: bool = False,
    ) -> VideoConfig:
        """A request's sampling and size: `fps` or `num_frames` replaces the default rule (and samples); the others
        only tighten (a `max_pixels` under `min_pixels` is a ValueError, as for images); `truncate_frames`: a
        `num_frames` over a video's frames takes them all."""
        kw: dict[str, Any] = {"truncate_frames": True} if truncate_frames else {}
        if fps is not None or num_frames is not None:
            kw.update(fps=fps, num_frames=num_frames, do_sample_frames=True)
        if max_frames is not None:
            kw["max_frames"] = min(self.max_frames, max_frames)
        if max_pixels is not None:
            if max_pixels < self.min_pixels:
                raise ValueError(f"max_pixels must be at least the videos' min_pixels ({self.min_pixels})")
            kw["max_pixels"] = min(self.max_pixels, max_pixels)
        return dataclasses.replace(self, **kw) if kw else self


# The video processor settings the published checkpoints ship, by VisionConfig.family: Qwen3-VL's
# video_preprocessor_config.json; Qwen2/2.5-VL ship none, so transformers' video processor reads their
# preprocessor_config.json's pixels. What dummy weights of a built-in hub id preprocess videos with.
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    },
    "qwen2_5_vl": {"min_pixels": 3136, "max_pixels": 12845056},
    "qwen2_vl": {"min_pixels": 3136, "max_pixels": 12845056},
}


IMAGE_BRANDS = (b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1")


def sniff(head: bytes) -> str | None:
    """The video container the first bytes of a file are (mp4, webm, avi, mpegts, flv, mpeg, ogg), or None: tells a
    video from an image by content. ISO files branded as images (AVIF, HEIF) are images."""
    if head[4:8] == b"ftyp":
        return None if head[8:12] in IMAGE_BRANDS else "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:3] == b"FLV":
        return "flv"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3"):
        return "mpeg"
    if len(head) >= 377 and head[0] == head[188] == head[376] == 0x47:
        return "mpegts"
    return None


@dataclass(frozen=True)
class VideoInfo:
    """What the container says of its first video stream (transformers' VideoMetadata)."""

    total_frames: int
    fps: float
    width: int
    height: int
    codec: str

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps else 0.0


def plural_frames(n: int) -> str:
    """ "1 frame", "2 frames"."""
    return f"{n} frame" if n == 1 else f"{n} frames"


def sample_indices(info: VideoInfo, cfg: VideoConfig) -> np.ndarray:
    """The indices of the frames to keep, as the family's `sample_frames` picks them (every frame when the config
    does not sample), never more than `max_frames`: where the family's rule would keep more (every frame of a long
    video, or a `num_frames` over it), `max_frames` frames floored to a temporal patch are spread evenly, as
    `sample_frames` spreads a `num_frames`. A `num_frames` over the video's frames is a VideoTooShort, or with
    `truncate_frames` every frame (floored to a temporal patch)."""
    total, t = info.total_frames, cfg.temporal_patch_size
    if total <= 0:
        raise VideoTooShort("the video has no frames")
    num_frames, fps = (cfg.num_frames, cfg.fps) if cfg.do_sample_frames else (None, None)
    if num_frames is not None and num_frames < t:
        raise VideoTooShort(f"num_frames {num_frames} is less than one temporal patch ({plural_frames(t)})")
    if num_frames is not None and num_frames > total and cfg.truncate_frames:
        num_frames = total if cfg.family == "qwen3" else math.floor(total / t) * t
    if cfg.family == "qwen3" and cfg.do_sample_frames:
        if num_frames is not None:
            num_frames = min(num_frames, cfg.max_frames)
        if num_frames is None and fps is not None:
            num_frames = int(total / (info.fps or 24) * fps)
            num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, cfg.min_frames), cfg.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int)
    most = math.floor(cfg.max_frames / t) * t  # at most max_frames, in whole temporal patches
    if num_frames is not None:
        num_frames = min(round(num_frames / t) * t, most)
    elif fps is not None:
        if not info.fps:
            raise VideoError("the video declares no frame rate, so it cannot be sampled by fps: give num_frames")
        max_frames = math.floor(min(cfg.max_frames, total) / t) * t
        wanted = total / info.fps * fps
        num_frames = math.floor(min(max(wanted, cfg.min_frames), max_frames, total) / t) * t
    elif total > cfg.max_frames:  # every frame, but at most max_frames of them
        num_frames = most
    if num_frames is not None and num_frames <= 0 and most <= 0:
        raise VideoTooShort(f"max_frames {cfg.max_frames} is less than one temporal patch ({plural_frames(t)})")
    if num_frames is None:
        return np.arange(total)
    if num_frames <= 0:
        raise VideoTooShort(f"the video has {plural_frames(total)}, fewer than one temporal patch ({plural_frames(t)})")
    if num_frames > total:
        raise VideoTooShort(
            f"num_frames {num_frames} is more than the video's {plural_frames(total)} (truncate_frames takes them all)"
        )
    return torch.arange(0, total, total / num_frames).int().numpy()


def frame_size(num_frames: int, height: int, width: int, cfg: VideoConfig) -> tuple[int, int]:
    """The (height, width) every sampled frame is resized to, as the family's processor computes it for
    `num_frames` sampled frames of height x width."""
    f, t = cfg.factor, cfg.temporal_patch_size
    check_aspect_ratio(height, width)
    if cfg.family == "qwen2":
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            total = int(cfg.max_video_tokens * f * f * 0.9)
            max_pixels = max(min(max_pixels, total * t // num_frames), int(cfg.min_pixels * 1.05))
        return smart_resize(height, width, f, cfg.min_pixels, max_pixels)
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * f * f, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if num_frames < t:
        raise VideoTooShort(f"{plural_frames(num_frames)} sampled: Qwen3-VL needs at least {t}")
    if height < f or width < f:
        scale = max(f / height, f / width)
        height, width = int(height * scale), int(width * scale)
    h, w = round(height / f) * f, round(width / f) * f
    frames = round(num_frames / t) * t
    if frames * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif frames * h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


@dataclass(frozen=True)
class Sampling:
    """What a video's header decides before a frame is decoded: which frames it keeps (`indices`, ascending, each
    once), the source's info, the temporal patch, and the (height, width) its frames are resized to; and from those
    the timing an LLM places its tokens by."""

    indices: np.ndarray
    info: VideoInfo
    temporal_patch_size: int
    size: tuple[int, int]

    def grid(self, patch_size: int) -> tuple[int, int, int]:
        """(slices, h / p, w / p)."""
        return -(-len(self.indices) // self.temporal_patch_size), self.size[0] // patch_size, self.size[1] // patch_size

    def timing(self) -> dict:
        """An answer's timing: frame_indices, fps, timestamps, second_per_grid_t."""
        return {
            "frame_indices": self.indices.tolist(),
            "fps": self.info.fps,
            "timestamps": self.timestamps,
            "second_per_grid_t": self.second_per_grid_t,
        }

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of video (transformers' VideoMetadata.sampled_fps)."""
        if not self.info.fps:
            return 24.0
        return len(self.indices) / self.info.total_frames * self.info.fps

    @property
    def second_per_grid_t(self) -> float:
        """Seconds per temporal patch: Qwen2.5-VL's `second_per_grid_ts` entry for this video."""
        return self.temporal_patch_size / self.sampled_fps

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each temporal patch (the mean of its first and last frame's times): what Qwen3-VL's processor
        writes before each slice's tokens (`<{t:.1f} seconds>`)."""
        fps = self.info.fps or 24.0
        indices = self.indices.tolist()
        t = self.temporal_patch_size
        indices += indices[-1:] * (-len(indices) % t)
        times = [i / fps for i in indices]
        return [(times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t)]


@dataclass
class Video:
    """A decoded video: its sampled frames resized (uint8 [F, h, w, 3]), or as their planes (uint8 [F, row_bytes],
    `layout` set: `load_video(planes=True)`, resized to `resized` where they run), which frames they are, and the
    source's frame rate."""

    frames: np.ndarray
    indices: np.ndarray
    info: VideoInfo
    temporal_patch_size: int
    decoder: str = "cpu"  # what decoded it: "nvdec" (the GPU's video engines) or "cpu"
    layout: PlanesLayout | None = None
    resized: tuple[int, int] | None = None  # (height, width) the planes become

    @property
    def size(self) -> tuple[int, int]:
        """The (height, width) of its frames once resized."""
        return self.resized if self.resized is not None else (self.frames.shape[1], self.frames.shape[2])

    def slices(self) -> list[np.ndarray]:
        """uint8 [T, h, w, 3] per temporal patch, the last frame repeated to fill the last slice (views where the
        frames divide evenly)."""
        t, frames = self.temporal_patch_size, self.frames
        if pad := -len(frames) % t:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        return [frames[i : i + t] for i in range(0, len(frames), t)]

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.indices, self.info, self.temporal_patch_size, self.size)

    @property
    def sampled_fps(self) -> float:
        return self.sampling.sampled_fps

    @property
    def second_per_grid_t(self) -> float:
        return self.sampling.second_per_grid_t

    @property
    def timestamps(self) -> list[float]:
        return self.sampling.timestamps


def unavailable() -> str | None:
    """Why this process cannot decode videos (PyAV missing, or broken), or None where it can; imports PyAV."""
    try:
        import av  # noqa: F401
    except ImportError as e:
        return f"PyAV cannot be imported ({e}): pip install 'vitserve[video]'"
    return None


def _av():
    try:
        import av
    except ImportError:
        raise VideoUnavailable("video decoding needs PyAV: pip install 'vitserve[video]'") from None
    return av


_nvdec_refused: str | None = None  # why NVDEC cannot run in this process (found on its first use)
_nvdec_tried = False


def nvdec_refused() -> str | None:
    """Why this process decodes in software although NVDEC was asked for (None: not refused, or not yet tried)."""
    return _nvdec_refused


def _nvdec_ready() -> bool:
    """Whether NVDEC can run in this process; the first call finds out (and logs a refusal once)."""
    global _nvdec_refused, _nvdec_tried
    if not _nvdec_tried:
        from .video_nvdec import unavailable

        _nvdec_tried, _nvdec_refused = True, unavailable()
        if _nvdec_refused is not None:
            log.warning("NVDEC cannot run here (%s): videos decode in software", _nvdec_refused)
    return _nvdec_refused is None


def _open(source: Any, max_pixels: int | None = None):
    """A PyAV input container for bytes, a file object or a path. `max_pixels`: the largest frame FFmpeg decodes
    while it reads the streams' parameters (it decodes a first frame at the size the headers declare, before any
    limit sees them)."""
    av = _av()
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    options = {"max_pixels": str(max_pixels)} if max_pixels else None
    try:
        return av.open(source, mode="r", options=options)
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise VideoError("not a video that can be opened", str(e)) from None


def probe(container, limits: VideoLimits | None = None) -> VideoInfo:
    """The first video stream's frame count, rate, size and codec. A container that does not record its frame
    count (WebM, MKV, MPEG-TS) has its packets counted, without decoding (transformers' pyav reader takes 0 there and
    fails), up to `limits.max_seconds` of them at the stream's rate (a stream that never ends is too long); one that
    cannot then be rewound is a VideoError. Images FFmpeg reads as one-frame videos (JPEG, MPO, PNG, AVIF, HEIF...)
    are VideoErrors; `codec` is the codec's name, whichever decoder reads it (AV1's is libdav1d)."""
    av = _av()
    demuxer, brand = container.format.name, container.metadata.get("major_brand", "").encode()
    if demuxer.endswith("_pipe") or demuxer in ("image2", "mjpeg", "gif", "apng") or brand in IMAGE_BRANDS:
        raise VideoError(f"an image ({brand.decode() or demuxer.removesuffix('_pipe')}), not a video")
    stream = _video_stream(container)
    if stream.codec_context is None:
        raise UnsupportedCodec("the video's codec has no decoder here")
    rate = stream.average_rate
    frames = int(stream.frames)
    if frames <= 0:
        most = limits.max_seconds * float(rate) if limits and rate else math.inf
        max_seconds = limits.max_seconds if limits else math.inf  # (only named where `most` is finite)
        frames = 0
        try:
            for packet in container.demux(stream):
                frames += packet.size > 0
                if frames > most:
                    raise VideoTooLong(
                        f"the video holds over {most:.0f} frames at {float(rate):g} fps; the limit is {max_seconds:g} s"
                    )
            if frames:
                container.seek(0)
        except av.error.FFmpegError as e:
            raise VideoError("the video's frames could not be counted", str(e)) from None
    return VideoInfo(
        frames, float(rate) if rate else 0.0, stream.width, stream.height, stream.codec_context.codec.canonical_name
    )


def _video_stream(container):
    if not container.streams.video:
        raise VideoError("the file has no video stream")
    return container.streams.video[0]


def sampled_frames(
    container, indices: np.ndarray, threads: int = 0, max_work: int | None = None, rewindable: bool = False
) -> Generator[tuple[int, Any], None, None]:
    """(index, PyAV frame) for the frames at `indices` (a repeated index gives its frame once, as transformers'
    reader does). Where the container's input can be read twice (`rewindable`), only what those frames need is
    decoded (`video_decode.decode_sampled`: the same frames as a decode of every frame; a frame may come twice, the
    same, where its plan did not hold); otherwise every frame up to the last one asked for. `threads`: FFmpeg's
    decoding threads (0: one per core). `max_work`: the decode work (`decode_work`, counted on the frames as they
    come, each sampled one as converted too) past which the video is refused (VideoTooCostly) before another frame
    is given: frames larger than the header said stop there."""
    av = _av()
    wanted = set(int(i) for i in indices)
    stream = _video_stream(container)
    if not stream.codec_context.is_open:  # (a second pass over the container keeps the first's threads)
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads
    work = 0
    try:
        for i, frame in decode_sampled(container, stream, wanted, rewindable):
            work += decode_work(frame.width, frame.height, 1, i in wanted)
            if max_work is not None and work > max_work:
                raise VideoTooCostly(
                    f"decoding the video takes more than its header declares (a frame of "
                    f"{frame.width}x{frame.height} at frame {i})"
                )
            if i in wanted:
                yield i, frame
    except av.error.FFmpegError as e:
        raise VideoError("the video could not be decoded", str(e)) from None


def decode_frames(
    container,
    indices: np.ndarray,
    size: tuple[int, int],
    threads: int = 0,
    max_work: int | None = None,
    rewindable: bool = False,
) -> Iterator[tuple[int, np.ndarray]]:
    """`sampled_frames`, each converted to RGB (swscale) and resized to `size` (torch's kernel) as it comes."""
    height, width = size
    for i, frame in sampled_frames(container, indices, threads, max_work, rewindable):
        rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
        yield i, resize(rgb, height, width).permute(1, 2, 0).numpy()


def _rewindable(source: Any) -> bool:
    """Whether PyAV can read `source` twice: bytes and paths can, a file object where it can seek."""
    if isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)):
        return True
    seekable = getattr(source, "seekable", None)
    return bool(seekable()) if callable(seekable) else False


def _most_pixels(limits: VideoLimits) -> int:
    """The largest frame FFmpeg may decode: twice the pixel limit (decoders pad their frames; the limit itself is
    checked on the header), for the frame it reads the parameters from and one a new sequence header enlarges."""
    return 2 * limits.max_frame_pixels + 256 * 256


@dataclass(frozen=True)
class VideoCost:
    """What decoding a video takes, read from its header: `memory` in bytes (its resized sampled frames and one
    decoded frame) and `work` (`decode_work`)."""

    memory: int
    work: int


@dataclass(frozen=True)
class VideoPlan:
    """A video's header read (`video_plan`): what it keeps, what decoding it takes, and whether its frames are kept
    as planes where they can be (`load_video(planes=True)`, and they fit the frames' memory limit)."""

    sampling: Sampling
    cost: VideoCost
    as_planes: bool = False
    keyframes: tuple[int, ...] = ()  # where its groups of pictures start (frame indices), where read (`groups`)

    def parts(self, most: int) -> list[tuple[int, int]]:
        """Its slices split into at most `most` runs (first, end) that decoders can take side by side: cut only where
        a slice starts a group of pictures other than its predecessor's, so that no part decodes much of another's
        frames, and balanced by the frames each part decodes (from its first group's keyframe to its last frame)."""
        t, kept = self.sampling.temporal_patch_size, self.sampling.indices
        n = -(-len(kept) // t)
        if most < 2 or len(self.keyframes) < 2 or n < 2:
            return [(0, n)]
        keys = np.asarray(self.keyframes)
        group = np.maximum(np.searchsorted(keys, kept[::t], side="right") - 1, 0)
        cuts = [s for s in range(1, n) if group[s] != group[s - 1]]
        if not cuts:
            return [(0, n)]
        last = [int(kept[min(t * s + t, len(kept)) - 1]) for s in range(n)]  # each slice's last frame

        def span(a: int, b: int) -> int:  # frames a part of slices [a, b) decodes
            return last[b - 1] - int(keys[group[a]]) + 1

        def split(most_frames: int) -> list[tuple[int, int]]:  # greedy: each part as long as it may be
            out, a = [], 0
            ends = [*cuts, n]
            while a < n:
                fits = [b for b in ends if b > a and span(a, b) <= most_frames]
                b = fits[-1] if fits else next(b for b in ends if b > a)
                out.append((a, b))
                a = b
            return out

        low, high = 1, span(0, n)
        while low < high:  # the least longest part that `most` parts allow
            middle = (low + high) // 2
            low, high = (low, middle) if len(split(middle)) <= most else (middle + 1, high)
        return split(low)


def _plan(container, cfg: VideoConfig, limits: VideoLimits, planes: bool = False) -> VideoPlan:
    """From the header, before any frame is kept: the video's info (its limits checked), the frames to keep, their
    size, and what decoding it takes (its limits checked; `planes`: kept as planes where they fit, `load_video`)."""
    info = probe(container, limits)
    limits.check(info)
    indices = sample_indices(info, cfg)
    kept = np.unique(indices)
    height, width = frame_size(len(indices), info.height, info.width, cfg)
    if len(kept) * height * width * 3 > limits.max_bytes:
        raise VideoTooLarge(
            f"{plural_frames(len(kept))} of {width}x{height} take "
            f"{len(kept) * height * width * 3 >> 20} MiB; the limit is {limits.max_bytes >> 20} MiB "
            "(sample fewer frames: max_frames, num_frames or fps; or smaller ones: max_pixels)"
        )
    work = decode_work(info.width, info.height, int(kept[-1]) + 1, len(kept))
    if limits.max_work is not None and work > limits.max_work:
        raise VideoTooCostly(
            f"decoding {plural_frames(int(kept[-1]) + 1)} of {info.width}x{info.height} and "
            f"converting {len(kept)} of them is {work / 1e9:.1f} G pixels of work; the limit is "
            f"{limits.max_work / 1e9:.1f} G (send a shorter or smaller video)"
        )
    kept_bytes = len(kept) * height * width * 3
    planes_bytes = len(kept) * PlanesLayout.bytes_for(info.height, info.width)
    as_planes = planes and planes_bytes <= limits.max_bytes
    if as_planes:
        kept_bytes = max(kept_bytes, planes_bytes)
    cost = VideoCost(kept_bytes + info.height * info.width * 3, work)
    return VideoPlan(Sampling(kept, info, cfg.temporal_patch_size, (height, width)), cost, as_planes)


def video_plan(
    source: Any, cfg: VideoConfig, limits: VideoLimits = VideoLimits(), planes: bool = False, groups: bool = False
) -> VideoPlan:
    """Which frames `load_video` keeps and at what size, and what decoding them takes (its frames, as RGB or with
    `planes` as planes, whichever is larger, and one decoded frame; its decode work), read from the video's header
    with the same checks `load_video` makes first: what a server knows and reserves before it decodes the video.
    `groups`: also where its groups of pictures start (one demux pass, no decoding; where the input can be read
    twice), so that its slices can be split among decoders (`VideoPlan.parts`, `load_video(part=...)`)."""
    container = _open(source, _most_pixels(limits))
    try:
        plan = _plan(container, cfg, limits, planes)
        return _with_groups(container, plan) if groups and _rewindable(source) else plan
    finally:
        container.close()


def with_groups(source: Any, plan: VideoPlan, limits: VideoLimits = VideoLimits()) -> VideoPlan:
    """`plan` (the video's `video_plan`) with where its groups of pictures start (`video_plan(groups=True)`), read
    by one demux pass where the input can be read twice; else `plan` as it is."""
    if not _rewindable(source):
        return plan
    container = _open(source, _most_pixels(limits))
    try:
        return _with_groups(container, plan)
    finally:
        container.close()


def _with_groups(container, plan: VideoPlan) -> VideoPlan:
    stream = _video_stream(container)
    most = 2 * max(int(stream.frames), int(plan.sampling.indices[-1]) + 1) + 64
    packets = packet_infos(container, stream, most)
    starts = group_starts(packets) if packets is not None else None
    return dataclasses.replace(plan, keyframes=tuple(starts or ()))


def video_cost(source: Any, cfg: VideoConfig, limits: VideoLimits = VideoLimits(), planes: bool = False) -> VideoCost:
    """`video_plan`'s cost."""
    return video_plan(source, cfg, limits, planes).cost


def load_video(
    source: Any,
    cfg: VideoConfig,
    limits: VideoLimits = VideoLimits(),
    threads: int = 0,
    planes: bool = False,
    part: tuple[int, int] | None = None,
) -> Video:
    """Decode, sample and resize one video (bytes, a file object or a path): uint8 frames ready to normalize.
    `threads`: FFmpeg's decoding threads (0: one per core, for one video at a time; a server decoding many side by
    side gives each a few). `planes`: keep the sampled frames' planes instead (`Video.layout`; a device converts and
    resizes them, pixels.frames_from_planes) where every sampled frame has an exact conversion and their planes
    fit `limits.max_bytes`; RGB frames otherwise. `part`: only the frames of slices [first, end) (`VideoPlan.parts`;
    the parts' slices in order are the whole video's)."""
    container = _open(source, _most_pixels(limits))
    try:
        plan = _plan(container, cfg, limits, planes)
        info, kept, (height, width) = plan.sampling.info, plan.sampling.indices, plan.sampling.size
        if part is not None:
            t = cfg.temporal_patch_size
            kept = kept[t * part[0] : t * part[1]]
            if not len(kept):
                raise ValueError(f"part {part} of a video of {plan.sampling.grid(1)[0]} slices")
        _video_stream(container).codec_context.options = {"max_pixels": str(_most_pixels(limits))}
        rewindable = _rewindable(source)
        decoding = (container, kept, threads, 2 * plan.cost.work, rewindable)
        if cfg.decoder == "nvdec" and rewindable and (video := _load_nvdec(container, kept, plan, limits)):
            return video
        if plan.as_planes and (video := _load_planes(*decoding, info, (height, width), cfg)) is not None:
            return video
        if plan.as_planes:  # a frame without an exact conversion: the frames are made here, from the start
            rewind(container, _video_stream(container))
        frames = np.empty((len(kept), height, width, 3), dtype=np.uint8)
        slot = {int(i): n for n, i in enumerate(kept)}
        filled = np.zeros(len(kept), dtype=bool)
        # a header that understates the work by over twice (frames larger than it says) is refused as it decodes
        for i, frame in decode_frames(container, kept, (height, width), *decoding[2:]):
            frames[slot[i]], filled[slot[i]] = frame, True
        _check_filled(filled, kept, info)
        return Video(frames, kept, info, cfg.temporal_patch_size)
    finally:
        container.close()


def _load_nvdec(container, kept: np.ndarray, plan: VideoPlan, limits: VideoLimits) -> Video | None:
    """`load_video`'s frames decoded by NVDEC (video_nvdec), as planes where the plan keeps planes, else made into
    RGB frames here by the devices' exact arithmetic on CPU tensors; None where NVDEC cannot take them (not in this
    process, not this stream, their planes over the frames' memory limit, or it failed on the video: the software
    decoder decodes it then, from the start)."""
    from . import video_nvdec
    from .pixels import frames_from_planes

    info, size = plan.sampling.info, plan.sampling.size
    if not _nvdec_ready() or len(kept) * PlanesLayout.bytes_for(info.height, info.width) > limits.max_bytes:
        return None
    try:
        decoded = video_nvdec.load_planes(container, kept)
    except video_nvdec.NvdecError as e:
        log.warning("NVDEC failed on a video (%s): it decodes in software", e)
        decoded = None
    rewind(container, _video_stream(container))
    if decoded is None:
        return None
    rows, layout = decoded
    if plan.as_planes:
        return Video(rows, kept, info, plan.sampling.temporal_patch_size, "nvdec", layout, size)
    frames = frames_from_planes(torch.from_numpy(rows), layout, size, "cpu").numpy()
    return Video(frames, kept, info, plan.sampling.temporal_patch_size, "nvdec")


def _load_planes(container, kept, threads, max_work, rewindable, info, size, cfg: VideoConfig) -> Video | None:
    """`load_video`'s frames as planes, or None at the first sampled frame whose layout differs from the first's or
    has no exact conversion."""
    layout, rows = None, np.empty((0, 0), dtype=np.uint8)
    slot = {int(i): n for n, i in enumerate(kept)}
    filled = np.zeros(len(kept), dtype=bool)
    frames = sampled_frames(container, kept, threads, max_work, rewindable)
    try:
        for i, frame in frames:
            if layout is None:
                layout = PlanesLayout.of(frame)
                if layout is None:
                    return None
                rows = np.empty((len(kept), layout.row_bytes), dtype=np.uint8)
            elif PlanesLayout.of(frame) != layout:
                return None
            planes_row(frame, layout, rows[slot[i]])
            filled[slot[i]] = True
    finally:  # (a pass left here ends now, its decoder settings put back, before the container is read again)
        frames.close()
    _check_filled(filled, kept, info)
    return Video(rows, kept, info, cfg.temporal_patch_size, layout=layout, resized=size)


def _check_filled(filled: np.ndarray, kept: np.ndarray, info: VideoInfo) -> None:
    if not filled.all():
        raise VideoError(
            f"the video declares {plural_frames(info.total_frames)} but ends before frame "
            f"{int(kept[np.argmin(filled)])}"
        )


def patchify(video: Video, cfg: VideoConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 rows [t * gh * gw, 3 * T * p * p] (transformers' `pixel_values_videos` for this video) and its
    grid (t, gh, gw)."""
    lut = fast_lut(cfg.image_mean, cfg.image_std)
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    slices = video.slices()
    _, h, w, _ = video.frames.shape
    gh, gw = h // p, w // p
    out = np.empty((len(slices), gh // m, gw // m, m, m, 3, t, p, p), dtype=np.float32)
    for j, frames in enumerate(slices):
        x = lut[np.arange(3), frames]  # [T, h, w, 3] float32
        x = x.reshape(t, gh // m, m, p, gw // m, m, p, 3)
        out[j] = x.transpose(1, 4, 2, 5, 7, 0, 3, 6)
    return out.reshape(len(slices) * gh * gw, -1), (len(slices), gh, gw)


def preprocess_videos(
    videos: list, cfg: VideoConfig, limits: VideoLimits = VideoLimits()
) -> tuple[torch.Tensor, torch.Tensor, list[Video]]:
    """Videos (bytes, file objects, paths or decoded `Video`s) -> (pixel_values_videos float32, video_grid_thw
    [n, 3] int64, the decoded videos), transformers' processor layout."""
    decoded = [v if isinstance(v, Video) else load_video(v, cfg, limits) for v in videos]
    rows, grids = zip(*(patchify(v, cfg) for v in decoded)) if decoded else ((), ())
    pixels = (
        torch.from_numpy(np.concatenate(rows))
        if rows
        else torch.empty(0, 3 * cfg.temporal_patch_size * cfg.patch_size**2)
    )
    return pixels, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3), decoded
