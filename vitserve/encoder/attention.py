"""Attention inside the segments of a packed batch: one interface, several kernels.

The tower binds each segment layout once per forward, inside the forward a CUDA graph captures
(`backend.bind(cu_seqlens, max_seqlen, lengths)`: one segment per frame for full attention, Qwen2.5's windows) and
calls the bound layout per layer with q, k, v [rows, heads, head_dim]. Binding derives what a kernel needs beyond
`cu_seqlens` on the device, once for all layers. Nothing on the CUDA backends syncs with the host, so a CUDA graph
captures them and replays with new `cu_seqlens` written in place.

Every backend keeps one contract: a row of a segment attends to exactly the rows of its segment; zero-length
segments are allowed; rows after the last segment (padding) are in no segment and their output is unspecified. The
backends differ in what padding rows may hold: `sdpa`, `flash` and `cudnn` never read them for a real row; `fa4`
reads up to one tile past a segment's end and weights those rows zero, so padding rows must be finite (the runner's
are: zero pixels through the tower), as NaN times zero is NaN.

- `sdpa`: exact per-segment torch SDPA over the plan's host-side lengths: the CPU and float32 path.
- `flash`: torch's FlashAttention-2 varlen kernel. Launches (segments x max_seqlen / 128 x heads) blocks, and an
  empty one costs ~1.3 ns: packing bounds its segment capacity by that (packing.frame_capacity).
- `fa4`: FlashAttention-4's CuTe DSL kernels (`pip install vitserve[fa4]`), compiled when selected (a few seconds per
  head size and process). Its launch grid grows with segments like flash's, so packing bounds it the same way.
- `cudnn`: cuDNN's ragged SDPA through nvidia-cudnn-frontend's graph API (`pip install vitserve[cudnn]`). A
  cuDNN graph is built per (segments, max_seqlen, layout), both rounded up to powers of two, on first use: the
  runner's warm-up forward before each capture builds them, never the capture itself. An unused segment costs it
  ~0.17 us whatever max_seqlen (16 heads, H200), so a call takes at most `max_segments` of them.

`select` resolves a name, `auto` picking the first of `AUTO_ORDER` that runs here (fastest first for the towers'
full attention on an H200, bench/attention_probe.py), with one log line per backend it passes over. Qwen2.5's
windows (at most 64 rows each) take `select(..., windows=True)`: under `auto`, flash, the fastest for short
segments.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from .config import ATTENTION_BACKENDS as BACKENDS

log = logging.getLogger("vitserve.attention")

AUTO_ORDER = ("fa4", "cudnn", "flash")
AUTO_WINDOW_ORDER = ("flash",)


class BackendUnavailable(RuntimeError):
    """This backend cannot run here (package missing, device or dtype unsupported); the message says why."""


class SDPA:
    """Exact attention, one torch SDPA call per segment (host-side lengths): any device, any dtype. Not capturable."""

    name = "sdpa"
    capturable = False  # reads host-side lengths
    max_segments = None  # planned like flash, so the CPU runs the GPU's default packing

    def bind(self, cu_seqlens: torch.Tensor, max_seqlen: int, lengths: list[int] | None):
        if lengths is None:
            raise ValueError("sdpa attention needs the plan's host-side segment lengths")
        return lambda q, k, v: _per_segment(q, k, v, lengths)


def _per_segment(q, k, v, lengths: list[int]) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        if n:
            seg = [t[start : start + n].transpose(0, 1)[None] for t in (q, k, v)]
            out.append(F.scaled_dot_product_attention(*seg)[0].transpose(0, 1))
        start += n
    if start < q.shape[0]:
        out.append(q.new_zeros(q.shape[0] - start, *q.shape[1:]))
    return torch.cat(out, dim=0)


class Flash:
    """torch's FlashAttention-2 varlen kernel (CUDA, half precision)."""

    name = "flash"
    capturable = True
    max_segments = None  # bounded by its launch grid instead (packing.frame_capacity)

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._varlen_attn = varlen_attn

    def bind(self, cu_seqlens: torch.Tensor, max_seqlen: int, lengths: list[int] | None):
        return lambda q, k, v: self._varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


