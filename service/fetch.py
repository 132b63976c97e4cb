"""Image URL fetching, only when the operator enables it (SSRF is the risk): http(s) only; the host is resolved, every
address checked (no private, loopback, link-local, multicast or reserved address: cloud metadata endpoints
included), and the connection made to the checked address itself, so a second DNS answer cannot swap it (DNS
rebinding); each redirect is checked the same way; size and time are bounded."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from .errors import InputRejected, InputTooLarge
from .settings import Settings

MAX_REDIRECTS = 3


async def resolve_public(url: str, param: str) -> tuple[str, str]:
    """(host, a checked public address to connect to) for an http(s) URL, or InputRejected."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputRejected(f"{param}: only http(s) URLs with a host can be fetched", "invalid_url", param)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InputRejected(f"{param}: cannot resolve {parts.hostname!r}", "invalid_url", param) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses or any(not a.is_global or a.is_multicast or a.is_reserved for a in addresses):
        raise InputRejected(f"{param}: {parts.hostname!r} resolves to a non-public address", "forbidden_url", param)
    return parts.hostname, str(addresses[0])


def pinned(url: str, address: str) -> str:
    """The URL with its host replaced by the checked address (the Host header and TLS name keep the real host)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


async def fetch_url(client: httpx.AsyncClient, url: str, param: str, settings: Settings) -> bytes:
    deadline = time.monotonic() + settings.url_fetch_timeout
    for _ in range(MAX_REDIRECTS + 1):
        host, address = await resolve_public(url, param)
        request = client.build_request("GET", pinned(url, address), headers={"Host": host},
                                       extensions={"sni_hostname": host})
        try:
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise InputRejected(f"{param}: fetching the URL gave HTTP {response.status_code}",
                                       "url_fetch_failed", param)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > settings.payload_limit:
                        raise InputTooLarge(f"{param}: image at URL is over {settings.payload_limit} bytes",
                                           "image_too_large", param)
                    if time.monotonic() > deadline:
                        raise InputRejected(f"{param}: fetching the URL took over {settings.url_fetch_timeout} s",
                                           "url_fetch_failed", param)
                return bytes(data)
            finally:
                await response.aclose()
        except httpx.HTTPError as e:
            raise InputRejected(f"{param}: fetching the URL failed: {type(e).__name__}", "url_fetch_failed",
                               param) from None
    raise InputRejected(f"{param}: more than {MAX_REDIRECTS} redirects", "url_fetch_failed", param)


async def fetch_all(images: list, settings: Settings, field: str = "input",
                    transport: httpx.AsyncBaseTransport | None = None) -> list:
    """Replace each URL in `images` by its bytes (other items unchanged); errors name the image `field[i]`."""
    urls = [(i, x) for i, x in enumerate(images) if type(x) is str]  # Base64Data is a str too, not a URL
    if not urls:
        return images
    async with httpx.AsyncClient(follow_redirects=False, timeout=settings.url_fetch_timeout, transport=transport,
                                 trust_env=False) as client:
        fetched = await asyncio.gather(*(fetch_url(client, url, f"{field}[{i}]", settings) for i, url in urls))
    images = list(images)
    for (i, _), data in zip(urls, fetched):
        images[i] = data
    return images
