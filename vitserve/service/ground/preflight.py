"""The checks of the settings against this machine, before anything loads or binds (ValueError when wrong): the
CUDA devices asked for exist, the model can be found, an attention backend named explicitly runs on the devices, and
the encoder tiers have their folder and packages."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from ...encoder.config import BUILTIN_CONFIGS, builtin_config
from .machine import ATTENTION_PACKAGES, downloads_allowed, installed
from .settings import Settings
from .settings_groups import DeviceSettings, ModelSettings
from .settings_media import TierSettings


def prepare(settings: Settings) -> list[str]:
    """Check what depends on this machine, before anything loads or binds (ValueError when wrong): the CUDA devices
    asked for exist, the model can be found (a name that cannot is refused at once, with the closest built-in
    name), an attention backend named explicitly runs on the devices, and the encoder tiers have their folder
    and packages. A tiny-* built-in, which has no checkpoint anywhere, switches to dummy weights. Returns lines to log
    about what was implied."""
    check_devices(settings.devices)
    notes = check_model(settings.model)
    check_attention(settings.devices)
    check_tiers(settings.tiers)
    return notes


def check_tiers(tiers: TierSettings) -> None:
    """The encoder tiers' needs: --ec-shared-storage an existing folder this user can write in (it is not
    created: a typo would go unnoticed), blake3 for its default digest, pyzmq for --sglang-encoder."""
    if tiers.ec_shared_storage is not None:
        path = Path(tiers.ec_shared_storage)
        if not path.is_dir():
            raise ValueError(
                f"--ec-shared-storage {tiers.ec_shared_storage}: "
                + (
                    "not a directory"
                    if path.exists()
                    else "no such directory (create it: the folder vLLM's consumer reads)"
                )
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--ec-shared-storage {tiers.ec_shared_storage}: not writable by this user")
        if tiers.ec_hash_algorithm == "blake3" and not installed("blake3"):
            raise ValueError(
                "--ec-shared-storage names items by vLLM's default digest, blake3, which is not "
                "installed: pip install 'vitserve[ec]' (or --ec-hash-algorithm, as the consumer's "
                "--mm-hasher-algorithm)"
            )
    if tiers.sglang_encoder and not installed("zmq"):
        raise ValueError("--sglang-encoder pushes over ZMQ, and pyzmq is not installed: pip install 'vitserve[sglang]'")


def check_devices(devices: DeviceSettings) -> None:
    asked = devices.asked()
    cuda = [d for d in asked if d.startswith("cuda")]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"device {cuda[0]} asked for, but CUDA is not available on this machine "
            f"(torch.cuda.is_available() is false); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    for d in cuda:
        if int(d.partition(":")[2] or 0) >= count:
            raise ValueError(
                f"device {d} asked for, but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )


def check_model(model: ModelSettings) -> list[str]:
    """A local path is left to the load (which reports one that is missing). Otherwise the name must be able to
    load: with dummy weights, a built-in name (load_configs resolves anything else as a checkpoint, through the
    hub); without, a tiny-* built-in (dummy weights implied) or a hub id, which has an organization (`org/name`,
    as every Qwen-VL id). With downloads off (HF_HUB_OFFLINE), a hub id must be in the local Hugging Face cache,
    looked up offline."""
    if Path(model.model).expanduser().exists() or model.model.startswith((".", "/", "~")):
        return []
    try:
        builtin_config(model.model)
        builtin = True
    except KeyError:
        builtin = False
    if model.load_format == "dummy":
        if not builtin:
            raise ValueError(
                f"--model {model.model!r} with --load-format dummy: not a built-in name, and no local "
                f"checkpoint directory of that name{did_you_mean(model.model)}"
            )
        return []
    if builtin and model.model.lower().startswith("tiny-"):
        if model.load_format != "auto":
            raise ValueError(f"{model.model} is a built-in test tower with no checkpoint: use --load-format dummy")
        model.load_format = "dummy"
        return [
            f"{model.model} is a built-in test tower with no checkpoint: using seeded random weights "
            "(--load-format dummy)"
        ]
    if "/" not in model.model:
        what = (
            "a built-in name, but not a hub id (org/name)"
            if builtin
            else "not a local directory, a built-in name or a hub id (org/name)"
        )
        raise ValueError(f"--model {model.model!r}: {what}{did_you_mean(model.model)}")
    if downloads_allowed():
        return []  # the load fetches what the cache lacks
    from huggingface_hub.constants import HF_HUB_CACHE

    from ...encoder.checkpoint import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(model.model, model.revision, allow_download=False)
    except CheckpointError as e:
        if not builtin:
            raise
        raise ValueError(
            f"{model.model!r} is not a local directory and not in the Hugging Face cache "
            f"({HF_HUB_CACHE}), and downloads are off (HF_HUB_OFFLINE=1): add --load-format dummy "
            f"for seeded random weights, or download it first (hf download {model.model}), or allow "
            "downloads (unset HF_HUB_OFFLINE)"
        ) from e
    return []


def check_attention(devices: DeviceSettings) -> None:
    """An attention backend named explicitly must run on every device. auto and sdpa run anywhere. Where
    encoder.attention.select needs no device to decide (the CPU, float32 on CUDA, and torch's own flash kernel),
    it decides here; on CUDA in half precision it would compile and check fa4's or cuDNN's kernel, which is the
    load's work, in the device's own process: here their package is looked for (not imported)."""
    name = devices.attention_backend
    if name in ("auto", "sdpa"):
        return
    import torch

    from ...encoder import attention
    from ...encoder.vision_encoder import parse_dtype

    served, dtype_name = devices.resolve()
    dtype = parse_dtype(dtype_name)
    for device in map(torch.device, dict.fromkeys(served)):
        if name in ATTENTION_PACKAGES and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            module, extra = ATTENTION_PACKAGES[name]
            if not installed(module):
                raise ValueError(
                    f"attention backend {name!r} is unavailable: {module} is not installed; "
                    f"pip install 'vitserve[{extra}]'"
                )
        else:
            attention.select(name, device, dtype, heads=1, head_dim=4)  # its ValueError, or nothing to build


def did_you_mean(model: str) -> str:
    """`; did you mean <the closest built-in name>?` (difflib, ignoring case), or where to find the names."""
    names = {name.lower(): name for name in BUILTIN_CONFIGS}
    match = difflib.get_close_matches(model.lower(), names, n=1)
    return f"; did you mean {names[match[0]]}?" if match else "; --help lists the built-in names"
