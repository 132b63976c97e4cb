"""The settings' groups (model, devices, server, batching, limits, decoding, cache, tiers, logging), each a dataclass
whose fields are flags and variables of their own names (flags.py), checked on its own when made, before anything
loads or binds, without torch. Settings (settings.py) holds one of each."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import ClassVar

from ...encoder.config import ATTENTION_BACKENDS, LOAD_FORMATS
from .machine import available_cpus, resolve_devices

LOG_LEVELS = ("debug", "info", "warning", "error")
CACHE_SCOPES = ("server", "api-key")
# what --dtype and --preprocess take: encoder.vision_encoder.DTYPES's names and encoder.preprocess.PREPROCESS_MODES,
# repeated here (a test keeps them equal) so that reading the settings (and --help) imports no torch, numpy or PIL
DTYPE_NAMES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half")
PREPROCESS_MODES = ("exact", "fast")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
EC_HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # service.tiers.vllm_hash.ALGORITHMS (a test keeps them equal)


def _setting(
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


def _networks(value: str | None) -> bool:
    """Whether `value` is None or comma-separated IP networks (CIDR) or addresses."""
    try:
        return value is None or all(ipaddress.ip_network(n.strip(), strict=False) for n in value.split(","))
    except ValueError:
        return False


def _one_of(name: str, value: str, allowed: tuple[str, ...], auto: bool = False) -> tuple[bool, str]:
    return (
        value in allowed or auto and value == "auto",
        f"--{name} must be {'auto or ' if auto else ''}one of {', '.join(allowed)}, got {value!r}",
    )


def _positive(group, *names: str) -> list[tuple[bool, str]]:
    return [(getattr(group, n) > 0, f"--{n.replace('_', '-')} must be positive") for n in names]


@dataclass
class ModelSettings:
    TITLE: ClassVar[str] = "model"
    model: str = _setting(  # required: None (not given) is refused by __post_init__
        None, "checkpoint dir, hub id (org/name), or built-in name", encode=True, metavar="MODEL"
    )
    load_format: str = _setting(
        "auto", "dummy: seeded random weights (implied for the tiny-* built-ins)", encode=True, choices=LOAD_FORMATS
    )
    revision: str | None = _setting(None, "hub revision", encode=True, metavar="REV")
    served_model_name: str | None = _setting(None, "model id in the API (default: --model)", metavar="NAME")

    def __post_init__(self):
        check(
            [
                (bool(self.model), "--model (or VITSERVE_MODEL) is required"),
                _one_of("load-format", self.load_format, LOAD_FORMATS),
            ]
        )

    @property
    def name(self) -> str:
        """The model's id in the API: --served-model-name, else --model."""
        return self.served_model_name or self.model


