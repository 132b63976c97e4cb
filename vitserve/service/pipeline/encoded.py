"""A request's answer as the pipeline gives it to the API: its items' Features and its phases' times."""

from __future__ import annotations

from dataclasses import dataclass

from ...encoder.features import Features


@dataclass
class Encoded:
    """A request's answer: per item its Features (encoder/features.py: tokens, or their mean with mean pooling, the
    deepstack features, the grid, and a video's timing: frame_indices, fps, timestamps, second_per_grid_t); how long
    decoding its items took, and the longest queue and inference times among them; the images the cache answered."""

    outputs: list[Features]
    decode_s: float
    queue_s: float
    inference_s: float
    cache_hits: int = 0
