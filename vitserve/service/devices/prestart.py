"""Device processes started before the server imports torch.

A device process's first seconds are its interpreter importing torch and the tower's code, then its CUDA context;
the server's own first seconds are the same imports, its settings checked (CUDA asked what devices there are), the
port bound and the front ends started, so a device process started after those begins its seconds only then.
`start` spawns them first, at `vitserve serve`'s start, from what the flags say without torch: each imports the
device process's code while the server imports its own, makes its CUDA context on the GPU it will most likely serve,
and then waits for its `Assignment` (the settings, its device and dtype, its spool prefix). A device
(`device_process.ProcessDevice`, from the loader) takes one (`take`) where one waits and starts one afresh where
none does; the ones not taken once every device has its process go (`release`).

This module imports no torch and nothing of the tower (a started process imports it to find `host`).
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..ground.signals import leave_to_owner

if TYPE_CHECKING:
    from ..ground.settings import Settings

GPU_DRIVER_NODE = "/dev/nvidiactl"  # where it is, `--device auto` will be a GPU (as far as can be known without torch)


@dataclass
class Assignment:
    """What a started device process serves, sent to it once the server has resolved its devices."""

    settings: Settings
    device: str
    dtype: str
    prefix: str


@dataclass
class Host:
    """A device process started ahead: the process and the server's end of its pipe (a device_process.Started)."""

    process: multiprocessing.process.BaseProcess
    conn: Connection

    def assign(self, settings: Settings, device: str, dtype: str, prefix: str) -> None:
        """Tell it what it serves (OSError: it is gone)."""
        self.conn.send(Assignment(settings, device, dtype, prefix))


_waiting: list[Host] = []


def expected_devices(settings: Settings, gpu_driver: bool | None = None) -> int:
    """How many device processes the server will start, as far as the flags say without torch: 0 where that
    cannot be known (`--devices all`: CUDA counts them), where devices are served from threads (`--device-processes
    false`, or its default on CPU devices), or where `auto` may be the CPU (no GPU driver). `gpu_driver`: whether the
    machine has one (default: GPU_DRIVER_NODE exists)."""
    asked, processes = settings.devices.asked(), settings.devices.device_processes
    if processes is False or not asked:
        return 0
    if gpu_driver is None:
        gpu_driver = os.path.exists(GPU_DRIVER_NODE)
    if "auto" in asked and not gpu_driver:
        return 0  # auto is the CPU, or a GPU that only CUDA can tell of
    if processes is None and not all(d == "auto" or d.startswith("cuda") for d in asked):
        return 0  # the default serves CPU devices from threads
    return len(asked)


def start(settings: Settings) -> None:
    """Spawn the device processes the flags foretell (`expected_devices`); each waits for its Assignment, having
    made its CUDA context on the GPU the flags name for it (devices are served in the order they are asked for;
    `auto` is cuda:0 where it is a GPU)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter, as ProcessDevice starts one
    asked = settings.devices.asked()
    for i in range(expected_devices(settings)):
        likely = "cuda:0" if asked[i] == "auto" else asked[i]
        conn, child = context.Pipe()
        process = context.Process(target=host, args=(child, likely), name="vitserve-device", daemon=True)
        process.start()
        child.close()
        _waiting.append(Host(process, conn))


def take() -> Host | None:
    """A started device process waiting for its Assignment, if one is."""
    return _waiting.pop(0) if _waiting else None


def release() -> None:
    """The started processes no device took go: killed (they hold nothing yet but their imports and a CUDA context,
    and they ignore SIGTERM as device processes do), so that a server ending early does not wait for them."""
    while _waiting:
        waiting = _waiting.pop()
        waiting.conn.close()
        waiting.process.kill()
        waiting.process.join()


def host(conn: Connection, likely: str) -> None:
    """A started device process: import the device's code, make the CUDA context where `likely` is a GPU, wait for
    the Assignment, serve it (or exit when the server closes the pipe first). A context that cannot be made here is
    left to the load, which says why."""
    leave_to_owner()  # as a device process does: the server decides when it stops
    from .device_process import serve_device  # torch and the tower: the import this process is started early for

    if likely.startswith("cuda"):
        import torch

        try:
            torch.cuda.set_device(likely)
            torch.empty(0, device=likely)  # the context made now, not at the load's first tensor
        except Exception:
            pass
    try:
        assignment = conn.recv()
    except (EOFError, OSError):
        return
    serve_device(conn, assignment.settings, assignment.device, assignment.dtype, assignment.prefix)
