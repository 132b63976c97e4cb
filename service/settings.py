"""Settings: one dataclass for `serve` and `encode`; every field is a kebab-case flag and a VITSERVE_* environment
variable, and every value is checked before anything loads or binds."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..encoder.config import ATTENTION_BACKENDS, LOAD_FORMATS, builtin_config
from ..encoder.preprocess import PREPROCESS_MODES

ENV_PREFIX = "VITSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error")
CACHE_SCOPES = ("server", "api-key")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _setting(default, help: str, encode: bool = False, aliases: tuple[str, ...] = ()):
    """A field; `encode`: `vitserve encode` reads it too (its other settings are the defaults)."""
    return field(default=default, metadata={"help": help, "encode": encode, "aliases": aliases})


@dataclass
class Settings:
    model: str | None = _setting(None, "checkpoint dir, hub id, or built-in name (required)", encode=True)
    load_format: str = _setting("auto", f"{', '.join(LOAD_FORMATS)} (dummy: seeded random weights; implied for the "
                                        "tiny-* built-ins)", encode=True)
    revision: str | None = _setting(None, "hub revision", encode=True)
    device: str = _setting("auto", "auto (cuda:0 if available, else cpu), cpu or cuda[:i]", encode=True)
    devices: str | None = _setting(None, "several devices, e.g. cuda:0,cuda:1 or all: one runner per device")
    dtype: str = _setting("auto", "auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16 (or fp32, "
                                  "fp16, bf16, half)", encode=True)
    attention_backend: str = _setting("auto", f"attention kernel: {', '.join(ATTENTION_BACKENDS)} (auto: the fastest "
                                              "installed for the device; cudnn needs vitserve[cudnn])", encode=True)
    preprocess: str = _setting("exact", "exact: bit-identical to transformers' PIL image processor, on the host; "
                                        "fast: its torchvision processor on the device (JPEGs by nvJPEG where "
                                        "torchvision is installed, resize on the GPU)", encode=True)
    gpu_memory_fraction: float = _setting(0.0, "cap each GPU's memory to this fraction (0: no cap)")
    host: str = _setting("0.0.0.0", "bind address")
    port: int = _setting(8000, "bind port")
    served_model_name: str | None = _setting(None, "model id in the API (default: --model)")
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics); "
                                         "several keys comma-separated, one per client (see --cache-scope)")
    max_batch_tokens: int = _setting(4096, "vision tokens (4 patches each) per GPU batch")
    max_batch_wait_ms: float = _setting(5.0, "while every device is busy, how long a batch waits for more images")
    budgets: str | None = _setting(None, "comma-separated CUDA graph budgets in patches (default: built-in)",
                                   encode=True)
    max_concurrent_requests: int = _setting(512, "requests in flight before 429")
    payload_limit: int = _setting(32 * 2**20, "request body limit in bytes (413)")
    max_image_pixels: int = _setting(50_000_000, "decoded pixels per image, read from its header (413; bomb guard)")
    decode_memory_per_request: int = _setting(2 * 2**30, "bytes that decoding one request's images may take, "
                                                          "estimated from their headers (413 beyond)")
    decode_memory: int = _setting(4 * 2**30, "bytes that the images being decoded may take on the whole server, "
                                             "estimated from their headers: images beyond it wait their turn")
    body_memory: int = _setting(512 * 2**20, "bytes that request bodies in flight may take on the whole server, "
                                             "twice each body's size counted (the body and its parsed images): "
                                             "beyond it, a request waits for room before its body is read")
    decode_timeout: float = _setting(10.0, "seconds a decode worker may spend on one image (beyond, the worker is "
                                           "replaced and the image refused: 413 decode_timeout)")
    max_images_per_request: int = _setting(64, "images per request (413)")
    min_pixels: int | None = _setting(None, "override the resize minimum (pixels)", encode=True)
    max_pixels: int | None = _setting(None, "override the resize maximum (pixels)", encode=True)
    decode_workers: int = _setting(0, "decode + resize workers (0: one per core)", aliases=("preprocess_workers",))
    decode_processes: bool = _setting(True, "run them as processes (false: threads)", aliases=("preprocess_processes",))
    device_processes: bool | None = _setting(None, "serve each device from a process of its own, sharing no GIL with "
                                                   "the HTTP server (default: on CUDA devices)")
    spool_dir: str | None = _setting(None, "RAM-backed directory where decoded images cross from the decode processes "
                                           "(default: /dev/shm; none: through a pipe, slower)")
    allow_url_fetch: bool = _setting(False, "accept http(s) image URLs (off: SSRF risk)")
    url_fetch_timeout: float = _setting(10.0, "seconds per URL fetch")
    log_format: str = _setting("text", "text or json", encode=True)
    cache_bytes: int = _setting(512 * 2**20, "host memory for the embedding cache: an image sent again is answered "
                                             "from it, without decoding or the device (0: off)")
    cache_scope: str = _setting("server", "who shares the embedding cache: server (every client) or api-key (each "
                                          "--api-key its own: a client never learns what another key sent)")
    max_header_bytes: int = _setting(64 * 2**10, "bytes of a request's line and headers (beyond, a 400 and the "
                                                 "connection closed)")
    header_timeout: float = _setting(10.0, "seconds to receive a request's headers, from its first byte (beyond, "
                                           "the connection is closed)")
    body_timeout: float = _setting(60.0, "seconds to receive a request's body (408 beyond)")
    max_connections: int = _setting(1024, "open connections; beyond, the longest-idle close to make room (needs as "
                                          "many file descriptors: the soft limit is raised to fit)")
    url_fetch_memory: int = _setting(256 * 2**20, "bytes fetched from image URLs in flight on the whole server "
                                                  "(429 beyond; one request's fetches are bounded by --payload-limit)")
    timeout_keep_alive: int = _setting(75, "seconds an idle connection stays open; longer than clients' and proxies' "
                                           "own (httpx 5, aiohttp 15, load balancers 60), so they always close first")
    log_level: str = _setting("info", "debug, info, warning or error", encode=True)

    def __post_init__(self):
        """Check every value on its own, before anything loads: ValueError with the flag and what is wrong."""
        from ..encoder.vision_encoder import DTYPES

        listed = self._device_list() if self.devices and self.devices != "all" else None
        checks = [(bool(self.model), "--model (or VITSERVE_MODEL) is required"),
                  (self.load_format in LOAD_FORMATS, f"--load-format must be one of {', '.join(LOAD_FORMATS)}, "
                                                     f"got {self.load_format!r}"),
                  (self.dtype == "auto" or self.dtype in DTYPES,
                   f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}"),
                  (self.device == "auto" or DEVICE.fullmatch(self.device),
                   f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}"),
                  (listed is None or listed and all(DEVICE.fullmatch(d) for d in listed),
                   f"--devices must be all or a comma-separated list of cpu, cuda or cuda:N, got {self.devices!r}"),
                  (self.attention_backend in ATTENTION_BACKENDS,
                   f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"),
                  (self.preprocess in PREPROCESS_MODES,
                   f"--preprocess must be {' or '.join(PREPROCESS_MODES)}, got {self.preprocess!r}"),
                  (self.log_format in ("text", "json"), f"--log-format must be text or json, got {self.log_format!r}"),
                  (self.cache_scope in CACHE_SCOPES, f"--cache-scope must be {' or '.join(CACHE_SCOPES)}, "
                                                     f"got {self.cache_scope!r}"),
                  (self.log_level in LOG_LEVELS, f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                                                 f"got {self.log_level!r}"),
                  (self.max_batch_tokens > 0, "--max-batch-tokens must be positive"),
                  (self.max_batch_wait_ms >= 0, "--max-batch-wait-ms must be >= 0"),
                  (0 <= self.gpu_memory_fraction <= 1, "--gpu-memory-fraction must be in [0, 1]"),
                  (self.max_concurrent_requests > 0, "--max-concurrent-requests must be positive"),
                  (self.timeout_keep_alive > 0, "--timeout-keep-alive must be positive"),
                  (self.url_fetch_timeout > 0, "--url-fetch-timeout must be positive"),
                  (min(self.decode_memory_per_request, self.decode_memory, self.max_header_bytes,
                       self.max_connections, self.url_fetch_memory, self.body_memory) > 0,
                   "--decode-memory-per-request, --decode-memory, --max-header-bytes, --max-connections, "
                   "--url-fetch-memory and --body-memory must be positive"),
                  (self.header_timeout > 0 and self.body_timeout > 0 and self.decode_timeout > 0,
                   "--header-timeout, --body-timeout and --decode-timeout must be positive"),
                  (self.decode_workers >= 0, "--decode-workers must be >= 0"),
                  (self.cache_bytes >= 0, "--cache-bytes must be >= 0"),
                  (self.payload_limit > 0 and self.max_image_pixels > 0 and self.max_images_per_request > 0,
                   "--payload-limit, --max-image-pixels and --max-images-per-request must be positive"),
                  (all(p is None or p > 0 for p in (self.min_pixels, self.max_pixels)),
                   "--min-pixels and --max-pixels must be positive"),
                  (None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels,
                   "--min-pixels must not exceed --max-pixels"),
                  (0 < self.port < 65536, "--port must be 1-65535"),
                  (self.api_key is None or self.api_keys(), "--api-key must name at least one key"),
                  (self.cache_scope != "api-key" or self.api_key,
                   "--cache-scope api-key needs --api-key (the keys are the scopes)")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.budget_list()

    def api_keys(self) -> list[str]:
        """The keys `--api-key` names (comma-separated); none: no key is asked for."""
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def encoder_kwargs(self) -> dict:
        """VisionEncoder.from_pretrained's arguments from these settings, besides model, device and dtype: the same
        wherever a device loads (a thread of the server, a device process, or `vitserve encode`)."""
        budgets = self.budget_list()
        return dict(load_format=self.load_format, revision=self.revision, min_pixels=self.min_pixels,
                    max_pixels=self.max_pixels, attention_backend=self.attention_backend, preprocess=self.preprocess,
                    **({} if budgets is None else {"budgets": budgets}))

    def budget_list(self) -> tuple[int, ...] | None:
        """`--budgets` as integers, each a positive multiple of the smallest frame (16 patches); None: built-in."""
        from ..encoder.packing import MIN_FRAME_PATCHES

        if not self.budgets:
            return None
        try:
            budgets = tuple(int(b) for b in self.budgets.split(",") if b.strip())
        except ValueError:
            budgets = ()
        if not budgets or any(b <= 0 or b % MIN_FRAME_PATCHES for b in budgets):
            raise ValueError(f"--budgets must be comma-separated positive multiples of {MIN_FRAME_PATCHES}, "
                             f"got {self.budgets!r}")
        return budgets

    def _device_list(self) -> list[str]:
        return [d.strip() for d in self.devices.split(",") if d.strip()]

    def prepare(self) -> list[str]:
        """Check what depends on this machine, before anything loads or binds (ValueError when wrong): the CUDA devices
        asked for exist, and the model is found without the network. A tiny-* built-in, which has no checkpoint
        anywhere, switches to dummy weights. Returns lines to log about what was implied."""
        self._check_devices()
        return self._check_model()

    def _check_devices(self) -> None:
        asked = [self.device] if not self.devices else [] if self.devices == "all" else self._device_list()
        cuda = [d for d in asked if d.startswith("cuda")]
        if not cuda:
            return
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {cuda[0]} asked for, but CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is false); use --device cpu or auto")
        count = torch.cuda.device_count()
        for d in cuda:
            if int(d.partition(":")[2] or 0) >= count:
                raise ValueError(f"device {d} asked for, but this machine has {count} CUDA device(s): "
                                 f"cuda:0 to cuda:{count - 1}")

    def _check_model(self) -> list[str]:
        """A tiny-* built-in implies dummy weights; with downloads off (HF_HUB_OFFLINE), a hub id must be in the local
        Hugging Face cache, looked up offline. A directory is left to the load (which reports one that is missing)."""
        from huggingface_hub.constants import HF_HUB_CACHE

        from ..encoder.checkpoint import CheckpointError, resolve_checkpoint

        if Path(self.model).expanduser().exists() or self.model.startswith((".", "/", "~")):
            return []
        try:
            builtin_config(self.model)
            builtin = True
        except KeyError:
            builtin = False
        if builtin and self.load_format == "dummy":
            return []
        if builtin and self.model.lower().startswith("tiny-"):
            if self.load_format != "auto":
                raise ValueError(f"{self.model} is a built-in test tower with no checkpoint: use --load-format dummy")
            self.load_format = "dummy"
            return [f"{self.model} is a built-in test tower with no checkpoint: using seeded random weights "
                    "(--load-format dummy)"]
        if downloads_allowed():
            return []  # the load fetches what the cache lacks
        try:
            resolve_checkpoint(self.model, self.revision, allow_download=False)
        except CheckpointError as e:
            if not builtin:
                raise
            raise ValueError(f"{self.model!r} is not a local directory and not in the Hugging Face cache "
                             f"({HF_HUB_CACHE}), and downloads are off (HF_HUB_OFFLINE=1): add --load-format dummy "
                             f"for seeded random weights, or download it first (hf download {self.model}), or allow "
                             "downloads (unset HF_HUB_OFFLINE)") from e
        return []


def downloads_allowed() -> bool:
    """Whether a hub id missing from the cache may be downloaded: unless HF_HUB_OFFLINE is set (as the loader)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes")


