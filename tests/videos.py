"""Test videos made with PyAV from the repository's real photos (examples/): a camera panning and zooming across a
photo, encoded in the codec, container and frame rate asked for; and hostile ones made from them (MP4 headers that
declare what the file does not hold, damaged bytes, empty streams, streams that never end). Nothing downloads; each
call builds its bytes."""

from __future__ import annotations

import fractions
import io
import struct
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = Path(__file__).resolve().parent.parent / "examples"


def frames_of(photo: str, count: int, width: int, height: int) -> list[np.ndarray]:
    """`count` RGB frames of width x height: a window sliding and shrinking across the photo."""
    image = Image.open(PHOTOS / photo).convert("RGB")
    w, h = image.size
    out = []
    for i in range(count):
        s = i / max(count - 1, 1)
        cw, ch = int(w * (0.9 - 0.3 * s)), int(h * (0.9 - 0.3 * s))
        x, y = int((w - cw) * s), int((h - ch) * (1 - s) * 0.5)
        out.append(np.asarray(image.crop((x, y, x + cw, y + ch)).resize((width, height), Image.BILINEAR)))
    return out


def make_video(
    count: int = 24,
    fps: float = 12,
    width: int = 160,
    height: int = 120,
    codec: str = "h264",
    container: str = "mp4",
    photo: str = "sample.jpg",
    rates: list[int] | None = None,
    options: dict[str, str] | None = None,
    pix_fmt: str | None = None,
) -> bytes:
    """An encoded video of `count` frames. `rates`: per-frame durations in 1/1000 s (a variable frame rate);
    `options`: the encoder's (e.g. {"g": "30", "bf": "0"}: keyframes every 30 frames, no B-frames); `pix_fmt`: the
    stream's pixel format (default: yuv420p, MJPEG's yuvj420p)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        rate = fractions.Fraction(fps).limit_denominator(1001)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt or ("yuvj420p" if codec == "mjpeg" else "yuv420p")
        stream.options = options or {}
        if rates is not None:
            stream.time_base = stream.codec_context.time_base = fractions.Fraction(1, 1000)
        pts = 0
        for i, array in enumerate(frames_of(photo, count, width, height)):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if rates is not None:
                frame.pts, frame.time_base = pts, fractions.Fraction(1, 1000)
                pts += rates[i % len(rates)]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


# ISO BMFF (MP4) boxes: a box whose children are parsed keeps the bytes before them (a full box's version and flags,
# a sample entry's fields); every other box is its payload.
_PARENTS = {
    b"moov": 0,
    b"trak": 0,
    b"mdia": 0,
    b"minf": 0,
    b"stbl": 0,
    b"edts": 0,
    b"stsd": 8,
    b"avc1": 78,
    b"mp4v": 78,
}


def mp4_boxes(data: bytes) -> list[list]:
    """The boxes of an MP4 as [kind, head, children] (a parent) or [kind, payload, None] (a leaf), in order."""
    out, i = [], 0
    while i + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[i + 8 : i + 16])[0], 16
        elif size == 0:
            size = len(data) - i
        body = data[i + header : i + size]
        if kind in _PARENTS:
            out.append([kind, body[: _PARENTS[kind]], mp4_boxes(body[_PARENTS[kind] :])])
        else:
            out.append([kind, body, None])
        i += size
    return out


def mp4_bytes(boxes: list[list]) -> bytes:
    """The bytes of `mp4_boxes`' tree (32-bit sizes)."""
    out = b""
    for kind, body, children in boxes:
        body = body if children is None else body + mp4_bytes(children)
        out += struct.pack(">I4s", 8 + len(body), kind) + body
    return out


def _find(boxes: list[list], kind: bytes) -> list[list]:
    """Every box of `kind` in the tree, depth first."""
    found = []
    for box in boxes:
        if box[0] == kind:
            found.append(box)
        if box[2] is not None:
            found += _find(box[2], kind)
    return found


def _ue(value: int) -> str:
    """Exp-Golomb code of `value`, as a string of bits."""
    code = bin(value + 1)[2:]
    return "0" * (len(code) - 1) + code


