"""The engine's backend without a model: the one batch accounting (answers per origin, the cache kept under each
key), the cache's single flight and its claims by owner, and the one /stats builder in both topologies."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import until

from vitserve.encoder.features import Features
from vitserve.encoder.preprocess import ImageError
from vitserve.service.devices.scheduler import WorkItem
from vitserve.service.ground.errors import InferenceFailed, InputRejected
from vitserve.service.ground.metrics import Metrics
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.backend import LocalBackend
from vitserve.service.pipeline.cache import WAIT, Cache
from vitserve.service.pipeline.lifecycle import Lifecycle, State
from vitserve.service.pipeline.stats import server_stats


class Origin:
    def __init__(self):
        self.deliveries = []

    def deliver(self, results):
        self.deliveries.append(results)


def backend() -> LocalBackend:
    metrics = Metrics()
    local = LocalBackend(
        Settings.of(model="tiny-qwen3-vl", load_format="dummy", cache_bytes=10**6),
        metrics,
        Lifecycle(metrics),
        ["cpu"],
        "float32",
        None,
        process_each=False,
    )
    local.model = SimpleNamespace(config=SimpleNamespace(merge_unit=4, family="qwen3_vl"))
    return local


def item(origin, key=None) -> WorkItem:
    return WorkItem(None, (1, 2, 2), None, key=key, origin=origin)


def test_a_batch_is_one_delivery_per_origin_and_its_answers_are_cached():
    local, a, b = backend(), Origin(), Origin()
    waited = []
    assert local.cache.lookup([b"k"], a, lambda i: waited.append) == [None]  # claimed by a
    assert local.cache.lookup([b"k"], b, lambda i: waited.append) == [WAIT]
    batch = [item(a, b"k"), item(b), item(a)]
    refused = ImageError("not an image")
    local.done(SimpleNamespace(name="cpu"), batch, [(torch.ones(3), []), (torch.zeros(2), []), refused], None, 0.5)
    assert [len(d) for d in a.deliveries] == [2] and [len(d) for d in b.deliveries] == [1]
    first, third = a.deliveries[0]
    assert first.keep and torch.equal(first.output.tokens, torch.ones(3)) and first.inference_s == 0.5
    assert isinstance(third.error, InputRejected) and third.error.message == "input[0]: not an image"
    assert len(waited) == 1 and isinstance(waited[0], Features) and local.cache.get(b"k") is waited[0]
    assert (
        local.batch_sizes == {3: 1}
        and local.metrics.registry.get_sample_value("vitserve_images_total", {"device": "cpu"}) == 3
    )


def test_a_failed_batch_lets_its_claims_go_and_a_lost_device_fails_the_server():
    local, origin, waited = backend(), Origin(), []
    local.cache.lookup([b"k"], origin, lambda i: waited.append)
    local.cache.lookup([b"k"], origin, lambda i: waited.append)
    error = InferenceFailed("the device is gone", "device_lost")
    local.done(SimpleNamespace(name="cpu"), [item(origin, b"k")], None, error, 0.0)
    assert waited == [None] and local.cache.get(b"k") is None and origin.deliveries[0][0].error is error
    assert local.life.state is State.FAILED and local.batch_sizes == {}


def test_claims_are_let_go_by_owner():
    cache, calls = Cache(10**6, Metrics()), []
    cache.lookup([b"a", b"b"], "front 0", lambda i: calls.append)
    cache.lookup([b"c"], "front 1", lambda i: calls.append)
    cache.lookup([b"a", b"c"], "front 1", lambda i: lambda entry: calls.append((i, entry)))
    cache.release(owner="front 0")  # front end 0 died: its claims end, their waiters compute them
    assert calls == [(0, None)] and sorted(cache.owners) == [b"c"]
    assert cache.lookup([b"a"], "front 1", lambda i: calls.append) == [None]  # free to claim again


def front(in_flight: int, hits: int) -> dict:
    return {
        "recent": {"request": [0.1]},
        "requests_in_flight": in_flight,
        "tiers": {"sglang": {"sockets": 1}},
        "decode_workers": 2,
        "decode_workers_replaced": 0,
        "counters": {"hits": hits, "misses": 1},
        "memory": {use: {"limit_bytes": 10, "bytes": 1} for use in ("bodies", "decode")},
        "videos": {"available": True, "reason": None},
    }


def test_stats_of_one_process_and_of_several_front_ends():
    local = backend()
    settings = local.settings
    one = server_stats(settings, local.stats(recent=False), [front(1, 2)])
    assert "api_servers" not in one and "api_servers" not in one["batching"]
    assert one["requests_in_flight"] == 1 and one["cache"]["hits"] == 2 and one["batching"]["decode_workers"] == 2
    assert one["tiers"] == {"sglang": {"sockets": 1}} and one["latency"]["request"]["count"] == 1
    several = server_stats(
        settings, local.stats(recent=True), [front(1, 2), front(3, 4)], api_servers=2, api_servers_replaced=1
    )
    assert (several["api_servers"], several["api_servers_replaced"], several["batching"]["api_servers"]) == (2, 1, 2)
    assert (
        several["requests_in_flight"] == 4
        and several["cache"]["hits"] == 6
        and several["tiers"]["sglang"] == {"sockets": 2}
    )
    assert several["memory"]["bodies"] == {"limit_bytes": 20, "bytes": 2}
    assert set(one) | {"api_servers", "api_servers_replaced"} == set(several)


def test_every_front_end_hears_which_entries_the_core_evicted(tmp_path):
    """A front end keeps the mappings of the entries it knows (HubBackend.known): without the core's Evicted record
    each would hold an evicted entry's pages for as long as it remembers the key."""
    from vitserve.service.entry.core import Core, Link
    from vitserve.service.pipeline.core_link import Evicted

    core = Core(Settings.of(model="tiny-qwen3-vl", load_format="dummy", device="cpu", spool_dir=str(tmp_path)), 2)
    heard: list[list] = [[], []]
    core.links = [Link(i, SimpleNamespace(send=heard[i].append), None) for i in range(2)]
    cache, size = core.backend.cache, Features(torch.zeros(1024), [], [1, 2, 2]).nbytes
    cache.limit = 2 * size
    for key in (b"a", b"b", b"c"):
        cache.put(key, Features(torch.zeros(1024), [], [1, 2, 2]))
    assert heard == [[Evicted([b"a"])], [Evicted([b"a"])]]


