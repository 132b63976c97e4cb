"""Server settings: one dataclass; every field is a kebab-case flag and a VITSERVE_* environment variable."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from ..encoder.config import ATTENTION_BACKENDS, LOAD_FORMATS

ENV_PREFIX = "VITSERVE_"


@dataclass
class Settings:
    model: str | None = field(default=None, metadata={"help": "checkpoint dir, hub id, or built-in name (required)"})
    load_format: str = field(default="auto", metadata={"help": f"{', '.join(LOAD_FORMATS)} (dummy: seeded random weights)"})
    revision: str | None = field(default=None, metadata={"help": "hub revision"})
    device: str = field(default="auto", metadata={"help": "auto (cuda:0 if available, else cpu), cpu or cuda[:i]"})
    devices: str | None = field(default=None, metadata={"help": "several devices, e.g. cuda:0,cuda:1 or all: one runner per device"})
    dtype: str = field(default="auto", metadata={"help": "auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16"})
    attention_backend: str = field(default="auto", metadata={"help": f"attention kernel: {', '.join(ATTENTION_BACKENDS)} (auto: the fastest installed for the device; cudnn needs vitserve[cudnn])"})
    gpu_memory_fraction: float = field(default=0.0, metadata={"help": "cap each GPU's memory to this fraction (0: no cap)"})
    host: str = field(default="0.0.0.0", metadata={"help": "bind address"})
    port: int = field(default=8000, metadata={"help": "bind port"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id in the API (default: --model)"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics)"})
    max_batch_tokens: int = field(default=4096, metadata={"help": "vision tokens (4 patches each) per GPU batch"})
    max_batch_wait_ms: float = field(default=5.0, metadata={"help": "how long a batch waits for more images"})
    budgets: str | None = field(default=None, metadata={"help": "comma-separated CUDA graph budgets in patches (default: built-in)"})
    max_concurrent_requests: int = field(default=512, metadata={"help": "requests in flight before 429"})
    payload_limit: int = field(default=32 * 2**20, metadata={"help": "request body limit in bytes (413)"})
    max_image_pixels: int = field(default=64_000_000, metadata={"help": "decoded pixels per image (413; bomb guard)"})
    max_images_per_request: int = field(default=64, metadata={"help": "images per request (413)"})
    min_pixels: int | None = field(default=None, metadata={"help": "override the resize minimum (pixels)"})
    max_pixels: int | None = field(default=None, metadata={"help": "override the resize maximum (pixels)"})
    decode_workers: int = field(default=0, metadata={"help": "decode + resize workers (0: one per core)",
                                                     "aliases": ("preprocess_workers",)})
    decode_processes: bool = field(default=True, metadata={"help": "run them as processes (false: threads)",
                                                           "aliases": ("preprocess_processes",)})
    device_processes: bool | None = field(default=None, metadata={"help": "serve each device from a process of its own, sharing no GIL with the HTTP server (default: on CUDA devices)"})
    spool_dir: str | None = field(default=None, metadata={"help": "RAM-backed directory where decoded images cross from the decode processes (default: /dev/shm; none: through a pipe, slower)"})
    allow_url_fetch: bool = field(default=False, metadata={"help": "accept http(s) image URLs (off: SSRF risk)"})
    url_fetch_timeout: float = field(default=10.0, metadata={"help": "seconds per URL fetch"})
    log_format: str = field(default="text", metadata={"help": "text or json"})
    timeout_keep_alive: int = field(default=75, metadata={"help": "seconds an idle connection stays open; longer than clients' and proxies' own (httpx 5, aiohttp 15, load balancers 60), so they always close first"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})

    def __post_init__(self):
        checks = [(bool(self.model), "--model (or VITSERVE_MODEL) is required"),
                  (self.load_format in LOAD_FORMATS, f"load-format must be one of {', '.join(LOAD_FORMATS)}"),
                  (self.attention_backend in ATTENTION_BACKENDS,
                   f"attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}"),
                  (self.log_format in ("text", "json"), "log-format must be text or json"),
                  (self.max_batch_tokens > 0, "max-batch-tokens must be positive"),
                  (self.max_batch_wait_ms >= 0, "max-batch-wait-ms must be >= 0"),
                  (0 <= self.gpu_memory_fraction <= 1, "gpu-memory-fraction must be in [0, 1]"),
                  (self.max_concurrent_requests > 0, "max-concurrent-requests must be positive"),
                  (self.timeout_keep_alive > 0, "timeout-keep-alive must be positive"),
                  (self.payload_limit > 0 and self.max_image_pixels > 0 and self.max_images_per_request > 0,
                   "limits must be positive"), (0 < self.port < 65536, "port must be 1-65535")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def encoder_kwargs(self) -> dict:
        """VisionEncoder.from_pretrained's arguments from these settings, besides model, device and dtype: the same
        wherever a device loads (a thread of the server, or a device process)."""
        budgets = self.budget_list()
        return dict(load_format=self.load_format, revision=self.revision, min_pixels=self.min_pixels,
                    max_pixels=self.max_pixels, attention_backend=self.attention_backend,
                    **({} if budgets is None else {"budgets": budgets}))

    def budget_list(self) -> tuple[int, ...] | None:
        if not self.budgets:
            return None
        try:
            return tuple(int(b) for b in self.budgets.split(",") if b.strip())
        except ValueError:
            raise ValueError(f"budgets must be comma-separated integers, got {self.budgets!r}") from None


def resolve_devices(settings: Settings) -> tuple[list[str], str]:
    """The devices to serve on (`--devices` list or "all", else `--device`) and the dtype (auto: bfloat16 on CUDA)."""
    import torch

    if settings.devices:
        if settings.devices == "all":
            count = torch.cuda.device_count()
            devices = [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
        else:
            devices = [d.strip() for d in settings.devices.split(",") if d.strip()]
    else:
        devices = ["cuda:0" if torch.cuda.is_available() else "cpu"] if settings.device == "auto" else [settings.device]
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if devices[0].startswith("cuda") else "float32"
    return devices, dtype


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _env_default(f):
    """The field's default from VITSERVE_<FIELD> (or an alias's variable) when set, else the dataclass default."""
    for name in (f.name, *f.metadata.get("aliases", ())):
        if ENV_PREFIX + name.upper() in os.environ:
            return os.environ[ENV_PREFIX + name.upper()]
    return f.default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (plus its old names, kept as aliases); its default comes from the environment."""
    for f in fields(Settings):
        env = ENV_PREFIX + f.name.upper()
        kind = f.type if isinstance(f.type, type) else str(f.type)
        default = _env_default(f)
        names = [_flag(f.name), *map(_flag, f.metadata.get("aliases", ()))]
        help_text = f"{f.metadata['help']} [env {env}; default {f.default}]"
        common = dict(dest=f.name, help=help_text)
        if "bool" in str(kind):
            parser.add_argument(*names, type=_parse_bool, nargs="?", const=True,
                                default=_parse_bool(default) if isinstance(default, str) else default, **common)
        elif "int" in str(kind) and "None" not in str(kind):
            parser.add_argument(*names, type=int, default=int(default), **common)
        elif "int" in str(kind):
            parser.add_argument(*names, type=int, default=None if default is None else int(default), **common)
        elif "float" in str(kind):
            parser.add_argument(*names, type=float, default=float(default), **common)
        else:
            parser.add_argument(*names, default=default, **common)


def from_args(args: argparse.Namespace) -> Settings:
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})


def flag_table() -> str:
    """Every flag as a Markdown table (docs/configuration.md holds it; a test keeps the two equal)."""
    rows = ["| flag | env var | default | meaning |", "|---|---|---|---|"]
    for f in fields(Settings):
        aliases = "".join(f" (or `{_flag(a)}`)" for a in f.metadata.get("aliases", ()))
        default = "(required)" if f.name == "model" else f.default
        rows.append(f"| `{_flag(f.name)}`{aliases} | `{ENV_PREFIX}{f.name.upper()}` | `{default}` | "
                    f"{f.metadata['help']} |")
    return "\n".join(rows)
