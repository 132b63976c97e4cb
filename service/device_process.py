"""A device served by a process of its own, so that its GPU work shares no GIL with the event loop.

The server's thread for the device only moves batches: the device process reads the batch's images from the
decode workers' spool files itself (the server passes their names; an image that came through a pipe, the array),
each image's outputs come back as a spool file of its own (written by a thread of the device process, beside the
next batch's launch), and the pipe between them carries small typed records (or, where the spool is full or gone,
the bytes themselves: slower, never wrong). The device process keeps two batches
on its GPU (`worker.pipeline`, as a device in the server's process does); the server keeps one more waiting in the
pipe, so that the GPU never waits for the round trip.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..encoder import VisionEncoder
from ..encoder.preprocess import ImageError
from ..encoder.vision_encoder import load_configs, parse_device, video_config_of

from . import spool
from .errors import Unavailable
from .logs import configure_logging
from .settings import Settings, resolve_devices
from .signals import leave_to_owner
from .worker import BATCHES_IN_FLIGHT, STOP, pipeline


@dataclass
class Ready:
    """Device process -> server: loaded and captured."""

    stats: dict


@dataclass
class LoadFailed:
    """Device process -> server: the model could not be loaded or captured there."""

    error: str


@dataclass
class Job:
    """Server -> device process: a batch to run (spooled images by name, others as arrays or EncodedJpeg), each
    image's (height, width) to run at, and which are mean-pooled."""

    job: int
    images: list
    sizes: list[tuple[int, int]]
    mean_pooling: list[bool]


@dataclass
class Answer:
    """Device process -> server: a job's outputs, one per image (an `Output`, or ("error", code, message) for an
    image the device could not decode), or the job's error."""

    job: int
    stats: dict
    outputs: list | None = None
    error: tuple[str, str] | None = None  # exception type name, message


@dataclass
class Output:
    """One image's tensors (tokens or mean, then deepstack), as (dtype name, shape, bytes) each, laid back to back in
    the spool file `path` (or in `data`, where the spool is full or gone: slower, never wrong). The file belongs to
    whoever holds this record: `tensors` maps it, and it is removed then unless kept (the embedding cache keeps
    it), or by `discard`."""

    entries: list
    grid: tuple[int, int, int] | None = None  # set by the core (the cache answers with it)
    path: str | None = None
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.entries)

    def tensors(self, keep: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tensors over the file's pages (mapped copy-on-write: no copy is made; OSError when the file is
        gone); the file is removed unless `keep`."""
        if self.data is not None:
            raw = np.frombuffer(self.data, np.uint8).copy()
        elif self.nbytes == 0:
            raw = np.empty(0, np.uint8)
        else:
            try:
                raw = np.memmap(self.path, np.uint8, mode="c", shape=(self.nbytes,))
            finally:
                if not keep:
                    spool.remove(self.path)
        raw, tensors, offset = torch.from_numpy(raw), [], 0
        for dtype, shape, n in self.entries:
            tensors.append(raw[offset:offset + n].view(getattr(torch, dtype)).view(shape))
            offset += n
        return tensors[0], tensors[1:]

    def discard(self) -> None:
        if self.path is not None:
            spool.remove(self.path)


def _pack(output, path: str) -> Output | tuple:
    """An image's outputs written to the spool file `path` (or kept as bytes where it cannot be written)."""
    if isinstance(output, ImageError):
        return "error", output.code, output.public
    arrays, entries = [], []
    first, deepstack = output
    for t in (first, *deepstack):
        t = t.contiguous()
        arrays.append(t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8))
        entries.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
    # a full or missing spool: the bytes go through the pipe (as bytes: a pickled tensor would go through shared
    # memory, /dev/shm again), slower, never wrong
    if spool.write(path, arrays):
        return Output(entries, path=path)
    return Output(entries, data=b"".join(a.tobytes() for a in arrays))


def unpacked(output) -> tuple | ImageError:
    """An Answer's output for one image as the engine takes it: (tokens, deepstack list), or the ImageError."""
    if isinstance(output, Output):
        return output.tensors()
    error = ImageError(output[2])
    error.code = output[1]
    return error


