"""Facts about this machine that the settings depend on, read apart from them: the CPUs this process may use (its
affinity and cgroup quota), the CUDA devices, whether a package is installed, and whether the hub may download."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

# the attention backends that need a package of their own (encoder.attention): its module, and vitserve's extra
ATTENTION_PACKAGES = {"fa4": ("flash_attn.cute", "fa4"), "cudnn": ("cudnn", "cudnn")}


def installed(module: str) -> bool:
    """Whether `module` can be imported (looked for, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or one without a spec
        return False


def downloads_allowed() -> bool:
    """Whether a hub id missing from the cache may be downloaded: unless HF_HUB_OFFLINE is set (as the loader)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes")


def resolve_devices(asked: list[str], dtype: str) -> tuple[list[str], str]:
    """The devices to serve on: those `asked` for (`auto`: cuda:0 where CUDA is, else the CPU), every CUDA device
    where none is (`--devices all`; the CPU without one); and the dtype (auto: bfloat16 on CUDA, float32 on the
    CPU)."""
    import torch

    if asked:
        served = [("cuda:0" if torch.cuda.is_available() else "cpu") if d == "auto" else d for d in asked]
    else:
        count = torch.cuda.device_count()
        served = [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    if dtype == "auto":
        dtype = "bfloat16" if served[0].startswith("cuda") else "float32"
    return served, dtype


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