def test_a_front_end_hears_a_lookups_answer_before_a_settle_of_it(tmp_path):
    """The core answers a lookup and tells its waits' settles over one pipe: a key settled by another thread while
    the lookup is answered reaches the front end after the lookup's answer (which registers the wait), else the
    front end would drop the settle and its request would wait for ever."""
    import threading

    from vitserve.service.entry.core import Core, Link
    from vitserve.service.pipeline.core_link import Lookup

    core = Core(Settings.of(model="tiny-qwen3-vl", load_format="dummy", device="cpu", spool_dir=str(tmp_path)), 2)
    sent, settlers = [], []
    link = Link(0, SimpleNamespace(send=lambda message: sent.append(type(message).__name__)), None)
    cache = core.backend.cache
    cache.lookup([b"k"], Link(1, SimpleNamespace(send=lambda message: None), None), lambda i: None)  # front end 1's
    looked_up = cache.lookup

    def lookup_then_settled(keys, owner, waiter):
        answers = looked_up(keys, owner, waiter)
        settlers.append(threading.Thread(target=cache.settle, args=(b"k", None)))
        settlers[0].start()
        settlers[0].join(0.5)  # front end 1's claim ends now, on another thread
        return answers

    cache.lookup = lookup_then_settled
    core._handle(link, Lookup(7, [b"k"]))
    settlers[0].join(5)
    assert sent == ["Looked", "Settled"]


