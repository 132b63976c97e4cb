"""NVDEC through PyNvVideoCodec (encoder/video_nvdec.py): the sampled frames' planes it copies out are the software
decoder's, byte for byte, on the streams whose references differ (on a GPU with PyNvVideoCodec; elsewhere they
skip), fed as the sampled decode plans them; the layout it reads from the header is the one the software path
reads from each frame (everywhere)."""

from __future__ import annotations

import dataclasses

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
    """Every codec NVDEC takes among the clips (at a size every codec's NVDEC takes): its sampled planes are
    load_video(planes=True)'s (the software decoder's, sparsely decoded), with the same layout; a codec it does not
    take gives None (software then)."""
    kw, _ = CLIPS[clip]
    data = make_video(120, 12, 256, 144, **kw)
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


def test_the_planned_packets_survive_a_bitstream_filter():
    """The packets walked for a plan stop at its last one though each is sent through the Annex B filter on the way
    (as NVDEC's feed does; the filter empties the packet it takes): no packet past the plan is read."""
    import av

    from vitserve.encoder.video_decode import packet_infos, plan_decode, planned_packets

    container = V._open(make_video(120, 12, 192, 108))
    stream = container.streams.video[0]
    plan = plan_decode(packet_infos(container, stream, 1000), {5, 30})
    assert plan is not None and plan.last < max(plan.index_of)  # the stream goes on past the plan
    bsf = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", stream)
    walked = []
    for packet, _ in planned_packets(container, stream, plan):
        walked.append(packet.pts)
        bsf.filter(packet)
    assert walked == list(plan.skips) and walked[-1] == plan.last
    container.close()


@pytest.fixture
def nvdec_here(monkeypatch):
    """This process as if NVDEC could run (its decode replaced by each test)."""
    monkeypatch.setattr(V, "_nvdec_refused", None)
    monkeypatch.setattr(V, "_nvdec_tried", True)


@pytest.mark.parametrize("planes", [False, True], ids=["rgb", "planes"])
def test_load_video_takes_nvdecs_planes_or_falls_back(nvdec_here, monkeypatch, planes):
    """load_video with decoder "nvdec": the planes NVDEC gives (here the software decoder's, which the GPU test holds
    NVDEC's to) become the video, said so: as planes for the devices, or made into RGB frames here by the devices'
    arithmetic, the software path's frames either way; where NVDEC fails on the video, or cannot take the stream,
    the software decoder decodes it from the start, the same frames, said so."""
    clip = make_video(60, 12, 192, 108)
    nvdec_cfg = dataclasses.replace(CFG, decoder="nvdec")
    software = V.load_video(clip, CFG, planes=planes)
    reference = V.load_video(clip, CFG, planes=True)
    asked = []

    def decoded(container, kept):
        asked.append(list(kept))
        next(container.decode(container.streams.video[0]))  # (read some: the fallback must start over)
        return reference.frames[np.searchsorted(reference.indices, kept)], reference.layout

    monkeypatch.setattr(video_nvdec, "load_planes", decoded)
    video = V.load_video(clip, nvdec_cfg, planes=planes)
    assert video.decoder == "nvdec" and asked == [list(software.indices)]
    assert video.layout == software.layout and np.array_equal(video.frames, software.frames)

    def failing(container, kept):
        next(container.decode(container.streams.video[0]))
        raise video_nvdec.NvdecError("NVDEC gave 3 of the 4 frames asked for")

    for fails in (failing, lambda container, kept: None):
        monkeypatch.setattr(video_nvdec, "load_planes", fails)
        video = V.load_video(clip, nvdec_cfg, planes=planes)
        assert video.decoder == "cpu" and np.array_equal(video.frames, software.frames)


@pytest.mark.parametrize(
    "kw, size",
    [
        (dict(codec="libx265", options={"x265-params": "log-level=error"}), (192, 108)),
        (dict(codec="libvpx-vp9", container="webm"), (160, 120)),
        (dict(codec="libx264"), (40, 16)),
    ],
    ids=["hevc under 144 high", "vp9 under 128 high", "h264 under 48 wide"],
)
def test_a_stream_smaller_than_nvdec_takes_is_left_to_software(kw, size):
    """A stream under its codec's smallest NVDEC size is not given to NVDEC (None: the software decoder decodes
    it), before NVDEC is opened (so on any machine)."""
    container = V._open(make_video(12, 12, *size, **kw))
    assert video_nvdec.load_planes(container, np.arange(4)) is None
    container.close()
