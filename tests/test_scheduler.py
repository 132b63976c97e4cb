"""The image queue (batches in arrival order up to a patch budget) and the pipeline that keeps a device fed."""

from __future__ import annotations

import threading
import time

import numpy as np

from vitserve.service.devices.scheduler import ImageQueue, WorkItem
from vitserve.service.devices.worker import STOP, pipeline
from vitserve.service.ground.metrics import Metrics


def items(*patches):
    return [WorkItem(np.zeros((1, 1, 3), np.uint8), (1, 1, n), None) for n in patches]


def test_image_queue_batches_in_arrival_order_up_to_the_budget():
    q = ImageQueue(Metrics())
    assert q.take(100, 0.0, block=False) == []
    a, b, c, d = items(40, 50, 30, 500)
    q.put([a, b, c, d])
    assert q.take(100, 1.0, block=False) == [a, b]  # c does not fit: it stays first, no waiting for more
    assert q.take(100, 0.0, block=False) == [c]
    assert q.take(100, 0.0, block=False) == [d]  # over the budget alone: a batch of its own
    e, f = items(10, 90)
    threading.Timer(0.05, q.put, ([f],)).start()
    start = time.monotonic()
    q.put([e])
    assert q.take(100, 2.0, block=False) == [e, f]  # a busy device waited for f within the batch window...
    assert time.monotonic() - start < 1.5  # ...and no longer: with f the batch is full
    g, h = items(10, 10)
    h.cancelled = True  # its client went away
    q.put([g, h])
    assert q.take(100, 0.0, block=False) == [g] and len(q) == 0
    assert q.metrics.registry.get_sample_value("vitserve_dropped_images_total") == 1
    threading.Timer(0.05, q.close).start()
    assert q.take(100, 0.0, block=True) is None  # a taker blocked on an empty queue wakes at close


def test_an_idle_device_launches_at_once_and_a_busy_one_batches():
    """Nothing in flight (block): the first image goes at once, whatever the window. Busy (not block): the window
    applies, unless another device is idle, which then gets the images."""
    q = ImageQueue(Metrics())
    a, b, e = items(10, 10, 10)
    threading.Timer(0.05, q.put, ([a],)).start()
    threading.Timer(0.4, q.put, ([e],)).start()
    start = time.monotonic()
    assert q.take(100, 5.0, block=True) == [a]  # idle: launched as soon as it arrived, not after the 5 s window
    assert time.monotonic() - start < 2.5
    q.put([b])
    assert q.take(20, 5.0, block=False) == [b, e]  # busy: b waited within the window for e (then full)
    c, d = items(10, 10)
    q.put([c])
    start = time.monotonic()
    assert q.take(100, 0.3, block=False) == [c]  # busy, no idle device, nothing more came: the whole window
    assert time.monotonic() - start >= 0.25
    idle: list = []
    taker = threading.Thread(target=lambda: idle.append(q.take(100, 5.0, block=True)))
    taker.start()
    while not q._idle:  # the other device is waiting with nothing in flight
        time.sleep(0.005)
    with q._ready:  # d arrives; the busy device looks first
        q.put([d])
        assert q.take(100, 5.0, block=False) == []  # it leaves d to the idle device...
        q._ready.notify_all()
    taker.join(2)
    assert idle == [[d]]  # ...which takes it at once


def test_batches_take_the_queued_groups_in_turn():
    """A long video's slices (one put) and a later request's images (another) share batches from the first one on:
    round-robin over the groups, each group's items in order; a dropped group's items leave the rotation."""
    q = ImageQueue(Metrics())
    video = [WorkItem(np.zeros((2, 28, 28, 3), np.uint8), (1, 2, 2), None, param=f"videos[0]#{i}") for i in range(6)]
    image = [WorkItem(np.zeros((28, 28, 3), np.uint8), (1, 2, 2), None, param=f"images[{i}]") for i in range(2)]
    late = [WorkItem(np.zeros((28, 28, 3), np.uint8), (1, 2, 2), None, param="input[0]")]
    q.put(video)
    q.put(image)
    assert [i.param for i in q.take(12, 0.0, block=False)] == ["videos[0]#0", "images[0]", "videos[0]#1"]
    q.put(late)
    q.drop(image[1:])
    assert [i.param for i in q.take(12, 0.0, block=False)] == ["videos[0]#2", "input[0]", "videos[0]#3"]
    assert len(q) == 2 and [i.param for i in q.take(100, 0.0, block=False)] == ["videos[0]#4", "videos[0]#5"]


def test_pipeline_keeps_depth_batches_in_flight_and_finishes_in_order():
    """Batch k+1 is launched before batch k is finished, never more than `depth` at once; a batch whose launch
    fails is skipped; `take` blocks only with nothing in flight; what is in flight at STOP is finished."""
    batches = iter(["a", "b", None, "fail", "c", "d", STOP])
    events, in_flight, worst = [], [0], [0]

    def take(block):
        batch = next(batches)
        events.append(("take", batch if batch is not STOP else "STOP", block))
        return batch

    def launch(batch):
        if batch == "fail":
            events.append(("failed", batch))
            return None
        in_flight[0] += 1
        worst[0] = max(worst[0], in_flight[0])
        events.append(("launch", batch))
        return batch.upper()

    def finish(batch, handle):
        assert handle == batch.upper()
        in_flight[0] -= 1
        events.append(("finish", batch))

    pipeline(take, launch, finish, depth=2)
    assert worst[0] == 2 and in_flight[0] == 0
    assert [e for e in events if e[0] == "finish"] == [("finish", x) for x in "abcd"]
    assert events[:5] == [
        ("take", "a", True),
        ("launch", "a"),
        ("take", "b", False),
        ("launch", "b"),
        ("finish", "a"),
    ]  # two in flight: the oldest is finished before taking more
    assert ("take", None, False) in events and ("failed", "fail") in events


def test_a_gone_clients_images_leave_the_queue_at_once():
    """Dropped when the client goes, not when a batch reaches them (behind a long batch, that could be seconds)."""
    q = ImageQueue(Metrics())
    a, b, c = items(10, 20, 30)
    q.put([a, b, c])
    q.drop([b, c])
    assert len(q) == 1 and q.metrics.registry.get_sample_value("vitserve_dropped_images_total") == 2
    assert q.metrics.registry.get_sample_value("vitserve_queue_depth") == 1
    assert q.take(100, 0.0, block=False) == [a]
    q.drop([a])  # already taken: it runs; nothing more is counted
    assert q.metrics.registry.get_sample_value("vitserve_dropped_images_total") == 2