@dataclass
class DeviceSettings:
    TITLE: ClassVar[str] = "devices and kernels"
    device: str = _setting(
        "auto", "auto (cuda:0 if available, else cpu), cpu or cuda[:i]", encode=True, metavar="{auto,cpu,cuda,cuda:N}"
    )
    devices: str | None = _setting(
        None, "several devices, e.g. cuda:0,cuda:1 or all: one runner per device", metavar="LIST"
    )
    dtype: str = _setting(
        "auto",
        "auto: bfloat16 on CUDA, float32 on the CPU (fp32, fp16, bf16 and half are aliases)",
        encode=True,
        choices=("auto", *DTYPE_NAMES),
    )
    attention_backend: str = _setting(
        "auto",
        "attention kernel (auto: the fastest installed for the device; cudnn needs vitserve[cudnn], fa4 vitserve[fa4])",
        encode=True,
        choices=ATTENTION_BACKENDS,
    )
    gpu_memory_fraction: float = _setting(0.0, "cap each GPU's memory to this fraction (0: no cap)", metavar="X")
    budgets: str | None = _setting(
        None, "comma-separated CUDA graph budgets in patches (default: built-in)", encode=True, metavar="LIST"
    )
    device_processes: bool | None = _setting(
        None,
        "serve each device from a process of its own, sharing no GIL with the HTTP server (default: on CUDA devices)",
    )

    def __post_init__(self):
        listed = self.listed()
        check(
            [
                _one_of("dtype", self.dtype, DTYPE_NAMES, auto=True),
                (
                    self.device == "auto" or DEVICE.fullmatch(self.device),
                    f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
                ),
                (
                    listed is None or listed and all(DEVICE.fullmatch(d) for d in listed),
                    f"--devices must be all or a comma-separated list of cpu, cuda or cuda:N, got {self.devices!r}",
                ),
                _one_of("attention-backend", self.attention_backend, ATTENTION_BACKENDS),
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
        """The devices named explicitly (--devices' list, else --device; none for `all`), `auto` included."""
        return [self.device] if not self.devices else self.listed() or []

    def resolve(self) -> tuple[list[str], str]:
        """The devices to serve on and the dtype, on this machine (machine.resolve_devices)."""
        return resolve_devices(self.device, self.devices, self.dtype)

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
    api_servers: int = _setting(
        0,
        "HTTP front-end processes on the one port, feeding the same devices and cache "
        "(0: one per 4 CPUs on CUDA devices, 2 to 8; 1 on the CPU); the limits are split "
        "evenly among them",
        metavar="N",
    )
    host: str = _setting("0.0.0.0", "bind address", metavar="HOST")
    port: int = _setting(8000, "bind port")
    api_key: str | None = _setting(
        None,
        "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics); "
        "several keys comma-separated, one per client (see --cache-scope)",
        metavar="KEY",
    )
    allow_url_fetch: bool = _setting(False, "accept http(s) image URLs (off: SSRF risk)")
    url_fetch_timeout: float = _setting(10.0, "seconds per URL fetch", metavar="SECONDS")
    max_header_bytes: int = _setting(
        64 * 2**10, "size of a request's line and headers (beyond, a 400 and the connection closed)", size=True
    )
    header_timeout: float = _setting(
        10.0,
        "seconds to receive a request's headers, from its first byte (beyond, the connection is closed)",
        metavar="SECONDS",
    )
    body_timeout: float = _setting(60.0, "seconds to receive a request's body (408 beyond)", metavar="SECONDS")
    max_connections: int = _setting(
        1024,
        "open connections; beyond, the longest-idle close to make room (needs as "
        "many file descriptors: the soft limit is raised to fit)",
    )
    timeout_keep_alive: int = _setting(
        75,
        "seconds an idle connection stays open; longer than clients' and proxies' "
        "own (httpx 5, aiohttp 15, load balancers 60), so they always close first",
        metavar="SECONDS",
    )

    def __post_init__(self):
        check(
            [
                *_positive(
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
    max_batch_tokens: int = _setting(4096, "vision tokens (4 patches each) per GPU batch")
    max_batch_wait_ms: float = _setting(
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
class LimitSettings:
    TITLE: ClassVar[str] = "limits"
    max_concurrent_requests: int = _setting(512, "requests in flight before 429")
    payload_limit: int = _setting(32 * 2**20, "request body limit (413)", size=True)
    max_image_pixels: int = _setting(50_000_000, "decoded pixels per image, read from its header (413; bomb guard)")
    decode_memory_per_request: int = _setting(
        2 * 2**30, "what decoding one request's images may take, estimated from their headers (413 beyond)", size=True
    )
    decode_memory: int = _setting(
        4 * 2**30,
        "what the images being decoded may take on the whole server, "
        "estimated from their headers: images beyond it wait their turn",
        size=True,
    )
    body_memory: int = _setting(
        512 * 2**20,
        "what request bodies in flight may take on the whole server, twice "
        "each body's size beyond its first MiB counted (the body and its "
        "parsed images): beyond it, a body waits for room (a chunked one: 429)",
        size=True,
    )
    max_images_per_request: int = _setting(64, "images per request (413)")
    max_videos_per_request: int = _setting(4, "videos per request (413)")
    max_video_frames: int = _setting(
        768, "frames sampled from one video: a request's num_frames or fps is capped to it"
    )
    max_video_seconds: float = _setting(3600.0, "a video's declared duration (413 video_too_long)", metavar="SECONDS")
    video_decode_work_per_request: int = _setting(
        24 * 10**9,
        "decode work one request's videos may take, read from "
        "their headers: source pixels decoded (every frame up "
        "to the last sampled one) plus 8x those of each "
        "sampled frame (413 decode_work beyond)",
        metavar="PIXELS",
    )
    video_decode_work: int = _setting(
        48 * 10**9,
        "decode work the videos being decoded may take on the whole "
        "server (as --video-decode-work-per-request counts it): videos "
        "beyond it wait their turn",
        metavar="PIXELS",
    )
    url_fetch_memory: int = _setting(
        256 * 2**20,
        "what is fetched from image URLs in flight on the whole server "
        "(429 beyond; one request's fetches are bounded by --payload-limit)",
        size=True,
    )

    def __post_init__(self):
        check(
            [
                *_positive(
                    self,
                    "max_concurrent_requests",
                    "payload_limit",
                    "max_image_pixels",
                    "max_images_per_request",
                    "decode_memory_per_request",
                    "decode_memory",
                    "body_memory",
                    "url_fetch_memory",
                    "max_video_frames",
                    "max_video_seconds",
                    "video_decode_work_per_request",
                    "video_decode_work",
                ),
                (self.max_videos_per_request >= 0, "--max-videos-per-request must be >= 0"),
            ]
        )


@dataclass
class DecodingSettings:
    TITLE: ClassVar[str] = "decoding"
    preprocess: str = _setting(
        "exact",
        "exact: bit-identical to transformers' PIL image processor, on the host; "
        "fast: its torchvision processor on the device (JPEGs by nvJPEG where "
        "torchvision is installed, resize on the GPU)",
        encode=True,
        choices=PREPROCESS_MODES,
    )
    decode_timeout: float = _setting(
        10.0,
        "seconds a decode worker may spend on one image (beyond, the worker is "
        "replaced and the image refused: 413 decode_timeout)",
        metavar="SECONDS",
    )
    video_fps: float | None = _setting(
        None,
        "frames a second sampled from a video by default (default: the checkpoint's video processor settings)",
        metavar="FPS",
    )
    video_decoder: str = _setting(
        "cpu",
        "cpu: FFmpeg's software decoders (transformers' frames); nvdec: the GPU's "
        "video engines where they open, software elsewhere (frames within about a "
        "level of the software ones: docs/video.md)",
        encode=True,
        choices=("cpu", "nvdec"),
    )
    video_decode_timeout: float = _setting(
        180.0,
        "seconds a decode worker may spend on one video (beyond, the "
        "worker is replaced and the video refused: 413 decode_timeout); "
        "the default fits --video-decode-work-per-request at 130 M a "
        "second, several times below a CPU's pace",
        metavar="SECONDS",
    )
    video_decode_workers: int = _setting(
        0,
        "decode workers that may decode videos at once; the others stay for "
        "images (0: half of --decode-workers, at least 1)",
    )
    min_pixels: int | None = _setting(
        None, "override the images' resize minimum (pixels; videos: --video-min-pixels)", encode=True
    )
    max_pixels: int | None = _setting(
        None, "override the images' resize maximum (pixels; videos: --video-max-pixels)", encode=True
    )
    video_min_pixels: int | None = _setting(
        None,
        "override the video processor's resize minimum (pixels: per frame "
        "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
        encode=True,
    )
    video_max_pixels: int | None = _setting(
        None,
        "override the video processor's resize maximum (pixels: per frame "
        "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
        encode=True,
    )
    decode_workers: int = _setting(
        0,
        "decode + resize workers (0: one per CPU this process may use: its affinity and cgroup quota)",
        aliases=("preprocess_workers",),
    )
    decode_processes: bool = _setting(True, "run them as processes (false: threads)", aliases=("preprocess_processes",))
    spool_dir: str | None = _setting(
        None,
        "RAM-backed directory where decoded images cross from the decode processes "
        "(default: /dev/shm; none: through a pipe, slower)",
        metavar="DIR",
    )

    def __post_init__(self):
        pixels = (self.min_pixels, self.max_pixels, self.video_min_pixels, self.video_max_pixels)
        check(
            [
                (
                    self.preprocess in PREPROCESS_MODES,
                    f"--preprocess must be {' or '.join(PREPROCESS_MODES)}, got {self.preprocess!r}",
                ),
                (self.video_decoder in ("cpu", "nvdec"), "--video-decoder must be cpu or nvdec"),
                *_positive(self, "decode_timeout", "video_decode_timeout"),
                (self.video_fps is None or self.video_fps > 0, "--video-fps must be positive (frames a second)"),
                (self.decode_workers >= 0, "--decode-workers must be >= 0"),
                (self.video_decode_workers >= 0, "--video-decode-workers must be >= 0"),
                (all(p is None or p > 0 for p in pixels[:2]), "--min-pixels and --max-pixels must be positive"),
                (
                    all(p is None or p > 0 for p in pixels[2:]),
                    "--video-min-pixels and --video-max-pixels must be positive",
                ),
                (None in pixels[2:] or pixels[2] <= pixels[3], "--video-min-pixels must not exceed --video-max-pixels"),
                (None in pixels[:2] or pixels[0] <= pixels[1], "--min-pixels must not exceed --max-pixels"),
            ]
        )

    def worker_count(self) -> int:
        """The decode workers to run: `--decode-workers`, else one per CPU this process may use (available_cpus)."""
        return self.decode_workers or available_cpus()


@dataclass
class CacheSettings:
    TITLE: ClassVar[str] = "cache"
    cache_bytes: int = _setting(
        512 * 2**20,
        "host memory for the embedding cache: an image sent again is answered "
        "from it, without decoding or the device (0: off)",
        size=True,
    )
    cache_scope: str = _setting(
        "server",
        "who shares the embedding cache: server (every client) or api-key (each "
        "--api-key its own: a client never learns what another key sent)",
        choices=CACHE_SCOPES,
    )

    def __post_init__(self):
        check(
            [
                (
                    self.cache_scope in CACHE_SCOPES,
                    f"--cache-scope must be {' or '.join(CACHE_SCOPES)}, got {self.cache_scope!r}",
                ),
                (self.cache_bytes >= 0, "--cache-bytes must be >= 0"),
            ]
        )


@dataclass
class TierSettings:
    TITLE: ClassVar[str] = "encoder tier"
    ec_shared_storage: str | None = _setting(
        None,
        "be vLLM's encoder tier: every item /v1/encode and "
        "/v1/chat/completions encode is also written where vLLM's "
        "ECExampleConnector reads it (DIR/<identifier>/"
        "encoder_cache.safetensors; DIR must exist; docs/llm.md)",
        metavar="DIR",
    )
    ec_storage_bytes: int = _setting(
        8 * 2**30,
        "what the encoder-cache files may take in --ec-shared-storage: beyond, the least recently written go",
        size=True,
    )
    ec_file_mode: str = _setting(
        "0644",
        "permissions of the encoder-cache files, octal (their folders: the same with x wherever r)",
        metavar="MODE",
    )
    ec_dtype: str = _setting(
        "auto", "dtype of the encoder-cache tensors: the vLLM model's (auto: --dtype's)", choices=("auto", *DTYPE_NAMES)
    )
    ec_model_id: str | None = _setting(
        None,
        "the model string the vLLM consumer runs (its --model), which its "
        "identifiers of items without a uuid hash (default: --model)",
        metavar="MODEL",
    )
    ec_hash_algorithm: str = _setting("blake3", "the consumer's --mm-hasher-algorithm", choices=EC_HASH_ALGORITHMS)
    sglang_encoder: bool = _setting(
        False,
        "be SGLang's encoder server: /encode and /scheduler_receive_url take "
        "what a --language-only SGLang server sends its --encoder-urls, and the "
        "features go to its ranks over ZMQ (docs/sglang.md); one front end",
    )
    sglang_timeout: float = _setting(
        180.0,
        "seconds an encoded /encode part waits for its receivers' "
        "registrations, and a registration for its part (SGLang's "
        "SGLANG_ENCODER_SEND_TIMEOUT)",
        metavar="SECONDS",
    )
    sglang_receivers: str | None = _setting(
        None,
        "networks the SGLang tier pushes features to, comma-separated "
        "(CIDR or addresses, e.g. 10.0.0.0/8,fd00::/8); default: any "
        "address but loopback, link-local (cloud metadata) and multicast "
        "ones",
        metavar="NETWORKS",
    )

    def __post_init__(self):
        check(
            [
                *_positive(self, "ec_storage_bytes", "sglang_timeout"),
                _one_of("ec-dtype", self.ec_dtype, DTYPE_NAMES, auto=True),
                (
                    re.fullmatch(r"0?[0-7]{3}", self.ec_file_mode) is not None,
                    "--ec-file-mode must be octal permissions, e.g. 0640",
                ),
                (
                    self.ec_hash_algorithm in EC_HASH_ALGORITHMS,
                    f"--ec-hash-algorithm must be one of {', '.join(EC_HASH_ALGORITHMS)}",
                ),
                (
                    _networks(self.sglang_receivers),
                    f"--sglang-receivers must be comma-separated networks (CIDR) or "
                    f"addresses, got {self.sglang_receivers!r}",
                ),
            ]
        )


@dataclass
class LogSettings:
    TITLE: ClassVar[str] = "logging"
    log_format: str = _setting(
        "text", "text (a progress bar on a terminal) or json", encode=True, choices=("text", "json")
    )
    log_level: str = _setting("info", "what is logged", encode=True, choices=LOG_LEVELS)

    def __post_init__(self):
        check(
            [
                (self.log_format in ("text", "json"), f"--log-format must be text or json, got {self.log_format!r}"),
                _one_of("log-level", self.log_level, LOG_LEVELS),
            ]
        )