def test_a_front_end_answers_an_entry_it_knows_from_its_mapping_until_the_core_says_it_is_evicted(
    tmp_path, monkeypatch
):
    """A front end's lookups (HubBackend) against a scripted core on a real pipe. The first lookup of a key goes to
    the core; a hit is remembered with its mapping, so the next lookup of that key is answered from it with no
    Lookup sent (the core is told with Touched) and no file opened (it is answered with the file removed); once the
    core says it evicted the entry (Evicted), the mapping goes and the key is asked for again. Missing any of these
    would send a Lookup for every hit, map the file for every hit, or keep an evicted entry's pages for good."""
    import asyncio
    import multiprocessing

    from vitserve.service.decoding import spool
    from vitserve.service.devices.device_protocol import Output, packed
    from vitserve.service.pipeline.core_link import Evicted, Looked, Lookup, Touched
    from vitserve.service.pipeline.hub import HubBackend

    tokens = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    record = packed((tokens, [tokens + 1]), str(tmp_path / "entry"))
    assert isinstance(record, Output) and record.path is not None
    record.grid = (1, 2, 6)
    core_end, front_end = multiprocessing.Pipe()
    metrics = Metrics()
    hub = HubBackend(front_end, Lifecycle(metrics), ["cpu"], lambda kind: {}, metrics)

    async def next_record():  # (in a thread: the event loop goes on sending)
        assert await asyncio.to_thread(core_end.poll, 5), "the front end sent nothing"
        return core_end.recv()

    async def main():
        await hub.start()
        assert type(await next_record()).__name__ == "Up"
        first = asyncio.ensure_future(hub.lookup([b"k", b"other"]))
        asked = await next_record()
        assert isinstance(asked, Lookup) and asked.keys == [b"k", b"other"]
        core_end.send(Looked(asked.id, [record, None]))
        hit, miss = await first
        assert torch.equal(hit.tokens, tokens) and torch.equal(hit.deepstack[0], tokens + 1) and miss is None
        again = await hub.lookup([b"k"])  # known: no Lookup, a Touched
        assert torch.equal(again[0].tokens, tokens) and again[0].grid == [1, 2, 6]
        told = await next_record()
        assert isinstance(told, Touched) and told.keys == [b"k"] and not core_end.poll(0.2)
        spool.remove(record.path)  # the core evicts it: its file goes first, then the front ends hear of it
        mapped = await hub.lookup([b"k"])
        assert torch.equal(mapped[0].tokens, tokens) and isinstance(await next_record(), Touched)
        released: list = []
        monkeypatch.setattr(spool, "release", lambda arrays: released.extend(arrays))
        core_end.send(Evicted([b"k"]))
        await until(lambda: b"k" not in hub.known, 5, "the evicted entry forgotten")
        (dropped,) = released  # its mapping let go on the release thread (its pages freed there, not on the loop)
        assert torch.equal(dropped.tokens, tokens)
        gone = asyncio.ensure_future(hub.lookup([b"k"]))
        asked = await next_record()
        assert isinstance(asked, Lookup) and asked.keys == [b"k"]
        core_end.send(Looked(asked.id, [None]))
        assert await gone == [None] and b"k" not in hub.known

    asyncio.run(main())
    assert metrics.registry.get_sample_value("vitserve_cache_known_hits_total") == 2


