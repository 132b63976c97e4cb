"""A video's sampled frames decoded by the GPU's video engines (NVDEC, through PyNvVideoCodec: the `nvdec` extra,
imported on first use) into device memory, and each sampled frame's NV12 planes copied out as its planes row
(video_planes: Y, then U and V), the bytes FFmpeg's software decoder gives for the same frame (measured on the H200
for H.264, HEVC and VP9: docs/decisions.md), ready for the devices' exact conversion (encoder.pixels).

The packets are PyAV's, fed as the sampled decode plans them (video_decode.plan_decode): a group of pictures that
no sampled frame needs is not fed at all; a group that is fed is fed whole up to the last packet needed (NVDEC
decodes every frame it is given). H.264 and HEVC stored length-prefixed (MP4, MKV) pass FFmpeg's Annex B filters
first, and the stream's parameter sets go with the first packet (a part of an open-GOP video starts at a keyframe
that carries none). Frames are placed by their presentation time, as in the software path. `load_video`
(VideoConfig.decoder "nvdec", `--video-decoder nvdec`) decodes through it, the software decoder its fallback; a
process that decodes here holds a CUDA context on its current device.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .video_decode import NOTHING, Unmapped, packet_infos, plan_decode, planned_packets
from .video_planes import FORMATS, Conversion, PlanesLayout

# PyAV's codec name -> (PyNvVideoCodec's cudaVideoCodec member, the bitstream filter its packets need, if any,
# the smallest and the largest (width, height) NVDEC decodes: NVIDIA's NVDEC support matrix, Ampere and later)
CODECS = {
    "h264": ("H264", "h264_mp4toannexb", (48, 16), (4096, 4096)),
    "hevc": ("HEVC", "hevc_mp4toannexb", (144, 144), (8192, 8192)),
    "vp9": ("VP9", None, (128, 128), (8192, 8192)),
    "av1": ("AV1", None, (128, 128), (8192, 8192)),
}


class NvdecError(RuntimeError):
    """NVDEC could not give the frames asked for (the caller decodes them in software)."""


def unavailable() -> str | None:
    """Why NVDEC cannot decode in this process (PyNvVideoCodec or CUDA missing), or None where it can."""
    try:
        import PyNvVideoCodec  # noqa: F401
        import torch
    except ImportError as e:
        return f"PyNvVideoCodec cannot be imported ({e}): pip install 'vitserve[nvdec]'"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def layout_of(stream: Any) -> PlanesLayout | None:
    """The planes layout of a video stream's frames as its header declares them, where NVDEC's output converts
    exactly (8-bit 4:2:0, a colour matrix swscale knows, an even height); else None."""
    context = stream.codec_context
    full = FORMATS.get(context.pix_fmt or "")
    if full is None:
        return None
    conversion = Conversion.of(int(context.colorspace), full or int(context.color_range) == 2, context.height)
    return None if conversion is None else PlanesLayout(context.height, context.width, conversion)


def parameter_sets(codec: str, extradata: bytes | None) -> bytes:
    """The parameter sets of an H.264 stream (SPS, PPS) or an HEVC one (VPS, SPS, PPS) from its MP4/MKV extradata
    (avcC, hvcC), in Annex B: fed with the first packet, since a decode that starts at a keyframe other than an IDR
    picture (a part of an open-GOP video) carries none of its own (FFmpeg's Annex B filters add them before IDR
    pictures only). b"" where the extradata holds none in those forms (absent, or Annex B already)."""
    data = bytes(extradata or b"")
    if codec not in ("h264", "hevc") or data[:1] != b"\x01":
        return b""
    nals, at = [], 0

    def take(count: int) -> None:  # `count` length-prefixed NAL units from `at`
        nonlocal at
        for _ in range(count):
            size = int.from_bytes(data[at : at + 2], "big")
            nals.append(data[at + 2 : at + 2 + size])
            at += 2 + size

    try:
        if codec == "h264":
            at = 6
            take(data[5] & 0x1F)  # the SPSs
            at += 1
            take(data[at - 1])  # the PPSs
        else:
            at = 23
            for _ in range(data[22]):  # arrays of one NAL unit type each (VPS, SPS, PPS, SEI)
                at += 3
                take(int.from_bytes(data[at - 2 : at], "big"))
    except IndexError:
        return b""
    if at > len(data) or not all(nals):
        return b""
    return b"".join(b"\x00\x00\x00\x01" + nal for nal in nals)


def _current_context() -> tuple[int, int]:
    """(CUDA context, stream) torch uses on this thread: the decoder decodes on torch's stream, so that the copies
    torch makes of its frames follow the decode."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # torch's context is current from here
    handle = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(handle))
    return int(handle.value or 0), int(torch.cuda.current_stream().cuda_stream)


