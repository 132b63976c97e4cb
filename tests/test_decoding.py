"""Decoding: the spool files that carry decoded pixels, the decode pool's worker processes (death, replacement,
a pool that cannot replace its last worker), and the decoder that drives them for the engine."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import IMAGES, images_in, png, until, wait_until
from PIL import Image

from vitserve.encoder.media import MediaBytes
from vitserve.service.api.http_errors import ServiceError
from vitserve.service.decoding import spool
from vitserve.service.decoding.decode_pool import DecodePool, PoolUnavailable, WorkerDied
from vitserve.service.devices.scheduler import WorkItem
from vitserve.service.ground.errors import ImageLost, InputRejected, Unavailable
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.engine import Engine, State


def b64(data: bytes) -> MediaBytes:
    return MediaBytes(base64.b64encode(data).decode())


def test_spool_round_trip_and_fallback(tmp_path):
    names = iter(range(100))
    prefix = spool.spool_prefix(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(prefix) + "lock"]  # held while we live

    image = np.random.default_rng(0).integers(0, 256, (28, 42, 3), dtype=np.uint8)

    def put(image):
        return spool.put(f"{prefix}{next(names)}", image)

    spooled = put(image)
    assert spooled is not None and len(images_in(tmp_path)) == 1
    assert np.array_equal(spooled.read(), image) and images_in(tmp_path) == []  # read back, file gone
    assert spool.put(str(tmp_path / "missing" / "x"), image) is None  # no directory: the caller pipes it
    short = put(image)
    with open(short.path, "r+b") as f:
        f.truncate(10)
    kept, lost = put(image), spool.Spooled(str(tmp_path / "gone"), (2, 2, 3))
    with pytest.raises(ImageLost, match="lost on its way.*short"):  # every file is read and removed anyway
        spool.pixels([short, image, lost, kept])
    assert images_in(tmp_path) == []
    a, b = put(image), put(image)
    assert [x.shape for x in spool.pixels([image, a])] == [image.shape] * 2
    spool.discard(image)  # an array: nothing to do
    spool.discard(b)
    assert images_in(tmp_path) == []
    put(image), put(image)
    spool.clear(prefix)
    assert list(tmp_path.iterdir()) == []


def _mapped(path: str) -> bool:
    """Whether this process maps the (removed) file at `path`."""
    return any(path in line for line in open("/proc/self/maps"))


def test_a_batch_of_decoded_images_is_let_go_on_a_thread_of_its_own(tmp_path):
    """A batch's images read from the spool are let go by `launch_decoded` once the encoder has them (its copy),
    on the release thread: their mappings (and the pages of their removed files) go there, not on the batch's
    thread (a 6 MB image's let-go costs that thread more than its copy). Also when the launch fails. Broken: the
    mappings kept (pages never freed), or unmapped on the batch's thread (which the finalizers would name)."""
    import threading
    import weakref

    from vitserve.service.devices.worker import launch_decoded

    image = np.random.default_rng(0).integers(0, 256, (64, 48, 3), dtype=np.uint8)
    where: list[str] = []

    class Encoder:
        def __init__(self, fail: bool = False):
            self.fail = fail

        def launch(self, images, sizes, mean_pooling, float32):
            assert [np.array_equal(x, image) for x in images] == [True, True]
            for x in images:  # (each a view of its mapping: it goes when the release thread lets go of it)
                weakref.finalize(x, lambda: where.append(threading.current_thread().name))
            if self.fail:
                raise RuntimeError("no device")
            return "launched"

    for fail in (False, True):
        where.clear()
        spooled = [spool.put(str(tmp_path / f"{fail}-{i}"), image) for i in range(2)]
        assert all(s is not None and not _mapped(s.path) for s in spooled)
        if fail:
            with pytest.raises(RuntimeError, match="no device"):
                launch_decoded(Encoder(fail), spooled, [(64, 48)] * 2, [False] * 2, [False] * 2)
        else:
            assert launch_decoded(Encoder(), spooled, [(64, 48)] * 2, [False] * 2, [False] * 2) == "launched"
        wait_until(lambda: len(where) == 2, 5, "the images let go")
        assert where == ["vitserve-release"] * 2
        assert images_in(tmp_path) == [] and not any(_mapped(s.path) for s in spooled)


def test_a_spool_file_reserved_while_the_image_decodes_holds_its_pixels_or_goes(tmp_path):
    """A decode worker's spool file is made (its pages allocated) while the image decodes, at the size its header
    says (`spool.reserve`), and the pixels are copied into it; a reservation of another size is given up for a file
    of the right one, one never used is removed, and one that could not be made leaves the pixels to the pipe. The
    decoded images are PIL's, full size or resized, and a bad image leaves no file behind. Broken: a file of the
    reserved size instead of the image's (a short or padded read), or files left by failed images."""
    from vitserve.encoder.image_errors import UndecodableImage
    from vitserve.encoder.preprocess import PreprocessConfig, load_for_device, load_image, resize_rgb
    from vitserve.service.decoding.decode import decode_and_resize

    image = np.random.default_rng(3).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    for name, nbytes in (("exact", image.nbytes), ("other", image.nbytes + 9)):
        path = str(tmp_path / name)
        spooled = spool.put(path, image, spool.reserve(path, nbytes))
        assert spooled is not None and os.path.getsize(path) == image.nbytes and np.array_equal(spooled.read(), image)
    spool.unreserve(spool.reserve(str(tmp_path / "unused"), 100))
    missing = str(tmp_path / "missing" / "x")
    assert spool.put(missing, image, spool.reserve(missing, image.nbytes)) is None  # the caller pipes it
    assert images_in(tmp_path) == []

    cfg = PreprocessConfig()
    photo = png(300, 200, 7, "JPEG")
    for full_size, want in ((True, load_for_device(photo, False)), (False, resize_rgb(load_image(photo), cfg))):
        path = str(tmp_path / f"photo-{full_size}")
        decoded = decode_and_resize(photo, False, 10**8, cfg, path, full_size)
        assert isinstance(decoded.image, spool.Spooled) and (decoded.image.offset > 0) == full_size  # (put_image's)
        assert os.path.getsize(path) == decoded.image.offset + want.nbytes
        assert np.array_equal(decoded.image.read(), want)
    broken = png(300, 200, 7)  # its structure whole (the header walk passes it), its pixel data not
    at = broken.index(b"IDAT") + 100
    broken = broken[:at] + bytes(b ^ 0xFF for b in broken[at : at + 50]) + broken[at + 50 :]
    reserved = []
    real_reserve = spool.reserve
    with pytest.MonkeyPatch.context() as m:
        m.setattr(spool, "reserve", lambda *args: reserved.append(real_reserve(*args)) or reserved[-1])
        with pytest.raises(UndecodableImage):
            decode_and_resize(broken, False, 10**8, cfg, str(tmp_path / "broken"))
    assert len(reserved) == 1 and images_in(tmp_path) == []  # reserved, then given up


def test_a_full_size_image_is_streamed_into_its_spool_file_never_packed_whole(tmp_path, monkeypatch):
    """A decoded PIL image goes into its spool file a block at a time (`spool.put_image`: Pillow's PPM writer, the
    pixels after its header, which the record's offset skips), into its reserved pages where the reservation is of
    its pixels' size, else a file of its own; no packed copy of the whole image is made in the worker (`tobytes`,
    which `np.asarray` calls, is not); where the file cannot be made, the caller pipes the pixels. Broken: an offset
    off by the header (the pixels shifted), a reservation of another size kept (a padded file), or the image
    packed whole first."""
    from PIL import Image

    from vitserve.encoder.preprocess import PreprocessConfig, load_for_device
    from vitserve.service.decoding.decode import decode_and_resize

    pixels = np.random.default_rng(4).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    for name, nbytes in (("reserved", pixels.nbytes), ("other", pixels.nbytes * 2), ("none", None)):
        path = str(tmp_path / name)
        spooled = spool.put_image(path, image, None if nbytes is None else spool.reserve(path, nbytes))
        assert spooled is not None and spooled.shape == pixels.shape
        assert os.path.getsize(path) == spooled.offset + pixels.nbytes and open(path, "rb").read(2) == b"P6"
        assert np.array_equal(spooled.read(), pixels) and images_in(tmp_path) == []
    assert spool.put_image(str(tmp_path / "missing" / "x"), image) is None
    with pytest.raises(ValueError, match="RGB image, not L"):  # (a grey one would be written as P5, a third the size)
        spool.put_image(str(tmp_path / "grey"), image.convert("L"))
    photo = png(640, 480, 2, "JPEG")
    packed = []
    real = Image.Image.tobytes
    monkeypatch.setattr(Image.Image, "tobytes", lambda self, *a, **k: packed.append(self.size) or real(self, *a, **k))
    decoded = decode_and_resize(photo, False, 10**8, PreprocessConfig(), str(tmp_path / "photo"), full_size=True)
    assert packed == [] and isinstance(decoded.image, spool.Spooled)
    assert np.array_equal(decoded.image.read(), load_for_device(photo, False))


@pytest.mark.slow
def test_spool_of_a_killed_server_is_removed_by_the_next(tmp_path):
    """A server killed with SIGKILL leaves its spool files; the next server on the directory removes them, never a
    live server's."""
    code = (
        "import sys, time; from vitserve.service.decoding import spool; p = spool.spool_prefix(sys.argv[1]); "
        "open(p + '7', 'wb').write(b'x' * 10); print(p, flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline().strip()
        ours = spool.spool_prefix(str(tmp_path))  # sweeps: the other server is alive, its files stay
        assert os.path.exists(theirs + "7") and os.path.exists(theirs + "lock") and os.path.exists(ours + "lock")
    finally:
        other.kill()
        other.wait()
    again = spool.spool_prefix(str(tmp_path))  # the next server: the killed one's files go, ours (alive) stay
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p + "lock") for p in (ours, again))
    spool.clear(ours)
    spool.clear(again)
    assert list(tmp_path.iterdir()) == []