class FA4:
    """FlashAttention-4's varlen forward (CuTe DSL; CUDA, half precision). Reads up to a tile past each segment's
    end with weight zero: padding rows must be finite (module docstring)."""

    name = "fa4"
    capturable = True
    max_segments = None  # bounded like flash's launch grid (packing.frame_capacity)

    def __init__(self, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int):
        try:
            from flash_attn.cute import flash_attn_varlen_func
        except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
            raise BackendUnavailable(
                f"flash-attn-4 is not importable ({type(e).__name__}: {e}); pip install 'vitserve[fa4]'"
            ) from None
        major = torch.cuda.get_device_capability(device)[0]
        if major not in (8, 9, 10, 11, 12):
            raise BackendUnavailable(f"flash-attn-4 has no kernels for compute capability {major}.x")
        self._varlen = flash_attn_varlen_func
        self.device, self.dtype, self.heads, self.head_dim = device, dtype, heads, head_dim

    def check(self) -> None:
        """Compile and run the kernel for the tower's head size once (before any capture): raises
        BackendUnavailable where it cannot."""
        try:
            q = torch.randn(64, self.heads, self.head_dim, device=self.device, dtype=self.dtype)
            cu = torch.tensor([0, 40, 64], dtype=torch.int32, device=self.device)
            out = self.bind(cu, 40, None)(q, q, q)
            torch.cuda.synchronize(self.device)
        except Exception as e:
            raise BackendUnavailable(
                f"flash-attn-4 cannot run {self.heads} heads x {self.head_dim} here "
                f"({type(e).__name__}: {str(e)[:200]})"
            ) from None
        if not torch.isfinite(out).all():
            raise BackendUnavailable("flash-attn-4 gave non-finite values on a check batch")

    def bind(self, cu_seqlens: torch.Tensor, max_seqlen: int, lengths: list[int] | None):
        def attend(q, k, v):
            out = self._varlen(
                q,
                k,
                v,
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen,
                max_seqlen_k=max_seqlen,
            )
            return out[0] if isinstance(out, tuple) else out

        return attend


