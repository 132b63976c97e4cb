"""A device served by a process of its own, so that its GPU work shares no GIL with the event loop.

The server's thread for the device only moves batches: the device process reads the batch's images from the
decode workers' spool files itself (the server passes their names; an image that came through a pipe, the array),
each image's outputs come back as a spool file of its own (written by the device process's answer writers, several
files at once, beside the next batch's launch), and the pipe between them carries small typed records
(device_protocol.py; or, where the spool is full or gone, the bytes themselves: slower, never wrong). The device
process keeps two batches on its GPU (`worker.pipeline`, as a device in the server's process does); the server keeps
one more waiting in the pipe, so that the GPU never waits for the round trip.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from ...encoder import VisionEncoder
from ...encoder.vision_encoder import load_configs, parse_device, video_config_of
from ..decoding import spool
from ..ground.errors import ErrorRecord, Unavailable
from ..ground.logs import configure_logging
from ..ground.settings import Settings
from ..ground.signals import leave_to_owner
from ..ground.timeline import mark
from .device_protocol import ANSWER_WRITERS, Batch, BatchAnswer, LoadFailed, Ready, Stop, unpacked, written
from .worker import BATCHES_IN_FLIGHT, STOP, launch_decoded, pipeline


def _load(settings: Settings, device: str, dtype: str) -> VisionEncoder:
    """The model on `device`, loaded and captured, in this (the device's) process."""
    if parse_device(device).type == "cuda":  # a clear error where CUDA is missing
        torch.cuda.set_device(device)
        # the host side here is planning and copies of a few MB: on one thread. ATen's OpenMP team waits at its
        # barrier for its slowest member, and on a host busy decoding that made the plan and the pinned copies of a
        # batch take longer than the GPU's run of it
        torch.set_num_threads(1)
        if settings.devices.gpu_memory_fraction:
            torch.cuda.set_per_process_memory_fraction(settings.devices.gpu_memory_fraction)
    return VisionEncoder.from_pretrained(settings.model.model, device=device, dtype=dtype, **settings.encoder_kwargs())


class Started(Protocol):
    """A device process started before its device was known (prestart.Host), waiting to be told it."""

    process: multiprocessing.process.BaseProcess
    conn: Connection

    def assign(self, settings: Settings, device: str, dtype: str, prefix: str) -> None: ...


@dataclass
class _Ran:
    """A batch the device ran (or failed), on its way to the answering thread."""

    job: int
    outputs: list | None = None
    error: ErrorRecord | None = None


def _send_answers(conn, ran: queue.Queue, runner, prefix: str) -> None:
    """The answering thread: each batch's outputs into spool files of their own (`written`), then its BatchAnswer
    sent, until `ran` gives None."""
    names = (f"{prefix}out-{n}" for n in itertools.count())
    with ThreadPoolExecutor(ANSWER_WRITERS, thread_name_prefix="vitserve-answer-writer") as writers:
        while (batch := ran.get()) is not None:
            outputs, error = None, batch.error
            if error is None:
                outputs, error = written(batch.outputs or [], names, writers)
            mark("device written")
            try:
                conn.send(BatchAnswer(batch.job, runner.stats.as_dict(), outputs, error))
            except (OSError, ValueError):  # the server went away
                return
            except Exception as e:  # an answer that cannot be sent still ends its job: the server never waits on it
                conn.send(
                    BatchAnswer(
                        batch.job, {}, None, ErrorRecord(type(e).__name__, f"the answer could not be sent: {e}")
                    )
                )


def serve_device(conn, settings: Settings, device: str, dtype: str, prefix: str) -> None:
    """The device process: load and capture, say Ready, then run the Batches the server sends, in order, until
    Stop."""
    # lines named by the device; a progress bar only where this is the one device (two would draw over each other)
    configure_logging(
        settings.logging.log_format,
        settings.logging.log_level,
        bar=None if len(settings.devices.resolve()[0]) == 1 else False,
        source=device,
    )
    leave_to_owner()  # a group's SIGTERM or Ctrl-C: the server drains, then stops this process
    try:
        encoder = _load(settings, device, dtype)
    except Exception as e:
        conn.send(LoadFailed(f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(encoder.runner.stats.as_dict()))

    def take(block: bool):
        if not block and not conn.poll():
            return None
        batch = conn.recv()
        if isinstance(batch, Stop):
            return STOP
        mark("device batch")
        return batch

    # answers are written and sent by a thread of their own: writing megabytes of token features to their files
    # overlaps the next batch's launch instead of delaying it (the GPU would wait)
    ran: queue.Queue = queue.Queue()
    sender = threading.Thread(
        target=_send_answers, args=(conn, ran, encoder.runner, prefix), name="vitserve-answers", daemon=True
    )
    sender.start()

    def launch(batch: Batch):
        try:
            launched = launch_decoded(encoder, batch.images, batch.sizes, batch.mean_pooling, batch.float32)
            mark("device launched")
            return launched
        except Exception as e:
            ran.put(_Ran(batch.job, error=ErrorRecord.of(e)))
            return None

    def answer(batch: Batch, launched) -> None:
        try:
            outputs = encoder.outputs(launched)
            mark("device ran")
            ran.put(_Ran(batch.job, outputs))
        except Exception as e:
            ran.put(_Ran(batch.job, error=ErrorRecord.of(e)))

    try:
        pipeline(take, launch, answer, BATCHES_IN_FLIGHT)
    except (EOFError, OSError, KeyboardInterrupt):  # the server went away: nothing to answer
        pass
    ran.put(None)
    sender.join()


class ProcessDevice:
    """The server's end of a device process (a device for `worker.DeviceWorker`): starts it, sends Batches,
    receives BatchAnswers (device_protocol.py). One thread uses it. `collect` gives each image's tensors, or with
    `records` its `Output` record (the core hands those on to the front ends without touching the bytes)."""

    depth = BATCHES_IN_FLIGHT + 1  # the device process runs two; one more waits in its pipe

    def __init__(
        self,
        settings: Settings,
        device: str,
        dtype: str,
        prefix: str,
        patch_size: int,
        records: bool = False,
        started: Started | None = None,
    ):
        self.name, self.prefix, self.patch_size, self.records = device, prefix, patch_size, records
        if started is not None:  # started at the server's start (devices/prestart.py), its imports done or under way
            self.conn, self.process = started.conn, started.process
            try:
                started.assign(settings, device, dtype, prefix)
            except OSError:
                raise RuntimeError(
                    f"the process for {device} exited while starting (exit code {self.process.exitcode})"
                ) from None
        else:
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's state
            self.conn, child = context.Pipe()
            self.process = context.Process(
                target=serve_device,
                args=(child, settings, device, dtype, prefix),
                name=f"vitserve-{device}",
                daemon=True,
            )
            self.process.start()
            child.close()
        self.stats: dict = {}
        self._jobs = itertools.count()
        self._answers: dict[int, BatchAnswer] = {}
        atexit.register(self._kill)  # until closed: a server that ends while this loads must not wait for it

    def _kill(self) -> None:
        """The process killed if it still runs, its spool files removed: `close`'s last step, and at the server's exit
        for a device process never closed (the server was stopped while it loaded): it ignores SIGTERM, and
        multiprocessing's exit would otherwise wait for it forever."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        spool.clear(self.prefix)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> None:
        """Blocks until the process has loaded and captured (RuntimeError when it could not)."""
        try:
            message = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the process for {self.name} exited while loading (exit code {self.process.exitcode})"
            ) from None
        if not isinstance(message, Ready):
            raise RuntimeError(f"{self.name}: {message.error}")
        self.stats = message.stats

    def bind_thread(self) -> None:
        pass

    def _lost(self) -> Unavailable:
        return Unavailable(
            f"the process serving {self.name} exited (exit code {self.process.exitcode}); the server is restarting",
            "device_lost",
        )

    def launch(self, batch) -> int:
        job = next(self._jobs)
        mark("batch sent")
        images = [item.image for item in batch]
        try:
            self.conn.send(
                Batch(
                    job,
                    images,
                    [item.size(self.patch_size) for item in batch],
                    [item.mean_pooling for item in batch],
                    [item.float32 for item in batch],
                )
            )
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
        mark("batch answered")
        self.stats = answer.stats or self.stats
        if answer.error is not None:
            raise answer.error.error()
        outputs = answer.outputs
        assert outputs is not None  # (a batch without an error has its outputs)
        if self.records:
            return outputs
        return [unpacked(output) for output in outputs]

    def runner_stats(self) -> dict:
        return self.stats

    def close(self, timeout: float = 30) -> None:
        atexit.unregister(self._kill)
        try:
            self.conn.send(Stop())
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        self._kill()  # (if it has not stopped by then)


def start_devices(
    settings: Settings,
    devices: list[str],
    dtype: str,
    prefix: str,
    *,
    records: bool = False,
    started=lambda: None,
    waiting=lambda: None,
) -> tuple:
    """Blocking: the model in one process per device, loading and capturing side by side. Returns (config,
    preprocess_config, video_config, processes) once every process is ready; `started()` is called when all are
    started (they load and capture from then on). `waiting()`: a process started ahead for the next device, if one
    waits (prestart.take). On a failure the started processes are closed and the error raised."""
    s = settings
    config, preprocess_config, ckpt = load_configs(
        s.model.model,
        s.model.load_format,
        s.model.revision,
        min_pixels=s.decoding.min_pixels,
        max_pixels=s.decoding.max_pixels,
    )
    video_config = video_config_of(
        config, ckpt, s.decoding.video_decoder, s.model.model, s.decoding.video_min_pixels, s.decoding.video_max_pixels
    )
    processes = []
    try:
        for i, device in enumerate(devices):
            processes.append(ProcessDevice(s, device, dtype, f"{prefix}dev{i}-", config.patch_size, records, waiting()))
        started()
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.close(5)
        raise
    return config, preprocess_config, video_config, processes
