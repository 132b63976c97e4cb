"""Decoding only what a video's sampling needs (encoder.video_decode): the plan on packet lists, then the frames it
decodes against a decode of every frame, on the streams whose references differ (B-frames, P-only, open GOPs, VP9's
hidden frames, a variable frame rate, MPEG-4 part 2)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from videos import make_video

from vitserve.encoder import video as V
from vitserve.encoder.video_decode import (
    NOTHING,
    REFERENCES,
    WHOLE,
    PacketInfo,
    decode_sampled,
    group_starts,
    plan_decode,
)


def packets(order: str, keys: str) -> list[PacketInfo]:
    """Packets in decode order: `order` gives each one's presentation position (one character a packet, 0-9 then
    a-z), `keys` marks keyframes with K."""
    return [PacketInfo(int(c, 36) * 100, k == "K") for c, k in zip(order, keys)]


# 1. the plan


def test_a_group_with_a_sampled_frame_decodes_its_references_and_a_group_without_one_nothing():
    # I0 P3 B1 B2 | I4 P7 B5 B6 | I8 ...: frames 1 and 9 wanted
    ps = packets("031247568b9a", "K...K...K...")
    plan = plan_decode(ps, {1, 9})
    assert plan is not None
    assert plan.index_of == {100 * i: i for i in range(12)}
    assert [plan.skips[p.pts] for p in ps if p.pts in plan.skips] == [
        *(REFERENCES, REFERENCES, WHOLE, REFERENCES),
        *(NOTHING, NOTHING, NOTHING, NOTHING),
        *(REFERENCES, REFERENCES, WHOLE),
    ]
    assert plan.last == 900 and 1000 not in plan.skips  # the packets after frame 9's are not fed


def test_leading_pictures_keep_the_group_before_them():
    # the second keyframe (presentation 6) has two frames shown before it that follow it in decode order: they may
    # refer to the group before, which is decoded although it holds no sampled frame
    ps = packets("0312645", "K...K..")
    plan = plan_decode(ps, {4})
    assert plan is not None
    assert [plan.skips.get(p.pts) for p in ps] == [REFERENCES] * 4 + [REFERENCES, WHOLE, None]
    plan = plan_decode(packets("0312456", "K...K.."), {5})  # no leading pictures: the group before is skipped
    assert plan is not None and [plan.skips[100 * i] for i in (0, 3, 1, 2)] == [NOTHING] * 4


def test_a_discarded_packet_is_decoded_for_its_references_and_counts_no_index():
    ps = [PacketInfo(-100, True, discard=True), *packets("0312", ".K..")[1:]]
    ps.insert(1, PacketInfo(0, False))
    plan = plan_decode(ps, {2})
    assert plan is not None and plan.index_of == {0: 0, 100: 1, 200: 2, 300: 3}
    assert plan.skips[-100] == REFERENCES


@pytest.mark.parametrize(
    "ps, why",
    [
        ([PacketInfo(0, True), PacketInfo(None, False)], "a packet without a time"),
        ([PacketInfo(0, True), PacketInfo(0, False)], "two packets at one time"),
        (packets("201", "K.."), "frames shown before the first keyframe (a decoder may drop them)"),
        (packets("012", "..."), "no keyframe"),
    ],
)
def test_a_stream_that_cannot_be_mapped_has_no_plan(ps, why):
    assert plan_decode(ps, {0}) is None, why


def test_a_wanted_index_past_the_stream_has_no_plan():
    assert plan_decode(packets("0123", "K..."), {2, 7}) is None


# 2. the frames


def full_decode(data: bytes, last: int) -> list[np.ndarray]:
    container = V._open(data)
    stream = container.streams.video[0]
    frames = []
    for frame in container.decode(stream):
        frames.append(frame.to_ndarray(format="yuv420p").copy())
        if len(frames) > last:
            break
    container.close()
    return frames


def sparse_decode(data: bytes, wanted: set[int], threads: int) -> tuple[dict[int, np.ndarray], int]:
    """The wanted frames (the planned decode) and how many frames the decoder gave in all."""
    container = V._open(data)
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    stream.codec_context.thread_count = threads
    got, given = {}, 0
    for i, frame in decode_sampled(container, stream, wanted, rewindable=True):
        given += 1
        if i in wanted:
            got[i] = frame.to_ndarray(format="yuv420p").copy()
    container.close()
    return got, given


H264_B = dict(codec="libx264", options={"preset": "veryfast", "g": "250"})
CLIPS = {
    "h264 B-frames, one GOP": (H264_B, True),
    "h264 P-only": (dict(codec="libx264", options={"preset": "veryfast", "g": "30", "bf": "0"}), False),
    "h264 open GOP": (
        dict(codec="libx264", options={"preset": "veryfast", "g": "24", "x264-params": "open-gop=1"}),
        True,
    ),
    "hevc open GOP (CRA)": (
        dict(codec="libx265", options={"preset": "veryfast", "x265-params": "keyint=24:open-gop=1:log-level=error"}),
        True,
    ),
    "vp9": (dict(codec="libvpx-vp9", container="webm", options={"g": "30", "deadline": "realtime"}), False),
    "variable frame rate": (dict(codec="libx264", options={"preset": "veryfast", "g": "40"}, rates=[33, 50, 17]), True),
    "mpeg-4 part 2, B-frames": (dict(codec="mpeg4", container="avi", options={"g": "30", "bf": "2"}), True),
}


@pytest.mark.parametrize("threads", [1, 0], ids=["one thread", "frame threads"])
@pytest.mark.parametrize("clip", list(CLIPS))
def test_the_sampled_frames_are_those_of_a_full_decode(clip, threads):
    """Every 7th frame and the last but two (past the last keyframe) of 120 (12 fps, 10 s): the planned decode gives
    each the same planes as a decode of every frame; where the stream has frames nothing refers to (B-frames), it
    decodes fewer frames than that."""
    kw, has_unreferenced = CLIPS[clip]
    data = make_video(120, 12, 192, 108, **kw)
    wanted = set(range(0, 118, 7)) | {117}
    full = full_decode(data, 117)
    got, given = sparse_decode(data, wanted, threads)
    assert sorted(got) == sorted(wanted)
    for i in sorted(wanted):
        assert np.array_equal(got[i], full[i]), i
    if has_unreferenced:
        assert given < 118, given


def test_groups_without_a_sampled_frame_are_not_decoded():
    """4 frames of 240 with a keyframe every 12 (closed GOPs): the frames of the other groups are not decoded at all,
    and the 4 are those of a full decode."""
    data = make_video(240, 24, 160, 96, codec="libx264", options={"preset": "veryfast", "g": "12", "bf": "0"})
    wanted = {0, 80, 160, 239}
    got, given = sparse_decode(data, wanted, 1)
    full = full_decode(data, 239)
    assert all(np.array_equal(got[i], full[i]) for i in wanted)
    assert given <= 4 * 12, given


def test_load_video_decodes_sparsely_from_bytes_and_wholly_from_a_stream_that_cannot_rewind():
    """The same frames from bytes (planned) and from a file object that cannot seek (decoded whole as it comes)."""

    class Once(io.RawIOBase):
        def __init__(self, data):
            self.inner = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, buffer):
            return self.inner.readinto(buffer)

    data = make_video(90, 12, 192, 108, **H264_B)
    cfg = V.VideoConfig("qwen3", 16, fps=2.0, do_sample_frames=True, min_pixels=32 * 32, max_pixels=64 * 64 * 16)
    a, b = V.load_video(data, cfg), V.load_video(Once(data), cfg)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.frames, b.frames)


# 3. a video split among decoders


def test_group_starts_are_keyframes_in_presentation_order():
    """B-frames reorder packets: a keyframe's index is its place among the shown frames, not its packet's; a stream
    that cannot be mapped has none."""
    assert group_starts(packets("0312645978", "K----K----")) == [0, 4]  # its packet is the 6th
    assert group_starts(packets("0312", "----")) == []
    assert group_starts([PacketInfo(None, True)]) is None


def plan_of(kept: list[int], keyframes: tuple[int, ...], t: int = 2) -> V.VideoPlan:
    info = V.VideoInfo(total_frames=kept[-1] + 1, fps=30.0, width=64, height=64, codec="h264")
    return V.VideoPlan(V.Sampling(np.asarray(kept), info, t, (64, 64)), V.VideoCost(0, 0), keyframes=keyframes)


def test_parts_cut_at_groups_and_balance_the_frames_decoded():
    """Slices start every 30 frames, groups every 100: parts end where a slice starts a new group, their decode spans
    (keyframe to last frame) as even as the cuts allow, never more parts than asked, and the parts cover every slice
    once, in order."""
    kept = list(range(0, 600, 15))  # 40 frames, 20 slices of 2; slice s starts at frame 30 s
    plan = plan_of(kept, tuple(range(0, 600, 100)))
    for most in (1, 2, 3, 4, 6, 20):
        parts = plan.parts(most)
        assert len(parts) <= most and parts[0][0] == 0 and parts[-1][1] == 20
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        for a, _ in parts[1:]:  # each cut starts a group
            assert (30 * a) // 100 != (30 * (a - 1)) // 100
    assert plan.parts(1) == [(0, 20)]
    assert plan.parts(2) == [(0, 10), (10, 20)]  # frames 0-299 and 300-599
    assert len(plan.parts(6)) == 6 and len(plan.parts(20)) == 6  # six groups: six parts at most
    assert plan_of(kept, (0,)).parts(4) == [(0, 20)]  # one group: nothing to cut
    assert plan_of(kept, ()).parts(4) == [(0, 20)]  # groups not read


def test_parts_of_a_slice_spanning_two_groups_and_an_odd_frame_count():
    """A slice whose frames lie in two groups goes with its first frame's; the last slice (one frame, repeated to
    fill it) ends the last part."""
    plan = plan_of([0, 40, 60, 90, 130], (0, 50, 100))  # slices (0, 40), (60, 90), (130,)
    assert plan.parts(3) == [(0, 1), (1, 2), (2, 3)]
    assert plan.parts(2) in ([(0, 1), (1, 3)], [(0, 2), (2, 3)])


SPLIT_CLIPS = {k: CLIPS[k][0] for k in ("h264 P-only", "h264 open GOP", "hevc open GOP (CRA)", "vp9")} | {
    "h264 B-frames, closed GOPs": dict(codec="libx264", options={"preset": "veryfast", "g": "20"}),
    "variable frame rate": CLIPS["variable frame rate"][0],
}


@pytest.mark.parametrize("planes", [False, True], ids=["rgb", "planes"])
@pytest.mark.parametrize("clip", list(SPLIT_CLIPS))
def test_a_video_split_into_parts_is_the_whole_video(clip, planes):
    """The server's split of a lone video (video_plan(groups=True), VideoPlan.parts, load_video(part=...)): the
    parts' frames, in order, are the whole video's, byte for byte, and so are their slices (the last one padded as
    the whole's); the plan found several groups to cut at."""
    data = make_video(120, 12, 192, 108, **SPLIT_CLIPS[clip])
    cfg = V.VideoConfig("qwen3", 16, fps=5.0, do_sample_frames=True, min_pixels=32 * 32, max_pixels=64 * 64 * 16)
    plan = V.video_plan(data, cfg, groups=True, planes=planes)
    whole = V.load_video(data, cfg, planes=planes)
    parts = plan.parts(4)
    assert len(plan.keyframes) >= 3 and len(parts) >= 2, (plan.keyframes, parts)
    videos = [V.load_video(data, cfg, planes=planes, part=part) for part in parts]
    assert np.array_equal(np.concatenate([v.indices for v in videos]), whole.indices)
    assert np.array_equal(np.concatenate([v.frames for v in videos]), whole.frames)
    split = [s for v in videos for s in v.slices()]
    assert len(split) == len(whole.slices()) and all(np.array_equal(a, b) for a, b in zip(split, whole.slices()))


# 4. the frames as planes, converted where they run


def test_planes_made_into_frames_are_load_videos_frames():
    """load_video(planes=True) keeps the sampled frames' planes (H.264 and VP9 in BT.601's limited range, MJPEG's
    full range, an odd chroma width); frames_from_planes makes of each slice the frames load_video makes on the host,
    byte for byte. A 4:4:4 video has no exact conversion here: its frames come as RGB, the same."""
    from vitserve.encoder.config import builtin_config
    from vitserve.encoder.pixels import frames_from_planes

    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl")).with_request(fps=3)
    clips = [
        make_video(40, 10, 320, 180),
        make_video(30, 10, 162, 96, codec="libvpx-vp9", container="webm"),
        make_video(20, 10, 160, 120, codec="mjpeg", container="avi"),
    ]
    for data in clips:
        rgb, planes = V.load_video(data, cfg), V.load_video(data, cfg, planes=True)
        assert planes.layout is not None and planes.size == rgb.size
        assert planes.frames.nbytes <= V.video_cost(data, cfg, planes=True).memory - 3 * planes.layout.row_bytes
        made = [frames_from_planes(s, planes.layout, planes.size, "cpu").numpy() for s in planes.slices()]
        assert np.array_equal(np.concatenate(made)[: len(rgb.frames)], rgb.frames)
    data = make_video(20, 10, 160, 120, codec="libx264", pix_fmt="yuv444p")
    video = V.load_video(data, cfg, planes=True)
    assert video.layout is None and np.array_equal(video.frames, V.load_video(data, cfg).frames)