def serve_device(conn, settings: Settings, device: str, dtype: str, prefix: str) -> None:
    """The device process: load and capture, say Ready, then run the Jobs the server sends, in order."""
    # lines named by the device; a progress bar only where this is the one device (two would draw over each other)
    configure_logging(settings.log_format, settings.log_level, bar=None if len(resolve_devices(settings)[0]) == 1
                      else False, source=device)
    leave_to_owner()  # a group's SIGTERM or Ctrl-C: the server drains, then stops this process
    try:
        if parse_device(device).type == "cuda":  # a clear error where CUDA is missing
            torch.cuda.set_device(device)
            # the host side here is planning and copies of a few MB: on one thread. ATen's OpenMP team waits at its
            # barrier for its slowest member, and on a host busy decoding that made the plan and the pinned copies
            # of a batch take longer than the GPU's run of it
            torch.set_num_threads(1)
            if settings.gpu_memory_fraction:
                torch.cuda.set_per_process_memory_fraction(settings.gpu_memory_fraction)
        encoder = VisionEncoder.from_pretrained(settings.model, device=device, dtype=dtype, **settings.encoder_kwargs())
    except Exception as e:
        conn.send(LoadFailed(f"{type(e).__name__}: {e}"))
        return
    runner, names = encoder.runner, itertools.count()
    conn.send(Ready(runner.stats.as_dict()))

    def take(block: bool):
        if not block and not conn.poll():
            return None
        job = conn.recv()
        return STOP if job is None else job

    # answers are written and sent by a thread of their own: writing megabytes of token features to their files
    # overlaps the next batch's launch instead of delaying it (the GPU would wait)
    answers: queue.Queue = queue.Queue()

    def send_answers() -> None:
        while (item := answers.get()) is not None:
            job, outputs, error = item
            packed = []
            try:
                for output in outputs or ():
                    packed.append(_pack(output, f"{prefix}out-{next(names)}"))
            except Exception as e:
                error = (type(e).__name__, str(e))
            if error is not None:
                for output in packed:
                    if isinstance(output, Output):
                        output.discard()
                packed = None
            try:
                conn.send(Answer(job, runner.stats.as_dict(), packed, error))
            except (OSError, ValueError):  # the server went away
                return
            except Exception as e:  # an answer that cannot be sent still ends its job: the server never waits on it
                conn.send(Answer(job, {}, None, (type(e).__name__, f"the answer could not be sent: {e}")))

    sender = threading.Thread(target=send_answers, name="vitserve-answers", daemon=True)
    sender.start()

    def launch(job: Job):
        try:
            return encoder.launch(spool.pixels(job.images), job.sizes, job.mean_pooling)
        except Exception as e:
            answers.put((job.job, None, (type(e).__name__, str(e))))
            return None

    def answer(job: Job, launched) -> None:
        try:
            answers.put((job.job, encoder.outputs(launched), None))
        except Exception as e:
            answers.put((job.job, None, (type(e).__name__, str(e))))

    try:
        pipeline(take, launch, answer, BATCHES_IN_FLIGHT)
    except (EOFError, OSError, KeyboardInterrupt):  # the server went away: nothing to answer
        pass
    answers.put(None)
    sender.join()


ERRORS = {"OutOfMemoryError": torch.OutOfMemoryError, "ImageLost": spool.ImageLost}  # re-raised as themselves


class ProcessDevice:
    """The server's end of a device process (a device for `worker.DeviceWorker`): starts it, sends Jobs, receives
    Answers. One thread uses it. `collect` gives each image's tensors, or with `records` its `Output` record (the
    core hands those on to the front ends without touching the bytes)."""

    depth = BATCHES_IN_FLIGHT + 1  # the device process runs two; one more waits in its pipe

    def __init__(self, settings: Settings, device: str, dtype: str, prefix: str, patch_size: int,
                 records: bool = False):
        self.name, self.prefix, self.patch_size, self.records = device, prefix, patch_size, records
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's state
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_device, args=(child, settings, device, dtype, prefix),
                                       name=f"vitserve-{device}", daemon=True)
        self.process.start()
        child.close()
        self.stats: dict = {}
        self._jobs = itertools.count()
        self._answers: dict[int, Answer] = {}

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> None:
        """Blocks until the process has loaded and captured (RuntimeError when it could not)."""
        try:
            message = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the process for {self.name} exited while loading "
                               f"(exit code {self.process.exitcode})") from None
        if not isinstance(message, Ready):
            raise RuntimeError(f"{self.name}: {message.error}")
        self.stats = message.stats

    def bind_thread(self) -> None:
        pass

    def _lost(self) -> Unavailable:
        return Unavailable(f"the process serving {self.name} exited (exit code {self.process.exitcode}); the server "
                           "is restarting", "device_lost")

    def launch(self, batch) -> int:
        job = next(self._jobs)
        images = [item.image for item in batch]
        try:
            self.conn.send(Job(job, images, [item.size(self.patch_size) for item in batch],
                               [item.mean_pooling for item in batch]))
        except OSError:  # BrokenPipeError: the process is gone
            for image in images:
                spool.discard(image)
            raise self._lost() from None
        return job

    def collect(self, job: int) -> list:
        while job not in self._answers:
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                raise self._lost() from None
            self._answers[answer.job] = answer
        answer = self._answers.pop(job)
        self.stats = answer.stats or self.stats
        if answer.error is not None:
            kind, message = answer.error
            raise ERRORS.get(kind, RuntimeError)(f"{kind}: {message}" if kind not in ERRORS else message)
        if self.records:
            return answer.outputs
        return [unpacked(output) for output in answer.outputs]

    def runner_stats(self) -> dict:
        return self.stats

    def close(self, timeout: float = 30) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        spool.clear(self.prefix)


def start_devices(settings: Settings, devices: list[str], dtype: str, prefix: str, *, records: bool = False,
                  started=lambda: None) -> tuple:
    """Blocking: the model in one process per device, loading and capturing side by side. Returns (config,
    preprocess_config, video_config, processes) once every process is ready; `started()` is called when all are started (they load
    and capture from then on). On a failure the started processes are closed and the error raised."""
    s = settings
    config, preprocess_config, ckpt = load_configs(s.model, s.load_format, s.revision, min_pixels=s.min_pixels,
                                                   max_pixels=s.max_pixels)
    video_config = video_config_of(config, ckpt, s.video_decoder, s.model, s.video_min_pixels,
                                   s.video_max_pixels)
    processes = []
    try:
        for i, device in enumerate(devices):
            processes.append(ProcessDevice(s, device, dtype, f"{prefix}dev{i}-", config.patch_size, records))
        started()
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.close(5)
        raise
    return config, preprocess_config, video_config, processes