def resolve_devices(settings: Settings) -> tuple[list[str], str]:
    """The devices to serve on (`--devices` list or "all", else `--device`) and the dtype (auto: bfloat16 on CUDA)."""
    import torch

    if settings.devices:
        if settings.devices == "all":
            count = torch.cuda.device_count()
            devices = [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
        else:
            devices = settings._device_list()
    else:
        devices = ["cuda:0" if torch.cuda.is_available() else "cpu"] if settings.device == "auto" else [settings.device]
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if devices[0].startswith("cuda") else "float32"
    return devices, dtype


class Parser(argparse.ArgumentParser):
    """Errors as one line, `<prog>: <what is wrong>`, with exit status 2. A bad VITSERVE_* variable (add_arguments
    records it) is one too, reported before any argument is read, `--help` included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.env_errors: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        if self.env_errors:
            self.error(self.env_errors[0])
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _kind(f) -> type:
    """The field's value type: bool, int, float or str (str for `str | None` fields)."""
    kind = str(f.type)
    return next((t for t in (bool, int, float) if t.__name__ in kind), str)


def _env_value(f):
    """VITSERVE_<FIELD> (or an alias's variable) as (variable, text) when set, else None."""
    for name in (f.name, *f.metadata["aliases"]):
        if ENV_PREFIX + name.upper() in os.environ:
            return ENV_PREFIX + name.upper(), os.environ[ENV_PREFIX + name.upper()]
    return None


def add_arguments(parser: Parser, encode: bool = False) -> None:
    """One flag per field (plus its old names, kept as aliases), `encode`: only the fields `vitserve encode` reads.
    A flag's default is its variable's value, converted here: a bad one is recorded on the parser."""
    for f in fields(Settings):
        if encode and not f.metadata["encode"]:
            continue
        kind = _kind(f)
        convert = _parse_bool if kind is bool else kind
        default, env = f.default, _env_value(f)
        if env is not None:
            try:
                default = convert(env[1])
            except (ValueError, argparse.ArgumentTypeError) as e:
                reason = str(e) if kind is bool else f"invalid {kind.__name__} value: {env[1]!r}"
                parser.env_errors.append(f"{env[0]}: {reason}")
        names = [_flag(f.name), *map(_flag, f.metadata["aliases"])]
        common = dict(dest=f.name, default=default, type=convert,
                      help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default {f.default}]")
        parser.add_argument(*names, **common, **(dict(nargs="?", const=True) if kind is bool else {}))


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags; a field the parser lacks (one `encode` does not read) keeps its default."""
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)})


def flag_table() -> str:
    """Every flag as a Markdown table (docs/configuration.md holds it; a test keeps the two equal)."""
    rows = ["| flag | env var | default | `encode` | meaning |", "|---|---|---|---|---|"]
    for f in fields(Settings):
        aliases = "".join(f" (or `{_flag(a)}`)" for a in f.metadata["aliases"])
        default = "(required)" if f.name == "model" else f.default
        rows.append(f"| `{_flag(f.name)}`{aliases} | `{ENV_PREFIX}{f.name.upper()}` | `{default}` | "
                    f"{'yes' if f.metadata['encode'] else ''} | {f.metadata['help']} |")
    return "\n".join(rows)
