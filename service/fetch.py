"""Image URL fetching, only when the operator enables it: http(s) only, public addresses only (every resolved
address checked, every redirect re-checked), size and time limits."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import httpx

from .errors import ServiceError
from .settings import Settings

MAX_REDIRECTS = 3


async def _check_public(url: str, param: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServiceError(400, f"{param}: only http(s) URLs with a host can be fetched", "invalid_url", param)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        raise ServiceError(400, f"{param}: cannot resolve {parts.hostname!r}", "invalid_url", param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global or address.is_multicast:
            raise ServiceError(400, f"{param}: {parts.hostname!r} resolves to a non-public address", "forbidden_url",
                               param)


async def fetch_url(client: httpx.AsyncClient, url: str, index: int, settings: Settings) -> bytes:
    param = f"input[{index}]"
    for _ in range(MAX_REDIRECTS + 1):
        await _check_public(url, param)
        try:
            async with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise ServiceError(400, f"{param}: fetching the URL gave HTTP {response.status_code}",
                                       "url_fetch_failed", param)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > settings.payload_limit:
                        raise ServiceError(413, f"{param}: image at URL is over {settings.payload_limit} bytes",
                                           "image_too_large", param)
                return bytes(data)
        except httpx.HTTPError as e:
            raise ServiceError(400, f"{param}: fetching the URL failed: {type(e).__name__}", "url_fetch_failed",
                               param) from None
    raise ServiceError(400, f"{param}: more than {MAX_REDIRECTS} redirects", "url_fetch_failed", param)


async def fetch_all(images: list, settings: Settings) -> list:
    """Replace each URL in `images` by its bytes (other items unchanged)."""
    urls = [(i, x) for i, x in enumerate(images) if type(x) is str]  # Base64Data is a str too, not a URL
    if not urls:
        return images
    async with httpx.AsyncClient(follow_redirects=False, timeout=settings.url_fetch_timeout) as client:
        fetched = await asyncio.gather(*(fetch_url(client, url, i, settings) for i, url in urls))
    images = list(images)
    for (i, _), data in zip(urls, fetched):
        images[i] = data
    return images
