"""Hostile videos (encoder/video.py), each made here from a real test video (tests/videos.py: MP4 headers that declare
what the file does not hold, damaged bytes, empty streams, streams that never end, images): each fails with one of
the video errors (VideoError and its subclasses, VideoTooLarge, VideoTooLong), from its header before any decoding
where the header gives it away, in bounded time and memory; or, where it is a legitimate video, decodes as
transformers' pyav reader would (frames in decode order, a frame's index its place in that order, the declared
average rate, the coded orientation). Nothing downloads."""

from __future__ import annotations

import dataclasses
import io
import time

import numpy as np
import pytest
import torch
from corpus import encode, photo
from videos import Endless, damaged, declare_mp4, emptied_mp4, empty_video, ftyp, make_video, mdat_span, mp4_boxes

from vitserve.encoder import video as V
from vitserve.encoder.config import builtin_config
from vitserve.encoder.preprocess import UndecodableImage, load_image

av = pytest.importorskip("av")
CLEAN = (V.VideoError, V.VideoTooLarge)  # every video error: VideoTooShort and UnsupportedCodec are VideoErrors,
# VideoTooLong a VideoTooLarge


def qwen2(**request) -> V.VideoConfig:
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl"))
    return cfg.with_request(**request) if request else cfg


def qwen3() -> V.VideoConfig:
    return V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl"))


def declared(data: bytes) -> V.VideoInfo:
    """What the container declares, as load_video reads it (the patch took), decoding no frame."""
    container = av.open(io.BytesIO(data), options={"max_pixels": "1"})
    try:
        return V.probe(container)
    finally:
        container.close()


