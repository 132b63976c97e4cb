"""What one request may hold, checked where the request is read, before anything is decoded: images and videos per
request, and from them the values a JSON body may carry and the files a multipart form may. The limits on one item
(pixels, a video's seconds and frames, decode work) are checked where the item is measured (decoder.py,
engine.py's video options), the bytes of a body by the gate."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputTooLarge
from .settings_media import LimitSettings


@dataclass(frozen=True)
class RequestLimits:
    """--max-images-per-request and --max-videos-per-request, and what follows from them."""

    images: int
    videos: int

    @classmethod
    def of(cls, limits: LimitSettings) -> RequestLimits:
        return cls(limits.max_images_per_request, limits.max_videos_per_request)

    @property
    def items(self) -> int:
        """Media of either kind in one request."""
        return self.images + self.videos

    @property
    def part_values(self) -> int:
        """The values a body of media parts (a chat request, an SGLang /encode call) is scanned for: several per
        part (its type, its URL object, its uuid)."""
        return 4 * self.items

    @property
    def form_files(self) -> int:
        """The file parts a multipart form may hold: every image and video, and one more (which says "too many")."""
        return self.items + 1

    def check_images(self, count: int, field: str) -> None:
        if count > self.images:
            raise InputTooLarge(f"{count} images in one request; the limit is {self.images}", "too_many_images", field)

    def check_videos(self, count: int, field: str) -> None:
        if count > self.videos:
            raise InputTooLarge(f"{count} videos in one request; the limit is {self.videos}", "too_many_videos", field)