def test_decode_workers_hand_pixels_over_through_the_spool(encoders, tmp_path):
    """With processes, decoded images stay in spool files until they are run, or dropped: the pixels equal the
    pipe's, and nothing stays behind when a request fails on a sibling image, is cancelled while decoding, or
    leaves the queue."""
    enc = encoders["tiny-qwen2.5-vl"]
    images = [b64(x) for x in IMAGES]

    async def scenario(spool_dir):
        engine = Engine(Settings.of(model=enc.name, decode_workers=2, spool_dir=spool_dir), encoders=enc)
        await engine.start()
        decoder, cfg = engine.decoder, engine.model.preprocess_config
        settled = lambda: images_in(spool_dir) == []  # noqa: E731  (decode jobs nobody waits for finish later)
        try:
            out = await decoder.decode(images, cfg)
            pixels = spool.pixels([image for image, _ in out])
            if spool_dir == "none":
                return pixels, [grid for _, grid in out], (await engine.server_stats())["spool"]
            assert all(isinstance(image, spool.Spooled) for image, _ in out) and images_in(spool_dir) == []
            with pytest.raises(InputRejected):  # a bad sibling: the good ones' files go
                await decoder.decode([*images, b64(b"not an image")], cfg)
            await until(settled, what="the spool emptied")
            submitted = decoder.pool.submitted
            task = asyncio.ensure_future(decoder.decode(images, cfg))  # cancelled while decoding
            await until(lambda: decoder.pool.submitted == submitted + len(images), what="every job submitted")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(settled, what="the spool emptied")
            gone = asyncio.get_running_loop().create_future()  # left while queued (the batch waits 5 ms)
            items = [WorkItem(image, grid, gone, cancelled=True) for image, grid in await decoder.decode(images, cfg)]
            engine.backend.queue.put(items)
            await until(settled, what="the spool emptied")
            return pixels, [grid for _, grid in out], (await engine.server_stats())["spool"]
        finally:
            await engine.stop()

    spooled, grids_a, where = asyncio.run(scenario(str(tmp_path)))
    piped, grids_b, nowhere = asyncio.run(scenario("none"))
    assert where == str(tmp_path) and nowhere is None and grids_a == grids_b
    for a, b in zip(spooled, piped):
        assert np.array_equal(a, b)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_dead_decode_worker_fails_no_request(encoders, tmp_path):
    """A worker that dies (a decoder crash, the OOM killer) fails only the image it was decoding, which is tried
    again on another; the worker is replaced, every request in flight is answered correctly, and nothing is left in
    the spool."""
    enc = encoders["tiny-qwen2.5-vl"]
    images = [b64(x) for x in IMAGES]
    big = b64(png(3000, 3000))  # decodes long enough to be caught at it

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=2, spool_dir=str(tmp_path)), encoders=enc)
        await engine.start()
        decoder, cfg = engine.decoder, engine.model.preprocess_config
        try:
            want = await decoder.decode([*images, big], cfg)
            tasks = [asyncio.ensure_future(decoder.decode([[*images, big][i % 4]], cfg)) for i in range(12)]
            busy = []

            def on_big():
                busy[:] = [p for p, size in decoder.pool.workers() if size and size > 100_000]
                return busy

            await until(on_big, what="a worker busy with the big image")
            os.kill(busy[0].pid, signal.SIGKILL)
            got = await asyncio.gather(*tasks)
            read = [(spool.pixels([image])[0], grid) for image, grid in [*want, *(g[0] for g in got)]]
            left = images_in(tmp_path)
            return (
                read[: len(want)],
                read[len(want) :],
                decoder.pool.replaced,
                (await engine.server_stats())["decode_workers_replaced"],
                left,
            )
        finally:
            await engine.stop()

    want, got, replaced, reported, left = asyncio.run(scenario())
    assert replaced == reported == 1 and left == []
    for i, (image, grid) in enumerate(got):
        assert grid == want[i % 4][1] and np.array_equal(image, want[i % 4][0])