class CuDNN:
    """cuDNN's ragged SDPA through nvidia-cudnn-frontend's graph API (CUDA, half precision).

    q, k, v and the output are the packed [rows, heads, head_dim] tensors themselves, described to cuDNN as
    [segments, heads, max_seqlen, head_dim] with the packed strides and a ragged offset per segment (its first
    element), and every segment's length for the padding mask. `bind` computes lengths and offsets from
    `cu_seqlens` on the device; v may be a strided view (the fused qkv output), with offsets of its own.
    """

    name = "cudnn"
    capturable = True
    max_segments = 256  # x ~0.17 us: at most ~45 us of unused capacity per layer

    def __init__(self, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int):
        try:
            import cudnn
        except Exception as e:  # ImportError, or a broken install failing to load its library
            raise BackendUnavailable(
                f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); pip install 'vitserve[cudnn]'"
            ) from None
        self.cudnn, self.device, self.dtype, self.heads, self.head_dim = cudnn, device, dtype, heads, head_dim
        self.io_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        self.graphs: dict[tuple, tuple] = {}  # shape key -> (cuDNN graph, workspace bytes)
        self.stream: int | None = None  # the stream the handle runs on

    def bind_stream(self, stream: int) -> None:
        """Run the handle on `stream`. cudnnSetStream is never called inside a CUDA graph capture (it fails there
        and invalidates the capture): a capture runs on the stream its warm-up set (`runner.capture_graph`)."""
        if stream == self.stream:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "cuDNN attention first runs on this stream inside a CUDA graph capture: a warm-up "
                "forward must run on the capture stream before capturing"
            )
        self.cudnn.set_stream(handle=self.handle, stream=stream)
        self.stream = stream

    def check(self) -> None:
        """Build one small graph for the tower's head sizes: raises BackendUnavailable where cuDNN lacks them."""
        heads, head_dim = self.heads, self.head_dim
        try:
            self._graph(4, 128, heads, head_dim, heads * head_dim, 3 * heads * head_dim, torch.int32)
        except Exception as e:
            raise BackendUnavailable(
                f"cuDNN {self.cudnn.backend_version_string()} has no ragged SDPA for "
                f"{heads} heads x {head_dim} ({type(e).__name__}: {e})"
            ) from None

    def bind(self, cu_seqlens: torch.Tensor, max_seqlen: int, lengths: list[int] | None):
        return _CuDNNLayout(self, cu_seqlens, max_seqlen)

    def _graph(
        self,
        segments: int,
        max_seqlen: int,
        heads: int,
        head_dim: int,
        row_stride: int,
        v_row_stride: int,
        offset_type: torch.dtype,
    ):
        key = (segments, max_seqlen, heads, head_dim, row_stride, v_row_stride, offset_type)
        if key in self.graphs:
            return self.graphs[key]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"cuDNN attention graph {key} first needed inside a CUDA graph capture: a warm-up "
                "forward must run the same shapes before capturing"
            )
        cudnn = self.cudnn
        ints = {torch.int32: cudnn.data_type.INT32, torch.int64: cudnn.data_type.INT64}[offset_type]
        g = cudnn.pygraph(
            io_data_type=self.io_type,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self.handle,
        )
        dims = (segments, heads, max_seqlen, head_dim)

        def packed(uid: int, name: str, stride: int):
            return g.tensor(
                name=name, uid=uid, dim=dims, stride=(max_seqlen * stride, head_dim, stride, 1), data_type=self.io_type
            )

        def index(uid: int, name: str, n: int, data_type=ints):
            return g.tensor(name=name, uid=uid, dim=(n, 1, 1, 1), stride=(1, 1, 1, 1), data_type=data_type)

        q, k, v = packed(_Q, "q", row_stride), packed(_K, "k", row_stride), packed(_V, "v", v_row_stride)
        for t, uid in ((q, _Q_OFFSETS), (k, _K_OFFSETS)):
            t.set_ragged_offset(index(uid, f"offsets{uid}", segments + 1))
        v.set_ragged_offset(index(_V_OFFSETS, "v_offsets", segments + 1))
        lengths = index(_LENGTHS, "lengths", segments, cudnn.data_type.INT32)
        o, _ = g.sdpa(
            name="attention",
            q=q,
            k=k,
            v=v,
            is_inference=True,
            attn_scale=1.0 / math.sqrt(head_dim),
            use_padding_mask=True,
            seq_len_q=lengths,
            seq_len_kv=lengths,
        )
        o.set_output(True).set_uid(_O).set_dim(dims).set_stride((max_seqlen * row_stride, head_dim, row_stride, 1))
        o.set_ragged_offset(index(_O_OFFSETS, "o_offsets", segments + 1))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graphs[key] = g, g.get_workspace_size()
        log.debug("built cuDNN attention graph %s", key)
        return self.graphs[key]


_Q, _K, _V, _O, _LENGTHS, _Q_OFFSETS, _K_OFFSETS, _V_OFFSETS, _O_OFFSETS = range(1, 10)


