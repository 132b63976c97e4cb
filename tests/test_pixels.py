"""The exact integer pixel arithmetic (encoder.pixels) against the libraries it reproduces: FFmpeg's yuv420p →
rgb24 conversion as PyAV runs it, and torch's CPU uint8 bicubic antialias resize (torchvision's, in transformers'
video processors); on CUDA, the same ops against the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitserve.encoder.pixels import resize, resize_plan, yuv_to_rgb
from vitserve.encoder.video_planes import Conversion

av = pytest.importorskip("av")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_frame(width: int, height: int, fmt: str, seed: int):
    """A PyAV frame of random planes, and the planes (uint8 tensors, each cut to its plane's width)."""
    rng = np.random.default_rng(seed)
    frame = av.VideoFrame(width, height, fmt)
    planes = []
    for plane in frame.planes:
        data = rng.integers(0, 256, (plane.height, plane.line_size), dtype=np.uint8)
        plane.update(data.tobytes())
        planes.append(torch.from_numpy(data[:, : plane.width].copy()))
    return frame, planes


MATRICES = {1: "BT.709", 2: "unspecified", 4: "FCC", 5: "BT.470 BG", 6: "SMPTE 170M", 7: "SMPTE 240M", 9: "BT.2020"}


@pytest.mark.parametrize("size", [(1280, 720), (854, 480), (853, 480), (17, 8), (2, 2)], ids=str)
@pytest.mark.parametrize("colorspace", list(MATRICES), ids=list(MATRICES.values()))
@pytest.mark.parametrize("fmt, full", [("yuv420p", False), ("yuvj420p", True), ("yuv420p", True)])
def test_the_conversion_is_ffmpegs(size, colorspace, fmt, full):
    """Every value of random planes (so every product and clamp), each colour matrix, limited and full range (a
    yuvj420p frame, or a yuv420p one tagged full range), odd widths."""
    width, height = size
    frame, (y, u, v) = random_frame(width, height, fmt, seed=width + colorspace)
    frame.colorspace = colorspace
    if fmt == "yuv420p" and full:
        frame.color_range = 2  # JPEG range
    conversion = Conversion.of(colorspace, full, height)
    assert conversion is not None
    ours = yuv_to_rgb(y, u, v, conversion).permute(1, 2, 0).numpy()
    assert np.array_equal(ours, frame.to_ndarray(format="rgb24"))


def test_a_frame_of_odd_height_or_an_unknown_matrix_has_no_exact_conversion():
    """swscale converts a frame of odd height through its general scaler, which this does not reproduce."""
    assert Conversion.of(2, False, 481) is None and Conversion.of(8, False, 480) is None
    frame, (y, u, v) = random_frame(64, 49, "yuv420p", seed=1)
    assert not np.array_equal(
        yuv_to_rgb(y, u, v, Conversion.of(2, False, 48)).permute(1, 2, 0).numpy(), frame.to_ndarray(format="rgb24")
    )


SIZES = [
    ((720, 1280), (480, 832)),  # 720p to Qwen3-VL's 2 fps frame
    ((720, 1278), (476, 840)),  # down one way, up the other
    ((360, 640), (448, 784)),  # up
    ((1080, 1920), (280, 504)),  # far down
    ((97, 131), (56, 224)),  # odd
    ((64, 64), (64, 128)),  # one axis unchanged
    ((30, 50), (600, 1000)),  # far up
]


@pytest.mark.parametrize("source, target", SIZES, ids=str)
def test_the_resize_is_torchs_uint8_antialias_kernel(source, target):
    x = torch.randint(0, 256, (2, 3, *source), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    reference = F.interpolate(x, size=list(target), mode="bicubic", align_corners=False, antialias=True)
    assert torch.equal(resize(x, resize_plan(*source, *target)), reference)


def test_a_decoded_frame_converted_and_resized_is_what_load_video_keeps():
    """A real clip's sampled frames: the planes PyAV decodes, converted and resized here, equal load_video's frames
    (swscale's conversion, torch's resize)."""
    from videos import make_video

    from vitserve.encoder import video as V

    data = make_video(24, 12, 320, 180)
    cfg = V.VideoConfig("qwen2", 14, fps=2.0, do_sample_frames=True, min_pixels=56 * 56, max_pixels=224 * 224)
    video = V.load_video(data, cfg)
    container = V._open(data)
    planes = {}
    for i, frame in enumerate(container.decode(container.streams.video[0])):
        if i in set(video.indices.tolist()):
            conversion = Conversion.of(frame.colorspace, frame.format.name == "yuvj420p", frame.height)
            y, u, v = (torch.from_numpy(frame.to_ndarray(format="yuv420p")), None, None)
            h, w = frame.height, frame.width
            flat = y.flatten()
            y = flat[: h * w].view(h, w)
            u = flat[h * w : h * w + (h // 2) * (w // 2)].view(h // 2, w // 2)
            v = flat[h * w + (h // 2) * (w // 2) :].view(h // 2, w // 2)
            planes[i] = yuv_to_rgb(y, u, v, conversion)
    container.close()
    _, height, width, _ = video.frames.shape
    plan = resize_plan(180, 320, height, width)
    for n, i in enumerate(video.indices.tolist()):
        assert np.array_equal(resize(planes[i], plan).permute(1, 2, 0).numpy(), video.frames[n]), i


@cuda
def test_the_same_ops_on_cuda_give_the_same_bytes():
    frame, (y, u, v) = random_frame(1280, 720, "yuv420p", seed=3)
    conversion = Conversion.of(1, False, 720)
    cpu = yuv_to_rgb(y, u, v, conversion)
    gpu = yuv_to_rgb(y.cuda(), u.cuda(), v.cuda(), conversion)
    assert torch.equal(gpu.cpu(), cpu)
    plan = resize_plan(720, 1280, 480, 832)
    assert torch.equal(resize(gpu, plan.to("cuda")).cpu(), resize(cpu, plan))


@cuda
@pytest.mark.parametrize(
    "shape",
    [(720, 1280, 480, 832), (480, 854, 308, 560), (480, 853, 480, 853), (36, 54, 72, 80), (40, 62, 40, 30)],
    ids=str,
)
def test_the_fused_kernels_give_the_tensor_ops_bytes(shape):
    """kernels.triton_pixels against its reference (the tensor ops here, fused=False) on random planes: downscale
    on both axes, an odd width kept, upscale, one axis only; BT.709 limited and BT.601 full range; three frames."""
    from vitserve.encoder.pixels import frames_from_planes
    from vitserve.encoder.video_planes import PlanesLayout

    h, w, height, width = shape
    for colorspace, full in ((1, False), (2, True)):
        layout = PlanesLayout(h, w, Conversion.of(colorspace, full, h))
        rows = torch.randint(0, 256, (3, layout.row_bytes), dtype=torch.uint8, device="cuda")
        fused = frames_from_planes(rows, layout, (height, width), "cuda", fused=True)
        reference = frames_from_planes(rows, layout, (height, width), "cuda", fused=False)
        assert fused.shape == (3, height, width, 3) and torch.equal(fused, reference)
        assert torch.equal(fused.cpu(), frames_from_planes(rows.cpu(), layout, (height, width), "cpu"))


def test_slices_of_several_videos_are_made_together_and_each_is_its_own():
    """Slices of two layouts and sizes, interleaved: each comes back as its own frames (those frames_from_planes
    makes of it alone), in its place."""
    from vitserve.encoder.pixels import frames_from_planes, slices_from_planes
    from vitserve.encoder.video_planes import PlanesLayout, SlicePlanes

    rng = np.random.default_rng(4)
    a = PlanesLayout(48, 64, Conversion.of(2, False, 48))
    b = PlanesLayout(36, 50, Conversion.of(1, True, 36))
    slices = [
        SlicePlanes(rng.integers(0, 256, (2, layout.row_bytes), dtype=np.uint8), layout, size)
        for layout, size in [(a, (28, 56)), (b, (56, 84)), (a, (28, 56)), (a, (56, 56)), (b, (56, 84))]
    ]
    made = slices_from_planes(slices, "cpu")
    for s, frames in zip(slices, made):
        assert torch.equal(frames, frames_from_planes(s.rows, s.layout, s.size, "cpu"))