def test_decode_pool_worker_death_and_errors():
    """The pool on its own: results in order of submission per job, exceptions back to their job, a job that kills
    its worker fails alone (WorkerDied) while the other jobs finish, and closing fails what still waits."""

    async def scenario():
        pool = DecodePool(2)
        await pool.start()
        try:
            ok = pool.submit(bytes.upper, b"abc")
            bad = pool.submit(int, b"x")
            dies = pool.submit(eval, b"__import__('os')._exit(3)")
            after = [pool.submit(bytes.center, b"a", i) for i in range(6)]
            assert await ok == b"ABC"
            with pytest.raises(ValueError):
                await bad
            with pytest.raises(WorkerDied, match="exit code 3"):
                await dies
            assert [await f for f in after] == [b"a".center(i) for i in range(6)]
            await until(lambda: len(pool.workers()) == 2 and pool.idle == 2, what="the dead worker replaced")
            assert pool.replaced == 1
            cancelled = pool.submit(bytes.upper, b"x" * 10**6)
            cancelled.cancel()
            assert await pool.submit(bytes.upper, b"y" * 10**6) == b"Y" * 10**6  # a megabyte each way
            processes = [p for p, _ in pool.workers()]
        finally:
            await pool.close()
        late = pool.submit(bytes.upper, b"x")
        with pytest.raises(PoolUnavailable, match="closed"):
            await late
        return processes

    assert all(not p.is_alive() for p in asyncio.run(scenario()))