class _CuDNNLayout:
    """One segment layout bound for a forward: lengths and the element offsets of packed rows (q, k, out) and of the
    fused qkv's v rows computed once, on the device, then one cuDNN graph execution per layer."""

    def __init__(self, backend: CuDNN, cu_seqlens: torch.Tensor, max_seqlen: int):
        # cuDNN graphs are keyed by powers of two of both (more unused segments cost ~0.17 us each, a longer
        # max_seqlen nothing): eager calls of any shape share a few dozen graphs instead of building one each
        segments = cu_seqlens.numel() - 1
        self.segments, self.max_seqlen = _power_of_two(segments), _power_of_two(max(16, max_seqlen))
        if self.segments > segments:  # zero-length segments after the last
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:].expand(self.segments - segments)])
        self.backend, self.cu = backend, cu_seqlens
        self.lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).view(-1, 1, 1, 1)
        self.offsets: dict[tuple, torch.Tensor] = {}
        width = backend.heads * backend.head_dim
        for stride in (width, 3 * width):
            self._offsets(stride, torch.int32)

    def _offsets(self, row_stride: int, offset_type: torch.dtype) -> torch.Tensor:
        key = (row_stride, offset_type)
        if key not in self.offsets:
            self.offsets[key] = (self.cu.to(offset_type) * row_stride).view(-1, 1, 1, 1)
        return self.offsets[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        if (
            q.stride() != k.stride()
            or q.stride(1) != head_dim
            or v.stride(1) != head_dim
            or q.stride(2) != 1
            or v.stride(2) != 1
        ):
            raise ValueError("cuDNN attention needs q and k alike and rows of [heads, head_dim] for q, k and v")
        # element offsets: int32 while the last row's offset fits, else int64
        offset_type = torch.int32 if rows * max(q.stride(0), v.stride(0)) < 2**31 else torch.int64
        graph, workspace_bytes = self.backend._graph(
            self.segments, self.max_seqlen, heads, head_dim, q.stride(0), v.stride(0), offset_type
        )
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        qk = self._offsets(q.stride(0), offset_type)
        pack = {
            _Q: q,
            _K: k,
            _V: v,
            _O: out,
            _LENGTHS: self.lengths,
            _Q_OFFSETS: qk,
            _K_OFFSETS: qk,
            _V_OFFSETS: self._offsets(v.stride(0), offset_type),
            _O_OFFSETS: self._offsets(out.stride(0), offset_type),
        }
        workspace = torch.empty(max(1, workspace_bytes), dtype=torch.uint8, device=q.device)
        self.backend.bind_stream(torch.cuda.current_stream(q.device).cuda_stream)
        graph.execute(pack, workspace, handle=self.backend.handle)
        return out


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def select(name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, windows: bool = False):
    """The attention backend called `name` for this device, dtype and head size; `auto`: the fastest that runs
    here (`windows`: for Qwen2.5's window attention). An explicit name that cannot run here raises ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {', '.join(BACKENDS)}")
    half_on_cuda = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if name == "sdpa" or (name == "auto" and not half_on_cuda):
        return SDPA()
    if not half_on_cuda:
        raise ValueError(
            f"attention backend {name!r} needs a CUDA device and float16 or bfloat16 "
            f"(here {device.type}, {str(dtype).removeprefix('torch.')}); use sdpa or auto"
        )
    for candidate in (AUTO_WINDOW_ORDER if windows else AUTO_ORDER) if name == "auto" else (name,):
        try:
            backend = _make(candidate, device, dtype, heads, head_dim)
        except BackendUnavailable as e:
            if name != "auto":
                raise ValueError(f"attention backend {name!r} is unavailable: {e}") from None
            log.info("attention: %s unavailable, trying the next: %s", candidate, e)
            continue
        if name == "auto":
            log.info(
                "attention: %s%s (auto: the fastest available on %s)",
                candidate,
                " for windows" if windows else "",
                torch.cuda.get_device_name(device),
            )
        return backend
    raise AssertionError("flash is always available on CUDA")  # torch's own kernel ends AUTO_ORDER


def _make(name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int):
    if name == "flash":
        return Flash()
    backend = (FA4 if name == "fa4" else CuDNN)(device, dtype, heads, head_dim)
    backend.check()
    return backend
