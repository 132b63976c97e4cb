"""The server's video decoding (service/decoder.py) under its budgets: a request's decode work read from its videos'
headers (--video-decode-work-per-request), the work in flight on the server (--video-decode-work), and the workers
videos may hold (--video-decode-workers), so that videos never take every worker from images. Real videos and
images, decoded by the decoder's threads; the video decode waits on an event where a test holds it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from corpus import encode, photo
from helpers import until
from videos import make_video

from vitserve.encoder import video as V
from vitserve.encoder.config import builtin_config
from vitserve.encoder.preprocess import PreprocessConfig
from vitserve.service.decoding import decoder as decoder_module
from vitserve.service.decoding.decoder import Decoder
from vitserve.service.ground.errors import InputRejected, InputTooLarge
from vitserve.service.ground.metrics import Metrics
from vitserve.service.ground.settings import Settings

pytest.importorskip("av")
CLIP = make_video(12, 6, 160, 120)
CFG = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(num_frames=4)
WORK = V.video_cost(CLIP, CFG).work


class Held:
    """decode.decode_video, each call held until `release` is set; `running` counts the calls under way."""

    def __init__(self):
        self.release, self.running, self.most, self._lock = threading.Event(), 0, 0, threading.Lock()
        self.calls, self.fail_part = 0, None  # fail_part: the part whose decode raises, by its place
        self.parts: dict[int, threading.Event] = {}  # a part (by its first slice) held by its own event

    def __call__(self, *args):
        with self._lock:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)
        try:
            part = args[7] if len(args) > 7 else None
            held = self.parts.get(part[0]) if part is not None else None
            assert (held or self.release).wait(30), "never released"
            if self.fail_part is not None and part is not None and part[0] > 0:
                raise V.VideoError("the video could not be decoded", "a part failed")
            return decode_video(*args)
        finally:
            with self._lock:
                self.running -= 1


decode_video = decoder_module.decode_video


def scenario(monkeypatch, settings: Settings, run):
    held = Held()
    monkeypatch.setattr(decoder_module, "decode_video", held)

    async def main():
        decoder = Decoder(settings.decoding, settings.limits, Metrics(), on_broken=lambda reason: None)
        try:
            return await run(decoder, held)
        finally:
            held.release.set()
            await decoder.close()

    return asyncio.run(main())


def test_videos_leave_the_other_workers_to_images(monkeypatch):
    """Two decode workers, two video requests: one video decodes at a time (half the workers), the other waits, and
    an image sent meanwhile is decoded by the free worker instead of waiting for the videos (the issue: two videos
    held both workers for 300 s while no image decoded)."""

    async def run(decoder, held):
        videos = [asyncio.ensure_future(decoder.decode_videos([CLIP], CFG)) for _ in range(2)]
        await until(lambda: held.running == 1, what="a video decoding")
        image = PreprocessConfig()
        done = await asyncio.wait_for(decoder.decode([encode(photo(64, 48, 1), "PNG")], image), 10)
        running = held.running
        held.release.set()
        answers = await asyncio.gather(*videos)
        return done, running, held.most, answers

    done, running, most, answers = scenario(
        monkeypatch, Settings.of(model="m", decode_processes=False, decode_workers=2), run
    )
    assert len(done) == 1 and running == 1 and most == 1
    assert [len(slices) for ((slices, _, _),) in answers] == [2, 2]  # 4 frames: 2 slices each


def test_the_work_in_flight_on_the_server_is_bounded(monkeypatch):
    """Room for two videos' workers but for one video's decode work (--video-decode-work): the second waits for the
    first to finish, then decodes."""

    async def run(decoder, held):
        videos = [asyncio.ensure_future(decoder.decode_videos([CLIP], CFG)) for _ in range(2)]
        await until(lambda: held.running == 1, what="a video decoding")
        await asyncio.sleep(0.3)
        running = held.running
        held.release.set()
        await asyncio.gather(*videos)
        return running, held.most

    settings = Settings.of(
        model="m", decode_processes=False, decode_workers=4, video_decode_workers=2, video_decode_work=WORK
    )
    assert scenario(monkeypatch, settings, run) == (1, 1)


def test_a_request_over_its_decode_work_is_refused_before_decoding(monkeypatch):
    """Two videos that each fit --video-decode-work-per-request but not together: a 413 decode_work naming the
    field; one video over it alone: a 413 decode_work naming the video. Both from the headers, no frame decoded."""

    async def run(decoder, held):
        with pytest.raises(InputTooLarge) as caught:
            await decoder.decode_videos([CLIP, CLIP], CFG)
        return caught.value, held.most

    for videos, limit, param in ((2, 2 * WORK - 1, "videos"), (1, WORK - 1, "videos[0]")):
        settings = Settings.of(model="m", decode_processes=False, decode_workers=2, video_decode_work_per_request=limit)
        error, most = scenario(monkeypatch, settings, lambda d, h: run_n(d, h, videos))
        assert (error.code, error.param, most) == ("decode_work", param, 0), error.message
        assert "G" in error.message and "send fewer, shorter or smaller" in error.message or "shorter" in error.message


async def run_n(decoder, held, n):
    with pytest.raises(InputTooLarge) as caught:
        await decoder.decode_videos([CLIP] * n, CFG)
    return caught.value, held.most


LONG = make_video(120, 12, 192, 108, codec="libx264", options={"preset": "veryfast", "g": "20"})  # six groups
LONG_CFG = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(fps=4)


def test_a_video_is_split_among_the_free_video_workers(monkeypatch):
    """Three video workers, one held by a video of one group of pictures (not split): a video of six groups decodes
    in two parts at once, on the two free workers, and its joined answer is the library's whole decode (slices,
    grid, timing)."""

    async def run(decoder, held):
        first = asyncio.ensure_future(decoder.decode_videos([CLIP], CFG))
        await until(lambda: held.running == 1, what="the first video decoding")
        second = asyncio.ensure_future(decoder.decode_videos([LONG], LONG_CFG))
        await until(lambda: held.running == 3, what="the second video's parts decoding")
        await asyncio.sleep(0.2)
        running = held.running
        held.release.set()
        await first
        return running, await second, held.calls

    settings = Settings.of(model="m", decode_processes=False, decode_workers=8, video_decode_workers=3)
    running, ((slices, grid, timing),), calls = scenario(monkeypatch, settings, run)
    whole = V.load_video(LONG, LONG_CFG)
    expected = whole.slices()
    assert running == 3 and calls == 3  # the first video whole, the second in two parts
    assert len(slices) == len(expected) and all(np.array_equal(a, b) for a, b in zip(slices, expected))
    assert grid == whole.sampling.grid(LONG_CFG.patch_size) and timing == whole.sampling.timing()


def test_a_part_that_fails_fails_its_video_only(monkeypatch):
    """One part of a split video fails to decode: the request gets that video's error, and the next request for the
    same video (split again) is answered whole."""

    async def run(decoder, held):
        held.release.set()
        held.fail_part = 1
        with pytest.raises(InputRejected) as caught:
            await decoder.decode_videos([LONG], LONG_CFG)
        held.fail_part = None
        ((slices, _, _),) = await decoder.decode_videos([LONG], LONG_CFG)
        return caught.value, len(slices)

    settings = Settings.of(model="m", decode_processes=False, decode_workers=8, video_decode_workers=4)
    error, slices = scenario(monkeypatch, settings, run)
    assert isinstance(error, InputRejected) and error.param == "videos[0]" and "could not be decoded" in str(error)
    assert slices == len(V.load_video(LONG, LONG_CFG).slices())


def test_each_part_is_handed_on_as_it_is_decoded(monkeypatch):
    """decode_planned's on_part: a split video's first part is handed on (its slices, its first slice's place)
    while its second is still decoding, then the second; the whole answer is the library's."""

    async def run(decoder, held):
        held.parts[0] = threading.Event()
        handed = []
        plans = await decoder.plan_videos([LONG], LONG_CFG)
        decoding = asyncio.ensure_future(
            decoder.decode_planned([LONG], plans, LONG_CFG, on_part=lambda k, first, s: handed.append((k, first, s)))
        )
        await until(lambda: held.running == 2, what="two parts decoding")
        held.release.set()  # every part but the first
        await until(lambda: len(handed) == 1, what="the second part handed on")
        first_handed, running = handed[0][1], held.running
        held.parts[0].set()
        ((slices, _, _),) = await decoding
        return first_handed, running, handed, slices

    settings = Settings.of(model="m", decode_processes=False, decode_workers=8, video_decode_workers=2)
    first_handed, running, handed, slices = scenario(monkeypatch, settings, run)
    expected = V.load_video(LONG, LONG_CFG).slices()
    assert first_handed > 0 and running == 1  # the later part first, while the first still decodes
    assert sorted(first for _, first, _ in handed) == [0, first_handed] and all(k == 0 for k, _, _ in handed)
    parts = sorted((first, s) for _, first, s in handed)
    joined = [x for _, s in parts for x in s]
    assert all(np.array_equal(a, b) for a, b in zip(joined, expected)) and len(joined) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(slices, expected))
