"""Opt-in URL fetching against SSRF, with a fake resolver and a mock transport (no network): every resolved address
checked, the connection pinned to the checked address, redirects re-checked, size and redirect count bounded."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx
import pytest

from vitserve.service.api.http_errors import ServiceError
from vitserve.service.ground.errors import EngineError
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline import fetch

DNS = {
    "images.example": ["93.184.216.34"],
    "cdn.example": ["151.101.1.1"],
    "internal.example": ["10.1.2.3"],
    "mixed.example": ["93.184.216.34", "127.0.0.1"],
    "metadata.example": ["169.254.169.254"],
    "v6.example": ["2606:4700::6810:84e5"],
}


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch):
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        try:  # literal addresses resolve to themselves, as with the real resolver
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (str(ipaddress.ip_address(host)), port))]
        except ValueError:
            pass
        if host not in DNS:
            raise socket.gaierror("unknown host")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in DNS[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def respond(body: bytes, status: int = 200, **headers) -> httpx.Response:
    """A response whose body streams, as from the network."""
    return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


def run(urls, handler, **settings):
    seen = []

    def record(request: httpx.Request):
        seen.append(request)
        return handler(request)

    result = asyncio.run(
        fetch.fetch_all(urls, Settings.of(model="m", **settings), transport=httpx.MockTransport(record))
    )
    return result, seen


def test_connection_is_pinned_to_the_checked_address():
    data, seen = run(["https://images.example/cat.png?x=1"], lambda r: respond(b"PNGDATA"))
    assert data == [b"PNGDATA"]
    (request,) = seen
    assert request.url.host == "93.184.216.34" and request.url.path == "/cat.png" and request.url.query == b"x=1"
    assert request.headers["host"] == "images.example" and request.extensions["sni_hostname"] == "images.example"
    data, seen = run(["http://v6.example:8080/a.jpg"], lambda r: respond(b"J"))
    assert seen[0].url.host == "2606:4700::6810:84e5" and seen[0].url.port == 8080


@pytest.mark.parametrize(
    "url",
    [
        "http://internal.example/x.png",
        "http://mixed.example/x.png",
        "http://metadata.example/latest/meta-data",
        "http://127.0.0.1/x",
        "http://[::1]/x",
    ],
)
def test_non_public_addresses_are_refused_before_connecting(url):
    with pytest.raises(EngineError) as e:
        run([url], lambda r: pytest.fail("must not connect"))
    assert ServiceError.of(e.value).status == 400 and e.value.code == "forbidden_url"


def test_redirects_are_rechecked_and_bounded():
    def to_internal(request):
        return httpx.Response(302, headers={"location": "http://internal.example/secret"})

    with pytest.raises(EngineError) as e:
        run(["http://images.example/a"], to_internal)
    assert e.value.code == "forbidden_url"

    hops = []

    def to_cdn(request):
        hops.append(request.headers["host"])
        if request.headers["host"] == "images.example":
            return httpx.Response(301, headers={"location": "https://cdn.example/a.png"})
        return respond(b"OK")

    data, _ = run(["http://images.example/a"], to_cdn)
    assert data == [b"OK"] and hops == ["images.example", "cdn.example"]

    with pytest.raises(EngineError) as e:
        run(["http://images.example/a"], lambda r: httpx.Response(302, headers={"location": "/again"}))
    assert "redirects" in e.value.message


def test_size_status_and_scheme_limits():
    with pytest.raises(EngineError) as e:
        run(["http://images.example/big"], lambda r: respond(b"x" * 5000), payload_limit=4096)
    assert ServiceError.of(e.value).status == 413
    with pytest.raises(EngineError) as e:
        run(["http://images.example/missing"], lambda r: httpx.Response(404))
    assert ServiceError.of(e.value).status == 400 and "HTTP 404" in e.value.message
    with pytest.raises(EngineError) as e:
        run(["http://nowhere.example/x"], lambda r: httpx.Response(200))
    assert e.value.code == "invalid_url"


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com:99999/",
        "http://example.com:-1/",
        "http://[::1/",
        "http://exa\r\nmple.com/",
        "http://images.example/a b",
        "ftp://images.example/",
    ],
)
def test_malformed_urls_are_400_invalid_url(url):
    with pytest.raises(EngineError) as e:
        run([url], lambda r: pytest.fail("must not connect"))
    assert ServiceError.of(e.value).status == 400 and e.value.code == "invalid_url"
    assert len(e.value.message) < 400


@pytest.mark.parametrize(
    "address",
    [
        "::ffff:10.0.0.1",
        "2002:0a00:0001::1",
        "2002:7f00:0001::1",
        "2001:0000:4136:e378:8000:63bf:f5ff:fffe",
        "64:ff9b::a00:1",
    ],
)
def test_private_ipv4_inside_ipv6_is_refused(address, monkeypatch):
    """IPv4-mapped, 6to4, Teredo and NAT64 addresses that carry a private (or loopback) IPv4 address."""
    monkeypatch.setitem(DNS, "sneaky.example", [address])
    with pytest.raises(EngineError) as e:
        run(["http://sneaky.example/x.png"], lambda r: pytest.fail("must not connect"))
    assert e.value.code == "forbidden_url"


def test_compressed_bodies_are_inflated_with_a_cap_and_bytes_are_bounded():
    import gzip

    small = gzip.compress(b"PNG" * 100)
    data, _ = run(["http://images.example/a"], lambda r: respond(small, **{"content-encoding": "gzip"}))
    assert data == [b"PNG" * 100]
    bomb = gzip.compress(b"\0" * (64 * 2**20))  # 64 KB that inflate to 64 MiB
    with pytest.raises(EngineError) as e:
        run(["http://images.example/a"], lambda r: respond(bomb, **{"content-encoding": "gzip"}), payload_limit=2**20)
    assert ServiceError.of(e.value).status == 413
    # one request's URLs together: 3 x 400 bytes against a 1000-byte limit
    with pytest.raises(EngineError) as e:
        run(["http://images.example/a"] * 3, lambda r: respond(b"x" * 400), payload_limit=1000)
    assert ServiceError.of(e.value).status == 413


def test_the_servers_fetch_budget_is_429_beyond_and_given_back():
    budget = fetch.FetchBudget(1000)
    settings = Settings.of(model="m", allow_url_fetch=True)

    def fetch_with(body):
        transport = httpx.MockTransport(lambda r: respond(body))
        return asyncio.run(fetch.fetch_all(["http://images.example/a"], settings, budget=budget, transport=transport))

    assert fetch_with(b"x" * 900) == [b"x" * 900] and budget.used == 0
    budget.used = 500  # another request's fetch in flight
    with pytest.raises(EngineError) as e:
        fetch_with(b"x" * 900)
    assert ServiceError.of(e.value).status == 429 and budget.used == 500


def test_one_deadline_for_the_whole_fetch():
    """A host that answers byte by byte, each in time for a per-read timeout, is cut off at the overall deadline."""

    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self):
            for _ in range(100):
                await asyncio.sleep(0.05)
                yield b"x"

    import time

    start = time.monotonic()
    with pytest.raises(EngineError) as e:
        run(["http://images.example/slow"], lambda r: httpx.Response(200, stream=Trickle()), url_fetch_timeout=0.5)
    assert e.value.code == "url_fetch_failed" and time.monotonic() - start < 3
