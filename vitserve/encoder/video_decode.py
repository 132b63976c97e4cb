"""Decode only the frames a video's sampling needs, with the same bytes a decode of every frame gives.

A frame's index is its place in the decoder's output (transformers' pyav reader counts frames so), which for the
streams this takes is the rank of its packet's presentation time among the stream's packets. One demux pass reads
the packets' times and keyframe flags (no decoding); then the packets are fed from the first one on, up to the packet
of the last sampled frame, each with the decoder told how much of it to decode (`codec_context.skip_frame`):

* a packet whose frame is sampled: all of it;
* another packet of a group of pictures (a keyframe and the packets up to the next one, in decode order) that holds a
  sampled frame: only if another frame refers to it (`NONREF`: FFmpeg drops a frame only when nothing refers to it,
  so every reference of a sampled frame is decoded as in a full decode);
* a packet of a group that holds no sampled frame and whose next group does not start with leading pictures (frames
  shown before their keyframe, which may refer to the group before): nothing (`ALL`).

So no frame is decoded from other references than in a full decode, and the container is never seeked. A stream this
cannot map (a packet without a time, two with the same, leading pictures before the first keyframe, which a decoder
may drop), or whose decoder then gives a frame it did not expect, is decoded whole (`decode_sampled` restarts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Iterator

WHOLE, REFERENCES, NOTHING = "DEFAULT", "NONREF", "ALL"  # FFmpeg's skip_frame: what of a packet is decoded


@dataclass(frozen=True)
class PacketInfo:
    """A video packet as the demuxer gives it, in decode order: its presentation time, whether it starts a group of
    pictures, whether the container marks its frame as not shown (an MP4 edit list's cut)."""

    pts: int | None
    keyframe: bool
    discard: bool = False


@dataclass(frozen=True)
class DecodePlan:
    """How much the decoder decodes of each packet up to the last one needed (`skips`, by presentation time: WHOLE,
    REFERENCES or NOTHING; the packets after `last` are not fed), and each shown frame's index by its presentation
    time."""

    skips: dict[int, str]
    last: int
    index_of: dict[int, int]


def plan_decode(packets: list[PacketInfo], wanted: set[int]) -> DecodePlan | None:
    """The packets to decode for the frames at indices `wanted`, or None where the stream cannot be mapped (decode
    it whole)."""
    index_of = _shown_indices(packets)
    if not wanted or index_of is None:
        return None
    pts: list[int] = [p.pts for p in packets]  # type: ignore[misc]
    starts = [j for j, p in enumerate(packets) if p.keyframe]
    if not starts or any(t < pts[starts[0]] for t, p in zip(pts, packets) if not p.discard):
        return None  # leading pictures before the first keyframe: a decoder may drop them, shifting every index
    wanted_at = {j for j, t in enumerate(pts) if not packets[j].discard and index_of[t] in wanted}
    if len(wanted_at) != len(wanted):
        return None
    last = max(wanted_at)
    bounds = list(zip([0, *starts[1:]], [*starts[1:], len(packets)]))  # packets before the first keyframe: group 0
    needed = [any(a <= j < b for j in wanted_at) for a, b in bounds]
    for g in range(len(bounds) - 2, -1, -1):  # a group whose successor needs it for its leading pictures
        a, b = bounds[g + 1]
        if needed[g + 1] and any(pts[j] < pts[a] for j in range(a, b) if not packets[j].discard):
            needed[g] = True
    skips = {
        pts[j]: WHOLE if j in wanted_at else REFERENCES if needed[g] else NOTHING
        for g, (a, b) in enumerate(bounds)
        for j in range(a, min(b, last + 1))
    }
    return DecodePlan(skips, pts[last], index_of)


def packet_infos(container: Any, stream: Any, most: int) -> list[PacketInfo] | None:
    """One demux pass over the stream (no decoding), then the container rewound to its start; None past `most`
    packets (a stream longer than it declares is decoded whole, which stops at the last wanted frame)."""
    packets = []
    for p in container.demux(stream):
        if p.size:
            packets.append(PacketInfo(p.pts, bool(p.is_keyframe), bool(p.is_discard)))
            if len(packets) > most:
                break
    container.seek(0)
    return packets if len(packets) <= most else None


def _shown_indices(packets: list[PacketInfo]) -> dict[int, int] | None:
    """Each shown frame's index by its packet's presentation time (its rank among them), or None where the packets
    cannot be mapped (none, one without a time, two with the same)."""
    times = [p.pts for p in packets]
    if not packets or any(t is None for t in times) or len(set(times)) != len(times):
        return None
    return {t: i for i, t in enumerate(sorted(p.pts for p in packets if not p.discard))}  # type: ignore[type-var, misc]


def group_starts(packets: list[PacketInfo]) -> list[int] | None:
    """The index of each group's keyframe (where a group of pictures starts), ascending, or None where the stream
    cannot be mapped (`plan_decode`'s rules): where a video's frames can be split among decoders at little cost,
    since a decode of the frames from one group on needs nothing before it but leading pictures."""
    index_of = _shown_indices(packets)
    if index_of is None:
        return None
    return sorted(index_of[p.pts] for p in packets if p.keyframe and not p.discard)  # type: ignore[index]


class Unmapped(Exception):
    """The decoder gave a frame the plan did not expect, or not every wanted one: the stream is decoded whole."""


def decode_sampled(container: Any, stream: Any, wanted: set[int], rewindable: bool) -> Iterator[tuple[int, Any]]:
    """(index, PyAV frame) for the frames at `wanted` indices, as a decode of every frame gives them, decoding only
    what they need (the module's plan) where the container's input can be read twice (`rewindable`: bytes, a path,
    a seekable file; a stream that cannot rewind is decoded as it arrives). Where the plan cannot be made or does
    not hold, every frame up to the last wanted one is decoded, and the frames given before are given again (the same
    where the plan held). Other shown frames may be given too (a decoder may decode more than asked): the caller
    keeps the wanted ones."""
    last = max(wanted)
    packets = packet_infos(container, stream, 2 * max(int(stream.frames), last + 1) + 64) if rewindable else None
    plan = plan_decode(packets, wanted) if packets is not None else None
    if plan is not None:
        try:
            given = yield from _planned(container, stream, plan)
            if wanted <= given:
                return
        except Unmapped:
            pass
        rewind(container, stream)
    for i, frame in enumerate(container.decode(stream)):
        yield i, frame
        if i >= last:
            return


def rewind(container: Any, stream: Any) -> None:
    """The container read again from its start, its decoder holding nothing of an earlier pass."""
    container.seek(0)
    stream.codec_context.flush_buffers()


def planned_packets(container: Any, stream: Any, plan: DecodePlan) -> Iterator[tuple[Any, str]]:
    """(packet, how much of it to decode) for the stream's packets up to the plan's last one; Unmapped at a packet
    the demux pass did not see."""
    for packet in container.demux(stream):
        if not packet.size:
            continue
        pts = packet.pts  # (read first: a bitstream filter the caller sends the packet through empties it)
        skip = plan.skips.get(pts)
        if skip is None:
            raise Unmapped
        yield packet, skip
        if pts == plan.last:
            return


def _planned(container: Any, stream: Any, plan: DecodePlan) -> Generator[tuple[int, Any], None, set[int]]:
    """The plan's frames, in order; returns the indices given."""
    context, given = stream.codec_context, [-1]
    try:
        for packet, skip in planned_packets(container, stream, plan):
            context.skip_frame = skip
            for frame in context.decode(packet):
                yield _indexed(frame, plan, given)
        context.skip_frame = WHOLE
        for frame in context.decode(None):
            yield _indexed(frame, plan, given)
    finally:
        context.skip_frame = WHOLE
    return set(given)


def _indexed(frame: Any, plan: DecodePlan, given: list[int]) -> tuple[int, Any]:
    index = plan.index_of.get(frame.pts)
    if index is None or index <= given[-1]:
        raise Unmapped
    given.append(index)
    return index, frame
