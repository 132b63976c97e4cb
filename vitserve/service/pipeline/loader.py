"""Loading the model onto the devices: in this process (an encoder per device, threads run them) or in one process
per device (service/device_process.py), loading and capturing side by side. Blocking: it runs off the event loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ... import __version__
from ...encoder import VisionEncoder
from ...encoder.config import VisionConfig
from ...encoder.preprocess import PreprocessConfig
from ...encoder.video import VideoConfig
from ..devices import prestart
from ..devices.device_process import start_devices
from ..devices.worker import LocalDevice
from ..ground.flags import format_size
from ..ground.logs import attention_text
from ..ground.settings import Settings
from .lifecycle import Lifecycle

log = logging.getLogger("vitserve.engine")


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs of the model itself: the tower's config and its preprocessing."""

    config: VisionConfig
    preprocess_config: PreprocessConfig
    video_config: VideoConfig

    @classmethod
    def of(cls, encoder: VisionEncoder) -> ModelInfo:
        return cls(encoder.config, encoder.preprocess_config, encoder.video_config)


def serving_text(
    settings: Settings, devices: list[str], process_each: bool, dtype: str, attention: dict, decode_workers: int
) -> str:
    """What serves, for the startup's ready line: version, model, devices, dtype, attention, decode workers, cache."""
    s = settings
    cache = (
        "off"
        if not s.cache.cache_bytes
        else f"{format_size(s.cache.cache_bytes)} per {'API key' if s.cache.cache_scope == 'api-key' else 'server'}"
    )
    return (
        f"vitserve {__version__}, {s.model.model} on {', '.join(devices)}{', one process each' * process_each} "
        f"({dtype}, attention {attention_text(attention)}), {decode_workers} decode "
        f"{'processes' if s.decoding.decode_processes else 'threads'}, cache {cache}"
    )


def load_here(settings: Settings, devices: list[str], dtype: str, life: Lifecycle) -> tuple[ModelInfo, list]:
    """An encoder per device in this process, loaded one after the other, then their graphs captured."""
    prestart.release()  # device processes started ahead (the flags foretold them) serve nothing here
    s = settings
    encoders = []
    for device in devices:
        if s.devices.gpu_memory_fraction and device.startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(s.devices.gpu_memory_fraction, torch.device(device))
        log.info("loading %s (%s) on %s as %s", s.model.model, s.model.load_format, device, dtype)
        encoders.append(
            VisionEncoder.from_pretrained(
                s.model.model, device=device, dtype=dtype, capture=False, **s.encoder_kwargs()
            )
        )
    if any(e.runner.use_graphs for e in encoders):
        log.info("loaded; capturing CUDA graphs")
    life.capturing()
    for encoder in encoders:
        encoder.capture()
    return ModelInfo.of(encoders[0]), [LocalDevice(e) for e in encoders]


def load_processes(
    settings: Settings, devices: list[str], dtype: str, prefix: str, life: Lifecycle, records: bool, also: str = ""
) -> tuple[ModelInfo, list]:
    """One process per device; done when all are loaded and captured. `records`: their answers stay Output records
    (spool files), not tensors. `also`: the log line's end (the core's front ends)."""
    s = settings
    log.info(
        "loading %s (%s) on %s as %s, one process per device%s",
        s.model.model,
        s.model.load_format,
        ", ".join(devices),
        dtype,
        also,
    )

    def started() -> None:
        prestart.release()  # started ahead for devices the server does not serve after all
        life.capturing()

    config, preprocess_config, video_config, processes = start_devices(
        s, devices, dtype, prefix, records=records, started=started, waiting=prestart.take
    )
    return ModelInfo(config, preprocess_config, video_config), processes
