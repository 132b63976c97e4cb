"""Image URL fetching, only when the operator enables it (SSRF is the risk): http(s) only; the host is resolved, every
address checked (no private, loopback, link-local, multicast or reserved address, cloud metadata endpoints and
private IPv4 addresses inside IPv6 forms included), and the connection made to the checked address itself, so a
second DNS answer cannot swap it (DNS rebinding); each redirect is checked the same way.

Bounded in time and bytes: one deadline for the whole fetch (redirects, headers, body); compressed bodies are
inflated off the event loop with a cap; a request's fetches take at most `--payload-limit` bytes together, and
every fetch in flight on the server at most `--url-fetch-memory` (429 beyond).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import zlib
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from ..ground.errors import InputRejected, InputTooLarge, QueueFull, clip
from ..ground.settings import Settings

MAX_REDIRECTS = 3


class FetchBudget:
    """Bytes held by fetches in flight across the server (`--url-fetch-memory`)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0


class Allowance:
    """One request's fetches: at most `room` bytes together, each byte also held against the server's budget until
    the request's fetching is done (`release`)."""

    def __init__(self, budget: FetchBudget, room: int):
        self.budget, self.room, self.held = budget, room, 0

    def take(self, n: int, param: str) -> None:
        if n > self.room:
            raise InputTooLarge(
                f"{param}: the images at this request's URLs are over its limit of bytes", "image_too_large", param
            )
        if self.budget.used + n > self.budget.limit:
            raise QueueFull(f"{param}: the server is fetching too many images at once; retry shortly")
        self.room -= n
        self.held += n
        self.budget.used += n

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo client, NAT64), if any."""
    if address.ipv4_mapped:
        return address.ipv4_mapped
    if address.sixtofour:
        return address.sixtofour
    if address.teredo:
        return address.teredo[1]
    if address in ipaddress.ip_network("64:ff9b::/96"):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    inner = embedded_ipv4(address) if address.version == 6 else None
    return all(a.is_global and not a.is_multicast and not a.is_reserved for a in (address, *filter(None, [inner])))


async def resolve_public(url: str, param: str) -> tuple[str, str, int]:
    """(host, a checked public address to connect to, port) for an http(s) URL, or InputRejected."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        if parts.scheme not in ("http", "https") or not host or any(c in url for c in "\r\n\t "):
            raise ValueError("scheme or host")
    except ValueError:  # a bad port (99999, -1), an unclosed [ or a control character in the host
        raise InputRejected(
            f"{param}: not a valid http(s) URL with a host: {clip(url)!r}", "invalid_url", param
        ) from None
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InputRejected(f"{param}: cannot resolve {clip(host)!r}", "invalid_url", param) from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]  # (a str: typed str | int)
    if not addresses or not all(public(a) for a in addresses):
        raise InputRejected(f"{param}: {clip(host)!r} resolves to a non-public address", "forbidden_url", param)
    return host, str(addresses[0]), port


def pinned(url: str, address: str) -> str:
    """The URL with its host replaced by the checked address (the Host header and TLS name keep the real host)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


def inflate(data: bytes, encoding: str, limit: int) -> bytes | None:
    """A gzip or deflate body inflated to at most `limit` bytes (None: it inflates to more); runs in a thread."""
    decoder = zlib.decompressobj(47 if encoding == "gzip" else zlib.MAX_WBITS)  # 47: gzip or zlib header
    out = decoder.decompress(data, limit + 1)
    if len(out) > limit:
        return None
    out += decoder.flush()
    return out if len(out) <= limit else None


async def fetch_url(client: httpx.AsyncClient, url: str, param: str, allowance: Allowance) -> bytes:
    """The image at `url`, within the request's allowance."""
    for _ in range(MAX_REDIRECTS + 1):
        host, address, _ = await resolve_public(url, param)
        request = client.build_request(
            "GET",
            pinned(url, address),
            extensions={"sni_hostname": host},
            headers={"Host": host, "Accept-Encoding": "gzip, deflate, identity"},
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise InputRejected(
                f"{param}: fetching the URL failed: {type(e).__name__}", "url_fetch_failed", param
            ) from None
        try:
            if response.is_redirect and "location" in response.headers:
                url = urljoin(url, response.headers["location"])
                continue
            if response.status_code != 200:
                raise InputRejected(
                    f"{param}: fetching the URL gave HTTP {response.status_code}", "url_fetch_failed", param
                )
            data = bytearray()
            async for chunk in response.aiter_raw():  # as sent: inflated below, capped, off the event loop
                allowance.take(len(chunk), param)
                data += chunk
            encoding = response.headers.get("content-encoding", "identity").lower()
            if encoding in ("gzip", "deflate"):
                inflated = await asyncio.get_running_loop().run_in_executor(
                    None, inflate, bytes(data), encoding, allowance.room
                )
                if inflated is None:
                    raise InputTooLarge(
                        f"{param}: the image at the URL inflates to over this request's limit of bytes",
                        "image_too_large",
                        param,
                    )
                allowance.take(len(inflated), param)
                return inflated
            if encoding != "identity":
                raise InputRejected(
                    f"{param}: the URL answered in an unsupported encoding ({clip(encoding)})",
                    "url_fetch_failed",
                    param,
                )
            return bytes(data)
        except httpx.HTTPError as e:
            raise InputRejected(
                f"{param}: fetching the URL failed: {type(e).__name__}", "url_fetch_failed", param
            ) from None
        finally:
            await response.aclose()
    raise InputRejected(f"{param}: more than {MAX_REDIRECTS} redirects", "url_fetch_failed", param)


async def fetch_all(
    images: list,
    settings: Settings,
    field: str = "input",
    budget: FetchBudget | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list:
    """Replace each URL in `images` by its bytes (other items unchanged); errors name the image `field[i]`. The
    whole of it takes at most `--url-fetch-timeout` seconds, and at most `--payload-limit` bytes."""
    urls = [(i, x) for i, x in enumerate(images) if isinstance(x, str)]  # the rest: MediaBytes or raw bytes
    if not urls:
        return images
    allowance = Allowance(budget or FetchBudget(settings.limits.url_fetch_memory), settings.limits.payload_limit)
    try:
        async with httpx.AsyncClient(
            follow_redirects=False, timeout=settings.server.url_fetch_timeout, transport=transport, trust_env=False
        ) as client:
            fetched = await asyncio.wait_for(
                asyncio.gather(*(fetch_url(client, url, f"{field}[{i}]", allowance) for i, url in urls)),
                settings.server.url_fetch_timeout,
            )
    except asyncio.TimeoutError:
        raise InputRejected(
            f"{field}: fetching the image URLs took over {settings.server.url_fetch_timeout:g} s",
            "url_fetch_failed",
            field,
        ) from None
    finally:
        allowance.release()  # the bytes now belong to the request, bounded by --payload-limit
    images = list(images)
    for (i, _), data in zip(urls, fetched):
        images[i] = data
    return images