def _sps_with_size(sps: bytes, width: int, height: int) -> bytes:
    """An H.264 SPS NAL unit (progressive, no scaling matrices, as x264 writes them) declaring width x height
    (multiples of 16) instead: the macroblock counts rewritten, every other field kept."""
    rbsp = bytearray()
    for byte in sps[1:]:
        if byte == 3 and rbsp[-2:] == b"\0\0":
            continue
        rbsp.append(byte)
    bits = "".join(f"{b:08b}" for b in rbsp)
    pos = 24

    def ue() -> int:
        nonlocal pos
        zeros = bits.index("1", pos) - pos
        value = int(bits[pos + zeros : pos + 2 * zeros + 1], 2) - 1
        pos += 2 * zeros + 1
        return value

    profile = rbsp[0]
    ue()  # seq_parameter_set_id
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        pos += ue() == 3  # chroma_format_idc (separate_colour_plane_flag)
        ue(), ue()  # bit depths
        assert bits[pos + 1] == "0", "scaling matrices are not rewritten"
        pos += 2
    ue()  # log2_max_frame_num_minus4
    poc_type = ue()
    assert poc_type != 1, "pic_order_cnt_type 1 is not rewritten"
    if poc_type == 0:
        ue()
    ue()  # max_num_ref_frames
    pos += 1  # gaps_in_frame_num_value_allowed_flag
    start = pos
    ue(), ue()
    assert bits[pos] == "1", "interlaced SPSs are not rewritten"
    rest = bits[pos:].rstrip("0")[:-1]  # less the rbsp stop bit and its alignment
    assert width % 16 == 0 and height % 16 == 0
    bits = bits[:start] + _ue(width // 16 - 1) + _ue(height // 16 - 1) + rest + "1"
    bits += "0" * (-len(bits) % 8)
    out = bytearray(sps[:1])
    for i in range(0, len(bits), 8):
        if out[-2:] == b"\0\0" and len(out) > 2 and int(bits[i : i + 8], 2) <= 3:
            out.append(3)
        out.append(int(bits[i : i + 8], 2))
    return bytes(out)


def declare_mp4(
    data: bytes,
    frames: int | None = None,
    width: int | None = None,
    height: int | None = None,
    fps: float | None = None,
    rotation: int | None = None,
) -> bytes:
    """`make_video`'s MP4 (moov after mdat, one video track, v0 boxes) whose headers declare what is asked while its
    samples stay as they are: `frames` (the stts count, the durations of mdhd, tkhd, mvhd and the edit list), `fps`
    (the stts delta: the media timescale / fps, the composition offsets and the edit's start scaled with it), width
    x height (tkhd, the sample entry, and an H.264 track's SPS, which is what FFmpeg believes) and `rotation`
    (tkhd's display matrix: degrees counter-clockwise, as FFmpeg reads it)."""
    boxes = mp4_boxes(data)
    kinds = [box[0] for box in boxes]
    assert kinds.index(b"mdat") < kinds.index(b"moov"), "sizes may change: moov must follow mdat"
    (stts,), (mdhd,), (tkhd,), (mvhd,) = (_find(boxes, k) for k in (b"stts", b"mdhd", b"tkhd", b"mvhd"))
    assert mdhd[1][0] == tkhd[1][0] == mvhd[1][0] == 0
    timescale, media_duration = struct.unpack(">II", mdhd[1][12:20])
    movie_scale = struct.unpack(">I", mvhd[1][12:16])[0]
    count = struct.unpack(">I", stts[1][4:8])[0]
    entries = [list(struct.unpack(">II", stts[1][8 + 8 * i : 16 + 8 * i])) for i in range(count)]
    if fps is not None:
        delta = int(timescale // fps)
        scale = entries[0][1] // delta  # composition offsets and the edit's start shrink as the deltas do
        for entry in entries:
            assert entry[1] == delta * scale and timescale % fps == 0
            entry[1] = delta
        for ctts in _find(boxes, b"ctts"):
            n = struct.unpack(">I", ctts[1][4:8])[0]
            pairs = struct.unpack(f">{2 * n}I", ctts[1][8 : 8 + 8 * n])
            assert all(v % scale == 0 for v in pairs[1::2])
            pairs = [v // scale if i % 2 else v for i, v in enumerate(pairs)]
            ctts[1] = ctts[1][:8] + struct.pack(f">{2 * n}I", *pairs)
        for elst in _find(boxes, b"elst"):
            start = struct.unpack(">I", elst[1][12:16])[0]
            elst[1] = elst[1][:12] + struct.pack(">I", start // scale) + elst[1][16:]
    if frames is not None:
        entries[-1][0] += frames - sum(n for n, _ in entries)
    if frames is not None or fps is not None:
        stts[1] = stts[1][:8] + b"".join(struct.pack(">II", *e) for e in entries)
        media_duration = sum(n * d for n, d in entries)
        movie_duration = -(-media_duration * movie_scale // timescale)
        mdhd[1] = mdhd[1][:16] + struct.pack(">I", media_duration) + mdhd[1][20:]
        mvhd[1] = mvhd[1][:16] + struct.pack(">I", movie_duration) + mvhd[1][20:]
        tkhd[1] = tkhd[1][:20] + struct.pack(">I", movie_duration) + tkhd[1][24:]
        for elst in _find(boxes, b"elst"):
            elst[1] = elst[1][:8] + struct.pack(">I", movie_duration) + elst[1][12:]
    if width is not None and height is not None:
        tkhd[1] = tkhd[1][:-8] + struct.pack(">II", width << 16, height << 16)
        for entry in _find(boxes, b"avc1") + _find(boxes, b"mp4v"):
            entry[1] = entry[1][:24] + struct.pack(">HH", width, height) + entry[1][28:]
        for avcc in _find(boxes, b"avcC"):
            body = avcc[1]
            assert body[5] & 31 == 1, "one SPS"
            size = struct.unpack(">H", body[6:8])[0]
            sps = _sps_with_size(body[8 : 8 + size], width, height)
            avcc[1] = body[:6] + struct.pack(">H", len(sps)) + sps + body[8 + size :]
    if rotation is not None:
        cos, sin = {0: (1, 0), 90: (0, 1), 180: (-1, 0), 270: (0, -1)}[rotation % 360]
        matrix = (cos << 16, -sin << 16, 0, sin << 16, cos << 16, 0, 0, 0, 1 << 30)
        tkhd[1] = tkhd[1][:40] + struct.pack(">9i", *matrix) + tkhd[1][76:]
    return mp4_bytes(boxes)


def emptied_mp4(data: bytes) -> bytes:
    """`make_video`'s MP4 with its track's sample tables emptied and its mdat dropped: a video stream (codec, size,
    rate) with no packets."""
    boxes = [box for box in mp4_boxes(data) if box[0] != b"mdat"]
    for kind in (b"stts", b"stss", b"ctts", b"stsc", b"stco"):
        for box in _find(boxes, kind):
            box[1] = box[1][:4] + struct.pack(">I", 0)
    for stsz in _find(boxes, b"stsz"):
        stsz[1] = stsz[1][:4] + struct.pack(">II", 0, 0)
    return mp4_bytes(boxes)


def empty_video(codec: str = "h264", container: str = "matroska", width: int = 64, height: int = 48) -> bytes:
    """A container PyAV writes with one video stream and no frames (its header and trailer only)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        out.start_encoding()
    return buf.getvalue()


def mdat_span(data: bytes) -> tuple[int, int]:
    """Where an MP4's media data (the payload of its mdat box) starts and ends."""
    i = 0
    while i + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        if kind == b"mdat":
            return i + 8, i + size
        i += size
    raise ValueError("no mdat")


def damaged(data: bytes, at: int, length: int, how: str = "zero") -> bytes:
    """`data` with `length` bytes from `at` zeroed ("zero"), inverted ("flip") or set to 0xFF ("ff")."""
    out = bytearray(data)
    for i in range(at, min(at + length, len(out))):
        out[i] = {"zero": 0, "flip": out[i] ^ 0xFF, "ff": 0xFF}[how]
    return bytes(out)


def ftyp(major: bytes, *compatible: bytes) -> bytes:
    """An ISO BMFF file's first box, as MP4, MOV, AVIF and HEIF files start."""
    return struct.pack(">I4s4sI", 16 + 4 * len(compatible), b"ftyp", major, 0) + b"".join(compatible)


class Endless(io.RawIOBase):
    """A live stream: a file object that serves `data` over and over and cannot seek. `served` counts the bytes read;
    past `most` of them it ends (so a reader that would never stop fails a test instead of hanging it)."""

    def __init__(self, data: bytes, most: int | None = None):
        self.data, self.most, self.served = data, most, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.most is not None and self.served >= self.most:
            return 0
        start = self.served % len(self.data)
        chunk = self.data[start : start + len(buffer)]
        buffer[: len(chunk)] = chunk
        self.served += len(chunk)
        return len(chunk)
