"""The settings' groups, each a dataclass whose fields are flags and variables of their own names (flags.py), checked
on its own when made, before anything loads or binds, without torch: here the model, devices, server, batching and
logging groups, and what declares and checks a field; settings_media.py the others. Settings (settings.py) holds one
of each."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import ClassVar

from ...encoder.config import ATTENTION_BACKENDS, LOAD_FORMATS
from .machine import resolve_devices

LOG_LEVELS = ("debug", "info", "warning", "error")
# what --dtype and --preprocess take: encoder.vision_encoder.DTYPES's names and encoder.preprocess.PREPROCESS_MODES,
# repeated here (a test keeps them equal) so that reading the settings (and --help) imports no torch, numpy or PIL
DTYPE_NAMES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half")
PREPROCESS_MODES = ("exact", "fast")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def setting(
    default,
    help: str,
    encode: bool = False,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    size: bool = False,
):
    """A field; `encode`: `vitserve encode` reads it too (its other settings are the defaults). `choices` and
    `metavar` are what --help shows as the value (the checks are the group's); `size`: a byte count, written as
    bytes or with a unit (flags.parse_size)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "encode": encode,
            "aliases": aliases,
            "choices": choices,
            "metavar": metavar,
            "size": size,
        },
    )


def check(rules: list[tuple[object, str]]) -> None:
    """ValueError with the first rule's message whose condition is false."""
    for ok, message in rules:
        if not ok:
            raise ValueError(message)


def networks(value: str | None) -> bool:
    """Whether `value` is None or comma-separated IP networks (CIDR) or addresses."""
    try:
        return value is None or all(ipaddress.ip_network(n.strip(), strict=False) for n in value.split(","))
    except ValueError:
        return False


def one_of(name: str, value: str, allowed: tuple[str, ...], auto: bool = False) -> tuple[bool, str]:
    return (
        value in allowed or auto and value == "auto",
        f"--{name} must be {'auto or ' if auto else ''}one of {', '.join(allowed)}, got {value!r}",
    )


def positive(group, *names: str) -> list[tuple[bool, str]]:
    return [(getattr(group, n) > 0, f"--{n.replace('_', '-')} must be positive") for n in names]


@dataclass
class ModelSettings:
    TITLE: ClassVar[str] = "model"
    model: str = setting(  # required: None (not given) is refused by __post_init__
        None, "checkpoint dir, hub id (org/name), or built-in name", encode=True, metavar="MODEL"
    )
    load_format: str = setting(
        "auto", "dummy: seeded random weights (implied for the tiny-* built-ins)", encode=True, choices=LOAD_FORMATS
    )
    revision: str | None = setting(None, "hub revision", encode=True, metavar="REV")
    served_model_name: str | None = setting(None, "model id in the API (default: --model)", metavar="NAME")

    def __post_init__(self):
        check(
            [
                (bool(self.model), "--model (or VITSERVE_MODEL) is required"),
                one_of("load-format", self.load_format, LOAD_FORMATS),
            ]
        )

    @property
    def name(self) -> str:
        """The model's id in the API: --served-model-name, else --model."""
        return self.served_model_name or self.model


@dataclass
class DeviceSettings:
    TITLE: ClassVar[str] = "devices and kernels"
    device: str = setting(
        "auto", "auto (cuda:0 if available, else cpu), cpu or cuda[:i]", encode=True, metavar="{auto,cpu,cuda,cuda:N}"
    )
    devices: str | None = setting(
        None, "several devices, e.g. cuda:0,cuda:1 or all: one runner per device", metavar="LIST"
    )
    dtype: str = setting(
        "auto",
        "auto: bfloat16 on CUDA, float32 on the CPU (fp32, fp16, bf16 and half are aliases)",
        encode=True,
        choices=("auto", *DTYPE_NAMES),
    )
    attention_backend: str = setting(
        "auto",
        "attention kernel (auto: the fastest installed for the device; cudnn needs vitserve[cudnn], fa4 vitserve[fa4])",
        encode=True,
        choices=ATTENTION_BACKENDS,
    )
    gpu_memory_fraction: float = setting(0.0, "cap each GPU's memory to this fraction (0: no cap)", metavar="X")
    budgets: str | None = setting(
        None, "comma-separated CUDA graph budgets in patches (default: built-in)", encode=True, metavar="LIST"
    )
    device_processes: bool | None = setting(
        None,
        "serve each device from a process of its own, sharing no GIL with the HTTP server (default: on CUDA devices)",
    )

    def __post_init__(self):
        listed = self.listed()
        check(
            [
                one_of("dtype", self.dtype, DTYPE_NAMES, auto=True),
                (
                    self.device == "auto" or DEVICE.fullmatch(self.device),
                    f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
                ),
                (
                    listed is None or listed and all(DEVICE.fullmatch(d) for d in listed),
                    f"--devices must be all or a comma-separated list of cpu, cuda or cuda:N, got {self.devices!r}",
                ),
                one_of("attention-backend", self.attention_backend, ATTENTION_BACKENDS),
                (0 <= self.gpu_memory_fraction <= 1, "--gpu-memory-fraction must be in [0, 1]"),
            ]
        )
        self.budget_list()

    def listed(self) -> list[str] | None:
        """The devices `--devices` lists (None: not a list, but absent or `all`)."""
        if not self.devices or self.devices == "all":
            return None
        return [d.strip() for d in self.devices.split(",") if d.strip()]

    def asked(self) -> list[str]:
        """The devices named explicitly (--devices' list, else --device, `auto` included; none for `all`)."""
        return [self.device] if not self.devices else self.listed() or []

    def resolve(self) -> tuple[list[str], str]:
        """The devices to serve on and the dtype, on this machine (machine.resolve_devices)."""
        return resolve_devices(self.asked(), self.dtype)

    def budget_list(self) -> tuple[int, ...] | None:
        """`--budgets` as integers, each a positive multiple of the smallest frame (16 patches); None: built-in."""
        if not self.budgets:
            return None
        from ...encoder.packing import MIN_FRAME_PATCHES  # imports torch: only when there are budgets to check

        try:
            budgets = tuple(int(b) for b in self.budgets.split(",") if b.strip())
        except ValueError:
            budgets = ()
        if not budgets or any(b <= 0 or b % MIN_FRAME_PATCHES for b in budgets):
            raise ValueError(
                f"--budgets must be comma-separated positive multiples of {MIN_FRAME_PATCHES}, got {self.budgets!r}"
            )
        return budgets