async def cannot_start():
    """In place of DecodePool.start_worker: the system out of processes."""
    raise OSError("fork: Resource temporarily unavailable")


def test_decode_pool_that_cannot_replace_its_last_worker_fails_what_waits():
    """When no worker is left and none can be started (the system out of processes or memory), what waits and what
    comes after fails with PoolUnavailable at once, instead of waiting forever, and the owner is told."""

    async def scenario():
        told = []
        pool = DecodePool(2, on_broken=told.append)
        await pool.start()
        pool.start_worker, pool.respawn_delays = cannot_start, (0.01, 0.01)
        try:
            busy = [pool.submit(eval, b"__import__('time').sleep(30)") for _ in range(2)]
            await until(lambda: pool.idle == 0, what="both workers holding a job")
            waiting = pool.submit(bytes.upper, b"abc")
            for process, _ in pool.workers():
                os.kill(process.pid, signal.SIGKILL)
            for job in busy:
                with pytest.raises(WorkerDied):
                    await asyncio.wait_for(job, 20)
            with pytest.raises(PoolUnavailable, match="none could be started"):
                await asyncio.wait_for(waiting, 20)
            with pytest.raises(PoolUnavailable, match="none could be started"):
                await pool.submit(bytes.upper, b"abc")
            return told, pool.replaced
        finally:
            await pool.close()

    told, replaced = asyncio.run(scenario())
    assert replaced == 2 and len(told) == 1 and "Resource temporarily unavailable" in told[0]


def test_decode_pool_tries_again_to_replace_a_worker():
    """A replacement that fails to start once (the system briefly out of processes) is tried again: the pool gets
    back to its size and serves, instead of shrinking for good."""

    async def scenario():
        pool = DecodePool(1)
        await pool.start()
        start, failures = pool.start_worker, []

        async def fails_once():
            if not failures:
                failures.append(True)
                raise OSError("fork: Resource temporarily unavailable")
            await start()

        pool.start_worker, pool.respawn_delays = fails_once, (0.01,)
        try:
            [(dead, _)] = pool.workers()
            os.kill(dead.pid, signal.SIGKILL)
            await until(lambda: [p.pid for p, _ in pool.workers()] not in ([], [dead.pid]), what="a new worker")
            return await pool.submit(bytes.upper, b"abc"), len(pool.workers()), pool.broken, failures
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (b"ABC", 1, None, [True])


def test_engine_without_decode_workers_fails_and_answers_503(encoders):
    """The engine's side of a broken decode pool: the server reports failed (the CLI then exits for a restart) and a
    request is answered 503 decode_unavailable, not a 400 that blames the image."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=1), encoders=enc)
        await engine.start()
        try:
            pool = engine.decoder.pool
            pool.start_worker, pool.respawn_delays = cannot_start, (0.01,)
            [(process, _)] = pool.workers()
            os.kill(process.pid, signal.SIGKILL)
            await until(lambda: engine.state is State.FAILED, what="the engine to fail")
            with pytest.raises(Unavailable) as error:
                await engine.decoder.decode([IMAGES[0]], engine.model.preprocess_config)
            return engine.error, ServiceError.of(error.value)
        finally:
            await engine.stop()

    reason, error = asyncio.run(scenario())
    assert "no decode worker is left" in reason
    assert error.status == 503 and error.code == "decode_unavailable"


def test_decode_workers_import_no_torch(encoders):
    """What a decode worker runs lives away from the engine and torch (150 MB and a second or two per worker)."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=1), encoders=enc)
        await engine.start()
        try:
            [(image, _)] = await engine.decoder.decode([IMAGES[0]], engine.model.preprocess_config)
            imported = await engine.decoder.pool.submit(
                eval,
                b"'torch' in __import__('sys').modules"
                b" or 'vitserve.service.pipeline.engine' in __import__('sys').modules",
            )
            return spool.pixels([image])[0], imported
        finally:
            await engine.stop()

    image, imported = asyncio.run(scenario())
    assert image.ndim == 3 and not imported


def test_the_decode_queue_is_round_robin_by_request():
    from vitserve.service.decoding.decode_pool import FairQueue

    q = FairQueue()
    for job in ("a1", "a2", "a3"):
        q.append("A", job)
    q.append("B", "b1")
    q.append("C", "c1")
    q.append("A", "a4")
    assert len(q) == 6 and [q.popleft() for _ in range(6)] == ["a1", "b1", "c1", "a2", "a3", "a4"]


