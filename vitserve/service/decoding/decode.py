"""What a decode worker process runs: its loop over the jobs it is sent (`serve_jobs`); decode (+ resize), the
pixels into a spool file; the header of an image whose first bytes do not hold it; and a video's decode, sampling
and resize, its slices into spool files. For images it imports numpy, PIL and the preprocessing only, never the
engine or torch (which would cost each worker ~150 MB and seconds at its first image); a worker imports torch at
its first video (the video processors' resize is torch's)."""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ...encoder.headers import ImageHeader, probe
from ...encoder.media import received
from ...encoder.preprocess import EncodedJpeg, PreprocessConfig, decode_for_device, load_image, resize_rgb, smart_resize
from ..ground.heap import keep_freed_memory, release_freed_memory
from ..ground.signals import leave_to_owner
from ..ground.timeline import mark
from . import spool
from .decode_protocol import read_job

IDLE_SECONDS = 2.0  # a worker given no job for this long gives its heap's free memory back


def serve_jobs(sock: socket.socket, idle: float = IDLE_SECONDS) -> None:
    """A worker: run each Call it is sent and answer its JobResult, until the server hangs up (SIGTERM and SIGINT
    are the server's: it hangs up on us). Its heap keeps the memory its jobs free for the next ones (an image's
    buffers are not faulted in anew each time: ground.heap), and gives it back once `idle` seconds pass without a
    job."""
    leave_to_owner()
    keep_freed_memory()
    while True:
        if not select.select([sock], [], [], idle)[0]:
            release_freed_memory()  # once per quiet spell: then it waits for the next job
        try:
            call, payload = read_job(sock)
        except (EOFError, OSError):
            return
        try:
            sock.sendall(call.run(payload).frame())
        except OSError:  # the server hung up
            return


def read_header(data, is_base64: bool) -> ImageHeader:
    """Runs in a worker: the header of an image from all of its bytes (its first ones did not hold it), by the
    format's walk over the whole image (PIL's identification for a format no walk reads)."""
    return probe(received(data, is_base64), whole=True)


@dataclass
class DecodedImage:
    """An image decoded by a worker: its pixels (a uint8 (H, W, 3) array, resized or, where the devices resize,
    full size; or its spool file; or a JPEG left encoded for nvJPEG), and the seconds the worker took."""

    image: np.ndarray | spool.Spooled | EncodedJpeg
    seconds: float


def decode_and_resize(
    data,
    is_base64: bool,
    max_image_pixels: int,
    cfg: PreprocessConfig,
    spool_prefix: str | None = None,
    full_size: bool = False,
    jpeg_on_device: bool = False,
) -> DecodedImage:
    """Runs in a worker: encoded bytes (or their base64 text, or where it lies: MediaHandle) -> the resized (H, W, 3)
    uint8 image, in a spool file when `spool_prefix` is given and it can, and the seconds it took (a DecodedImage).
    Before PIL reads it, the image's structure is walked whole (`probe`): what breaks its limits (a JPEG's scans, a
    PNG's chunks, a TIFF's arrays, its declared size) is refused, and the bytes after its end (a phone's motion
    video, junk) are left out. `full_size`: the device resizes (fast preprocessing, or the exact one's resize on the
    devices), so the image stays full size, and with `jpeg_on_device` (fast) a JPEG stays encoded (an EncodedJpeg,
    read from its header only) for nvJPEG to decode there."""
    start = time.perf_counter()
    mark("worker decode")
    data = received(data, is_base64)
    header = probe(data, whole=True)
    header.check(max_image_pixels)
    if header.end is not None and header.end < len(data):
        data = data[: header.end]
    # the spool file's pages allocated while the image decodes, at the size its header says it comes out
    reserved = None
    if spool_prefix and not (full_size and jpeg_on_device):
        reserved = spool.reserve(spool_prefix, _rgb_bytes(header, cfg, full_size))
    image: Image.Image | EncodedJpeg | np.ndarray
    try:
        if full_size:
            image = decode_for_device(data, jpeg_on_device, max_image_pixels)
            if isinstance(image, EncodedJpeg):
                return DecodedImage(image, time.perf_counter() - start)
        else:
            image = resize_rgb(load_image(data, max_image_pixels=max_image_pixels), cfg)
    except BaseException:
        spool.unreserve(reserved)
        raise
    decoded = DecodedImage(_handed_on(image, spool_prefix, reserved), time.perf_counter() - start)
    mark("worker decoded")
    return decoded


