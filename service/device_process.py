"""A device served by a process of its own (`--device-processes`), so that its GPU thread shares no GIL with the
event loop.

With threads, two H200s served 1.57x one: each GPU thread gave up the GIL at every torch call and waited for the
event loop to hand it back (a 9.5-image batch took 111 ms on two GPUs against 93 ms on one), while the runners alone
scaled 2.01x. Here the server's thread for the device only moves batches: the device process reads the batch's
images from the decode workers' spool files itself (the server passes their names; an image that came through the
pipe, the array), its outputs come back as a spool file of their own, and the pipe between them carries
descriptions (or, where the spool is full or gone, the bytes themselves: slower, never wrong).
The device process keeps two batches on its GPU, like the in-process worker; the server keeps a third one waiting
in the pipe, so that the GPU never waits for the round trip.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import signal

import numpy as np
import torch

from encoder import VisionEncoder
from encoder.vision_encoder import parse_device
from encoder.preprocess import normalize_lut

from . import spool
from .settings import Settings

log = logging.getLogger("vitserve.device")


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def _pack_outputs(outputs) -> tuple[list, list[np.ndarray]]:
    """Every image's tensors (tokens or mean, then deepstack) as raw bytes to lay back to back, and their layout."""
    arrays, layout = [], []
    for first, deepstack in outputs:
        entry = []
        for t in (first, *deepstack):
            t = t.contiguous()
            arrays.append(t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8))
            entry.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
        layout.append(entry)
    return layout, arrays


def _unpack_outputs(raw: np.ndarray, layout: list) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    raw, outputs, offset = torch.from_numpy(raw), [], 0
    for entry in layout:
        tensors = []
        for dtype, shape, n in entry:
            tensors.append(raw[offset:offset + n].view(getattr(torch, dtype)).view(shape))
            offset += n
        outputs.append((tensors[0], tensors[1:]))
    return outputs


def serve_device(conn, settings: Settings, device: str, dtype: str, prefix: str) -> None:
    """The device process: load and capture, say ready, then run the batches the server sends, in order."""
    from .cli import configure_logging  # the server's log format (text or JSON) and level

    configure_logging(settings.log_format, settings.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops this process
    try:
        if parse_device(device).type == "cuda":  # a clear error where CUDA is missing
            torch.cuda.set_device(device)
            if settings.gpu_memory_fraction:
                torch.cuda.set_per_process_memory_fraction(settings.gpu_memory_fraction)
        encoder = VisionEncoder.from_pretrained(settings.model, device=device, dtype=dtype, **settings.encoder_kwargs())
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    runner, names = encoder.runner, itertools.count()
    conn.send(("ready", runner.stats.as_dict()))
    cfg = encoder.preprocess_config
    lut = normalize_lut(cfg.image_mean, cfg.image_std)
    pending: collections.deque = collections.deque()

    def answer(job: int, launch) -> None:
        try:
            layout, arrays = _pack_outputs(runner.collect(launch))
            path = f"{prefix}out-{next(names)}"
            # a full or missing spool: the bytes go through the pipe (as bytes: a pickled tensor would go through
            # shared memory, /dev/shm again), slower, never wrong
            data = None if spool.write(path, arrays) else b"".join(a.tobytes() for a in arrays)
        except Exception as e:
            conn.send((job, None, None, _error(e), runner.stats.as_dict(), None))
        else:
            conn.send((job, path, layout, None, runner.stats.as_dict(), data))

    try:
        while True:
            if pending and not conn.poll():
                answer(*pending.popleft())  # nothing new to launch behind it: wait for it to land
                continue
            message = conn.recv()
            if message is None:
                break
            job, images, pool_mean = message
            try:
                launch = runner.launch_images(spool.pixels(images), lut, pool_mean)
            except Exception as e:
                conn.send((job, None, None, _error(e), runner.stats.as_dict(), None))
                continue
            pending.append((job, launch))
            if len(pending) > 1:
                answer(*pending.popleft())
        while pending:
            answer(*pending.popleft())
    except (EOFError, OSError, KeyboardInterrupt):  # the server went away: nothing to answer
        pass


class DeviceProcess:
    """The server's end of a device process: starts it, sends batches, receives outputs (one thread uses it)."""

    def __init__(self, settings: Settings, device: str, dtype: str, prefix: str):
        self.device, self.prefix = device, prefix
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's state
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_device, args=(child, settings, device, dtype, prefix),
                                       name=f"vitserve-{device}", daemon=True)
        self.process.start()
        child.close()
        self.stats: dict = {}
        self._jobs = itertools.count()
        self._answers: dict[int, tuple] = {}

    def wait_ready(self) -> None:
        """Blocks until the process has loaded and captured (RuntimeError when it could not)."""
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the process for {self.device} exited while loading "
                               f"(exit code {self.process.exitcode})") from None
        if kind != "ready":
            raise RuntimeError(f"{self.device}: {payload}")
        self.stats = payload

    def launch(self, images: list, pool_mean: list[bool]) -> int:
        """Send a batch: spooled images (`spool.Spooled`) by name, arrays as they are."""
        job = next(self._jobs)
        try:
            self.conn.send((job, images, pool_mean))
        except OSError:  # BrokenPipeError: the process is gone
            for image in images:
                spool.discard(image)
            raise DeviceLost(f"the process serving {self.device} exited (exit code {self.process.exitcode})") from None
        return job

    def collect(self, job: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        while job not in self._answers:
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                raise DeviceLost(f"the process serving {self.device} exited (exit code "
                                 f"{self.process.exitcode})") from None
            self._answers[answer[0]] = answer
        _, path, layout, error, self.stats, data = self._answers.pop(job)
        if error is not None:
            kind, message = error
            raise (torch.OutOfMemoryError if kind == "OutOfMemoryError" else RuntimeError)(f"{kind}: {message}")
        size = sum(n for entry in layout for _, _, n in entry)
        return _unpack_outputs(np.frombuffer(data, np.uint8).copy() if data is not None else spool.read(path, size),
                               layout)

    def stop(self, timeout: float = 30) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        spool.clear(self.prefix)


class DeviceLost(RuntimeError):
    """The device process is gone: its batches fail and the server reports itself failed."""
