"""Where this tier may push features (docs/sglang.md, Access): a receiver's `host:port` parsed, its host resolved and
checked against the allowed networks (`ReceiverNetworks`, `--sglang-receivers`), and the ZMQ endpoint of the address
checked. SGLang sends no API key, so these checks are the tier's fence."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket

from ..ground.errors import InputRejected, NotAllowed
from ..pipeline.fetch import embedded_ipv4

RESOLVE_TIMEOUT = 5.0  # seconds to resolve a receiver's host name
HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
# where features are never pushed unless --sglang-receivers lists the network: this host (loopback, unspecified),
# link-local (cloud metadata services at 169.254.169.254 and fd00:ec2::254 among them), multicast and broadcast,
# and the metadata addresses outside those ranges (Alibaba's, Azure's wire server)
REFUSED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "0.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "255.255.255.255/32",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "::1/128",
        "::/128",
        "fe80::/10",
        "ff00::/8",
        "fd00:ec2::254/128",
    )
)
ADDRESS = re.compile(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<p6>\d{1,5})|(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{1,5})")


def endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of a TCP address (an IPv6 host bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def receiver_address(address: str) -> tuple[str, int]:
    """The host and port of a registration's `host:port`; anything else is a 400."""
    match = ADDRESS.fullmatch(address)
    port = int(match["p6"] or match["port"]) if match else 0
    if not match or not 0 < port < 65536:
        raise InputRejected(
            f"receive_url must be host:port ([ipv6]:port), got {address[:100]!r}", "invalid_receive_url", "receive_url"
        )
    return match["v6"] or match["host"], port


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal as an address (an IPv4-mapped IPv6 one as its IPv4 address); None for a host name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


class ReceiverNetworks:
    """Where this server pushes features to (`--sglang-receivers`): an address in a listed network; with none
    listed, any address but this host's, link-local (cloud metadata) and multicast ones (`REFUSED`). A host name is
    resolved here (off the event loop, within `RESOLVE_TIMEOUT`), every address it has is checked, and the socket
    connects to the address checked (never to the name, which could resolve elsewhere the next time)."""

    def __init__(self, networks: str | None = None):
        self.networks = [
            ipaddress.ip_network(n.strip(), strict=False) for n in (networks or "").split(",") if n.strip()
        ]

    def allowed(self, ip) -> bool:
        """`ip` may be pushed to; an IPv6 address that carries an IPv4 one (6to4, Teredo, NAT64) only where both may."""
        inner = embedded_ipv4(ip) if ip.version == 6 else None
        for address in (ip, *filter(None, [inner])):
            if self.networks:
                if not any(address.version == n.version and address in n for n in self.networks):
                    return False
            elif any(address.version == n.version and address in n for n in REFUSED):
                return False
        return True

    async def resolve(self, host: str, param: str) -> str:
        """The address to push to for `host` (a 400 for a host that is no host name or cannot be resolved, a 403
        for one outside the allowed networks); `param` names the field in errors."""
        ip = address_of(host)
        addresses = [ip] if ip is not None else await self._addresses(host, param)
        refused = next((a for a in addresses if not self.allowed(a)), None)
        if refused is not None:
            named = f"{refused} is" if ip is not None else f"{host!r} resolves to {refused},"
            raise NotAllowed(
                f"{param}: {named} outside the networks features are pushed to (--sglang-receivers)",
                "receiver_not_allowed",
                param,
            )
        return str(addresses[0])

    @staticmethod
    async def _addresses(host: str, param: str) -> list:
        """The addresses a host name resolves to (a 400 for no host name, or one that does not resolve)."""
        if not HOST_NAME.fullmatch(host):
            raise InputRejected(f"{param}: not a host name or IP address: {host[:100]!r}", "invalid_receiver", param)
        try:
            found = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError):
            raise InputRejected(f"{param}: cannot resolve {host!r}", "invalid_receiver", param) from None
        addresses = [address_of(str(entry[4][0]).split("%")[0]) for entry in found]  # (a str: typed str | int)
        if not addresses:
            raise InputRejected(f"{param}: {host!r} has no address", "invalid_receiver", param)
        return addresses