def _handed_on(image: Image.Image | np.ndarray, path: str | None, reserved: spool.Reserved | None):
    """The pixels as the worker hands them on: in the spool file at `path` where it can be written (a PIL image is
    streamed into it, never packed whole in this process), else as an array (through the pipe)."""
    if path:
        if isinstance(image, Image.Image):
            spooled = spool.put_image(path, image, reserved)
        else:
            spooled = spool.put(path, image, reserved)
        if spooled is not None:
            return spooled
    return np.asarray(image)


def _rgb_bytes(header: ImageHeader, cfg: PreprocessConfig, full_size: bool) -> int:
    """The bytes of an image's RGB pixels as a worker hands them on, from its header: full size, or resized."""
    height, width = header.height, header.width
    if not full_size:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return height * width * 3


def plan_video(data, is_base64: bool, cfg, limits, planes: bool = False):
    """Runs in a worker: what a video keeps and what decoding it takes (a VideoPlan), from its header
    (encoder.video.video_plan: its limits checked first; `planes`: its frames kept as planes where they can)."""
    from ...encoder.video import video_plan

    return video_plan(received(data, is_base64), cfg, limits, planes)


def plan_groups(data, is_base64: bool, plan, limits):
    """Runs in a worker: a video's `plan` with where its groups of pictures start (encoder.video.with_groups: one
    demux pass), for splitting it among workers."""
    from ...encoder.video import with_groups

    return with_groups(received(data, is_base64), plan, limits)


VIDEO_DECODE_THREADS = 2  # FFmpeg threads per video at least (the decoder gives a lone video more)


def _video_worker() -> None:
    """A decode worker process's torch runs one frame's resize at a time on one thread: OpenMP's team of one per
    core in every worker would oversubscribe the host (and spin in its barrier) whenever several decode videos."""
    import multiprocessing

    import torch

    if multiprocessing.current_process().name == "vitserve-decode" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@dataclass
class DecodedVideo:
    """A video decoded by a worker: its slices (uint8 [T, h, w, 3] each, or their spool files; or SlicePlanes), its
    grid (slices, h / p, w / p), its timing (frame_indices, fps, timestamps, second_per_grid_t: what its answer
    carries), the decoder that decoded it, the seconds the worker took, and the video's declared duration in
    seconds."""

    slices: list
    grid: tuple
    timing: dict
    decoder: str
    seconds: float
    duration: float

    @staticmethod
    def joined(parts: list[DecodedVideo], timing: dict) -> DecodedVideo:
        """One video from its parts' (load_video(part=...)), in order; `timing`: the whole video's (its plan's)."""
        first = parts[0]
        grid = (sum(p.grid[0] for p in parts), *first.grid[1:])
        slices = [s for p in parts for s in p.slices]
        return DecodedVideo(slices, grid, timing, first.decoder, max(p.seconds for p in parts), first.duration)


def decode_video(
    data,
    is_base64: bool,
    cfg,
    limits,
    spool_path: str | None = None,
    threads: int = VIDEO_DECODE_THREADS,
    planes: bool = False,
    part: tuple[int, int] | None = None,
) -> DecodedVideo:
    """Runs in a worker: a video's encoded bytes (or base64, or where it lies) -> its DecodedVideo, the slices in
    spool files `spool_path`-0, -1, ... where given and it can (encoder.video.load_video: the limits are checked from
    the header first, frames decoded one at a time and resized as they come; with `planes`, their planes kept for
    the device to convert and resize where that is exact: each slice a SlicePlanes; `part`: only slices [first,
    end), the video's timing then that part's)."""
    from ...encoder.video import load_video
    from ...encoder.video_planes import SlicePlanes

    _video_worker()
    start = time.perf_counter()
    video = load_video(received(data, is_base64), cfg, limits, threads, planes, part)
    slices = video.slices()
    out: list = [
        (spool_path and spool.put(f"{spool_path}-{j}", s)) or np.ascontiguousarray(s) for j, s in enumerate(slices)
    ]
    if video.layout is not None:
        out = [SlicePlanes(x, video.layout, video.size) for x in out]
    sampling, seconds = video.sampling, time.perf_counter() - start
    grid = sampling.grid(cfg.patch_size)
    return DecodedVideo(out, grid, sampling.timing(), video.decoder, seconds, video.info.duration)
