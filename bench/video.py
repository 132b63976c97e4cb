"""Issue 27's video figures for one model, each from this one run against a real `vitserve serve` (dummy weights by
default). Prints a table, writes JSON (--out).

- single: one clip (--clip, default 30 s of 1280x720 H.264 at 30 fps, sampled at --fps 2), one client over HTTP
  (multipart /v1/encode, bfloat16 tokens as safetensors, one keep-alive connection): end-to-end seconds, the median
  of --repeats after a warm-up. Beside it transformers, timed the same way in this process before the server starts:
  `transformers.video_utils.load_video(backend="pyav")` with its processor's `sample_frames`, its video processor
  (`Qwen2VLVideoProcessor` or `Qwen3VLVideoProcessor`, with the settings vitserve serves: the same pixels), then its
  own vision tower (built from the config, the same dummy weights, on --device in --dtype, --hf-attention), the
  tokens back on the host; and the ratio. transformers' video processors need torchvision: without it that column
  says why it was skipped.
- throughput: --clients client threads, each streaming the clips of --mix (a few lengths and sizes) one request after
  another for --seconds: sampled video frames/s answered over HTTP; beside it the engine alone on the same clips,
  decoded once (`vitserve.encoder.video.load_video`) and their slices run through `runner.launch_images`/`collect`
  in --max-batch-tokens batches, pipelined, for --engine-seconds, in this process before the server starts (freed
  after); and the ratio.
- long: a long clip (--long-seconds, default 600 s: 1200 frames at 2 fps, but the video processors sample at most
  their max_frames, 768; at --long-size, low by default so that making it is cheap) sent once while --image-clients
  clients send examples/sample.jpg to /v1/embeddings: the server's peak RSS above idle (the sum over its process
  tree: front ends, device and decode processes; from /proc every 50 ms; shared pages count once per process) and
  the images' p50/p99 beside the long clip against without it (measured first, for --image-seconds).
The server runs with the embedding cache off (the same image is sent over and over), a payload limit that fits the
largest clip and --max-video-frames that fits the long clip, then --server-flags (`--server-flags "--cache-bytes
2G" --phases single`: the warm-up fills the cache, and single's figure is a cache hit's). Every phase is bounded
(--request-timeout per request, a deadline per phase) so a hung server fails a phase instead of hanging the run.

What the tower sees depends on the video processor settings. Dummy weights of a built-in hub id take the published
checkpoints' (encoder.video.PUBLISHED); a tiny-* model the processor classes' defaults: Qwen3-VL's class default fits
all sampled frames together into 768·32² pixels (the 30 s clip: 60 frames of 64x128), its published config into
25165824 (60 frames of 480x832). `--video-config published` (or a JSON file or text of settings) writes the model
once as a checkpoint directory (config, those settings, the same seeded dummy weights as safetensors in --dtype, under
the temp dir; about 1.2 GB for Qwen3-VL-8B's tower in bf16) that the server, the engine and transformers all load.

Clips are made once from examples/ photos (tests/videos.py's frames_of: a camera panning across a photo, played
back and forth) with PyAV's libx264 (--x264-preset) and kept in --clip-dir, named by their parameters. The defaults
take about 15 MB and 80 s on 2 cores; `--make-clips --clip-dir build/video-clips` makes them and exits, and a device
call that carries build/video-clips (with --clip-dir build/video-clips) skips making them there.

    # on the device (the av wheel carried: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend av)
    source bench/gpu_env.sh; PYTHONPATH=$SITE$PWD python3 bench/video.py --out video.json
    PYTHONPATH=$SITE$PWD python3 bench/video.py --video-config published --out video-published.json
    PYTHONPATH=$SITE$PWD python3 bench/video.py --model Qwen/Qwen2.5-VL-7B-Instruct --hf-attention eager --out v.json
    # a smoke run on a CPU (tiny-qwen3-vl, small clips, 2 clients, 10 s, a 60 s long clip: under a minute)
    PYTHONPATH=$PWD python3 bench/video.py --cpu --out /tmp/video.json
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import functools
import gc
import http.client
import json
import os
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_http import run_batches, server_batches  # noqa: E402
from frontend import cores_text, process_tree, with_server_cores  # noqa: E402
from video_decode import full_decode, timed  # noqa: E402
from videos import frames_of  # noqa: E402

PHASES = ("single", "throughput", "long")
CPU_DEFAULTS = dict(
    model="tiny-qwen3-vl",
    device="cpu",
    dtype="float32",
    clip="4x320x240",
    mix="4x320x240,3x256x192,6x320x180",
    clients=2,
    seconds=10.0,
    engine_seconds=3.0,
    engine_batches=1,
    repeats=3,
    long_seconds=60.0,
    long_size="320x180",
    image_clients=2,
    image_seconds=5.0,
    request_timeout=120.0,
    start_timeout=180.0,
)
HEADERS = ("decode", "queue", "inference", "serialize")  # the answers' x-<phase>-time, ms


# ---- clips ---------------------------------------------------------------------------------------------------------
def parse_clip(text: str, fps: float) -> dict:
    """`SECONDSxWIDTHxHEIGHT[@FPS]` -> the clip's parameters."""
    size, _, rate = text.partition("@")
    seconds, width, height = size.split("x")
    return dict(seconds=float(seconds), width=int(width), height=int(height), fps=float(rate or fps))


