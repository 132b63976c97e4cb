"""Settings: one group of each kind (settings_groups.py) for `serve` and `encode`; each component receives its
group. Every field is a kebab-case flag and a VITSERVE_* environment variable of its own name (flags.py generates
them from the groups), and every value is checked before anything loads or binds: each group's on its own, what spans
groups here, what depends on this machine by preflight.py (from the facts of machine.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .machine import available_cpus
from .settings_groups import BatchingSettings, DeviceSettings, LogSettings, ModelSettings, ServerSettings, check
from .settings_media import CacheSettings, DecodingSettings, LimitSettings, TierSettings


@dataclass
class Settings:
    """`serve`'s and `encode`'s settings: one group per concern, each checked on its own, then what spans groups."""

    model: ModelSettings
    devices: DeviceSettings = field(default_factory=DeviceSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    decoding: DecodingSettings = field(default_factory=DecodingSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    tiers: TierSettings = field(default_factory=TierSettings)
    logging: LogSettings = field(default_factory=LogSettings)

    def __post_init__(self):
        check(
            [
                (
                    self.server.api_servers <= 1 or self.devices.device_processes is not False,
                    "--api-servers above 1 serves the devices from processes of their own: drop "
                    "--device-processes false",
                ),
                (
                    not self.tiers.sglang_encoder or self.server.api_servers <= 1,
                    "--sglang-encoder pairs each /encode part with its receivers' registrations in one process: it "
                    "takes one front end (--api-servers 1)",
                ),
                (
                    self.cache.cache_scope != "api-key" or self.server.api_key,
                    "--cache-scope api-key needs --api-key (the keys are the scopes)",
                ),
            ]
        )

    @classmethod
    def of(cls, **values) -> Settings:
        """Settings from fields by their flat names (the flags' and variables' own: model=, device=, port=, ...);
        every other field keeps its default. An unknown name is a TypeError, as a dataclass's."""
        groups: dict[str, Any] = {}  # each group under its field's name
        for group in dataclasses.fields(cls):
            names = {f.name for f in dataclasses.fields(GROUP_TYPES[group.name])}
            groups[group.name] = GROUP_TYPES[group.name](**{k: values.pop(k) for k in list(values) if k in names})
        if values:
            raise TypeError(f"unknown settings: {', '.join(sorted(values))}")
        return cls(**groups)

    def encoder_kwargs(self) -> dict:
        """VisionEncoder.from_pretrained's arguments from these settings, besides model, device and dtype: the same
        wherever a device loads (a thread of the server, a device process, or `vitserve encode`)."""
        budgets, decoding = self.devices.budget_list(), self.decoding
        return dict(
            load_format=self.model.load_format,
            revision=self.model.revision,
            min_pixels=decoding.min_pixels,
            max_pixels=decoding.max_pixels,
            video_min_pixels=decoding.video_min_pixels,
            video_max_pixels=decoding.video_max_pixels,
            attention_backend=self.devices.attention_backend,
            preprocess=decoding.preprocess,
            video_decoder=decoding.video_decoder,
            **({} if budgets is None else {"budgets": budgets}),
        )

    def batching_stats(self, decode_workers: int) -> dict:
        """/stats' `batching`: the settings that shape batches, and the decode workers running."""
        return {
            "max_batch_tokens": self.batching.max_batch_tokens,
            "max_batch_wait_ms": self.batching.max_batch_wait_ms,
            "max_concurrent_requests": self.limits.max_concurrent_requests,
            "max_images_per_request": self.limits.max_images_per_request,
            "preprocess": self.decoding.preprocess,
            "decode_workers": decode_workers,
            "decode_processes": self.decoding.decode_processes,
        }

    def api_server_count(self) -> int:
        """The front ends to run: `--api-servers`, else one per 4 CPUs this process may use (2 to 8) where a device
        is a GPU (the front end is what caps a GPU), and 1 on CPU devices, with --device-processes false or with
        --sglang-encoder."""
        if self.server.api_servers:
            return self.server.api_servers
        if (
            self.devices.device_processes is False
            or self.tiers.sglang_encoder  # (SGLang's calls pair up in one process)
            or not any(d.startswith("cuda") for d in self.devices.resolve()[0])
        ):
            return 1
        return min(8, max(2, available_cpus() // 4))


SettingsGroup = (
    ModelSettings
    | DeviceSettings
    | ServerSettings
    | BatchingSettings
    | LimitSettings
    | DecodingSettings
    | CacheSettings
    | TierSettings
    | LogSettings
)
# each group's type, by its name in Settings (dataclasses.fields gives the annotation as a string)
GROUP_TYPES: dict[str, type[SettingsGroup]] = {
    "model": ModelSettings,
    "devices": DeviceSettings,
    "server": ServerSettings,
    "batching": BatchingSettings,
    "limits": LimitSettings,
    "decoding": DecodingSettings,
    "cache": CacheSettings,
    "tiers": TierSettings,
    "logging": LogSettings,
}
