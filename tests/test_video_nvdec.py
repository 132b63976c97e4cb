"""NVDEC through PyNvVideoCodec (encoder/video_nvdec.py): the sampled frames' planes it copies out are the software
decoder's, byte for byte, on the streams whose references differ (on a GPU with PyNvVideoCodec; elsewhere they
skip), fed as the sampled decode plans them; the layout it reads from the header is the one the software path
reads from each frame (everywhere)."""

from __future__ import annotations

import numpy as np
import pytest
from test_video_decode import CLIPS
from videos import make_video

from vitserve.encoder import video as V
from vitserve.encoder import video_nvdec
from vitserve.encoder.video_planes import PlanesLayout

pytest.importorskip("av")
NVDEC = pytest.mark.skipif(video_nvdec.unavailable() is not None, reason=f"needs NVDEC: {video_nvdec.unavailable()}")
CFG = V.VideoConfig("qwen3", 16, fps=3.0, do_sample_frames=True, min_pixels=32 * 32, max_pixels=64 * 64 * 16)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(codec="libvpx-vp9", container="webm"),
        dict(codec="mjpeg", container="avi"),
        dict(codec="libx264", pix_fmt="yuv444p"),
    ],
    ids=["h264", "vp9", "mjpeg", "h264 4:4:4"],
)
def test_the_header_layout_is_each_frames(kw):
    """The layout from the stream's header (what NVDEC's frames are converted with) is the one PlanesLayout reads
    from a decoded frame, or None where the software path has none either (4:4:4)."""
    container = V._open(make_video(10, 10, 162, 96, **kw))
    stream = container.streams.video[0]
    frame = next(container.decode(stream))
    assert video_nvdec.layout_of(stream) == PlanesLayout.of(frame)
    container.close()


@NVDEC
@pytest.mark.parametrize("clip", list(CLIPS))
def test_nvdec_planes_are_the_software_decoders(clip):
    """Every codec NVDEC takes among the clips: its sampled planes are load_video(planes=True)'s (the software
    decoder's, sparsely decoded), with the same layout; a codec it does not take gives None (software then)."""
    kw, _ = CLIPS[clip]
    data = make_video(120, 12, 192, 108, **kw)
    software = V.load_video(data, CFG, planes=True)
    container = V._open(data)
    got = video_nvdec.load_planes(container, software.indices)
    container.close()
    codec = {"libx264": "h264", "libx265": "hevc", "libvpx-vp9": "vp9"}.get(kw["codec"], kw["codec"])
    if codec not in video_nvdec.CODECS:
        assert got is None
        return
    assert got is not None
    rows, layout = got
    assert layout == software.layout
    assert np.array_equal(rows, software.frames)
