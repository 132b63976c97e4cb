"""The server's video decoding (service/decoder.py) under its budgets: a request's decode work read from its videos'
headers (--video-decode-work-per-request), the work in flight on the server (--video-decode-work), and the workers
videos may hold (--video-decode-workers), so that videos never take every worker from images. Real videos and
images, decoded by the decoder's threads; the video decode waits on an event where a test holds it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from corpus import encode, photo
from helpers import until
from videos import make_video

from vitserve.encoder import video as V
from vitserve.encoder.config import builtin_config
from vitserve.encoder.preprocess import PreprocessConfig
from vitserve.service.decoding import decoder as decoder_module
from vitserve.service.decoding.decoder import Decoder
from vitserve.service.ground.errors import InputTooLarge
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

    def __call__(self, *args):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(30), "never released"
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
