"""Settings: one dataclass for `serve` and `encode`; every field is a kebab-case flag and a VITSERVE_* environment
variable, and every value is checked before anything loads or binds."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import re
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path

from ...encoder.config import ATTENTION_BACKENDS, BUILTIN_CONFIGS, LOAD_FORMATS, builtin_config

ENV_PREFIX = "VITSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error")
CACHE_SCOPES = ("server", "api-key")
# what --dtype and --preprocess take: encoder.vision_encoder.DTYPES's names and encoder.preprocess.PREPROCESS_MODES,
# repeated here (a test keeps them equal) so that reading the settings (and --help) imports no torch, numpy or PIL
DTYPE_NAMES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half")
PREPROCESS_MODES = ("exact", "fast")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
# the groups of `vitserve serve --help` and of docs/configuration.md's table, in their order
GROUPS = ("model", "devices and kernels", "server", "batching", "limits", "decoding", "cache", "encoder tier",
          "logging")
EC_HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # service.vllm_hash.ALGORITHMS (a test keeps them equal)


def _networks(value: str | None) -> bool:
    """Whether `value` is None or comma-separated IP networks (CIDR) or addresses."""
    import ipaddress

    try:
        return value is None or all(ipaddress.ip_network(n.strip(), strict=False) for n in value.split(","))
    except ValueError:
        return False


def _setting(default, help: str, group: str, encode: bool = False, aliases: tuple[str, ...] = (),
             choices: tuple[str, ...] | None = None, metavar: str | None = None, size: bool = False):
    """A field; `encode`: `vitserve encode` reads it too (its other settings are the defaults). `choices` and
    `metavar` are what --help shows as the value (the checks are __post_init__'s); `size`: a byte count, written
    as bytes or with a unit (parse_size)."""
    assert group in GROUPS, group
    return field(default=default, metadata={"help": help, "group": group, "encode": encode, "aliases": aliases,
                                            "choices": choices, "metavar": metavar, "size": size})


@dataclass
class Settings:
    model: str | None = _setting(None, "checkpoint dir, hub id (org/name), or built-in name", "model",
                                 encode=True, metavar="MODEL")
    load_format: str = _setting("auto", "dummy: seeded random weights (implied for the tiny-* built-ins)", "model",
                                encode=True, choices=LOAD_FORMATS)
    revision: str | None = _setting(None, "hub revision", "model", encode=True, metavar="REV")
    device: str = _setting("auto", "auto (cuda:0 if available, else cpu), cpu or cuda[:i]", "devices and kernels",
                           encode=True, metavar="{auto,cpu,cuda,cuda:N}")
    devices: str | None = _setting(None, "several devices, e.g. cuda:0,cuda:1 or all: one runner per device",
                                   "devices and kernels", metavar="LIST")
    dtype: str = _setting("auto", "auto: bfloat16 on CUDA, float32 on the CPU (fp32, fp16, bf16 and half are "
                                  "aliases)", "devices and kernels", encode=True, choices=("auto", *DTYPE_NAMES))
    attention_backend: str = _setting("auto", "attention kernel (auto: the fastest installed for the device; cudnn "
                                              "needs vitserve[cudnn], fa4 vitserve[fa4])", "devices and kernels",
                                      encode=True, choices=ATTENTION_BACKENDS)
    preprocess: str = _setting("exact", "exact: bit-identical to transformers' PIL image processor, on the host; "
                                        "fast: its torchvision processor on the device (JPEGs by nvJPEG where "
                                        "torchvision is installed, resize on the GPU)", "decoding", encode=True,
                               choices=PREPROCESS_MODES)
    gpu_memory_fraction: float = _setting(0.0, "cap each GPU's memory to this fraction (0: no cap)",
                                          "devices and kernels", metavar="X")
    api_servers: int = _setting(0, "HTTP front-end processes on the one port, feeding the same devices and cache "
                                   "(0: one per 4 CPUs on CUDA devices, 2 to 8; 1 on the CPU); the limits are split "
                                   "evenly among them", "server", metavar="N")
    host: str = _setting("0.0.0.0", "bind address", "server", metavar="HOST")
    port: int = _setting(8000, "bind port", "server")
    served_model_name: str | None = _setting(None, "model id in the API (default: --model)", "model", metavar="NAME")
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics); "
                                         "several keys comma-separated, one per client (see --cache-scope)",
                                   "server", metavar="KEY")
    max_batch_tokens: int = _setting(4096, "vision tokens (4 patches each) per GPU batch", "batching")
    max_batch_wait_ms: float = _setting(5.0, "while every device is busy, how long a batch waits for more images",
                                        "batching", metavar="MS")
    budgets: str | None = _setting(None, "comma-separated CUDA graph budgets in patches (default: built-in)",
                                   "devices and kernels", encode=True, metavar="LIST")
    max_concurrent_requests: int = _setting(512, "requests in flight before 429", "limits")
    payload_limit: int = _setting(32 * 2**20, "request body limit (413)", "limits", size=True)
    max_image_pixels: int = _setting(50_000_000, "decoded pixels per image, read from its header (413; bomb guard)",
                                     "limits")
    decode_memory_per_request: int = _setting(2 * 2**30, "what decoding one request's images may take, estimated "
                                                         "from their headers (413 beyond)", "limits", size=True)
    decode_memory: int = _setting(4 * 2**30, "what the images being decoded may take on the whole server, "
                                             "estimated from their headers: images beyond it wait their turn",
                                  "limits", size=True)
    body_memory: int = _setting(512 * 2**20, "what request bodies in flight may take on the whole server, twice "
                                             "each body's size beyond its first MiB counted (the body and its "
                                             "parsed images): beyond it, a body waits for room (a chunked one: 429)",
                                "limits", size=True)
    decode_timeout: float = _setting(10.0, "seconds a decode worker may spend on one image (beyond, the worker is "
                                           "replaced and the image refused: 413 decode_timeout)", "decoding",
                                     metavar="SECONDS")
    max_images_per_request: int = _setting(64, "images per request (413)", "limits")
    max_videos_per_request: int = _setting(4, "videos per request (413)", "limits")
    max_video_frames: int = _setting(768, "frames sampled from one video: a request's num_frames or fps is capped "
                                          "to it", "limits")
    max_video_seconds: float = _setting(3600.0, "a video's declared duration (413 video_too_long)", "limits",
                                        metavar="SECONDS")
    video_fps: float | None = _setting(None, "frames a second sampled from a video by default (default: the "
                                             "checkpoint's video processor settings)", "decoding", metavar="FPS")
    video_decoder: str = _setting("cpu", "cpu: FFmpeg's software decoders (transformers' frames); nvdec: the GPU's "
                                         "video engines where they open, software elsewhere (frames within about a "
                                         "level of the software ones: docs/video.md)", "decoding", encode=True,
                                  choices=("cpu", "nvdec"))
    video_decode_timeout: float = _setting(180.0, "seconds a decode worker may spend on one video (beyond, the "
                                                  "worker is replaced and the video refused: 413 decode_timeout); "
                                                  "the default fits --video-decode-work-per-request at 130 M a "
                                                  "second, several times below a CPU's pace", "decoding",
                                           metavar="SECONDS")
    video_decode_work_per_request: int = _setting(24 * 10**9, "decode work one request's videos may take, read from "
                                                              "their headers: source pixels decoded (every frame up "
                                                              "to the last sampled one) plus 8x those of each "
                                                              "sampled frame (413 decode_work beyond)", "limits",
                                                  metavar="PIXELS")
    video_decode_work: int = _setting(48 * 10**9, "decode work the videos being decoded may take on the whole "
                                                  "server (as --video-decode-work-per-request counts it): videos "
                                                  "beyond it wait their turn", "limits", metavar="PIXELS")
    video_decode_workers: int = _setting(0, "decode workers that may decode videos at once; the others stay for "
                                            "images (0: half of --decode-workers, at least 1)", "decoding")
    min_pixels: int | None = _setting(None, "override the images' resize minimum (pixels; videos: "
                                            "--video-min-pixels)", "decoding", encode=True)
    max_pixels: int | None = _setting(None, "override the images' resize maximum (pixels; videos: "
                                            "--video-max-pixels)", "decoding", encode=True)
    video_min_pixels: int | None = _setting(None, "override the video processor's resize minimum (pixels: per frame "
                                                  "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
                                            "decoding", encode=True)
    video_max_pixels: int | None = _setting(None, "override the video processor's resize maximum (pixels: per frame "
                                                  "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
                                            "decoding", encode=True)
    decode_workers: int = _setting(0, "decode + resize workers (0: one per CPU this process may use: its affinity "
                                      "and cgroup quota)", "decoding", aliases=("preprocess_workers",))
    decode_processes: bool = _setting(True, "run them as processes (false: threads)", "decoding",
                                      aliases=("preprocess_processes",))
    device_processes: bool | None = _setting(None, "serve each device from a process of its own, sharing no GIL with "
                                                   "the HTTP server (default: on CUDA devices)", "devices and kernels")
    spool_dir: str | None = _setting(None, "RAM-backed directory where decoded images cross from the decode processes "
                                           "(default: /dev/shm; none: through a pipe, slower)", "decoding",
                                     metavar="DIR")
    allow_url_fetch: bool = _setting(False, "accept http(s) image URLs (off: SSRF risk)", "server")
    url_fetch_timeout: float = _setting(10.0, "seconds per URL fetch", "server", metavar="SECONDS")
    log_format: str = _setting("text", "text (a progress bar on a terminal) or json", "logging", encode=True,
                               choices=("text", "json"))
    cache_bytes: int = _setting(512 * 2**20, "host memory for the embedding cache: an image sent again is answered "
                                             "from it, without decoding or the device (0: off)", "cache", size=True)
    cache_scope: str = _setting("server", "who shares the embedding cache: server (every client) or api-key (each "
                                          "--api-key its own: a client never learns what another key sent)", "cache",
                                choices=CACHE_SCOPES)
    ec_shared_storage: str | None = _setting(None, "be vLLM's encoder tier: every item /v1/encode and "
                                                   "/v1/chat/completions encode is also written where vLLM's "
                                                   "ECExampleConnector reads it (DIR/<identifier>/"
                                                   "encoder_cache.safetensors; DIR must exist; docs/llm.md)",
                                             "encoder tier", metavar="DIR")
    ec_storage_bytes: int = _setting(8 * 2**30, "what the encoder-cache files may take in --ec-shared-storage: "
                                                "beyond, the least recently written go", "encoder tier", size=True)
    ec_file_mode: str = _setting("0644", "permissions of the encoder-cache files, octal (their folders: the same "
                                         "with x wherever r)", "encoder tier", metavar="MODE")
    ec_dtype: str = _setting("auto", "dtype of the encoder-cache tensors: the vLLM model's (auto: --dtype's)",
                             "encoder tier", choices=("auto", *DTYPE_NAMES))
    ec_model_id: str | None = _setting(None, "the model string the vLLM consumer runs (its --model), which its "
                                             "identifiers of items without a uuid hash (default: --model)",
                                       "encoder tier", metavar="MODEL")
    ec_hash_algorithm: str = _setting("blake3", "the consumer's --mm-hasher-algorithm", "encoder tier",
                                      choices=EC_HASH_ALGORITHMS)
    sglang_encoder: bool = _setting(False, "be SGLang's encoder server: /encode and /scheduler_receive_url take "
                                           "what a --language-only SGLang server sends its --encoder-urls, and the "
                                           "features go to its ranks over ZMQ (docs/sglang.md); one front end",
                                    "encoder tier")
    sglang_timeout: float = _setting(180.0, "seconds an encoded /encode part waits for its receivers' "
                                            "registrations, and a registration for its part (SGLang's "
                                            "SGLANG_ENCODER_SEND_TIMEOUT)", "encoder tier", metavar="SECONDS")
    sglang_receivers: str | None = _setting(None, "networks the SGLang tier pushes features to, comma-separated "
                                                  "(CIDR or addresses, e.g. 10.0.0.0/8,fd00::/8); default: any "
                                                  "address but loopback, link-local (cloud metadata) and multicast "
                                                  "ones", "encoder tier", metavar="NETWORKS")
    max_header_bytes: int = _setting(64 * 2**10, "size of a request's line and headers (beyond, a 400 and the "
                                                 "connection closed)", "server", size=True)
    header_timeout: float = _setting(10.0, "seconds to receive a request's headers, from its first byte (beyond, "
                                           "the connection is closed)", "server", metavar="SECONDS")
    body_timeout: float = _setting(60.0, "seconds to receive a request's body (408 beyond)", "server",
                                   metavar="SECONDS")
    max_connections: int = _setting(1024, "open connections; beyond, the longest-idle close to make room (needs as "
                                          "many file descriptors: the soft limit is raised to fit)", "server")
    url_fetch_memory: int = _setting(256 * 2**20, "what is fetched from image URLs in flight on the whole server "
                                                  "(429 beyond; one request's fetches are bounded by --payload-limit)",
                                     "limits", size=True)
    timeout_keep_alive: int = _setting(75, "seconds an idle connection stays open; longer than clients' and proxies' "
                                           "own (httpx 5, aiohttp 15, load balancers 60), so they always close first",
                                       "server", metavar="SECONDS")
    log_level: str = _setting("info", "what is logged", "logging", encode=True, choices=LOG_LEVELS)

    def __post_init__(self):
        """Check every value on its own, before anything loads (and without torch): ValueError with the flag and what
        is wrong."""
        listed = self._device_list() if self.devices and self.devices != "all" else None
        checks = [(bool(self.model), "--model (or VITSERVE_MODEL) is required"),
                  (self.load_format in LOAD_FORMATS, f"--load-format must be one of {', '.join(LOAD_FORMATS)}, "
                                                     f"got {self.load_format!r}"),
                  (self.dtype == "auto" or self.dtype in DTYPE_NAMES,
                   f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"),
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
                  (self.api_servers >= 0, "--api-servers must be >= 0"),
                  (self.api_servers <= 1 or self.device_processes is not False,
                   "--api-servers above 1 serves the devices from processes of their own: drop "
                   "--device-processes false"),
                  (self.cache_bytes >= 0, "--cache-bytes must be >= 0"),
                  (self.ec_storage_bytes > 0, "--ec-storage-bytes must be positive"),
                  (self.video_decoder in ("cpu", "nvdec"), "--video-decoder must be cpu or nvdec"),
                  (self.ec_dtype == "auto" or self.ec_dtype in DTYPE_NAMES,
                   f"--ec-dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.ec_dtype!r}"),
                  (re.fullmatch(r"0?[0-7]{3}", self.ec_file_mode) is not None,
                   "--ec-file-mode must be octal permissions, e.g. 0640"),
                  (self.ec_hash_algorithm in EC_HASH_ALGORITHMS,
                   f"--ec-hash-algorithm must be one of {', '.join(EC_HASH_ALGORITHMS)}"),
                  (self.sglang_timeout > 0, "--sglang-timeout must be positive"),
                  (_networks(self.sglang_receivers),
                   f"--sglang-receivers must be comma-separated networks (CIDR) or addresses, got "
                   f"{self.sglang_receivers!r}"),
                  (not self.sglang_encoder or self.api_servers <= 1,
                   "--sglang-encoder pairs each /encode part with its receivers' registrations in one process: it "
                   "takes one front end (--api-servers 1)"),
                  (self.payload_limit > 0 and self.max_image_pixels > 0 and self.max_images_per_request > 0,
                   "--payload-limit, --max-image-pixels and --max-images-per-request must be positive"),
                  (self.max_videos_per_request >= 0, "--max-videos-per-request must be >= 0"),
                  (self.max_video_frames > 0, "--max-video-frames must be positive"),
                  (self.max_video_seconds > 0, "--max-video-seconds must be positive"),
                  (self.video_decode_timeout > 0, "--video-decode-timeout must be positive"),
                  (self.video_fps is None or self.video_fps > 0, "--video-fps must be positive (frames a second)"),
                  (self.video_decode_work_per_request > 0, "--video-decode-work-per-request must be positive"),
                  (self.video_decode_work > 0, "--video-decode-work must be positive"),
                  (self.video_decode_workers >= 0, "--video-decode-workers must be >= 0"),
                  (all(p is None or p > 0 for p in (self.min_pixels, self.max_pixels)),
                   "--min-pixels and --max-pixels must be positive"),
                  (all(p is None or p > 0 for p in (self.video_min_pixels, self.video_max_pixels)),
                   "--video-min-pixels and --video-max-pixels must be positive"),
                  (None in (self.video_min_pixels, self.video_max_pixels)
                   or self.video_min_pixels <= self.video_max_pixels,
                   "--video-min-pixels must not exceed --video-max-pixels"),
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
                    max_pixels=self.max_pixels, video_min_pixels=self.video_min_pixels,
                    video_max_pixels=self.video_max_pixels, attention_backend=self.attention_backend,
                    preprocess=self.preprocess,
                    video_decoder=self.video_decoder,
                    **({} if budgets is None else {"budgets": budgets}))

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
            raise ValueError(f"--budgets must be comma-separated positive multiples of {MIN_FRAME_PATCHES}, "
                             f"got {self.budgets!r}")
        return budgets

    def _device_list(self) -> list[str]:
        return [d.strip() for d in self.devices.split(",") if d.strip()]

    def decode_worker_count(self) -> int:
        """The decode workers to run: `--decode-workers`, else one per CPU this process may use (available_cpus)."""
        return self.decode_workers or available_cpus()

    def batching(self, decode_workers: int) -> dict:
        """/stats' `batching`: the settings that shape batches, and the decode workers running."""
        return {"max_batch_tokens": self.max_batch_tokens, "max_batch_wait_ms": self.max_batch_wait_ms,
                "max_concurrent_requests": self.max_concurrent_requests,
                "max_images_per_request": self.max_images_per_request, "preprocess": self.preprocess,
                "decode_workers": decode_workers, "decode_processes": self.decode_processes}

    def api_server_count(self) -> int:
        """The front ends to run: `--api-servers`, else one per 4 CPUs this process may use (2 to 8) where a device
        is a GPU (the front end is what caps a GPU), and 1 on CPU devices, with --device-processes false or with
        --sglang-encoder."""
        if self.api_servers:
            return self.api_servers
        if (self.device_processes is False or self.sglang_encoder  # (SGLang's calls pair up in one process)
                or not any(d.startswith("cuda") for d in resolve_devices(self)[0])):
            return 1
        return min(8, max(2, available_cpus() // 4))

    def prepare(self) -> list[str]:
        """Check what depends on this machine, before anything loads or binds (ValueError when wrong): the CUDA devices
        asked for exist, the model can be found (a name that cannot is refused at once, with the closest built-in
        name), an attention backend named explicitly runs on the devices, and the encoder tiers have their folder
        and packages. A tiny-* built-in, which has no
        checkpoint anywhere, switches to dummy weights. Returns lines to log about what was implied."""
        self._check_devices()
        notes = self._check_model()
        self._check_attention()
        self._check_tiers()
        return notes

    def _check_tiers(self) -> None:
        """The encoder tiers' needs: --ec-shared-storage an existing folder this user can write in (it is not
        created: a typo would go unnoticed), blake3 for its default digest, pyzmq for --sglang-encoder."""
        if self.ec_shared_storage is not None:
            path = Path(self.ec_shared_storage)
            if not path.is_dir():
                raise ValueError(f"--ec-shared-storage {self.ec_shared_storage}: "
                                 + ("not a directory" if path.exists() else "no such directory (create it: the "
                                                                            "folder vLLM's consumer reads)"))
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"--ec-shared-storage {self.ec_shared_storage}: not writable by this user")
            if self.ec_hash_algorithm == "blake3" and not _installed("blake3"):
                raise ValueError("--ec-shared-storage names items by vLLM's default digest, blake3, which is not "
                                 "installed: pip install 'vitserve[ec]' (or --ec-hash-algorithm, as the consumer's "
                                 "--mm-hasher-algorithm)")
        if self.sglang_encoder and not _installed("zmq"):
            raise ValueError("--sglang-encoder pushes over ZMQ, and pyzmq is not installed: "
                             "pip install 'vitserve[sglang]'")

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
        """A local path is left to the load (which reports one that is missing). Otherwise the name must be able to
        load: with dummy weights, a built-in name (load_configs resolves anything else as a checkpoint, through the
        hub); without, a tiny-* built-in (dummy weights implied) or a hub id, which has an organization (`org/name`,
        as every Qwen-VL id). With downloads off (HF_HUB_OFFLINE), a hub id must be in the local Hugging Face cache,
        looked up offline."""
        if Path(self.model).expanduser().exists() or self.model.startswith((".", "/", "~")):
            return []
        try:
            builtin_config(self.model)
            builtin = True
        except KeyError:
            builtin = False
        if self.load_format == "dummy":
            if not builtin:
                raise ValueError(f"--model {self.model!r} with --load-format dummy: not a built-in name, and no local "
                                 f"checkpoint directory of that name{did_you_mean(self.model)}")
            return []
        if builtin and self.model.lower().startswith("tiny-"):
            if self.load_format != "auto":
                raise ValueError(f"{self.model} is a built-in test tower with no checkpoint: use --load-format dummy")
            self.load_format = "dummy"
            return [f"{self.model} is a built-in test tower with no checkpoint: using seeded random weights "
                    "(--load-format dummy)"]
        if "/" not in self.model:
            what = "a built-in name, but not a hub id (org/name)" if builtin else \
                "not a local directory, a built-in name or a hub id (org/name)"
            raise ValueError(f"--model {self.model!r}: {what}{did_you_mean(self.model)}")
        if downloads_allowed():
            return []  # the load fetches what the cache lacks
        from huggingface_hub.constants import HF_HUB_CACHE

        from ...encoder.checkpoint import CheckpointError, resolve_checkpoint

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

    def _check_attention(self) -> None:
        """An attention backend named explicitly must run on every device. auto and sdpa run anywhere. Where
        encoder.attention.select needs no device to decide (the CPU, float32 on CUDA, and torch's own flash kernel),
        it decides here; on CUDA in half precision it would compile and check fa4's or cuDNN's kernel, which is the
        load's work, in the device's own process: here their package is looked for (not imported)."""
        name = self.attention_backend
        if name in ("auto", "sdpa"):
            return
        import torch

        from ...encoder import attention
        from ...encoder.vision_encoder import parse_dtype

        devices, dtype = resolve_devices(self)
        dtype = parse_dtype(dtype)
        for device in map(torch.device, dict.fromkeys(devices)):
            if name in ATTENTION_PACKAGES and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
                module, extra = ATTENTION_PACKAGES[name]
                if not _installed(module):
                    raise ValueError(f"attention backend {name!r} is unavailable: {module} is not installed; "
                                     f"pip install 'vitserve[{extra}]'")
            else:
                attention.select(name, device, dtype, heads=1, head_dim=4)  # its ValueError, or nothing to build


# the attention backends that need a package of their own (encoder.attention): its module, and vitserve's extra
ATTENTION_PACKAGES = {"fa4": ("flash_attn.cute", "fa4"), "cudnn": ("cudnn", "cudnn")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or one without a spec
        return False


def did_you_mean(model: str) -> str:
    """`; did you mean <the closest built-in name>?` (difflib, ignoring case), or where to find the names."""
    names = {name.lower(): name for name in BUILTIN_CONFIGS}
    match = difflib.get_close_matches(model.lower(), names, n=1)
    return f"; did you mean {names[match[0]]}?" if match else "; --help lists the built-in names"


def downloads_allowed() -> bool:
    """Whether a hub id missing from the cache may be downloaded: unless HF_HUB_OFFLINE is set (as the loader)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes")


def available_cpus(root: str | Path = "/") -> int:
    """The CPUs this process may use: its affinity mask, bounded by its cgroup's CPU quota (a container's or a pod's
    limit), rounded up; at least 1. `root`: where /proc and /sys are found (a fake tree, in tests)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(Path(root))
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs the cgroup quota allows (quota / period), None when there is none: cgroup v2's `cpu.max` ("max 100000":
    none, "200000 100000": 2), else v1's `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`. Read in the
    process's own cgroup (/proc/self/cgroup) and every parent of it, and at the hierarchy's root (a container's
    cgroup namespace shows its own cgroup there): the smallest holds."""
    fs = root / "sys/fs/cgroup"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    own = {}  # hierarchy ("" for v2, else its controllers) -> the process's cgroup path in it
    for parts in (line.split(":", 2) for line in lines):
        if len(parts) == 3:
            own[parts[1]] = parts[2].strip("/")
    quotas = []
    v2 = [fs / own.get("", "")]
    v1 = [fs / c / own.get(c, "") for c in ("cpu,cpuacct", "cpu")]
    for base, read in [(d, _v2_quota) for d in v2] + [(d, _v1_quota) for d in v1]:
        for directory in (base, *base.parents):
            if directory == fs.parent:
                break
            if (quota := read(directory)) is not None:
                quotas.append(quota)
    return min(quotas, default=None)


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


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
    records it) is one too, reported before any argument is read, `--help` included. Flags are never abbreviated
    (`--mod` is not `--model`), and an unknown one gets the closest known one suggested."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.env_errors: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        if self.env_errors:
            self.error(self.env_errors[0])
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = [a.split("=")[0] for a in extras if a.startswith("--")]
            known = [o for o in self._option_string_actions if o.startswith("--")]
            match = next((m[0] for f in flags if (m := difflib.get_close_matches(f, known, n=1))), None)
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {match}?" if match else ""))
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.I)
# byte counts: IEC units are powers of 1024 (Kubernetes' Ki, Mi, Gi too), SI units powers of 1000; a bare K, M or G
# (1000 to Kubernetes, 1024 to Docker) is refused as ambiguous
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              **{f"{p}{b}": 2 ** (10 * (i + 1)) for i, p in enumerate("kmgt") for b in ("i", "ib")}}


def parse_size(text: str) -> int:
    """A byte count: a plain integer, or a number and a unit (`512KiB`, `32MiB`, `4GiB`, `1.5GB`; GB is 10**9,
    GiB 2**30; any case), rounded down to a whole byte."""
    m = SIZE.fullmatch(text.strip())
    if not m or m[2].lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a unit: 512KiB, 32MiB, 4GiB; KB, "
                                         "MB, GB are powers of 1000)")
    return int(Fraction(m[1]) * SIZE_UNITS[m[2].lower()])


def format_size(n: int) -> str:
    """A byte count as parse_size reads it back: in the largest IEC unit that holds it whole (`32MiB`), else bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % SIZE_UNITS[unit.lower()] == 0:
            return f"{n // SIZE_UNITS[unit.lower()]}{unit}"
    return str(n)


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


def _convert(f):
    """What reads the field's flag and variable: parse_size for sizes, _parse_bool for booleans, else its type."""
    kind = _kind(f)
    return parse_size if f.metadata["size"] else _parse_bool if kind is bool else kind


def _default(f) -> str | None:
    """The default as a user writes it (sizes in units, booleans lowercase); None where there is none to show."""
    if f.default is None:
        return None
    if f.metadata["size"]:
        return format_size(f.default)
    return str(f.default).lower() if isinstance(f.default, bool) else str(f.default)


def _metavar(f) -> str:
    """The value as --help and the table show it: the choices, or what kind of value it is."""
    if f.metadata["choices"]:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    kind = _kind(f)
    return f.metadata["metavar"] or ("SIZE" if f.metadata["size"] else "BOOL" if kind is bool else
                                     "N" if kind is int else "X" if kind is float else "TEXT")


def _env_value(f):
    """VITSERVE_<FIELD> (or an alias's variable) as (variable, text) when set, else None."""
    for name in (f.name, *f.metadata["aliases"]):
        if ENV_PREFIX + name.upper() in os.environ:
            return ENV_PREFIX + name.upper(), os.environ[ENV_PREFIX + name.upper()]
    return None


def builtin_names() -> str:
    """The built-in model names, for --help: every Qwen3-VL `-Instruct` is there as `-Thinking` too."""
    names = [n for n in BUILTIN_CONFIGS if not n.endswith("-Thinking")]
    return ", ".join(names) + " (each Qwen3-VL -Instruct also as -Thinking)"


def add_arguments(parser: Parser, encode: bool = False) -> None:
    """One flag per field (plus its old names, kept as aliases), in GROUPS; `encode`: only the fields `vitserve
    encode` reads. A flag's default is its variable's value, converted here: a bad one is recorded on the parser."""
    groups = {}
    for f in sorted(fields(Settings), key=lambda f: GROUPS.index(f.metadata["group"])):
        if encode and not f.metadata["encode"]:
            continue
        convert, default, env = _convert(f), f.default, _env_value(f)
        if env is not None:
            try:
                default = convert(env[1])
            except (ValueError, argparse.ArgumentTypeError) as e:
                reason = str(e) if isinstance(e, argparse.ArgumentTypeError) else \
                    f"invalid {_kind(f).__name__} value: {env[1]!r}"
                parser.env_errors.append(f"{env[0]}: {reason}")
        group = f.metadata["group"]
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        shown = "required" if f.name == "model" else None if _default(f) is None else f"default {_default(f)}"
        names = [_flag(f.name), *map(_flag, f.metadata["aliases"])]
        common = dict(dest=f.name, default=default, type=convert, metavar=_metavar(f),
                      help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}{'; ' + shown if shown else ''}]")
        groups[group].add_argument(*names, **common, **(dict(nargs="?", const=True) if _kind(f) is bool else {}))


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags; a field the parser lacks (one `encode` does not read) keeps its default."""
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)})


def flag_table() -> str:
    """Every flag as Markdown tables, one per group (docs/configuration.md holds them; a test keeps the two equal)."""
    out = []
    for group in GROUPS:
        out += ["", f"**{group}**", "", "| flag | value | env var | default | `encode` | meaning |",
                "|---|---|---|---|---|---|"]
        for f in (f for f in fields(Settings) if f.metadata["group"] == group):
            aliases = "".join(f" (or `{_flag(a)}`)" for a in f.metadata["aliases"])
            default = "(required)" if f.name == "model" else f"`{_default(f)}`" if _default(f) is not None else "–"
            out.append(f"| `{_flag(f.name)}`{aliases} | `{_metavar(f)}` | `{ENV_PREFIX}{f.name.upper()}` | "
                       f"{default} | {'yes' if f.metadata['encode'] else ''} | {f.metadata['help']} |")
    return "\n".join(out[1:])