def test_the_decode_budget_queues_what_does_not_fit_and_lets_small_images_pass():
    from vitserve.service.decoding.budget import MemoryBudget

    async def scenario():
        budget = MemoryBudget(100, patience=0.2)
        order = []

        async def take(name, cost, hold):
            share = await budget.acquire(cost)
            order.append(name)
            await asyncio.sleep(hold)
            budget.release(share)

        first = asyncio.ensure_future(take("first 60", 60, 0.05))
        await asyncio.sleep(0)
        big = asyncio.ensure_future(take("big 60", 60, 0))  # does not fit beside the first: waits
        small = asyncio.ensure_future(take("small 30", 30, 0))  # fits: goes ahead of the big one
        huge = asyncio.ensure_future(take("huge 500", 500, 0))  # more than the whole budget: takes all of it, alone
        await asyncio.gather(first, big, small, huge)
        assert budget.used == 0
        cancelled = asyncio.ensure_future(budget.acquire(10))
        budget.used = 100
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        budget.used = 0
        # one that has waited past its patience: nobody goes ahead of it any more
        budget.used = 50
        waiting = asyncio.ensure_future(budget.acquire(60))
        await asyncio.sleep(0.3)
        late = asyncio.ensure_future(budget.acquire(10))
        await asyncio.sleep(0)
        budget.release(0)  # a release re-checks the waiters: the patient one does not fit yet, so `late` waits
        assert not late.done()
        budget.release(50)
        await asyncio.wait_for(asyncio.gather(waiting, late), 1)
        return order

    assert asyncio.run(scenario()) == ["first 60", "small 30", "big 60", "huge 500"]


def test_the_decode_budget_is_shared_by_request_not_by_arrival():
    """A request with many images that each take the whole budget (progressive JPEGs) takes one share per turn:
    another request's image waits for one of them, not for all, even once every waiter is past its patience."""
    from vitserve.service.decoding.budget import MemoryBudget

    async def scenario():
        budget = MemoryBudget(100, patience=0)
        heavy, light, order, held = object(), object(), [], []

        async def take(name, cost, owner):
            held.append(await budget.acquire(cost, owner))
            order.append(name)

        await take("heavy 0", 100, heavy)
        waiting = [asyncio.ensure_future(take(f"heavy {i}", 100, heavy)) for i in range(1, 5)]
        await asyncio.sleep(0)
        waiting.append(asyncio.ensure_future(take("light", 10, light)))
        await asyncio.sleep(0.01)  # every waiter past its patience
        while len(order) < 6:  # each decode, done in the order they started, gives its share back
            budget.release(held.pop(0))
            await asyncio.sleep(0)
        await asyncio.gather(*waiting)
        budget.release(held.pop(0))
        assert budget.used == 0 and not held
        return order

    assert asyncio.run(scenario()) == ["heavy 0", "heavy 1", "light", "heavy 2", "heavy 3", "heavy 4"]