def test_the_core_tells_every_other_front_end_of_the_entries_a_batch_stored(tmp_path):
    """A batch's stored entries go to each front end but the one whose request computed them (it has them in its
    answers), so that any front end answers their next hit without a Lookup."""
    from vitserve.service.devices.device_protocol import Output
    from vitserve.service.entry.core import Core, Link
    from vitserve.service.pipeline.backend import Result
    from vitserve.service.pipeline.core_link import Stored, StoredEntry

    core = Core(Settings.of(model="tiny-qwen3-vl", load_format="dummy", device="cpu", spool_dir=str(tmp_path)), 3)
    heard: list[list] = [[], [], []]
    core.links = [Link(i, SimpleNamespace(send=heard[i].append), None) for i in range(3)]
    assert core.backend.stored == core.stored
    a, b = Output([], (1, 2, 2), "a"), Output([], (1, 2, 2), "b")
    core.stored(
        [
            Result(WorkItem(None, (1, 2, 2), None, key=b"a", origin=core.links[0]), a, keep=True),
            Result(WorkItem(None, (1, 2, 2), None, key=b"b", origin=core.links[1]), b, keep=True),
        ]
    )
    told_a, told_b = StoredEntry(b"a", a), StoredEntry(b"b", b)
    assert heard == [[Stored([told_b])], [Stored([told_a])], [Stored([told_a, told_b])]]


def test_a_front_end_answers_an_entry_stored_for_another_from_its_file(tmp_path, monkeypatch):
    """An entry the core stored for another front end (`Stored`) is answered here from its file at its first hit,
    with no Lookup sent (the core is told with Touched), and known from then on; one whose file is gone by its hit
    (evicted meanwhile) is asked of the core; an evicted one (`Evicted`) is forgotten; the records kept are bounded
    (KNOWN_ENTRIES), the oldest going first."""
    import asyncio
    import multiprocessing

    from vitserve.service.devices.device_protocol import Output, packed
    from vitserve.service.pipeline import hub as hub_module
    from vitserve.service.pipeline.core_link import Evicted, Looked, Lookup, Stored, StoredEntry, Touched
    from vitserve.service.pipeline.hub import HubBackend

    def stored(*keys, record=None):
        return Stored([StoredEntry(key, record or records[key]) for key in keys])

    monkeypatch.setattr(hub_module, "KNOWN_ENTRIES", 3)
    tokens = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    records = {}
    for key in (b"k", b"gone", b"evicted", b"old", b"new"):
        records[key] = packed((tokens, [tokens + 1]), str(tmp_path / key.decode()))
        assert isinstance(records[key], Output) and records[key].path is not None
        records[key].grid = (1, 2, 6)
    (tmp_path / "gone").unlink()
    core_end, front_end = multiprocessing.Pipe()
    metrics = Metrics()
    hub = HubBackend(front_end, Lifecycle(metrics), ["cpu"], lambda kind: {}, metrics)

    async def next_record():
        assert await asyncio.to_thread(core_end.poll, 5), "the front end sent nothing"
        return core_end.recv()

    async def main():
        await hub.start()
        assert type(await next_record()).__name__ == "Up"
        core_end.send(stored(b"k", b"gone", b"evicted"))
        await until(lambda: len(hub.named) == 3, 5, "the stored records kept")
        (hit,) = await hub.lookup([b"k"])
        assert torch.equal(hit.tokens, tokens) and torch.equal(hit.deepstack[0], tokens + 1) and hit.grid == [1, 2, 6]
        told = await next_record()
        assert isinstance(told, Touched) and told.keys == [b"k"] and b"k" in hub.known and b"k" not in hub.named
        gone = asyncio.ensure_future(hub.lookup([b"gone"]))
        asked = await next_record()
        assert isinstance(asked, Lookup) and asked.keys == [b"gone"]
        core_end.send(Looked(asked.id, [None]))
        assert await gone == [None]
        core_end.send(Evicted([b"evicted"]))
        await until(lambda: b"evicted" not in hub.named, 5, "the evicted record forgotten")
        core_end.send(stored(b"old", b"new", b"k"))  # k: known already
        await until(lambda: b"new" in hub.named, 5, "the newer records kept")
        assert list(hub.named) == [b"old", b"new"]
        core_end.send(stored(b"a", b"b", record=records[b"k"]))
        await until(lambda: b"b" in hub.named, 5, "the newest records kept")
        assert list(hub.named) == [b"new", b"a", b"b"]  # three at most: the oldest went

    asyncio.run(main())
    assert metrics.registry.get_sample_value("vitserve_cache_known_hits_total") == 1