def timed(fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - start
    except Exception as e:
        e.seconds = time.perf_counter() - start
        raise


# 1. a tiny file declaring 8K frames and 100000 of them


@pytest.mark.parametrize(
    "declare, limits, error",
    [
        (dict(frames=100_000), V.VideoLimits(), V.VideoTooLong),
        (dict(frames=100_000, width=7680, height=4320), V.VideoLimits(), V.VideoTooLong),
        (dict(width=7680, height=4320), V.VideoLimits(max_frame_pixels=1920 * 1080), V.VideoTooLarge),
        (dict(frames=100_000, width=16000, height=16000), V.VideoLimits(max_seconds=1e6), V.VideoTooLarge),
    ],
    ids=["100000 frames", "8K x 100000 frames", "8K over a 1080p limit", "16000x16000 (256 MP) frames"],
)
def test_a_tiny_file_declaring_more_than_the_limits_is_refused_from_its_header(monkeypatch, declare, limits, error):
    """A 3 KB MP4 of 8 frames of 64x48 whose boxes (stts, mdhd, tkhd, the SPS in avcC) declare 100000 frames and
    8K or 16000x16000 ones: refused by the limits from its header, within a second, without a frame decoded by
    load_video. 16000x16000: FFmpeg decodes a first frame at the declared size while it opens the file, before any
    limit sees the header (2.5 s and 384 MB here); `_open` caps that decode at twice the pixel limit."""
    data = declare_mp4(make_video(8, 8, 64, 48), **declare)
    assert len(data) < 4096
    info = declared(data)
    assert (info.total_frames, info.width, info.height) == (
        declare.get("frames", 8),
        declare.get("width", 64),
        declare.get("height", 48),
    )
    monkeypatch.setattr(V, "decode_frames", pytest.fail)
    with pytest.raises(error) as caught:
        timed(V.load_video, data, qwen2(num_frames=4), limits)
    assert caught.value.seconds < 1.0, caught.value.seconds


def test_a_tiny_file_declaring_100000_frames_within_the_limits_fails_cleanly():
    """Within the limits (a day of video allowed) the 8 frames it holds are what decoding finds: a VideoError saying
    so, within 2 s (decoding stops at the data's end, nothing is kept for the frames never found)."""
    data = declare_mp4(make_video(8, 8, 64, 48), frames=100_000)
    with pytest.raises(V.VideoError, match="declares 100000 frames but ends before frame ") as caught:
        timed(V.load_video, data, qwen2(num_frames=4), V.VideoLimits(max_seconds=86400))
    assert caught.value.seconds < 2.0


def test_a_huge_declared_rate_does_not_slip_past_the_limits():
    """100000 frames at 16384 fps last 6 s (within the time limit): Qwen2's default keeps every frame up to
    max_frames (768 spread over 100000), Qwen3's samples 2 fps (12 spread over 100000): each finds 1 of them, a
    VideoError; with max_frames raised to keep every frame, their memory is refused before decoding."""
    data = declare_mp4(make_video(8, 8, 64, 48), frames=100_000, fps=16384)
    info = declared(data)
    assert (info.total_frames, info.fps) == (100_000, 16384.0) and info.duration < 10
    for cfg in (qwen2(), qwen3()):
        with pytest.raises(V.VideoError, match="declares 100000 frames but ends before frame"):
            V.load_video(data, cfg)
    with pytest.raises(V.VideoTooLarge, match="MiB; the limit is"):
        V.load_video(data, dataclasses.replace(qwen2(), max_frames=100_000))


def test_limits_refuse_a_frame_size_from_the_header_and_a_missing_one_as_undecodable():
    """A frame exactly at the pixel limit (an odd width: decoders pad rows) decodes, one pixel over is refused; a
    header with no frame size is an undecodable video, not a too-large one."""
    for codec, container in (("h264", "mp4"), ("mpeg4", "avi"), ("libvpx-vp9", "webm"), ("mjpeg", "avi")):
        data = make_video(8, 8, 100, 48, codec=codec, container=container)
        assert len(V.load_video(data, qwen2(num_frames=4), V.VideoLimits(max_frame_pixels=100 * 48)).frames) == 4
        with pytest.raises(V.VideoTooLarge):
            V.load_video(data, qwen2(num_frames=4), V.VideoLimits(max_frame_pixels=100 * 48 - 1))
    with pytest.raises(V.VideoError) as caught:
        V.VideoLimits().check(V.VideoInfo(12, 6.0, 0, 0, "h264"))
    assert not isinstance(caught.value, V.VideoTooLarge)


def test_a_frame_larger_than_the_header_mid_stream_is_refused_as_it_decodes():
    """Two MPEG-TS streams end to end: a header of 64x48, then a new SPS of 1024x1024. Under a 128x128 limit the
    large frames are refused by the decoder (a VideoError), never decoded; within it they are refused as they
    come, for the decode work they take past twice what the header declared (VideoTooCostly), before one of them is
    converted; the first stream alone decodes. (FFmpeg says so at the first large frame, or, decoding with many
    threads, drops them and the stream ends early.)"""
    small = make_video(6, 6, 64, 48, container="mpegts")
    data = small + make_video(6, 6, 1024, 1024, container="mpegts")
    with pytest.raises(V.VideoError, match="could not be decoded|declares 12 frames but ends before frame"):
        V.load_video(data, qwen2(), V.VideoLimits(max_frame_pixels=128 * 128))
    with pytest.raises(V.VideoTooCostly, match="a frame of 1024x1024 at frame 6"):
        V.load_video(data, qwen2())
    assert len(V.load_video(small, qwen2()).frames) == 6


# 1b. decode work: a small file that takes minutes of CPU to decode


def black_video(count: int, width: int, height: int) -> bytes:
    """`count` black frames of width x height in H.264: a few hundred bytes a frame, whatever their size."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("h264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(count):
            out.mux(stream.encode(black))
        out.mux(stream.encode())
    return buf.getvalue()


def test_a_video_bomb_is_refused_from_its_header_for_its_decode_work(monkeypatch):
    """400 frames of 4096x4096 declared by a 3 KB file (the issue's 62 KB bomb held a worker 288 s): every frame is
    decoded up to the last one sampled and each sampled one converted, which no other limit prices. Its decode work
    is refused from the header, in under a second, no frame decoded; the same file within a larger budget is not."""
    data = declare_mp4(make_video(8, 8, 64, 48), frames=400, width=4096, height=4096)
    assert len(data) < 4096
    monkeypatch.setattr(V, "decode_frames", pytest.fail)
    work = V.decode_work(4096, 4096, 400, 400)  # Qwen2's default keeps every frame
    with pytest.raises(V.VideoTooCostly, match="decoding 400 frames of 4096x4096") as caught:
        timed(V.video_cost, data, qwen2(), V.VideoLimits(max_work=work - 1))
    assert caught.value.seconds < 1.0 and caught.value.code == "decode_work"
    assert V.video_cost(data, qwen2(), V.VideoLimits(max_work=work)).work == work
    with pytest.raises(V.VideoTooCostly):
        V.load_video(data, qwen2(), V.VideoLimits(max_work=work - 1))


@pytest.mark.parametrize("request_", [{}, {"num_frames": 4}], ids=["every frame", "4 frames"])
def test_the_decode_work_from_the_header_bounds_what_decoding_counts(request_):
    """What video_cost declares (every frame up to the last sampled one decoded) bounds what decode_frames counts as
    it decodes an honest video (1024x1024, 12 frames), which decodes only what the sampled frames need: a limit of
    exactly the declared work decodes it; a limit one under the sampled frames' own decode and conversion is refused
    as it decodes."""
    data, cfg = black_video(12, 1024, 1024), qwen2(**request_)
    cost = V.video_cost(data, cfg)
    kept = np.unique(V.sample_indices(declared(data), cfg))
    assert cost.work == V.decode_work(1024, 1024, int(kept[-1]) + 1, len(kept))
    least = V.decode_work(1024, 1024, len(kept), len(kept))
    for limit, fits in ((cost.work, True), (least - 1, False)):
        container = V._open(data)
        try:
            frames = V.decode_frames(container, kept, (28, 28), max_work=limit, rewindable=True)
            if fits:
                assert sorted({i for i, _ in frames}) == kept.tolist()
            else:
                with pytest.raises(V.VideoTooCostly):
                    list(frames)
        finally:
            container.close()


# 2. streams that never end


def test_a_live_stream_is_counted_only_up_to_the_time_limit():
    """An MPEG-TS (no frame count: its packets are counted) served for ever by a file object that cannot seek:
    counting stops past the time limit's worth of frames at the stream's rate (a VideoTooLong), after reading about
    that much of it; under the default hour too, within 2 s. (`most` ends the stream so that a reader that would
    never stop fails here instead of hanging.)"""
    ts = make_video(12, 6, 64, 48, container="mpegts")  # 2 s a copy
    stream = Endless(ts, most=3000 * len(ts))
    with pytest.raises(V.VideoTooLong, match="over 60 frames at 6 fps"):
        V.load_video(stream, qwen2(fps=2), V.VideoLimits(max_seconds=10))
    assert stream.served <= 8 * len(ts)
    stream = Endless(ts, most=3000 * len(ts))
    with pytest.raises(V.VideoTooLong) as caught:
        timed(V.load_video, stream, qwen2(fps=2))
    assert caught.value.seconds < 2.0 and stream.served <= 1802 * len(ts)


def test_decoding_stops_at_the_last_sampled_frame():
    """Frames come one at a time as they decode (the first before a second copy is read) and decoding stops at the
    last index asked for, however much stream follows."""
    ts = make_video(12, 6, 64, 48, container="mpegts")
    stream = Endless(ts, most=100 * len(ts))
    container = V._open(stream)
    frames = V.decode_frames(container, np.array([0, 30, 60]), (28, 28))
    assert next(frames)[1].shape == (28, 28, 3) and stream.served <= 2 * len(ts)
    assert len(list(frames)) == 2 and stream.served <= 7 * len(ts)
    container.close()


def test_a_stream_that_cannot_be_rewound_fails_cleanly():
    """A stream with no frame count is read twice (counted, then decoded). Through a pipe (a file object that cannot
    seek) a short one rewinds within FFmpeg's buffer and decodes as its bytes do; a long one (24000 frames, 17 MB)
    cannot go back, nor can a bare H.264 elementary stream (no container, no index): a VideoError, not FFmpeg's
    PermissionError."""
    ts = make_video(12, 6, 64, 48, container="mpegts")
    short = V.load_video(Endless(ts, most=4 * len(ts)), qwen2(num_frames=4))
    assert np.array_equal(short.frames, V.load_video(ts * 4, qwen2(num_frames=4)).frames)
    with pytest.raises(V.VideoError, match="could not be counted"):
        V.load_video(Endless(ts, most=2000 * len(ts)), qwen2(num_frames=4), V.VideoLimits(max_seconds=86400))
    with pytest.raises(V.VideoError):
        V.load_video(make_video(12, 6, 64, 48, container="h264"), qwen2(num_frames=4))


# 3. damaged bytes


@pytest.mark.parametrize("how", ["zero", "flip", "ff"])
def test_a_corrupt_packet_mid_stream_decodes_or_fails_cleanly(how):
    """64 bytes zeroed, inverted or set to 0xFF in the middle of an H.264 MP4's media data: FFmpeg conceals the
    damage and every sampled frame comes out at the right size, or the video is a VideoError; nothing else."""
    data = make_video(24, 12, 128, 96)
    start, end = mdat_span(data)
    bad = damaged(data, (start + end) // 2, 64, how)
    assert bad != data and len(bad) == len(data)
    try:
        video = V.load_video(bad, qwen2(num_frames=8))
    except V.VideoError:
        return
    clean = V.load_video(data, qwen2(num_frames=8))
    assert video.frames.shape == clean.frames.shape and video.indices.tolist() == clean.indices.tolist()


@pytest.mark.parametrize(
    "codec, container",
    [
        ("h264", "mp4"),
        ("libvpx-vp9", "webm"),
        ("mpeg4", "avi"),
        ("h264", "mpegts"),
        ("h264", "matroska"),
        ("mjpeg", "mp4"),
    ],
)
def test_damage_anywhere_fails_only_with_video_errors(codec, container):
    """24 deterministic damages spread over the whole file (headers, indexes, packets; three kinds of damage, four
    lengths), sampled the Qwen2 and the Qwen3 way: each decodes the frames it samples or raises a video error; never
    another exception (FFmpeg's PermissionError, an AttributeError of a stream with no decoder...), never slow."""
    data = make_video(12, 6, 64, 48, codec=codec, container=container)
    for k in range(24):
        bad = damaged(data, len(data) * (2 * k + 1) // 48, (1, 4, 16, 64)[k % 4], ("zero", "flip", "ff")[k % 3])
        start = time.perf_counter()
        try:
            video = V.load_video(bad, qwen2(num_frames=4) if k % 2 else qwen3())
            assert len(video.frames) == len(np.unique(video.indices))
        except CLEAN:
            pass
        assert time.perf_counter() - start < 1.0, k


# 4. an image sent as a video, a video sent as an image


def image_files() -> dict[str, bytes]:
    rgb = photo(96, 64, 3)
    files = {
        "png": encode(rgb, "PNG"),
        "jpeg": encode(rgb, "JPEG"),
        "mpo": encode(rgb, "MPO", save_all=True, append_images=[photo(96, 64, 4)]),
        "apng": encode(rgb, "PNG", save_all=True, append_images=[photo(96, 64, 5)]),
        "gif": encode(rgb.convert("P"), "GIF", save_all=True, append_images=[photo(96, 64, 6).convert("P")]),
        "webp": encode(rgb, "WEBP", save_all=True, append_images=[photo(96, 64, 7)]),
        "tiff": encode(rgb, "TIFF"),
        "bmp": encode(rgb, "BMP"),
    }
    from PIL import features

    if features.check("avif"):
        files["avif"] = encode(rgb, "AVIF")  # FFmpeg reads it as a one-frame AV1 MP4
    return files


@pytest.mark.parametrize("name, data", list(image_files().items()), ids=list(image_files()))
def test_an_image_is_not_a_video(name, data):
    """Every image format, still and animated, fails load_video with a VideoError, the Qwen2 way (every frame: a JPEG
    would be a one-frame video, an MPO a two-frame one) and the Qwen3 way; and sniff calls none of them a video."""
    assert V.sniff(data[:512]) is None
    for cfg in (qwen2(), qwen3()):
        with pytest.raises(V.VideoError):
            V.load_video(data, cfg)


def test_a_video_is_not_an_image():
    """The image decoder refuses every video container with an UndecodableImage (a clean 400, not a crash)."""
    for codec, container in (("h264", "mp4"), ("libvpx-vp9", "webm"), ("mpeg4", "avi"), ("h264", "mpegts")):
        with pytest.raises(UndecodableImage):
            load_image(make_video(4, 4, 64, 48, codec=codec, container=container))


def test_sniff_tells_video_containers_from_images():
    """By content: MP4 (and MOV, 3GP), WebM and Matroska, AVI, MPEG-TS are videos; ISO files branded as images
    (AVIF, HEIF: the same 'ftyp' box as MP4) are not, nor PNG or JPEG."""
    for codec, container, name in (
        ("h264", "mp4", "mp4"),
        ("h264", "mov", "mp4"),
        ("libvpx-vp9", "webm", "webm"),
        ("h264", "matroska", "webm"),
        ("mpeg4", "avi", "avi"),
        ("h264", "mpegts", "mpegts"),
    ):
        assert V.sniff(make_video(4, 4, 64, 48, codec=codec, container=container)[:512]) == name, container
    for major in (b"isom", b"mp42", b"qt  ", b"3gp4", b"M4V "):
        assert V.sniff(ftyp(major, b"isom", b"mp41") + bytes(64)) == "mp4", major
    for major in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
        assert V.sniff(ftyp(major, b"mif1", b"miaf") + bytes(64)) is None, major
    rgb = photo(64, 48)
    assert V.sniff(encode(rgb, "PNG")[:512]) is None and V.sniff(encode(rgb, "JPEG")[:512]) is None


# 5. no frames


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: emptied_mp4(make_video(8, 8, 64, 48)), V.VideoTooShort),
        (lambda: empty_video("mpeg4", "avi"), V.VideoTooShort),
        (lambda: empty_video("h264", "matroska"), V.VideoError),
        (lambda: empty_video("libvpx-vp9", "webm"), V.VideoError),
        (lambda: empty_video("h264", "mp4"), V.VideoError),
    ],
    ids=["mp4 track with empty sample tables", "avi", "matroska", "webm", "mp4 as PyAV writes it"],
)
def test_a_video_stream_with_no_frames_fails_cleanly(make, error):
    """A container with a video stream and no packets: VideoTooShort where FFmpeg shows the stream (nothing to
    rewind after counting none), a VideoError where it refuses the file."""
    data = make()
    with pytest.raises(error):
        V.load_video(data, qwen2())
    with pytest.raises(error):
        V.load_video(data, qwen3())


# 6. variable frame rate


def test_a_variable_frame_rate_follows_the_declared_average_rate():
    """Frames of 50, 100 and 200 ms in turn: the video's rate is PyAV's average_rate (12 frames over 1.3 s, not
    the nominal 10), the indices are the family's sample_indices on it, a frame's index is its place in decode
    order (not its time), and the timestamps are index / average rate, as transformers' pyav reader has them."""
    data = make_video(12, 10, 64, 48, rates=[50, 100, 200])
    container = av.open(io.BytesIO(data))
    stream = container.streams.video[0]
    rate = float(stream.average_rate)
    times = [frame.time for frame in container.decode(stream)]
    container.close()
    assert len(times) == 12 and rate == pytest.approx(120 / 13) and times[3] == pytest.approx(0.35)
    for cfg in (qwen2(fps=2), qwen2(num_frames=6), qwen3()):
        video = V.load_video(data, cfg)
        assert video.info.fps == rate and video.info.total_frames == 12
        assert video.indices.tolist() == V.sample_indices(video.info, cfg).tolist()
        assert len(video.frames) == len(video.indices)
    video = V.load_video(data, qwen2(num_frames=4))
    assert video.indices.tolist() == [0, 3, 6, 9]
    container = av.open(io.BytesIO(data))
    decoded = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    container.close()
    _, h, w, _ = video.frames.shape
    for frame, i in zip(video.frames, video.indices):
        expected = V.resize(torch.from_numpy(decoded[i]).permute(2, 0, 1), h, w).permute(1, 2, 0).numpy()
        assert np.array_equal(frame, expected)
    video = V.load_video(data, qwen3())
    t = video.temporal_patch_size
    assert video.timestamps == pytest.approx(
        [
            (video.indices[i] + video.indices[min(i + t, len(video.indices)) - 1]) / 2 / rate
            for i in range(0, len(video.indices), t)
        ]
    )


# 7. rotation


def test_rotation_metadata_is_ignored_frames_come_coded():
    """A display matrix of 90 degrees in the MP4's tkhd: PyAV reports it (frame.rotation) but to_ndarray gives the
    frame as coded, and so does load_video (transformers' pyav reader ignores rotation too): 64 wide by 48 high,
    pixel for pixel the unrotated video's frames."""
    plain = make_video(8, 8, 64, 48)
    rotated = declare_mp4(plain, rotation=90)
    container = av.open(io.BytesIO(rotated))
    frame = next(container.decode(container.streams.video[0]))
    container.close()
    assert getattr(frame, "rotation", 90) == 90 and frame.to_ndarray(format="rgb24").shape == (48, 64, 3)
    video, reference = V.load_video(rotated, qwen2()), V.load_video(plain, qwen2())
    assert (video.info.width, video.info.height) == (64, 48)
    assert video.frames.shape[1] < video.frames.shape[2] and np.array_equal(video.frames, reference.frames)


# 8. codecs


@pytest.mark.parametrize(
    "codec, container", [("ffv1", "matroska"), ("rawvideo", "avi"), ("rawvideo", "matroska"), ("ffv1", "avi")]
)
def test_an_unsupported_codec_is_refused_before_decoding(monkeypatch, codec, container):
    data = make_video(6, 6, 64, 48, codec=codec, container=container)
    monkeypatch.setattr(V, "decode_frames", pytest.fail)
    with pytest.raises(V.UnsupportedCodec, match=f"{codec} videos are not accepted"):
        V.load_video(data, qwen2())


def test_a_codec_with_no_decoder_is_unsupported(monkeypatch):
    """An AVI whose codec tag names no codec FFmpeg knows (the stream has no decoder): UnsupportedCodec, not an
    AttributeError from the stream."""
    data = make_video(6, 6, 64, 48, codec="mpeg4", container="avi").replace(b"FMP4", b"ZZZZ")
    monkeypatch.setattr(V, "decode_frames", pytest.fail)
    with pytest.raises(V.UnsupportedCodec, match="no decoder"):
        V.load_video(data, qwen2())


def test_an_allowed_codec_is_named_by_its_codec_not_its_decoder():
    """AV1 is decoded by libdav1d: the allow-list names codecs, so an AV1 video is 'av1' and decodes."""
    try:
        data = make_video(8, 8, 64, 48, codec="libsvtav1", container="mp4")
    except (av.error.FFmpegError, ValueError):
        pytest.skip("no AV1 encoder in this PyAV")
    assert [box[0] for box in mp4_boxes(data)][-1] == b"moov"
    video = V.load_video(data, qwen2(num_frames=4))
    assert video.info.codec == "av1" and len(video.frames) == 4