def clip_name(c: dict) -> str:
    return f"{c['seconds']:g}s-{c['width']}x{c['height']}-{c['fps']:g}fps"


def make_clip(c: dict, directory: Path, preset: str, photo: str = "sample.jpg") -> Path:
    """An H.264 MP4 of `c`, made once and kept in `directory`: tests/videos.py's pan across `photo` (a 4 s sweep,
    played back and forth so that only one sweep of frames is ever held), encoded frame by frame."""
    import av

    path = directory / f"{clip_name(c)}-{Path(photo).stem}-{preset}.mp4"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    count = round(c["seconds"] * c["fps"])
    sweep = max(2, min(count, round(4 * c["fps"])))
    frames = frames_of(photo, sweep, c["width"], c["height"])
    t = time.perf_counter()
    part = path.with_suffix(f".{os.getpid()}.part")
    with av.open(str(part), mode="w", format="mp4") as out:
        stream = out.add_stream("h264", rate=Fraction(c["fps"]).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = c["width"], c["height"], "yuv420p"
        stream.options = {"preset": preset, "crf": "23"}
        for k in range(count):
            j = k % (2 * sweep - 2)
            frame = av.VideoFrame.from_ndarray(frames[j if j < sweep else 2 * sweep - 2 - j], format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    part.rename(path)
    print(f"made {path.name}: {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t:.1f} s", flush=True)
    return path


# ---- a checkpoint whose video processor is a published one ----------------------------------------------------------
# The video processor settings the published checkpoints ship (encoder.video.PUBLISHED, what dummy weights of a
# built-in hub id take too); a tiny-* model runs with the processor classes' defaults instead: Qwen3-VL's fit every
# sampled frame together into 768·32² pixels (a 30 s clip at 2 fps: 60 frames of 64x128), the published config into
# 25165824.


def with_video_config(args) -> None:
    """--video-config: the model as a checkpoint directory (its config, these video processor settings, and the
    seeded dummy weights written as safetensors, in --dtype) that the server, the engine and transformers all load
    (--load-format auto), made once under the temp dir."""
    import hashlib

    from safetensors.torch import save_file

    from vitserve.encoder import checkpoint
    from vitserve.encoder.config import builtin_config, from_hf_config
    from vitserve.encoder.vision_encoder import parse_dtype

    cfg = builtin_config(args.model)
    if args.video_config == "published":
        from vitserve.encoder.video import PUBLISHED

        video = PUBLISHED[cfg.family]
    else:
        video = json.loads(
            Path(args.video_config).read_text() if Path(args.video_config).is_file() else args.video_config
        )
    from hf_reference import vision_config

    vision = vision_config(cfg)
    config = dict(model_type=cfg.family, vision_config=vision)
    pixels = dict(
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
    )
    tower = lambda c: {k: v for k, v in vars(c).items() if k not in pixels}  # noqa: E731
    assert tower(from_hf_config(config)) == tower(cfg), "the written config.json is not the model's"
    key = hashlib.sha1(json.dumps([args.model, args.dtype, video], sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / f"vitserve-bench-video-{Path(args.model).name}-{key}"
    if not (directory / "model.safetensors").is_file():
        t = time.perf_counter()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "preprocessor_config.json").write_text(
            json.dumps(
                pixels
                | dict(
                    patch_size=cfg.patch_size,
                    temporal_patch_size=cfg.temporal_patch_size,
                    merge_size=cfg.spatial_merge_size,
                )
            )
        )
        (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
        dtype = parse_dtype(args.dtype)
        tensors = {f"visual.{k}": v.to(dtype).contiguous() for k, v in checkpoint.dummy_tensors(cfg).items()}
        save_file(tensors, str(directory / "model.safetensors.part"))
        os.rename(directory / "model.safetensors.part", directory / "model.safetensors")
        del tensors
        print(f"wrote {directory} in {time.perf_counter() - t:.1f} s", flush=True)
    args.model, args.load_format = str(directory), "auto"


# ---- bounds and requests -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def bounded(seconds: float, what: str):
    """TimeoutError in this (the main) thread once `seconds` have passed: a phase that hangs fails instead."""

    def fire(*_):
        raise TimeoutError(f"{what}: over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def multipart(fields: dict, name: str, data: bytes) -> tuple[bytes, dict]:
    """A multipart /v1/encode body of one video and its fields, and its headers (bfloat16 safetensors back)."""
    b = "vitserve-bench-video-boundary"
    head = "".join(f'--{b}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items())
    head += (
        f'--{b}\r\nContent-Disposition: form-data; name="videos"; filename="{name}"\r\nContent-Type: video/mp4\r\n\r\n'
    )
    body = head.encode() + data + f"\r\n--{b}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={b}", "accept": "application/octet-stream"}


def video_body(path: Path, fps: float) -> tuple[bytes, dict]:
    return multipart({"fps": f"{fps:g}", "dtype": "bfloat16"}, path.name, path.read_bytes())


class Connection:
    """One keep-alive connection; `post` times a request from its first byte to its answer's last, and reconnects
    after a failure."""

    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url)
        self.host, self.port, self.timeout, self.conn = parts.hostname, parts.port, timeout, None
        self.headers_s = 0.0  # the last answer: seconds from its request's first byte to its headers

    def post(self, path: str, body: bytes, headers: dict) -> tuple[float, int, bytes, dict]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        start = time.perf_counter()
        try:
            self.conn.request("POST", path, body=body, headers=headers)
            r = self.conn.getresponse()
            self.headers_s = time.perf_counter() - start
            data = r.read()
        except Exception:
            self.close()
            raise
        return time.perf_counter() - start, r.status, data, {k.lower(): v for k, v in r.getheaders()}

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def answer_frames(data: bytes) -> int:
    """Sampled frames in a safetensors answer (its metadata's `videos` timing: frame_indices per video)."""
    n = struct.unpack("<Q", data[:8])[0]
    videos = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["videos"])
    return sum(len(v["frame_indices"]) for v in videos if v)


def percentiles(ms: list[float]) -> dict:
    if not ms:
        return dict(count=0, p50_ms=None, p99_ms=None)
    return dict(
        count=len(ms), p50_ms=float(np.percentile(ms, 50)), p99_ms=float(np.percentile(ms, 99)), max_ms=float(max(ms))
    )


# ---- the server's memory -------------------------------------------------------------------------------------------
class RssSampler(threading.Thread):
    """The RSS summed over a process tree every `period` s (the tree walked again every second): (time, bytes)."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period, self.samples, self.done = pid, period, [], threading.Event()

    def run(self):
        pids, walked = [], 0.0
        while not self.done.is_set():
            now = time.perf_counter()
            if now - walked >= 1.0:
                pids, walked = process_tree(self.pid), now
            each = {}
            for p in pids:
                try:
                    each[p] = int(open(f"/proc/{p}/statm").read().split()[1]) * self.PAGE
                except (OSError, IndexError, ValueError):
                    pass
            self.samples.append((now, sum(each.values()), each))
            self.done.wait(self.period)

    def between(self, start: float, end: float) -> list[int]:
        return [b for t, b, _ in list(self.samples) if start <= t <= end]

    def by_process(self, idle: tuple[float, float], busy: tuple[float, float]) -> dict[str, float]:
        """Each process's peak RSS over `busy` above its median over `idle`, MB, by pid and command."""

        def of(span):
            out: dict[int, list[int]] = {}
            for t, _, each in list(self.samples):
                if span[0] <= t <= span[1]:
                    for p, b in each.items():
                        out.setdefault(p, []).append(b)
            return out

        before, during, names = of(idle), of(busy), {}
        for p in during:
            try:
                argv = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace").split("\0")
                cmd = " ".join([Path(argv[0]).name, *argv[1:4]])[:70]
            except OSError:
                cmd = "(exited)"
            names[f"{p} {cmd}"] = (max(during[p]) - statistics.median(before.get(p, [0]))) / 2**20
        return names


# ---- in this process: the engine alone, transformers ---------------------------------------------------------------
def free_device():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def engine_only(args, paths: list[Path]) -> dict:
    """The runner alone on the mix's slices, decoded once: sampled frames/s, pipelined in --max-batch-tokens
    batches as the server's worker runs them (launch the next batch before collecting the last)."""
    from vitserve.encoder import VisionEncoder
    from vitserve.encoder.video import load_video

    enc = VisionEncoder.from_pretrained(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format)
    try:
        cfg = enc.video_config.with_request(fps=args.fps, max_frames=args.max_video_frames)
        t = time.perf_counter()
        videos = [load_video(p, cfg) for p in paths]
        decode_s = time.perf_counter() - t
        p, budget = enc.config.patch_size, args.max_batch_tokens * enc.config.merge_unit
        # the mix over and over, at least --engine-batches full batches a pass: the pipeline drains once a pass
        once = [s for v in videos for s in v.slices()]
        repeat = max(1, -(-args.engine_batches * budget // sum((s.shape[1] // p) * (s.shape[2] // p) for s in once)))
        slices = once * repeat
        frames = repeat * sum(len(v.indices) for v in videos)
        batches = server_batches(slices, p, budget)
        run_batches(enc.runner, batches, enc.video_lut)  # warm
        passes, t = 0, time.perf_counter()
        while passes == 0 or time.perf_counter() - t < args.engine_seconds:
            run_batches(enc.runner, batches, enc.video_lut)
            passes += 1
        wall = time.perf_counter() - t
        return dict(
            frames_per_s=passes * frames / wall,
            slices_per_s=passes * len(slices) / wall,
            passes=passes,
            wall_s=wall,
            mix_per_pass=repeat,
            frames_per_pass=frames,
            slices_per_pass=len(slices),
            batches_per_pass=len(batches),
            grids=[[len(v.slices()), v.frames.shape[1] // p, v.frames.shape[2] // p] for v in videos],
            decode_s_once=decode_s,
            attention=enc.attention_backend,
        )
    finally:
        del enc
        free_device()


def hf_processor(family: str, vcfg):
    """transformers' video processor for the family, with the settings vitserve serves (`vcfg`); raises what keeps
    it from running here (no torchvision)."""
    import importlib

    importlib.import_module("torchvision")  # transformers' video processors resize with it
    if family == "qwen3":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as Processor
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as Processor
    return Processor(
        size={"shortest_edge": vcfg.min_pixels, "longest_edge": vcfg.max_pixels},
        patch_size=vcfg.patch_size,
        temporal_patch_size=vcfg.temporal_patch_size,
        merge_size=vcfg.merge_size,
        image_mean=list(vcfg.image_mean),
        image_std=list(vcfg.image_std),
        min_frames=vcfg.min_frames,
        max_frames=vcfg.max_frames,
        cap_pixels_per_frame=vcfg.cap_pixels_per_frame,
    )


def transformers_single(args, path: Path) -> dict:
    """transformers on the single clip, end to end: pyav decode and sampling, its video processor, its tower on
    --device, the tokens (and deepstack) on the host; the median of --repeats after a warm-up, and by step."""
    import torch
    from hf_reference import hf_vision_tower

    from vitserve.encoder import checkpoint
    from vitserve.encoder.vision_encoder import load_configs, parse_device, parse_dtype, video_config_of

    cfg, _, ckpt = load_configs(args.model, args.load_format)
    vcfg = video_config_of(cfg, ckpt).with_request(fps=args.fps, max_frames=args.max_video_frames)
    try:
        from transformers.video_utils import load_video

        processor = hf_processor(vcfg.family, vcfg)
    except Exception as e:  # noqa: BLE001  (what keeps it from running is the figure)
        return {"skipped": f"{type(e).__name__}: {e}"[:500]}
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    tensors = checkpoint.dummy_tensors(cfg, 0) if ckpt is None else checkpoint.read_vision_tensors(ckpt)
    tower = hf_vision_tower(cfg, tensors, device, dtype, args.hf_attention)
    del tensors
    sample = functools.partial(processor.sample_frames, fps=args.fps)

    def once() -> dict:
        t0 = time.perf_counter()
        frames, metadata = load_video(str(path), backend="pyav", sample_indices_fn=sample)
        t1 = time.perf_counter()
        out = processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt")
        t2 = time.perf_counter()
        with torch.no_grad():
            result = tower(out["pixel_values_videos"].to(device, dtype), grid_thw=out["video_grid_thw"].to(device))
            tokens = result.pooler_output.cpu()
            deepstack = [d.cpu() for d in (getattr(result, "deepstack_features", None) or [])]
        t3 = time.perf_counter()
        return dict(
            total=t3 - t0,
            decode=t1 - t0,
            processor=t2 - t1,
            tower=t3 - t2,
            frames=len(frames),
            grid=out["video_grid_thw"][0].tolist(),
            tokens=tokens.shape[0],
            deepstack=len(deepstack),
        )

    try:
        try:
            once()  # warm
        except Exception as e:  # noqa: BLE001
            return {"skipped": f"{type(e).__name__}: {e}"[:500]}
        runs = [once() for _ in range(args.repeats)]
    finally:
        tower = None  # noqa: F841  (freed before the server takes the device)
        free_device()
    return dict(
        seconds=statistics.median(r["total"] for r in runs),
        runs=[r["total"] for r in runs],
        median_by_step_s={k: statistics.median(r[k] for r in runs) for k in ("decode", "processor", "tower")},
        frames=runs[0]["frames"],
        grid=runs[0]["grid"],
        tokens=runs[0]["tokens"],
        attention=args.hf_attention,
        processor=type(processor).__name__,
    )


# ---- over HTTP -----------------------------------------------------------------------------------------------------
def warm(url: str, small: tuple[bytes, dict], bodies: list[tuple[bytes, dict]], args, connections: int) -> dict:
    """A small clip twice from each of `connections` connections at once (each decode worker imports torch at its
    first video, which is no part of a figure), then every clip of the run once."""
    errors = []

    def run(k):
        conn = Connection(url, args.request_timeout)
        for body in [small, small] + (bodies if k == 0 else []):
            try:
                _, status, data, _ = conn.post("/v1/encode", *body)
                if status != 200:
                    errors.append(f"{status}: {data[:200]!r}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        conn.close()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(connections)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} warm-up request(s) failed: {errors[0]}")
    return dict(connections=connections)


def http_single(url: str, path: Path, args) -> dict:
    body = video_body(path, args.fps)
    conn, runs = Connection(url, args.request_timeout), []
    try:
        seconds, status, data, _ = conn.post("/v1/encode", *body)  # warm
        assert status == 200, (status, data[:300])
        for _ in range(args.repeats):
            seconds, status, data, headers = conn.post("/v1/encode", *body)
            assert status == 200, (status, data[:300])
            phases = {h: float(headers.get(f"x-{h}-time", "nan")) / 1e3 for h in HEADERS}
            runs.append((seconds, phases | {"headers": conn.headers_s}))
    finally:
        conn.close()
    n = struct.unpack("<Q", data[:8])[0]
    clip = path.read_bytes()
    return dict(
        # the floor the decode stage is held to: PyAV decoding every frame of the clip on one thread, in this run
        full_decode_s=timed(lambda: full_decode(clip), 3),
        seconds=statistics.median(s for s, _ in runs),
        runs=[s for s, _ in runs],
        frames=answer_frames(data),
        grid=json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["grid_thw"])[0],
        body_mb=len(body[0]) / 1e6,
        answer_mb=len(data) / 1e6,
        median_by_header_s={h: statistics.median(p[h] for _, p in runs) for h in HEADERS},
        # the request sent and the answer's headers back (the server's whole work); the rest is the answer's body
        median_to_headers_s=statistics.median(p["headers"] for _, p in runs),
    )


def http_throughput(url: str, paths: list[Path], args) -> dict:
    """--clients threads, each sending the mix's clips in turn (each client from its own place in the mix) until
    --seconds have passed; sampled frames/s over the whole run (to the last answer) and over the middle 80% of the
    answers."""
    bodies = [video_body(p, args.fps) for p in paths]
    rows, failures, lock = [], [], threading.Lock()
    start, cpu = time.perf_counter(), time.process_time()
    deadline = start + args.seconds

    def client(k):
        conn, i = Connection(url, args.request_timeout), k
        while time.perf_counter() < deadline:
            try:
                seconds, status, data, _ = conn.post("/v1/encode", *bodies[i % len(bodies)])
                with lock:
                    if status == 200:
                        rows.append((time.perf_counter(), seconds, answer_frames(data), i % len(bodies), len(data)))
                    else:
                        failures.append(f"{status}: {data[:200]!r}")
            except Exception as e:  # noqa: BLE001
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
            i += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline + args.request_timeout + 5 - time.perf_counter()))
    hung = sum(th.is_alive() for th in threads)
    rows = sorted(rows)
    end = rows[-1][0] if rows else time.perf_counter()
    frames = sum(r[2] for r in rows)
    middle = rows[len(rows) // 10 : len(rows) - len(rows) // 10]
    steady = (sum(r[2] for r in middle[1:]) / (middle[-1][0] - middle[0][0])) if len(middle) > 1 else None
    return dict(
        clients=args.clients,
        answered=len(rows),
        failures=len(failures),
        failure_examples=failures[:3],
        hung_clients=hung,
        frames=frames,
        wall_s=end - start,
        # the clients' process (threads under one GIL): near 1 core, it is what bounds the answers read
        client_cores=(time.process_time() - cpu) / (time.perf_counter() - start),
        answer_mb_per_s=sum(r[4] for r in rows) / 1e6 / (end - start),
        frames_per_s=frames / (end - start),
        steady_frames_per_s=steady,
        latency=percentiles([r[1] * 1e3 for r in rows]),
        p50_ms_by_clip={
            paths[j].name: float(np.median([r[1] * 1e3 for r in rows if r[3] == j]))
            for j in sorted({r[3] for r in rows})
        },
    )


class ImageClients:
    """--image-clients threads sending examples/sample.jpg to /v1/embeddings back to back until stopped:
    (start, ms, status) per request."""

    def __init__(self, url: str, args):
        uri = "data:image/jpeg;base64," + base64.b64encode((ROOT / "examples" / "sample.jpg").read_bytes()).decode()
        self.body = json.dumps({"input": [uri], "encoding_format": "base64"}).encode()
        self.url, self.args, self.rows, self.errors = url, args, [], []
        self.stop, self.threads = threading.Event(), []

    def _run(self):
        conn = Connection(self.url, self.args.request_timeout)
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                seconds, status, _, _ = conn.post("/v1/embeddings", self.body, {"content-type": "application/json"})
                self.rows.append((t, seconds * 1e3, status))
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{type(e).__name__}: {e}")
        conn.close()

    def start(self):
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.args.image_clients)]
        for th in self.threads:
            th.start()
        return self

    def finish(self) -> int:
        """Stop them; how many did not stop in time."""
        self.stop.set()
        for th in self.threads:
            th.join(self.args.request_timeout + 5)
        return sum(th.is_alive() for th in self.threads)

    def between(self, start: float, end: float) -> dict:
        ok = [ms for t, ms, status in self.rows if start <= t <= end and status == 200]
        bad = sum(1 for t, _, status in self.rows if start <= t <= end and status != 200)
        return percentiles(ok) | dict(failures=bad, errors=len(self.errors))


def http_long(url: str, proc, sampler: RssSampler, path: Path, args) -> dict:
    """Idle RSS (1 s, nothing in flight), the images alone for --image-seconds, then the images beside the long
    clip, sent once: its answer's time and frames, the RSS peak above idle, the images' p50/p99 of each stretch."""
    time.sleep(1.0)
    t = time.perf_counter()
    time.sleep(1.0)
    idle_span = (t, time.perf_counter())
    idle = sampler.between(*idle_span)
    idle_rss = int(statistics.median(idle)) if idle else None
    alone = ImageClients(url, args).start()
    t0 = time.perf_counter()
    time.sleep(args.image_seconds)
    t1 = time.perf_counter()
    stuck = alone.finish()
    unloaded = alone.between(t0 + min(1.0, args.image_seconds / 5), t1)  # the first second warms the connections
    body = video_body(path, args.fps)
    beside = ImageClients(url, args).start()
    time.sleep(min(1.0, args.image_seconds / 5))
    conn, status, frames, headers, error = Connection(url, args.request_timeout), None, None, {}, None
    start = time.perf_counter()
    try:
        seconds, status, data, headers = conn.post("/v1/encode", *body)
        frames = answer_frames(data) if status == 200 else None
        error = None if status == 200 else data[:300].decode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001
        seconds, error = time.perf_counter() - start, f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    conn.close()
    time.sleep(0.5)
    stuck += beside.finish()
    peak = sampler.between(start, time.perf_counter())
    return dict(
        clip=path.name,
        body_mb=len(body[0]) / 1e6,
        status=status,
        answer_error=error,
        seconds=seconds,
        frames=frames,
        by_header_s={h: float(headers.get(f"x-{h}-time", "nan")) / 1e3 for h in HEADERS},
        idle_rss_mb=idle_rss / 2**20 if idle_rss else None,
        peak_rss_mb=max(peak) / 2**20 if peak else None,
        peak_rss_growth_mb=(max(peak) - idle_rss) / 2**20 if peak and idle_rss else None,
        server_processes=len(process_tree(proc.pid)),
        rss_samples=len(peak),
        peak_rss_growth_mb_by_process=sampler.by_process(idle_span, (start, time.perf_counter())),
        image_clients=args.image_clients,
        images_unloaded=unloaded,
        images_beside_long=beside.between(start, end),
        stuck_image_clients=stuck,
    )


# ---- the run -------------------------------------------------------------------------------------------------------
def figures(r: dict) -> list[tuple[str, str]]:
    ph, rows = r.get("phases", {}), []

    def row(label, value):
        try:
            text = value()
        except (KeyError, TypeError, ZeroDivisionError, IndexError):
            text = "–"
        rows.append((label, text))

    def ms(x):
        return "–" if x is None else f"{x:.0f}"

    single, hf = ph.get("single", {}), ph.get("transformers", {})
    if "server" in ph:
        rows.append(("server", "did not start: " + ph["server"]["error"][-80:].replace("\n", " ")))
    row(
        "video processor: pixels (min, max), frames (min, max)",
        lambda: (
            f"{r['video_config']['min_pixels']}, "
            f"{r['video_config']['max_pixels']}, {r['video_config']['min_frames']}, {r['video_config']['max_frames']}"
        ),
    )
    row(
        "single: clip",
        lambda: f"{r['clips']['single']} at {r['fps']:g} fps: {single['frames']} frames, grid {single['grid']}",
    )
    row(
        "single: vitserve over HTTP, s (median)",
        lambda: single.get("error") or f"{single['seconds']:.3f} (of {len(single['runs'])})",
    )
    row(
        "single: vitserve decode / inference, s",
        lambda: f"{single['median_by_header_s']['decode']:.3f} / {single['median_by_header_s']['inference']:.3f}",
    )
    row(
        "single: decode stage / one-thread full decode of the clip",
        lambda: (
            f"{single['median_by_header_s']['decode']:.3f} / {single['full_decode_s']:.3f} s "
            f"({single['median_by_header_s']['decode'] / single['full_decode_s']:.2f}x)"
        ),
    )
    row(
        "single: vitserve to the answer's headers / its body, s (MB)",
        lambda: (
            f"{single['median_to_headers_s']:.3f} / {single['seconds'] - single['median_to_headers_s']:.3f} "
            f"({single['answer_mb']:.1f})"
        ),
    )
    row(
        "single: transformers processor + tower, s",
        lambda: (
            ("skipped: " + hf["skipped"][:60])
            if "skipped" in hf
            else hf.get("error") or f"{hf['seconds']:.3f} ({hf['attention']})"
        ),
    )
    row(
        "single: transformers decode / processor / tower, s",
        lambda: " / ".join(f"{hf['median_by_step_s'][k]:.3f}" for k in ("decode", "processor", "tower")),
    )
    row(
        "single: transformers / vitserve",
        lambda: (
            f"{hf['seconds'] / single['seconds']:.2f}x"
            + ("" if hf["grid"] == single["grid"] else f" (grids differ: transformers {hf['grid']})")
        ),
    )
    tp, eng = ph.get("throughput", {}), ph.get("engine", {})
    row("throughput: clips", lambda: ", ".join(r["clips"]["mix"]))
    row(
        "throughput: HTTP frames/s (steady)",
        lambda: (
            tp.get("error")
            or f"{tp['frames_per_s']:.1f} ({tp['steady_frames_per_s'] or 0:.1f}), {tp['clients']} clients"
        ),
    )
    row(
        "throughput: HTTP answers, failures, p50 / p99 ms",
        lambda: f"{tp['answered']}, {tp['failures']}, {ms(tp['latency']['p50_ms'])} / {ms(tp['latency']['p99_ms'])}",
    )
    row(
        "throughput: server cores (by role)",
        lambda: (
            f"{tp['server_cores']:.1f} ({cores_text(tp['server_cores_by_role'])}); clients {tp['client_cores']:.2f}, "
            f"answers {tp['answer_mb_per_s']:.0f} MB/s"
        ),
    )
    row("throughput: engine only frames/s", lambda: eng.get("error") or f"{eng['frames_per_s']:.1f}")
    row("throughput: HTTP / engine", lambda: f"{tp['frames_per_s'] / eng['frames_per_s']:.1%}")
    lg = ph.get("long", {})
    row(
        "long: clip, frames sampled, s",
        lambda: (
            lg.get("error")
            or f"{r['clips']['long']}, {lg['frames']}, {lg['seconds']:.1f}"
            + (f" (status {lg['status']}: {lg['answer_error'][:60]})" if lg["answer_error"] else "")
        ),
    )
    row("long: server RSS idle / peak growth, MB", lambda: f"{lg['idle_rss_mb']:.0f} / +{lg['peak_rss_growth_mb']:.0f}")
    row(
        "long: image p50 / p99 ms, alone",
        lambda: (
            f"{ms(lg['images_unloaded']['p50_ms'])} / "
            f"{ms(lg['images_unloaded']['p99_ms'])} ({lg['images_unloaded']['count']})"
        ),
    )
    row(
        "long: image p50 / p99 ms, beside the long clip",
        lambda: (
            f"{ms(lg['images_beside_long']['p50_ms'])} / "
            f"{ms(lg['images_beside_long']['p99_ms'])} ({lg['images_beside_long']['count']})"
        ),
    )
    return rows


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:{width}s}  {text}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="a fast smoke configuration on the CPU: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in CPU_DEFAULTS.items()),
    )
    ap.add_argument("--model", default="Qwen/Qwen3-VL-8B-Instruct")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument(
        "--video-config",
        default=None,
        help="video processor settings (a JSON file or text, or `published`: those of the family's "
        "published checkpoints)\nfor dummy weights, served from a checkpoint directory written once "
        "(default: the processor classes' defaults)",
    )
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--fps", type=float, default=2.0, help="frames sampled a second of video (every request)")
    ap.add_argument("--clip", default="30x1280x720", help="single: SECONDSxWIDTHxHEIGHT[@FPS]")
    ap.add_argument("--clip-fps", type=float, default=30.0, help="the clips' frame rate where not given")
    ap.add_argument("--repeats", type=int, default=5, help="single: timed runs after a warm-up, each side")
    ap.add_argument("--hf-attention", default="sdpa", choices=("sdpa", "eager"), help="transformers' tower")
    ap.add_argument("--mix", default="10x1280x720,30x1280x720,20x640x360,60x854x480", help="throughput: clips")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0, help="throughput: how long the clients send")
    ap.add_argument("--engine-seconds", type=float, default=10.0, help="throughput: the engine alone, timed")
    ap.add_argument("--engine-batches", type=int, default=8, help="throughput: the engine's full batches a pass")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="the server's, and the engine's batches")
    ap.add_argument("--long-seconds", type=float, default=600.0, help="long: the clip's length")
    ap.add_argument("--long-size", default="640x360", help="long: WIDTHxHEIGHT")
    ap.add_argument("--image-clients", type=int, default=4, help="long: clients sending images")
    ap.add_argument("--image-seconds", type=float, default=15.0, help="long: the images alone, first")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags, after the bench's own")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the server to be ready")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds for any one answer")
    ap.add_argument("--clip-dir", default=str(Path(tempfile.gettempdir()) / "vitserve-bench-video"))
    ap.add_argument("--x264-preset", default="veryfast")
    ap.add_argument("--make-clips", action="store_true", help="only make the clips (into --clip-dir)")
    ap.add_argument("--out", default=None)
    if "--cpu" in sys.argv[1:]:
        ap.set_defaults(**CPU_DEFAULTS)
    args = ap.parse_args()
    phases = [p for p in PHASES if p in args.phases.split(",")]
    begin = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server

    # the clips
    specs = {
        "single": parse_clip(args.clip, args.clip_fps),
        "mix": [parse_clip(c, args.clip_fps) for c in args.mix.split(",")],
        "long": parse_clip(f"{args.long_seconds:g}x{args.long_size}", args.clip_fps),
    }
    clip_dir, photos = Path(args.clip_dir), ("sample.jpg", "portrait.png")
    with bounded(1800, "making the clips"):
        single_path = make_clip(specs["single"], clip_dir, args.x264_preset) if "single" in phases else None
        mix_paths = (
            [make_clip(c, clip_dir, args.x264_preset, photos[i % 2]) for i, c in enumerate(specs["mix"])]
            if "throughput" in phases
            else []
        )
        long_path = make_clip(specs["long"], clip_dir, args.x264_preset) if "long" in phases else None
        warm_path = make_clip(parse_clip("2x320x240", 30), clip_dir, args.x264_preset)  # every decode worker's first
    if args.make_clips:
        return
    model_name = args.model
    if args.video_config:
        with bounded(900, "writing the checkpoint"):
            with_video_config(args)
    # what a long clip needs of the server's limits; the bench's own flags, then --server-flags
    largest = max((p.stat().st_size for p in [single_path, long_path, *mix_paths] if p), default=0)
    args.max_video_frames = max(768, int(args.long_seconds * args.fps) + 2)
    flags = [
        "--model",
        args.model,
        "--load-format",
        args.load_format,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--log-level",
        "warning",
        "--cache-bytes",
        "0",
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--payload-limit",
        str(max(32 * 2**20, 2 * largest)),
        "--max-video-frames",
        str(args.max_video_frames),
        *args.server_flags.split(),
    ]
    results: dict[str, dict] = {}
    from vitserve.encoder.vision_encoder import load_configs, video_config_of

    cfg, _, ckpt = load_configs(args.model, args.load_format)
    vcfg = video_config_of(cfg, ckpt).with_request(fps=args.fps, max_frames=args.max_video_frames)
    result = dict(
        model=model_name,
        checkpoint=args.model if args.video_config else None,
        device=args.device,
        dtype=args.dtype,
        date=time.strftime("%Y-%m-%d"),
        fps=args.fps,
        server_flags=flags,
        args=vars(args),
        video_config=dataclasses.asdict(vcfg),
        phases=results,
        clips={
            "single": clip_name(specs["single"]),
            "mix": [clip_name(c) for c in specs["mix"]],
            "long": clip_name(specs["long"]),
        },
        clip_mb={p.name: p.stat().st_size / 1e6 for p in [single_path, long_path, *mix_paths] if p},
    )

    def save():
        if args.out:
            json.dump(result, open(args.out, "w"), indent=1)

    def phase(name, seconds, measure):
        t = time.perf_counter()
        try:
            with bounded(seconds, name):
                results[name] = measure()
        except Exception as e:  # noqa: BLE001  (one phase's failure is reported; the others still run)
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        results[name]["phase_s"] = time.perf_counter() - t
        print(
            f"{name}: {time.perf_counter() - t:.1f} s"
            + (f" ({results[name]['error'][:200]})" if "error" in results[name] else ""),
            flush=True,
        )
        save()

    # in this process, before the server holds the device
    if "throughput" in phases:
        phase("engine", 900 + 2 * args.engine_seconds, lambda: engine_only(args, mix_paths))
    if "single" in phases:
        phase("transformers", 900 + 60 * args.repeats, lambda: transformers_single(args, single_path))
    if "throughput" in phases or "single" in phases:
        free_device()  # what the phases' frames held, now unreferenced, leaves the device for the server

    t = time.perf_counter()
    try:
        from vitserve.service.entry.launch import start_server, stop_server

        proc, url = start_server(*flags, timeout=args.start_timeout)
    except (RuntimeError, ImportError) as e:
        results["server"] = {"error": str(e)[-2000:]}
        print(f"the server did not start: {str(e)[-500:]}", flush=True)
        proc = None
    if proc is not None:
        sampler = RssSampler(proc.pid)
        sampler.start()
        print(f"server ready in {time.perf_counter() - t:.1f} s", flush=True)
        try:
            bodies = [video_body(p, args.fps) for p in ([single_path] if single_path else []) + mix_paths]
            phase(
                "warm-up",
                (3 + len(bodies)) * args.request_timeout,
                lambda: warm(
                    url, video_body(warm_path, args.fps), bodies, args, max(2, min(args.clients, os.cpu_count() or 1))
                ),
            )
            if "single" in phases:
                phase("single", (args.repeats + 2) * args.request_timeout, lambda: http_single(url, single_path, args))
            if "throughput" in phases:
                phase(
                    "throughput",
                    args.seconds + 2 * args.request_timeout + 30,
                    lambda: with_server_cores(proc, lambda: http_throughput(url, mix_paths, args)),
                )
            if "long" in phases:
                phase(
                    "long",
                    args.image_seconds + 3 * args.request_timeout + 60,
                    lambda: http_long(url, proc, sampler, long_path, args),
                )
        finally:
            sampler.done.set()
            stop_server(proc)
    print(
        f"{model_name} on {args.device} ({args.dtype}), {time.perf_counter() - begin:.0f} s; server flags: "
        f"{' '.join(flags[2:])}"
    )
    rows = figures(result)
    print_table(rows)
    result["figures"] = dict(rows)
    save()


if __name__ == "__main__":
    main()
