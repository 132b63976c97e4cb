"""Our video preprocessing against transformers' video processors themselves (Qwen2VLVideoProcessor for
Qwen2/2.5-VL, Qwen3VLVideoProcessor), on the frames of the same decoder (transformers' pyav reader): frame indices,
`video_grid_thw` and `pixel_values_videos` bit-identical, over codecs, frame rates, sampling requests and the
per-frame pixel cap. transformers' video processors need torchvision, which does not load beside CI's CPU torch:
this runs where torchvision does (the GPU machine; bench/gpu_frontend.sh checks)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from videos import make_video

from vitserve.encoder import video as V
from vitserve.encoder.config import builtin_config

pytest.importorskip("av")
try:
    import torchvision  # noqa: F401
except Exception:  # not installed, or built for another torch
    pytest.skip("needs torchvision (transformers' video processors)", allow_module_level=True)

CLIPS = [("h264", "mp4", 30, 10, 320, 240), ("mpeg4", "avi", 17, 7.5, 96, 64), ("hevc", "mp4", 40, 30, 640, 360)]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: c[0])
@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"])
def test_matches_transformers_video_processor(tmp_path, model, clip):
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video

    codec, container, frames, fps, width, height = clip
    data = make_video(frames, fps, width, height, codec, container)
    path = tmp_path / f"clip.{container}"
    path.write_bytes(data)
    cfg = V.VideoConfig.for_model(builtin_config(model))
    processor_class = Qwen3VLVideoProcessor if cfg.family == "qwen3" else Qwen2VLVideoProcessor
    small = max(64 * cfg.factor**2 * (1 if cfg.family == "qwen2" else 4), cfg.min_pixels)  # (under it: refused)
    for request in ({"fps": 2.0}, {"num_frames": 6}, {"fps": 2.0, "max_pixels": small}):
        for cap in (False, True):
            ours_cfg = dataclasses.replace(cfg, cap_pixels_per_frame=cap).with_request(**request)
            processor = processor_class(
                size={"shortest_edge": ours_cfg.min_pixels, "longest_edge": ours_cfg.max_pixels},
                patch_size=cfg.patch_size,
                cap_pixels_per_frame=cap,
            )
            sampling = {k: v for k, v in request.items() if k != "max_pixels"}
            decoded, metadata = load_video(
                str(path), backend="pyav", sample_indices_fn=functools.partial(processor.sample_frames, **sampling)
            )
            ref = processor(videos=[decoded], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt")
            pixels, grids, videos = V.preprocess_videos([data], ours_cfg)
            what = (request, cap)
            assert videos[0].indices.tolist() == list(metadata.frames_indices), what
            assert grids.tolist() == ref["video_grid_thw"].tolist(), what
            assert torch.equal(pixels, ref["pixel_values_videos"]), what