def test_the_decoder_takes_decode_memory_in_the_requests_turn(encoders):
    """With room for one image's decode at a time, a request sent while another's five images wait for that room
    decodes after one of them, not after all five: the decoder takes each image's share in its request's turn."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(
            Settings.of(model=enc.name, decode_workers=1, decode_processes=False, decode_memory=1), encoders=enc
        )
        await engine.start()
        decoder, cfg = engine.decoder, engine.model.preprocess_config
        budget = decoder.budget
        budget.patience = 0  # every waiter past its patience at once: where arrival order was the rule
        decoded = lambda: engine.metrics.registry.get_sample_value("vitserve_decode_seconds_count")  # noqa: E731
        try:
            room = await budget.acquire(1)  # taken, as by an image being decoded
            heavy = asyncio.ensure_future(decoder.decode([b64(png(64, 64, seed)) for seed in range(5)], cfg))
            await until(lambda: budget.waiting == 5, 10, "the five images waiting")
            light = asyncio.ensure_future(decoder.decode([b64(png(48, 48, 9))], cfg))
            await until(lambda: budget.waiting == 6, 10, "the other request's image waiting")
            budget.release(room)
            await light
            # the heavy request's first image, this one, and at most its next, which may end as this one returns
            assert decoded() <= 3
            await heavy
            assert decoded() == 6
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_decode_memory_is_estimated_from_the_header_alone():
    import io as _io

    from PIL import Image

    from vitserve.encoder.headers import probe
    from vitserve.service.decoding.decoder import head

    def encoded(mode, fmt, size=(6000, 4000), **kw):
        buf = _io.BytesIO()
        Image.new(mode, size).save(buf, fmt, **kw)
        return buf.getvalue()

    for data, mode in (
        (encoded("RGBA", "WEBP", lossless=True), "RGBA"),
        (encoded("RGB", "WEBP", quality=50), "RGB"),
        (encoded("RGB", "PNG"), "RGB"),
        (encoded("L", "JPEG"), "L"),
    ):
        header = probe(head(b64(data)))  # from the first 64 KB of its base64 text
        assert (header.width, header.height, header.mode) == (6000, 4000, mode)
    opaque, clear = probe(encoded("RGB", "PNG")), probe(encoded("RGBA", "PNG"))
    assert opaque.decode_bytes == 6000 * 4000 * 12 and clear.decode_bytes == 6000 * 4000 * 20


def test_decode_pool_kills_what_runs_too_long_or_for_nobody_and_makes_payloads_late():
    """Issue 25: a job past the pool's timeout fails with JobTimedOut (its worker killed and replaced, `on_lost`
    told); a running job whose caller is gone is killed after the grace (without it, the worker would sleep on); a
    waiting job holds no bytes: its payload is made when a worker takes it."""
    import time

    from vitserve.service.decoding.decode_pool import JobTimedOut

    async def scenario():
        pool, lost, made = DecodePool(1, timeout=0.5), [], []
        await pool.start()
        try:
            slow = pool.submit(eval, b"__import__('time').sleep(30)", on_lost=lambda: lost.append("slow"))
            queued = pool.submit(bytes.upper, lambda: made.append(1) or b"abc")
            await until(lambda: pool.idle == 0, what="the worker busy")
            assert made == []  # waiting: only the function that makes its bytes
            start = time.monotonic()
            with pytest.raises(JobTimedOut, match="ran past 0.5 s"):
                await slow
            assert time.monotonic() - start < 5
            await until(lambda: lost == ["slow"], what="on_lost told")  # once its socket reads the end
            assert await queued == b"ABC" and made == [1] and pool.replaced == 1
        finally:
            await pool.close()
        pool = DecodePool(1, grace=0.2)  # no timeout: only the grace stops it
        await pool.start()
        try:
            gone = pool.submit(eval, b"__import__('time').sleep(30)")
            await until(lambda: pool.idle == 0, what="the worker busy")
            [(process, _)] = pool.workers()
            gone.cancel()
            await until(lambda: not process.is_alive(), timeout=5, what="the worker killed")
            assert await pool.submit(bytes.upper, b"x") == b"X" and pool.replaced == 1
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_only_the_image_bytes_go_to_a_worker(encoders, monkeypatch):
    """Issue 25: a 16x16 PNG followed by a megabyte of junk (as bytes, as base64): the worker is sent the PNG (its
    base64 up to IEND), not the junk; an image whose end is past the probe's bytes is cut by the worker's walk."""
    from corpus import encode as encode_image
    from corpus import photo

    from vitserve.service.decoding import decode_pool

    enc, sent = encoders["tiny-qwen2.5-vl"], []
    send = decode_pool._Link.send
    monkeypatch.setattr(
        decode_pool._Link, "send", lambda link, call, payload: (sent.append(len(payload)), send(link, call, payload))
    )
    small = encode_image(photo(16, 16, 60), "PNG")
    icc = encode_image(photo(40, 30, 61), "JPEG", icc_profile=bytes(100_000))  # its header past the first 64 KB

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=1, spool_dir="none"), encoders=enc)
        await engine.start()
        cfg = engine.model.preprocess_config
        try:
            out = await engine.decoder.decode([small + bytes(2**20), b64(small + bytes(2**20)), small], cfg)
            sent_small = list(sent)
            [(far, _)] = await engine.decoder.decode([icc + bytes(2**20)], cfg)
            return [image for image, _ in out], sent_small, far, engine.decoder.pool.submitted, engine.decoder.full_size
        finally:
            await engine.stop()

    (junked, junked64, plain), sent_small, far, submitted, full_size = asyncio.run(scenario())
    assert sent_small == [len(small), -(-len(small) // 3) * 4, len(small)]
    assert np.array_equal(junked, plain) and np.array_equal(junked64, plain)
    assert submitted == 5  # 3 decodes, then a header read off the loop and its decode
    from vitserve.encoder.preprocess import PreprocessConfig, load_image, resize_rgb

    whole = load_image(icc)  # on a GPU the devices resize (--image-resize auto): the worker's image is full size
    assert np.array_equal(far, np.asarray(whole) if full_size else resize_rgb(whole, PreprocessConfig()))


def test_a_decode_thread_past_the_timeout_gives_413_at_once(encoders):
    """Issue 25: with threads (`--decode-processes false`) nothing can be killed, but the request gets its 413
    decode_timeout at the limit instead of waiting for the image (a 4000² JPEG of 60 scans: ~1.5 s)."""
    import time

    from corpus import progressive_jpeg

    enc, bomb = encoders["tiny-qwen2.5-vl"], progressive_jpeg(4000, 60)

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_processes=False, decode_timeout=0.2), encoders=enc)
        await engine.start()
        try:
            start = time.monotonic()
            with pytest.raises(Exception) as error:
                await engine.decoder.decode([bomb], engine.model.preprocess_config)
            return ServiceError.of(error.value), time.monotonic() - start
        finally:
            await engine.stop()

    error, seconds = asyncio.run(scenario())
    assert error.status == 413 and error.code == "decode_timeout" and error.message.startswith("input[0]: ")
    assert seconds < 1.2


@pytest.mark.parametrize(
    "item,text",
    [
        ("a photo of a cat", True),
        ("a photo of a cat!", True),
        ("一只猫的照片", True),
        (b"Dear team,\nhere it is.", True),
        (base64.b64encode(b"plain words in a text file, base64 as a data URI").decode(), False),  # a file
        (base64.b64encode(np.random.default_rng(0).bytes(900)).decode(), False),
        ("aGVsbG8gd29ybGQ", False),
        (IMAGES[0], False),
        (b"%PDF-1.7\n1 0 obj <</Type /Catalog>> endobj\n", False),
        ("", False),
    ],
)
def test_text_is_told_apart_from_images_and_base64(item, text):
    from vitserve.service.decoding.decoder import looks_like_text

    assert looks_like_text(MediaBytes(item) if isinstance(item, str) else item) is text


def test_text_sent_as_an_image_is_a_400_that_says_so(encoders):
    """Issue 16: words where an image goes were "not a recognized image format (9 bytes of data)"."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=1), encoders=enc)
        await engine.start()
        errors = []
        try:
            for item in (MediaBytes("a photo of a cat"), MediaBytes("a photo of a cat?"), b"some notes I wrote\n"):
                with pytest.raises(InputRejected) as error:
                    await engine.decoder.decode([item], engine.model.preprocess_config)
                errors.append(error.value)
            with pytest.raises(InputRejected) as error:  # a file sent as base64 is told as what it is
                await engine.decoder.decode([b64(b"plain words in a file")], engine.model.preprocess_config)
            return errors, error.value
        finally:
            await engine.stop()

    errors, junk = asyncio.run(scenario())
    for error in errors:
        assert error.code == "text_input" and "encodes images" in error.message and "not text" in error.message
        assert error.message.startswith("input[0]: ") and error.param == "input[0]"
    assert junk.code == "undecodable_image"


