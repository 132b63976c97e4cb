"""Opt-in URL fetching against SSRF, with a fake resolver and a mock transport (no network): every resolved address
checked, the connection pinned to the checked address, redirects re-checked, size and redirect count bounded."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx
import pytest

from vitserve.service import fetch
from vitserve.service.errors import EngineError, ServiceError
from vitserve.service.settings import Settings

DNS = {"images.example": ["93.184.216.34"], "cdn.example": ["151.101.1.1"], "internal.example": ["10.1.2.3"],
       "mixed.example": ["93.184.216.34", "127.0.0.1"], "metadata.example": ["169.254.169.254"],
       "v6.example": ["2606:4700::6810:84e5"]}


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch):
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        try:  # literal addresses resolve to themselves, as with the real resolver
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (str(ipaddress.ip_address(host)), port))]
        except ValueError:
            pass
        if host not in DNS:
            raise socket.gaierror("unknown host")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in DNS[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def run(urls, handler, **settings):
    seen = []

    def record(request: httpx.Request):
        seen.append(request)
        return handler(request)

    result = asyncio.run(fetch.fetch_all(urls, Settings(model="m", **settings), transport=httpx.MockTransport(record)))
    return result, seen


def test_connection_is_pinned_to_the_checked_address():
    data, seen = run(["https://images.example/cat.png?x=1"], lambda r: httpx.Response(200, content=b"PNGDATA"))
    assert data == [b"PNGDATA"]
    (request,) = seen
    assert request.url.host == "93.184.216.34" and request.url.path == "/cat.png" and request.url.query == b"x=1"
    assert request.headers["host"] == "images.example" and request.extensions["sni_hostname"] == "images.example"
    data, seen = run(["http://v6.example:8080/a.jpg"], lambda r: httpx.Response(200, content=b"J"))
    assert seen[0].url.host == "2606:4700::6810:84e5" and seen[0].url.port == 8080


@pytest.mark.parametrize("url", ["http://internal.example/x.png", "http://mixed.example/x.png",
                                 "http://metadata.example/latest/meta-data", "http://127.0.0.1/x", "http://[::1]/x"])
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
        return httpx.Response(200, content=b"OK")

    data, _ = run(["http://images.example/a"], to_cdn)
    assert data == [b"OK"] and hops == ["images.example", "cdn.example"]

    with pytest.raises(EngineError) as e:
        run(["http://images.example/a"], lambda r: httpx.Response(302, headers={"location": "/again"}))
    assert "redirects" in e.value.message


def test_size_status_and_scheme_limits():
    with pytest.raises(EngineError) as e:
        run(["http://images.example/big"], lambda r: httpx.Response(200, content=b"x" * 5000), payload_limit=4096)
    assert ServiceError.of(e.value).status == 413
    with pytest.raises(EngineError) as e:
        run(["http://images.example/missing"], lambda r: httpx.Response(404))
    assert ServiceError.of(e.value).status == 400 and "HTTP 404" in e.value.message
    with pytest.raises(EngineError) as e:
        run(["http://nowhere.example/x"], lambda r: httpx.Response(200))
    assert e.value.code == "invalid_url"
