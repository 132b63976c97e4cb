"""The settings' groups about the media requests carry: what a request may hold (limits), how its images and videos
are decoded (decoding), the embedding cache that answers them again, and the encoder tiers that write them for an
LLM (settings_groups.py says how a group is declared and checked)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from .machine import available_cpus
from .settings_groups import DTYPE_NAMES, PREPROCESS_MODES, check, networks, one_of, positive, setting

CACHE_SCOPES = ("server", "api-key")
EC_HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # service.tiers.vllm_hash.ALGORITHMS (a test keeps them equal)


@dataclass
class LimitSettings:
    TITLE: ClassVar[str] = "limits"
    max_concurrent_requests: int = setting(512, "requests in flight before 429")
    payload_limit: int = setting(32 * 2**20, "request body limit (413)", size=True)
    max_image_pixels: int = setting(50_000_000, "decoded pixels per image, read from its header (413; bomb guard)")
    decode_memory_per_request: int = setting(
        2 * 2**30, "what decoding one request's images may take, estimated from their headers (413 beyond)", size=True
    )
    decode_memory: int = setting(
        4 * 2**30,
        "what the images being decoded may take on the whole server, "
        "estimated from their headers: images beyond it wait their turn",
        size=True,
    )
    body_memory: int = setting(
        512 * 2**20,
        "what request bodies in flight may take on the whole server, twice "
        "each body's size beyond its first MiB counted (the body and its "
        "parsed images): beyond it, a body waits for room (a chunked one: 429)",
        size=True,
    )
    max_images_per_request: int = setting(64, "images per request (413)")
    max_videos_per_request: int = setting(4, "videos per request (413)")
    max_video_frames: int = setting(768, "frames sampled from one video: a request's num_frames or fps is capped to it")
    max_video_seconds: float = setting(3600.0, "a video's declared duration (413 video_too_long)", metavar="SECONDS")
    video_decode_work_per_request: int = setting(
        24 * 10**9,
        "decode work one request's videos may take, read from "
        "their headers: source pixels decoded (every frame up "
        "to the last sampled one) plus 8x those of each "
        "sampled frame (413 decode_work beyond)",
        metavar="PIXELS",
    )
    video_decode_work: int = setting(
        48 * 10**9,
        "decode work the videos being decoded may take on the whole "
        "server (as --video-decode-work-per-request counts it): videos "
        "beyond it wait their turn",
        metavar="PIXELS",
    )
    url_fetch_memory: int = setting(
        256 * 2**20,
        "what is fetched from image URLs in flight on the whole server "
        "(429 beyond; one request's fetches are bounded by --payload-limit)",
        size=True,
    )

    def __post_init__(self):
        check(
            [
                *positive(
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
    preprocess: str = setting(
        "exact",
        "exact: bit-identical to transformers' PIL image processor, on the host; "
        "fast: its torchvision processor on the device (JPEGs by nvJPEG where "
        "torchvision is installed, resize on the GPU)",
        encode=True,
        choices=PREPROCESS_MODES,
    )
    image_resize: str = setting(
        "auto",
        "where the exact preprocessing resizes an image: worker (PIL in the decode "
        "workers), device (the devices, with Pillow's integer arithmetic: the same "
        "bytes, less host work), auto (device on CUDA devices, worker on the CPU); "
        "the fast preprocessing always resizes on the device",
        choices=("auto", "device", "worker"),
    )
    decode_timeout: float = setting(
        10.0,
        "seconds a decode worker may spend on one image (beyond, the worker is "
        "replaced and the image refused: 413 decode_timeout)",
        metavar="SECONDS",
    )
    video_fps: float | None = setting(
        None,
        "frames a second sampled from a video by default (default: the checkpoint's video processor settings)",
        metavar="FPS",
    )
    video_decoder: str = setting(
        "cpu",
        "cpu: FFmpeg's software decoders (transformers' frames); nvdec: the GPU's "
        "video engines (PyNvVideoCodec: the nvdec extra) where they take the stream, "
        "the same frames; software elsewhere (docs/video.md)",
        encode=True,
        choices=("cpu", "nvdec"),
    )
    video_convert: str = setting(
        "auto",
        "where a video's sampled frames become RGB at their size: worker (the decode "
        "workers), device (the devices convert and resize the decoder's YUV planes: "
        "the same bytes, less host work), auto (device on CUDA devices, worker on the CPU)",
        choices=("auto", "device", "worker"),
    )
    video_decode_timeout: float = setting(
        180.0,
        "seconds a decode worker may spend on one video (beyond, the "
        "worker is replaced and the video refused: 413 decode_timeout); "
        "the default fits --video-decode-work-per-request at 130 M a "
        "second, several times below a CPU's pace",
        metavar="SECONDS",
    )
    video_decode_workers: int = setting(
        0,
        "decode workers that may decode videos at once; the others stay for "
        "images (0: half of --decode-workers, at least 1)",
    )
    min_pixels: int | None = setting(
        None, "override the images' resize minimum (pixels; videos: --video-min-pixels)", encode=True
    )
    max_pixels: int | None = setting(
        None, "override the images' resize maximum (pixels; videos: --video-max-pixels)", encode=True
    )
    video_min_pixels: int | None = setting(
        None,
        "override the video processor's resize minimum (pixels: per frame "
        "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
        encode=True,
    )
    video_max_pixels: int | None = setting(
        None,
        "override the video processor's resize maximum (pixels: per frame "
        "for Qwen2/2.5-VL, every sampled frame together for Qwen3-VL)",
        encode=True,
    )
    decode_workers: int = setting(
        0,
        "decode + resize workers (0: one per CPU this process may use: its affinity and cgroup quota)",
        aliases=("preprocess_workers",),
    )
    decode_processes: bool = setting(True, "run them as processes (false: threads)", aliases=("preprocess_processes",))
    spool_dir: str | None = setting(
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
                (self.video_convert in ("auto", "device", "worker"), "--video-convert must be auto, device or worker"),
                (self.image_resize in ("auto", "device", "worker"), "--image-resize must be auto, device or worker"),
                *positive(self, "decode_timeout", "video_decode_timeout"),
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

    def video_planes(self, devices: list[str]) -> bool:
        """Whether videos reach the devices as planes (`--video-convert` on these devices)."""
        return self.video_convert == "device" or (
            self.video_convert == "auto" and any(d.startswith("cuda") for d in devices)
        )

    def images_full_size(self, devices: list[str]) -> bool:
        """Whether images reach the devices full size, resized there (fast preprocessing, or `--image-resize` on
        these devices)."""
        return (
            self.preprocess == "fast"
            or self.image_resize == "device"
            or (self.image_resize == "auto" and any(d.startswith("cuda") for d in devices))
        )

    def worker_count(self) -> int:
        """The decode workers to run: `--decode-workers`, else one per CPU this process may use (available_cpus)."""
        return self.decode_workers or available_cpus()


@dataclass
class CacheSettings:
    TITLE: ClassVar[str] = "cache"
    cache_bytes: int = setting(
        512 * 2**20,
        "host memory for the embedding cache: an image or video sent again is "
        "answered from it, without decoding or the device (0: off)",
        size=True,
    )
    cache_scope: str = setting(
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
    ec_shared_storage: str | None = setting(
        None,
        "be vLLM's encoder tier: every item /v1/encode and "
        "/v1/chat/completions encode is also written where vLLM's "
        "ECExampleConnector reads it (DIR/<identifier>/"
        "encoder_cache.safetensors; DIR must exist; docs/llm.md)",
        metavar="DIR",
    )
    ec_storage_bytes: int = setting(
        8 * 2**30,
        "what the encoder-cache files may take in --ec-shared-storage: beyond, the least recently written go",
        size=True,
    )
    ec_file_mode: str = setting(
        "0644",
        "permissions of the encoder-cache files, octal (their folders: the same with x wherever r)",
        metavar="MODE",
    )
    ec_dtype: str = setting(
        "auto", "dtype of the encoder-cache tensors: the vLLM model's (auto: --dtype's)", choices=("auto", *DTYPE_NAMES)
    )
    ec_model_id: str | None = setting(
        None,
        "the model string the vLLM consumer runs (its --model), which its "
        "identifiers of items without a uuid hash (default: --model)",
        metavar="MODEL",
    )
    ec_hash_algorithm: str = setting("blake3", "the consumer's --mm-hasher-algorithm", choices=EC_HASH_ALGORITHMS)
    sglang_encoder: bool = setting(
        False,
        "be SGLang's encoder server: /encode and /scheduler_receive_url take "
        "what a --language-only SGLang server sends its --encoder-urls, and the "
        "features go to its ranks over ZMQ (docs/sglang.md); one front end",
    )
    sglang_timeout: float = setting(
        180.0,
        "seconds an encoded /encode part waits for its receivers' "
        "registrations, and a registration for its part (SGLang's "
        "SGLANG_ENCODER_SEND_TIMEOUT)",
        metavar="SECONDS",
    )
    sglang_receivers: str | None = setting(
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
                *positive(self, "ec_storage_bytes", "sglang_timeout"),
                one_of("ec-dtype", self.ec_dtype, DTYPE_NAMES, auto=True),
                (
                    re.fullmatch(r"0?[0-7]{3}", self.ec_file_mode) is not None,
                    "--ec-file-mode must be octal permissions, e.g. 0640",
                ),
                (
                    self.ec_hash_algorithm in EC_HASH_ALGORITHMS,
                    f"--ec-hash-algorithm must be one of {', '.join(EC_HASH_ALGORITHMS)}",
                ),
                (
                    networks(self.sglang_receivers),
                    f"--sglang-receivers must be comma-separated networks (CIDR) or "
                    f"addresses, got {self.sglang_receivers!r}",
                ),
            ]
        )
