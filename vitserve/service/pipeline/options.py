"""A request's preprocessing options checked against the server's: an image's `max_pixels`, a video's sampling
(fps, num_frames, max_frames, max_pixels) within --max-video-frames. A bad option is the request's error (400, or
413 over a limit), raised before anything is decoded."""

from __future__ import annotations

import dataclasses

from ...encoder.preprocess import PreprocessConfig
from ...encoder.video import VideoConfig
from ..ground.errors import InputRejected, InputTooLarge
from ..ground.settings_media import DecodingSettings, LimitSettings


def checked_image_config(cfg: PreprocessConfig, max_pixels: int | None) -> PreprocessConfig:
    """The model's image preprocessing, its resized size capped at a request's `max_pixels`."""
    if max_pixels is None:
        return cfg
    if max_pixels < cfg.min_pixels:
        raise InputRejected(
            f"max_pixels must be at least this server's min_pixels ({cfg.min_pixels})",
            "invalid_max_pixels",
            "max_pixels",
        )
    return dataclasses.replace(cfg, max_pixels=min(max_pixels, cfg.max_pixels))


def checked_video_config(
    cfg: VideoConfig,
    limits: LimitSettings,
    decoding: DecodingSettings,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
    truncate_frames: bool = False,
) -> VideoConfig:
    """The model's video preprocessing with a request's sampling (else --video-fps where set), within the server's
    limits: at most --max-video-frames frames (a larger num_frames is refused, 413)."""
    most = limits.max_video_frames
    if num_frames is not None and num_frames > most:
        raise InputTooLarge(
            f"num_frames {num_frames} is over this server's limit of {most} frames a video",
            "too_many_frames",
            "num_frames",
        )
    if fps is None and num_frames is None and decoding.video_fps is not None:
        fps = decoding.video_fps
    if num_frames is not None and num_frames < cfg.temporal_patch_size:
        raise InputRejected(
            f"num_frames must be at least {cfg.temporal_patch_size} (one temporal patch), got {num_frames}",
            "invalid_num_frames",
            "num_frames",
        )
    if max_pixels is not None and max_pixels < cfg.min_pixels:
        raise InputRejected(
            f"max_pixels must be at least this server's video min_pixels ({cfg.min_pixels})",
            "invalid_max_pixels",
            "max_pixels",
        )
    return cfg.with_request(fps, num_frames, min(max_frames or most, most), max_pixels, truncate_frames)