@pytest.mark.parametrize("stage", ["decode", "header"])
def test_a_request_fails_at_its_first_bad_image_without_waiting_for_the_others(encoders, monkeypatch, stage):
    """Issue 33: an image that fails (a truncated PNG: its decode fails; or one over the pixel limit, its header read
    from its first bytes) fails its request at once, while another image of it is still being decoded (or its header
    read by a decode worker): that one is held until the test ends, and the request's error comes first."""
    import threading

    from corpus import bomb_png, photo
    from corpus import encode as encode_image

    from vitserve.service.decoding import decoder as decoder_module

    enc, release, held = encoders["tiny-qwen2.5-vl"], threading.Event(), threading.Event()
    slow = encode_image(photo(40, 30, 62), "JPEG", icc_profile=bytes(100_000))  # its header past the first 64 KB
    bad = png(64, 64, 63)[:-200] if stage == "decode" else bomb_png()
    target = "decode_and_resize" if stage == "decode" else "read_header"
    real = getattr(decoder_module, target)

    def holding(data, *args, **kwargs):
        if bytes(data[: len(slow)]) == slow:
            held.set()
            release.wait(30)
        elif stage == "decode":  # the bad image fails while the slow one is being decoded, however threads start
            held.wait(10)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(decoder_module, target, holding)

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_processes=False, decode_workers=2), encoders=enc)
        await engine.start()
        used = []

        async def decode():  # the budget as decode() returns: its dropped decodes have given theirs back
            try:
                await engine.decoder.decode([slow, bad], engine.model.preprocess_config)
            finally:
                used.append(engine.decoder.budget.used)

        try:
            with pytest.raises(Exception) as error:
                await asyncio.wait_for(decode(), 10)
            return error.value, held.is_set(), used[0]
        finally:
            release.set()
            await engine.stop()

    error, slow_started, budget_left = asyncio.run(scenario())
    assert not isinstance(error, asyncio.TimeoutError), "the request waited for its other image"
    error = ServiceError.of(error)
    assert error.param == "input[1]" and error.status == (400 if stage == "decode" else 413), error.message
    assert slow_started or stage == "header"
    assert budget_left == 0


def test_a_video_whose_worker_dies_is_tried_again_then_refused_as_the_videos_fault(encoders, tmp_path):
    """A decode worker that dies under a video (the OOM killer, a crash) costs the video one more try, on another
    worker: the request is answered. A video under which two die is a 400 `undecodable_video` that says the video
    crashed the decoder (it was told `undecodable_image`, "the image crashed the decoder")."""
    pytest.importorskip("av")
    from videos import make_video

    enc = encoders["tiny-qwen3-vl"]
    clip = make_video(240, 30, 640, 480)  # decodes long enough to be caught at it

    async def scenario(kills: int):
        engine = Engine(Settings.of(model=enc.name, decode_workers=2, spool_dir=str(tmp_path)), encoders=enc)
        await engine.start()
        decoder = engine.decoder
        try:
            task = asyncio.ensure_future(decoder.decode_videos([clip], engine.video_config(num_frames=4)))
            for _ in range(kills):
                busy = []

                def on_video():  # the worker decoding it (not the one reading its header first)
                    busy[:] = [
                        link.process
                        for link in decoder.pool._links
                        if link.job is not None and b"decode_video" in link.job.call
                    ]
                    return busy

                await until(on_video, what="a worker decoding the video")
                os.kill(busy[0].pid, signal.SIGKILL)
                await until(lambda: not busy[0].is_alive(), what="the worker gone")
            try:
                return await task, decoder.pool.replaced
            except InputRejected as e:
                return e, decoder.pool.replaced
        finally:
            await engine.stop()

    (video,), replaced = asyncio.run(scenario(1))
    assert replaced == 1 and video[1] == (2, *video[1][1:])  # 4 frames: 2 slices
    error, replaced = asyncio.run(scenario(2))
    assert isinstance(error, InputRejected) and replaced == 2
    assert (error.code, error.param) == ("undecodable_video", "videos[0]") and "video crashed" in error.message


