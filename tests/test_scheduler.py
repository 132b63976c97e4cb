"""The image queue (batches in arrival order up to a patch budget) and the pipeline that keeps a device fed."""

from __future__ import annotations

import threading
import time

import numpy as np

from vitserve.service.metrics import Metrics
from vitserve.service.scheduler import ImageQueue, WorkItem
from vitserve.service.worker import STOP, pipeline


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
    assert q.take(100, 2.0, block=True) == [e, f]  # waited for f within the batch wait...
    assert time.monotonic() - start < 1.5  # ...and no longer: with f the batch is full
    g, h = items(10, 10)
    h.cancelled = True  # its client went away
    q.put([g, h])
    assert q.take(100, 0.0, block=False) == [g] and len(q) == 0
    assert q.metrics.registry.get_sample_value("vitserve_dropped_images_total") == 1
    threading.Timer(0.05, q.close).start()
    assert q.take(100, 0.0, block=True) is None  # a taker blocked on an empty queue wakes at close


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
    assert events[:5] == [("take", "a", True), ("launch", "a"), ("take", "b", False), ("launch", "b"),
                          ("finish", "a")]  # two in flight: the oldest is finished before taking more
    assert ("take", None, False) in events and ("failed", "fail") in events