@dataclass
class ServerSettings:
    TITLE: ClassVar[str] = "server"
    api_servers: int = setting(
        0,
        "HTTP front-end processes on the one port, feeding the same devices and cache "
        "(0: one per 4 CPUs on CUDA devices, 2 to 8; 1 on the CPU); the limits are split "
        "evenly among them",
        metavar="N",
    )
    host: str = setting("0.0.0.0", "bind address", metavar="HOST")
    port: int = setting(8000, "bind port")
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics); "
        "several keys comma-separated, one per client (see --cache-scope)",
        metavar="KEY",
    )
    allow_url_fetch: bool = setting(False, "accept http(s) image URLs (off: SSRF risk)")
    url_fetch_timeout: float = setting(10.0, "seconds per URL fetch", metavar="SECONDS")
    max_header_bytes: int = setting(
        64 * 2**10, "size of a request's line and headers (beyond, a 400 and the connection closed)", size=True
    )
    header_timeout: float = setting(
        10.0,
        "seconds to receive a request's headers, from its first byte (beyond, the connection is closed)",
        metavar="SECONDS",
    )
    body_timeout: float = setting(60.0, "seconds to receive a request's body (408 beyond)", metavar="SECONDS")
    max_connections: int = setting(
        1024,
        "open connections; beyond, the longest-idle close to make room (needs as "
        "many file descriptors: the soft limit is raised to fit)",
    )
    timeout_keep_alive: int = setting(
        75,
        "seconds an idle connection stays open; longer than clients' and proxies' "
        "own (httpx 5, aiohttp 15, load balancers 60), so they always close first",
        metavar="SECONDS",
    )

    def __post_init__(self):
        check(
            [
                *positive(
                    self,
                    "timeout_keep_alive",
                    "url_fetch_timeout",
                    "max_header_bytes",
                    "max_connections",
                    "header_timeout",
                    "body_timeout",
                ),
                (self.api_servers >= 0, "--api-servers must be >= 0"),
                (0 < self.port < 65536, "--port must be 1-65535"),
                (self.api_key is None or self.api_keys(), "--api-key must name at least one key"),
            ]
        )

    def api_keys(self) -> list[str]:
        """The keys `--api-key` names (comma-separated); none: no key is asked for."""
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]


@dataclass
class BatchingSettings:
    TITLE: ClassVar[str] = "batching"
    max_batch_tokens: int = setting(4096, "vision tokens (4 patches each) per GPU batch")
    max_batch_wait_ms: float = setting(
        5.0, "while every device is busy, how long a batch waits for more images", metavar="MS"
    )

    def __post_init__(self):
        check(
            [
                (self.max_batch_tokens > 0, "--max-batch-tokens must be positive"),
                (self.max_batch_wait_ms >= 0, "--max-batch-wait-ms must be >= 0"),
            ]
        )


@dataclass
class LogSettings:
    TITLE: ClassVar[str] = "logging"
    log_format: str = setting(
        "text", "text (a progress bar on a terminal) or json", encode=True, choices=("text", "json")
    )
    log_level: str = setting("info", "what is logged", encode=True, choices=LOG_LEVELS)

    def __post_init__(self):
        check(
            [
                (self.log_format in ("text", "json"), f"--log-format must be text or json, got {self.log_format!r}"),
                one_of("log-level", self.log_level, LOG_LEVELS),
            ]
        )