def test_images_are_resized_where_image_resize_says_with_the_same_answer(encoders):
    """--image-resize device: the decode workers hand each image on full size, its grid the size the device resizes
    it to (with Pillow's arithmetic, encoder.pixels); worker: PIL resizes it in the worker. The answers are the same
    values either way, and the library's. Among the images, one whose height shrinks by more than twice its width
    grows, which the installed Pillow resizes rows first."""
    from vitserve.encoder.preprocess import target_size

    enc = encoders["tiny-qwen3-vl"]
    images = [png(250, 335, 4), png(97, 61, 5), png(64, 64, 6), *IMAGES]
    sizes = [Image.open(io.BytesIO(x)).size for x in images]

    async def scenario(resize):
        engine = Engine(Settings.of(model=enc.name, decode_workers=2, image_resize=resize), encoders=enc)
        await engine.start()
        try:
            assert engine.decoder.full_size is (resize == "device")
            cfg = engine.model.preprocess_config
            decoded = await engine.decoder.decode([b64(x) for x in images], cfg)
            pixels = spool.pixels([image for image, _ in decoded])
            encoded = await engine.encode([b64(x) for x in images])
            return pixels, [grid for _, grid in decoded], [o.tokens for o in encoded.outputs]
        finally:
            await engine.stop()

    full, grids, on_device = asyncio.run(scenario("device"))
    resized, grids_worker, in_worker = asyncio.run(scenario("worker"))
    p = enc.preprocess_config.patch_size
    assert [a.shape[:2] for a in full] == [(h, w) for w, h in sizes]  # full size
    assert [a.shape[:2] for a in resized] == [target_size(a, enc.preprocess_config) for a in full]
    assert grids == grids_worker == [(1, a.shape[0] // p, a.shape[1] // p) for a in resized]
    library = enc.encode(images)
    for a, b, c in zip(on_device, in_worker, library):
        assert torch.equal(a, b)
        assert torch.allclose(a, c.embeddings, rtol=1e-5, atol=1e-6)


HEAP_PROBE = """
import json, resource
from PIL import Image
from vitserve.service.ground import heap

def faults(fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def image():  # a decoded image's 32 MB (Pillow keeps RGB as 4 bytes a pixel): written whole, then freed
    Image.new("RGB", (4096, 2048), (1, 2, 3))

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()

image()
default = faults(image)
kept_took = heap.keep_freed_memory()
image()
kept = faults(image)
held = rss()
heap.release_freed_memory()
print(json.dumps(dict(default=default, kept_took=kept_took, kept=kept, held=held, released=rss())))
"""


def test_a_decoding_process_reuses_freed_buffers_and_gives_them_back_when_asked():
    """ground.heap: with keep_freed_memory an image-sized buffer freed and allocated again is not faulted in again
    (glibc would unmap it and map fresh pages: each faulted in and cleared), and release_freed_memory gives the
    heap's free memory back to the system. In a fresh interpreter: the heap's thresholds are the process's."""
    from vitserve.service.ground import heap

    if heap._glibc() is None:
        pytest.skip("the C library is not glibc: nothing to tune")
    probe = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    r = __import__("json").loads(probe.stdout)
    pages = 32 * 2**20 // os.sysconf("SC_PAGESIZE")
    if r["default"] < pages // 4:  # (transparent huge pages for every mapping: few faults either way)
        pytest.skip(f"a fresh 32 MB buffer took only {r['default']} page faults here")
    assert r["kept_took"] and r["kept"] < pages // 20, r
    assert r["held"] - r["released"] >= 16 * 2**20, r  # the kept buffer went back


def test_a_decode_worker_gives_its_freed_memory_back_once_idle(monkeypatch):
    """decode.serve_jobs: the worker keeps its heap's freed memory while jobs come, and releases it once `idle`
    seconds pass without one: once per quiet spell (not again and again while it waits), and again after the next
    job."""
    import pickle
    import socket
    import threading
    import time

    from vitserve.service.decoding import decode
    from vitserve.service.decoding.decode_protocol import ANSWER_HEADER, Call, job_frames, read_exactly

    calls: list[str] = []
    monkeypatch.setattr(decode, "leave_to_owner", lambda: None)  # (signals: the main thread's)
    monkeypatch.setattr(decode, "keep_freed_memory", lambda: calls.append("keep"))
    monkeypatch.setattr(decode, "release_freed_memory", lambda: calls.append("release"))
    ours, theirs = socket.socketpair()
    worker = threading.Thread(target=decode.serve_jobs, args=(theirs, 0.3), daemon=True)
    worker.start()

    def job(payload: bytes) -> int:
        ours.sendall(b"".join(job_frames(pickle.dumps(Call(len, ())), payload)))
        size = ANSWER_HEADER.unpack(read_exactly(ours, ANSWER_HEADER.size))[0]
        return pickle.loads(read_exactly(ours, size)).value

    assert job(b"abc") == 3 and job(b"abcd") == 4
    assert calls == ["keep"]  # jobs back to back: nothing released
    wait_until(lambda: calls == ["keep", "release"], 5, "the idle worker's release")
    time.sleep(1.0)
    assert calls == ["keep", "release"]  # idle on: nothing released again
    assert job(b"ab") == 2
    wait_until(lambda: calls == ["keep", "release", "release"], 5, "the release after the next job")
    ours.close()
    worker.join(5)
    assert not worker.is_alive()
    theirs.close()
