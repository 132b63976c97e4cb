"""The fast preprocessing (opt-in: `preprocess="fast"`): what transformers' default image processor for Qwen-VL, the
torchvision-backed "fast" one (`Qwen2VLImageProcessor`), does to an image, run on the model's device.

* decode: JPEGs (RGB or grayscale) by nvJPEG on the GPU (`torchvision.io.decode_jpeg(device=...)`) where
  torchvision is installed, their EXIF orientation applied there; every other image, and a JPEG nvJPEG refuses, by
  PIL on the host (`preprocess.load_image`), then copied to the device through pinned memory.
* resize: to `smart_resize`'s size with torchvision's `resize` arithmetic (bicubic, antialiased): on CUDA in float32,
  clamped to 0..255, rounded, back to uint8; on the CPU torch's native uint8 kernel. The same image size in and out
  is not filtered.
* normalize: the processor's fused float32 arithmetic, `(x - 255 * mean) / (255 * std)`, as a (3, 256) table
  (`fast_lut`) the runner gathers from, like the exact path's.

The trade-off: it is not bit-identical to the PIL processor (the default, `preprocess.py`).
nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a few levels on average, more at sharp chroma
edges, and the float resize rounds a level apart from PIL's fixed-point one here and there (a mean difference under
0.005 in normalized units, the tolerance transformers holds its two processors to). What it buys: no decode of a
JPEG and no resize on the host.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .image_resize import pillow_resize_images
from .pixels import upload
from .preprocess import EncodedJpeg, ImageError, PreprocessConfig, load_for_device, load_image, target_size


@functools.cache
def nvjpeg_available() -> bool:
    """Whether JPEGs can be decoded on a CUDA device here: torchvision with its image extension, and CUDA."""
    if not torch.cuda.is_available():
        return False
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception:  # not installed, or built for another torch
        return False
    return True


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """[C, H, W] as PIL's `ImageOps.exif_transpose` turns an image with this EXIF orientation (1-8)."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return torch.rot90(image, -1, (-2, -1))
    if orientation == 7:
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return torch.rot90(image, 1, (-2, -1))
    return image


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [3, H, W] -> [3, height, width] as torchvision's `resize(image, (height, width), BICUBIC,
    antialias=True)` computes it on that device."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    x = image.contiguous()[None]
    if x.device.type == "cpu":  # torchvision takes torch's native uint8 kernel there
        return F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)[0]
    out = F.interpolate(x.float(), size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)[0]


@functools.lru_cache(maxsize=32)
def fast_lut(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(3, 256) float32: uint8 value v of channel c as the fast processor normalizes it, in float32
    `(v - float32(mean[c]) * 255) / (float32(std[c]) * 255)` (rescale fused into normalize)."""
    m = np.asarray(mean, np.float32)[:, None] * np.float32(255.0)
    s = np.asarray(std, np.float32)[:, None] * np.float32(255.0)
    lut = ((np.arange(256, dtype=np.float32)[None, :] - m) / s).astype(np.float32)
    lut.setflags(write=False)
    return lut


def _nvjpeg(jpegs: list[EncodedJpeg], device: torch.device) -> list[torch.Tensor | None]:
    """[3, H, W] uint8 on the device per JPEG (None where nvJPEG refuses it, or is not there), all in one batched
    call when it can."""
    if device.type != "cuda" or not nvjpeg_available():
        return [None] * len(jpegs)
    from torchvision.io import ImageReadMode, decode_jpeg

    inputs = [torch.from_numpy(np.frombuffer(j.data, np.uint8).copy()) for j in jpegs]
    try:
        return list(decode_jpeg(inputs, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one bad file fails the batch: each alone, so only it falls back
        out = []
        for x in inputs:
            try:
                out.append(decode_jpeg(x, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host uint8 [H, W, 3] image as [3, H, W] on the device."""
    return upload(array, device).permute(2, 0, 1)


def load(images: list, device: torch.device) -> list[np.ndarray | EncodedJpeg]:
    """PIL images, encoded bytes or paths as resize_on_device takes them for `device`: JPEGs left encoded where
    nvJPEG decodes them there, the rest decoded by PIL, full size."""
    jpeg_on_device = torch.device(device).type == "cuda" and nvjpeg_available()
    return [load_for_device(x, jpeg_on_device) for x in images]


def resize_on_device(
    images: list, sizes: list[tuple[int, int]], device: torch.device, exact: bool = False
) -> list[torch.Tensor | ImageError]:
    """Decoded (uint8 [H, W, 3] host arrays, full size) or still encoded (EncodedJpeg) images -> each resized on
    `device` to its (height, width) in `sizes`, uint8 [h, w, 3], by the fast processor's arithmetic (`resize`) or,
    `exact`, by Pillow's (encoder.image_resize: the PIL processor's bytes, host arrays only, all in one upload); an
    ImageError in place of an image that cannot be decoded (a JPEG neither nvJPEG nor PIL reads), so that only it
    fails."""
    device = torch.device(device)
    if exact:
        return list(pillow_resize_images([np.asarray(x) for x in images], sizes, device))
    chw: list = [None] * len(images)
    jpegs = [i for i, x in enumerate(images) if isinstance(x, EncodedJpeg)]
    if jpegs:
        for i, decoded in zip(jpegs, _nvjpeg([images[i] for i in jpegs], device)):
            jpeg = images[i]
            stored = (jpeg.height, jpeg.width) if jpeg.orientation < 5 else (jpeg.width, jpeg.height)
            if decoded is not None and tuple(decoded.shape[-2:]) == stored:
                chw[i] = orient(decoded, jpeg.orientation)
                continue
            try:  # PIL's turn: it decodes more (CMYK inside, arithmetic coding) and names what is wrong; the size
                # its header declares passed the server's limit already
                chw[i] = _upload(np.asarray(load_image(jpeg.data, max_image_pixels=jpeg.height * jpeg.width)), device)
            except ImageError as e:
                chw[i] = e
    out: list = []
    for i, (image, (h, w)) in enumerate(zip(images, sizes)):
        x = chw[i] if chw[i] is not None else _upload(image, device)
        if not isinstance(x, ImageError):
            x = resize(x, h, w).permute(1, 2, 0).contiguous()
        out.append(x)
    return out


def preprocess(
    images: list, cfg: PreprocessConfig, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast processor's output for PIL images, encoded bytes or paths: (pixel_values [rows, patch_dim] float32,
    grid_thw [n, 3] int64) on the CPU, in its layout. Decoding as `load` does; ImageError for a bad image."""
    device = torch.device(device)
    loaded = load(images, device)
    resized = resize_on_device(loaded, [target_size(x, cfg) for x in loaded], device)
    frames: list[torch.Tensor] = []
    for x in resized:
        if isinstance(x, ImageError):
            raise x
        frames.append(x)
    lut = torch.tensor(fast_lut(cfg.image_mean, cfg.image_std), device=device)
    rows, grids, p, m, t = [], [], cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    for x in frames:
        h, w = x.shape[0] // p, x.shape[1] // p
        values = lut[torch.arange(3, device=device)[:, None, None], x.permute(2, 0, 1).long()]  # [3, H, W]
        patches = values.reshape(3, h // m, m, p, w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # processor order
        rows.append(patches[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, t, -1, -1).reshape(h * w, -1).cpu())
        grids.append((1, h, w))
    return torch.cat(rows), torch.tensor(grids, dtype=torch.long)
