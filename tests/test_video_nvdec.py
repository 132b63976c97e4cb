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
    load_video(planes=True)'s (the software decoder's, sparsely decoded), with the same layout, for the whole video
    and for a part of it that starts at a later keyframe; a codec it does not take gives None (software then)."""
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
    later = software.indices >= 60  # a part of the video: its decode starts at a later keyframe (open GOPs: no IDR)
    container = V._open(data)
    got = video_nvdec.load_planes(container, software.indices[later])
    container.close()
    assert got is not None and np.array_equal(got[0], software.frames[later])


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


def _nal_units(annexb: bytes) -> list[bytes]:
    """The NAL units of an Annex B byte stream (split at its start codes, trailing zeros dropped)."""
    parts = annexb.replace(b"\x00\x00\x00\x01", b"\x00\x00\x01").split(b"\x00\x00\x01")
    return [part.rstrip(b"\x00") for part in parts if part]


@pytest.mark.parametrize(
    "codec, kinds",
    [("libx264", lambda nal: nal[0] & 0x1F in (7, 8)), ("libx265", lambda nal: (nal[0] >> 1) & 0x3F in (32, 33, 34))],
    ids=["h264: SPS, PPS", "hevc: VPS, SPS, PPS"],
)
def test_the_parameter_sets_are_the_streams(codec, kinds):
    """The parameter sets read from the MP4's extradata (fed with NVDEC's first packet, so that a part starting at
    an open GOP's keyframe decodes) are the ones FFmpeg's Annex B filter puts before the stream's first picture,
    and nothing the stream does not carry; extradata already in Annex B or cut short gives none."""
    import av

    options = {"preset": "veryfast", "x265-params": "log-level=error"} if codec == "libx265" else None
    container = V._open(make_video(24, 12, 256, 144, codec=codec, options=options))
    stream = container.streams.video[0]
    name = stream.codec_context.name
    bsf = av.bitstream.BitStreamFilterContext(f"{name}_mp4toannexb", stream)
    first = next(p for p in container.demux(stream) if p.size)
    filtered = b"".join(bytes(p) for p in bsf.filter(first))
    ours, theirs = _nal_units(video_nvdec.parameter_sets(name, stream.codec_context.extradata)), _nal_units(filtered)
    assert [nal for nal in ours if kinds(nal)] == [nal for nal in theirs if kinds(nal)] != []
    assert all(nal in theirs for nal in ours)  # (x265's extradata carries an SEI too, which the filter passes on)
    assert video_nvdec.parameter_sets(name, b"\x00\x00\x00\x01" + ours[0]) == b""  # Annex B already
    assert video_nvdec.parameter_sets(name, bytes(stream.codec_context.extradata)[:9]) == b""  # cut short
    container.close()