def load_planes(container: Any, kept: np.ndarray) -> tuple[np.ndarray, PlanesLayout] | None:
    """The planes rows (uint8 [len(kept), row_bytes], in `kept`'s order) of the frames at indices `kept` of an
    open PyAV container whose input can be read twice, decoded by NVDEC, and their layout; None where NVDEC or
    the exact conversion cannot take this stream (its codec, its size, its pixel format, or a stream the plan cannot
    map). NvdecError where NVDEC fails on it or does not give every frame asked for."""
    import av

    stream = container.streams.video[0]
    codec, layout = CODECS.get(stream.codec_context.name), layout_of(stream)
    if codec is None or layout is None:
        return None
    (least_w, least_h), (most_w, most_h) = codec[2], codec[3]
    if not (least_w <= layout.width <= most_w and least_h <= layout.height <= most_h):
        return None
    import PyNvVideoCodec as nvc
    import torch

    wanted = {int(i): n for n, i in enumerate(kept)}
    packets = packet_infos(container, stream, 2 * max(int(stream.frames), int(kept[-1]) + 1) + 64)
    plan = plan_decode(packets, set(wanted)) if packets is not None else None
    if plan is None:
        return None
    context, cuda_stream = _current_context()
    try:
        decoder = nvc.CreateDecoder(
            gpuid=torch.cuda.current_device(),
            codec=getattr(nvc.cudaVideoCodec, codec[0]),
            cudacontext=context,
            cudastream=cuda_stream,
            usedevicememory=1,
        )
    except Exception as e:  # noqa: BLE001  (PyNvVideoCodec raises its own types, and RuntimeError)
        raise NvdecError(f"NVDEC does not open {stream.codec_context.name}: {e}") from None
    bsf = av.bitstream.BitStreamFilterContext(codec[1], stream) if codec[1] else None
    first = [parameter_sets(stream.codec_context.name, stream.codec_context.extradata)]  # (with the first packet)
    rows = np.empty((len(kept), layout.row_bytes), dtype=np.uint8)
    filled = np.zeros(len(kept), dtype=bool)

    def take(frames) -> None:
        for frame in frames:
            index = plan.index_of.get(int(frame.timestamp))
            if index in wanted:
                _copy_out(frame, layout, rows[wanted[index]])
                filled[wanted[index]] = True

    def feed(data: bytes, pts: int) -> None:
        if first and data:
            data = first.pop() + data
        packet = nvc.PacketData()
        buffer = np.frombuffer(data, dtype=np.uint8)  # (held until Decode returns: NVDEC parses it there)
        packet.bsl_data, packet.bsl, packet.pts = buffer.ctypes.data if len(buffer) else 0, len(buffer), pts
        take(decoder.Decode(packet))

    try:
        for packet, skip in planned_packets(container, stream, plan):
            if skip != NOTHING:
                for part in bsf.filter(packet) if bsf is not None else [packet]:
                    feed(bytes(part), part.pts or 0)
        if bsf is not None:
            for part in bsf.filter(None):
                feed(bytes(part), part.pts or 0)
        feed(b"", 0)  # the end of the stream: the frames NVDEC holds for reordering come out
    except Unmapped:
        raise NvdecError("a packet the demux pass did not see") from None
    except (av.error.FFmpegError, RuntimeError) as e:
        raise NvdecError(f"NVDEC failed on this video: {e}") from None
    if not filled.all():
        raise NvdecError(f"NVDEC gave {int(filled.sum())} of the {len(kept)} frames asked for")
    return rows, layout


def _copy_out(frame: Any, layout: PlanesLayout, row: np.ndarray) -> None:
    """A decoded NV12 frame (device memory) into its planes row on the host: Y, then its interleaved chroma split
    into U and V."""
    import torch

    h, w = layout.height, layout.width
    ch, cw = layout.chroma
    y, uv = (torch.as_tensor(plane, device="cuda") for plane in frame.cuda())
    if tuple(y.shape[:2]) != (h, w) or tuple(uv.shape[:2]) != (ch, cw):
        raise NvdecError(f"a frame of {y.shape[1]}x{y.shape[0]}, not the header's {w}x{h}")
    out = torch.from_numpy(row)
    out[: h * w].view(h, w).copy_(y[:h, :w, 0])
    out[h * w : h * w + ch * cw].view(ch, cw).copy_(uv[:ch, :cw, 0])
    out[h * w + ch * cw :].view(ch, cw).copy_(uv[:ch, :cw, 1])
