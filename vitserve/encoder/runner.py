"""Graph-cached runner: one CUDA graph per patch budget, replayed with fresh metadata for any mix of images.

It owns the static buffers, the capture and replay of the graphs, and the copies between host and device; which
images share a replay, and at which budget, is decided by packing.py.

Every batch replays correctly because:
- Nothing that depends on the grids is frozen at capture. Pixels and *all* metadata (positions, full and window
  cu_seqlens, window permutation and its inverse, Qwen3 interpolation taps) are copied into static buffers before
  every replay; a graph is keyed by its budget only because everything else is an input. Rotary cos/sin are computed
  inside the graph from the positions, so there is no shared rotary cache to go stale.
- Static buffers are allocated once, at the largest budget, before any capture, and only ever written in place
  (`copy_`/`zero_`); graphs read views of them. Nothing is reallocated while graphs exist.
- Kernel launch parameters that must be Python ints hold for any batch the packer admits: full attention runs with
  max_seqlen = budget (any frame that fits), window attention with the window size, and the number of segments is
  the budget's fixed capacity (packing.frame_capacity, packing.window_capacity), unused entries repeating the end
  offset (zero-length segments).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import VisionConfig
from .packing import Batch, Packer
from .pixels import upload
from .plan import BatchPlan, TowerInputs, check_grids, grid_patches, make_plan, patch_starts, to_device
from .progress import Progress

log = logging.getLogger("vitserve.runner")

# Patch budgets captured by default: from one 224x224 image (256 patches) to 16 448x448 images or one 1792x1792
# image (16384 patches), in steps of 256 up to 4096 (where a server's batches mostly fall), then of 1024. Padding is
# compute thrown away: a step of 256 keeps it under 20% of a replay from 1280 patches up, a step of 1024 from 5120
# up. A capture costs ~50-150 ms and one output buffer, so holding all 28 budgets is cheap.
DEFAULT_BUDGETS = (*range(256, 4096 + 1, 256), *range(5120, 16384 + 1, 1024))


@dataclass
class BudgetStats:
    captured: bool = False
    capture_ms: float = 0.0
    replays: int = 0
    real_patches: int = 0
    padded_patches: int = 0


@dataclass
class Launch:
    """A call's work in flight: per replay, its image indices, plan and host outputs (tokens and deepstack, or None
    where every image of the replay is pooled; per-image means, or None where none is); `done` fires when the
    device-to-host copies have landed (None on the CPU, where everything ran synchronously)."""

    grids: list
    parts: list
    mean_pooling: list[bool]
    done: torch.cuda.Event | None = None

    @property
    def num_images(self) -> int:
        return len(self.grids)


@dataclass
class RunnerStats:
    """`mode`: how batches run: "graphs" (a CUDA graph replayed per budget), "padded" (eagerly, padded to their
    budget as a graph would be: tests on the CPU) or "eager" (eagerly at their own size: CPU, float32). Per budget,
    its graph's replays and their real and padding patches; `eager_runs` and `eager_patches`: batches run eagerly
    and their patches, `eager_fallbacks` the images among them too large for any budget."""

    mode: str = "eager"
    budgets: dict[int, BudgetStats] = field(default_factory=dict)
    eager_runs: int = 0
    eager_patches: int = 0
    eager_fallbacks: int = 0
    pool_bytes: int = 0
    capture_seconds: float = 0.0
    attention: dict[str, str] = field(default_factory=dict)  # layer kind (full, window) -> attention backend

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "budgets": {str(b): vars(s).copy() for b, s in self.budgets.items()},
            "attention": dict(self.attention),
            "eager_runs": self.eager_runs,
            "eager_patches": self.eager_patches,
            "eager_fallbacks": self.eager_fallbacks,
            "pool_bytes": self.pool_bytes,
            "capture_seconds": round(self.capture_seconds, 3),
        }


class GraphRunner:
    """Encodes lists of images by packing them into patch budgets and replaying one CUDA graph per budget.

    Thread-safety: one runner per device, used from one worker thread. Its static buffers and graphs are shared
    state, so a call that overlaps another (from a second thread) raises RuntimeError instead of corrupting it.

    Without CUDA graphs (CPU, or float32 on CUDA, where flash attention is unavailable) it plans and packs the same
    way and runs each batch eagerly at its own size: padding is compute thrown away where no graph needs a fixed
    shape. `pad=True` pads such batches too, over the same static buffers a graph reads, so the CPU tests exercise
    exactly what a GPU replays.
    """

    def __init__(
        self,
        tower,
        cfg: VisionConfig,
        device: torch.device,
        dtype: torch.dtype,
        budgets=DEFAULT_BUDGETS,
        pad: bool | None = None,
    ):
        self.tower, self.cfg, self.device, self.dtype = tower, cfg, device, dtype
        self.packer = Packer(cfg, budgets, tower.attention.max_segments, tower.window_attention.max_segments)
        self.budgets = self.packer.budgets
        self.use_graphs = (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and tower.attention.capturable
            and tower.window_attention.capturable
        )
        self.window_seqlen = cfg.window_tokens**2 * cfg.merge_unit if cfg.window_size else 0
        self.stats = RunnerStats(
            budgets={b: BudgetStats() for b in self.budgets},
            attention={
                "full": tower.attention.name,
                **({"window": tower.window_attention.name} if cfg.window_size else {}),
            },
        )
        self.pad = pad
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._luts: dict[bytes, torch.Tensor] = {}
        self._static: TowerInputs | None = None

    @property
    def pad(self) -> bool:
        """Whether batches are padded to their budget: always with CUDA graphs, else when asked."""
        return self._pad

    @pad.setter
    def pad(self, value: bool | None) -> None:
        self._pad = self.use_graphs or bool(value)
        self.stats.mode = "graphs" if self.use_graphs else "padded" if self._pad else "eager"

    @property
    def static(self) -> TowerInputs:
        """The buffers a padded batch is written into, allocated at the largest budget on first use (only a padded
        runner has them); graphs read views of them; only ever written in place."""
        if self._static is None:
            cfg, device, largest = self.cfg, self.device, self.budgets[-1]
            cap_full = max(self.packer.frame_capacity(b) for b in self.budgets)
            cap_window = max(self.packer.window_capacity(b) for b in self.budgets)
            windowed, interp = bool(cfg.window_size), bool(cfg.num_position_embeddings)

            def buf(*shape, dtype=torch.int32, on=True):
                return torch.zeros(*shape, dtype=dtype, device=device) if on else None

            self._static = TowerInputs(
                pixel_values=buf(largest, cfg.patch_dim, dtype=self.dtype),
                positions=buf(largest, 2),
                cu_seqlens=buf(cap_full + 1),
                max_seqlen=largest,
                seqlens=None,
                cu_window_seqlens=buf(cap_window + 1, on=windowed),
                max_window_seqlen=self.window_seqlen,
                patch_order=buf(largest, dtype=torch.int64, on=windowed),
                token_order=buf(largest // cfg.merge_unit, dtype=torch.int64, on=windowed),
                interp_indices=buf(largest, 4, dtype=torch.int64, on=interp),
                interp_weights=buf(largest, 4, dtype=torch.float32, on=interp),
            )
        return self._static

    def pack(self, grids) -> list[Batch]:
        """The replays (and eager batches) a call with these grids runs: packing.Packer.pack."""
        return self.packer.pack(grids)

    # ---- running -------------------------------------------------------------------------------------------------
    def _enter(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "GraphRunner is used from one worker thread at a time: its static buffers and graphs "
                "are shared, and a replay is already in flight"
            )

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grids) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Encode a packed batch in transformers' processor layout; returns (tokens, deepstack list) per grid, in
        input order, on the CPU."""
        return self.collect(self.launch(pixel_values, grids))

    @torch.inference_mode()
    def launch(self, pixel_values: torch.Tensor, grids) -> Launch:
        """Enqueue a call's replays and their copies on the device and return at once: the caller can prepare and
        launch the next call while these run (copies go through pinned memory, so nothing here waits for the GPU).
        `collect` the returned Launch before launching twice more."""
        grids = check_grids(grids, self.cfg)
        starts = [0]
        for g in grids:
            starts.append(starts[-1] + grid_patches(g))
        if pixel_values.dim() != 2 or pixel_values.shape != (starts[-1], self.cfg.patch_dim):
            raise ValueError(
                f"pixel_values must be [{starts[-1]}, {self.cfg.patch_dim}] for these grids, "
                f"got {tuple(pixel_values.shape)}"
            )

        def rows_for(indices: list[int], n: int) -> torch.Tensor:
            rows = torch.empty(n, pixel_values.shape[1], dtype=pixel_values.dtype, pin_memory=self._pin)
            return torch.cat([pixel_values[starts[i] : starts[i + 1]] for i in indices], out=rows)

        return self._launch(grids, rows_for)

    @torch.inference_mode()
    def launch_images(
        self,
        images: list,
        pixel_lut,
        mean_pooling: list[bool] | None = None,
        slice_lut=None,
        float32: list[bool] | None = None,
    ) -> Launch:
        """`launch` for resized uint8 RGB images ([H, W, 3], sides multiples of the patch size; host arrays from
        preprocess.resize_rgb, or tensors on this device from preprocess_fast.resize_on_device): 8x fewer bytes to
        copy than float rows, and normalize + patchify run on the device through `pixel_lut` ([3, 256] float32,
        preprocess.normalize_lut or preprocess_fast.fast_lut), giving exactly that preprocessing's values. A video
        slice ([T, H, W, 3]: T frames, video.Video.slices) is an image whose T frames differ; an image's one frame is
        repeated over T. Slices map through `slice_lut` where given (the video processor's arithmetic), else
        `pixel_lut`.

        Images flagged in `mean_pooling` come back as (mean of their tokens [D] in float32, []): the mean is taken on
        the device, and a replay whose images are all pooled copies only the means back. A replay that holds an
        image flagged in `float32` copies its tokens and deepstack back in float32, widened on the device where it
        computes in a narrower dtype (exact: every bfloat16 or float16 value is a float32 one), so that no host
        converts them; the replay's other images come back so too."""
        arrays = [
            a if torch.is_tensor(a) and a.device.type != "cpu" else a.numpy() if torch.is_tensor(a) else np.asarray(a)
            for a in images
        ]  # on this device already (fast preprocessing), else host
        p, t = self.cfg.patch_size, self.cfg.temporal_patch_size
        bad = [
            tuple(a.shape)
            for a in arrays
            if a.dtype not in (np.uint8, torch.uint8)
            or a.ndim not in (3, 4)
            or (a.ndim == 4 and a.shape[0] != t)
            or a.shape[-1] != 3
            or a.shape[-3] % p
            or a.shape[-2] % p
        ]
        if bad:
            raise ValueError(
                f"images must be uint8 [H, W, 3] (or video slices [{t}, H, W, 3]) with sides multiples "
                f"of {p}; got {bad[:3]}"
            )
        grids = check_grids([(1, a.shape[-3] // p, a.shape[-2] // p) for a in arrays], self.cfg)
        lut = self._device_lut(
            np.concatenate([np.reshape(pixel_lut, -1), np.reshape(pixel_lut if slice_lut is None else slice_lut, -1)])
        )
        return self._launch(
            grids, lambda indices, n: self._device_rows([arrays[i] for i in indices], n, lut), mean_pooling, float32
        )

    def _device_lut(self, pixel_lut) -> torch.Tensor:
        """The normalization table on the device, uploaded once per table: a fresh upload per launch is a pageable
        copy, which would make the host wait for the replay in flight and serialize the pipeline."""
        table = np.ascontiguousarray(pixel_lut, dtype=np.float32).reshape(-1)
        key = table.tobytes()
        if key not in self._luts:
            self._luts[key] = torch.tensor(table, device=self.device)
        return self._luts[key]

    def _launch(
        self, grids, rows_for, mean_pooling: list[bool] | None = None, float32: list[bool] | None = None
    ) -> Launch:
        mean_pooling = list(mean_pooling) if mean_pooling is not None else [False] * len(grids)
        float32 = list(float32) if float32 is not None else [False] * len(grids)
        if len(mean_pooling) != len(grids) or len(float32) != len(grids):
            raise ValueError(
                f"{len(mean_pooling)} mean_pooling and {len(float32)} float32 flags for {len(grids)} images"
            )
        self._enter()
        try:
            parts = []
            for batch in self.pack(grids):
                n = sum(grid_patches(grids[i]) for i in batch.indices)
                plan, merged, deepstack = self._run_batch(
                    [grids[i] for i in batch.indices], rows_for(batch.indices, n), batch.budget
                )
                pooled = [mean_pooling[i] for i in batch.indices]
                tokens = ds = means = None
                if not all(pooled):
                    wide = torch.float32 if any(float32[i] and not mean_pooling[i] for i in batch.indices) else None
                    tokens = self._to_host(merged, plan, wide)
                    ds = [self._to_host(d, plan, wide) for d in deepstack]
                if any(pooled):
                    means = self._to_host(self._segment_means(merged, plan.token_offsets))
                parts.append((batch.indices, plan, tokens, ds, means))
            done = None
            if self._pin:
                done = torch.cuda.Event()
                done.record()
            return Launch(grids, parts, mean_pooling, done)
        finally:
            self._lock.release()

    def _segment_means(self, rows: torch.Tensor, offsets: list[int]) -> torch.Tensor:
        """Float32 mean of rows[a:b] for each consecutive pair of `offsets`, in a fixed handful of device calls
        whatever the number of images (each call from a GPU thread gives up the GIL and waits to get it back). One
        product of the images' weights [n, rows] with the rows, not a scatter (CUDA's index_add adds with atomics in
        no fixed order): the same batch gives the same means bit for bit, run after run."""
        counts = np.diff(offsets)
        segment = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        weight = np.repeat((1.0 / counts).astype(np.float32), counts)
        segment_d, weight_d = (self._upload(torch.from_numpy(x)) for x in (segment, weight))
        images = torch.arange(len(counts), device=rows.device)
        weights = (segment_d[None, :] == images[:, None]).float() * weight_d[None, :]
        return weights @ rows[: offsets[-1]].float()

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without making the host wait (through pinned memory on CUDA)."""
        return (t.pin_memory() if self._pin else t).to(self.device, non_blocking=True)

    def _device_rows(self, arrays: list, n: int, lut: torch.Tensor) -> torch.Tensor:
        """Patch rows [n, patch_dim] in the model dtype, cut on the device from the items' uint8 pixels: each row
        gathers its p x p x 3 pixels of each of the T frames (merge-block order, like the processor) and maps them
        through the normalization tables (images through the first, slices through the second); an image's one
        frame stands for all T."""
        p, m, t = self.cfg.patch_size, self.cfg.spatial_merge_size, self.cfg.temporal_patch_size
        if any(torch.is_tensor(a) for a in arrays):  # (the host ones uploaded: a batch of both)
            on_device = [a if torch.is_tensor(a) else upload(a, self.device) for a in arrays]
            raw_d = torch.cat([a.reshape(-1) for a in on_device])
        else:
            raw = torch.empty(sum(a.size for a in arrays), dtype=torch.uint8, pin_memory=self._pin)
            np.concatenate([a.reshape(-1) for a in arrays], out=raw.numpy())
            raw_d = raw.to(self.device, non_blocking=True)
        base, stride, step = np.empty(n, np.int32), np.empty(n, np.int32), np.zeros(n, np.int32)
        offset = row = 0
        for a in arrays:
            height, width = a.shape[-3], a.shape[-2]
            h, w = height // p, width // p
            base[row : row + h * w] = offset + patch_starts(h, w, m, p)
            stride[row : row + h * w] = width * 3
            if a.ndim == 4:  # a video slice: its frames follow one another
                step[row : row + h * w] = height * width * 3
            offset, row = offset + int(np.prod(a.shape)), row + h * w
        base_d, stride_d = (self._upload(torch.from_numpy(v)) for v in (base, stride))
        k = torch.arange(p, device=self.device, dtype=torch.int32)
        c = torch.arange(3, device=self.device, dtype=torch.int32)[None, :, None, None]
        index = base_d[:, None, None, None] + stride_d[:, None, None, None] * k[:, None] + (k * 3)[None, :] + c
        out = torch.empty(n, 3, t, p, p, dtype=self.dtype, device=self.device)
        if not step.any():
            values = lut[c * 256 + raw_d[index].int()]  # [n, 3, p, p] float32
            out.copy_(values[:, :, None].expand(n, 3, t, p, p))
        else:
            table = np.where(step > 0, 3 * 256, 0).astype(np.int32)
            step_d, table_d = (self._upload(torch.from_numpy(v))[:, None, None, None, None] for v in (step, table))
            frames = step_d * torch.arange(t, device=self.device, dtype=torch.int32)[None, None, :, None, None]
            values = lut[table_d + c[:, :, None] * 256 + raw_d[index[:, :, None] + frames].int()]  # [n, 3, t, p, p]
            out.copy_(values)
        return out.view(n, -1)

    def collect(self, launch: Launch) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Wait for a launch's copies to land; (tokens, deepstack list) per image, in input order, on the CPU."""
        if launch.done is not None:
            launch.done.synchronize()
        results: list = [None] * launch.num_images
        for indices, plan, merged, deepstack, means in launch.parts:
            offsets = plan.token_offsets
            for j, (i, a, b) in enumerate(zip(indices, offsets, offsets[1:])):
                results[i] = (means[j], []) if launch.mean_pooling[i] else (merged[a:b], [d[a:b] for d in deepstack])
        return results

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy without blocking the host: from pinned memory on CUDA (a pageable source would wait for the GPU)."""
        dst.copy_(src.pin_memory() if self._pin and not src.is_pinned() else src, non_blocking=True)

    def _to_host(
        self, out: torch.Tensor, plan: BatchPlan | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The real rows (in `dtype` where given), copied to (pinned) host memory in stream order, before the next
        replay reuses the graph memory pool."""
        rows = out[: plan.num_tokens] if plan is not None else out
        if dtype is not None:
            rows = rows.to(dtype)
        if not self._pin:
            return rows
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        return host

    def _run_batch(self, grids, pixel_values: torch.Tensor, budget: int | None):
        if budget is None or not self.pad:  # too large for any budget, or no graph to fit: eagerly, as it is
            plan = make_plan(grids, self.cfg)
            merged, deepstack = self.tower(to_device(plan, pixel_values, self.device, self.dtype))
            self.stats.eager_runs += 1
            self.stats.eager_patches += plan.num_patches
            self.stats.eager_fallbacks += len(grids) if budget is None else 0
            return plan, merged, deepstack
        plan = make_plan(grids, self.cfg, pad_to=budget)
        inputs = self._load(plan, pixel_values, budget)
        if self.use_graphs:
            self.graphs[budget].replay()
            merged, deepstack = self.outputs[budget]
        else:
            merged, deepstack = self.tower(inputs)
        stats = self.stats.budgets[budget]
        stats.replays += 1
        stats.real_patches += plan.num_patches
        stats.padded_patches += budget - plan.num_patches
        return plan, merged, deepstack

    def _load(self, plan: BatchPlan, pixel_values: torch.Tensor, budget: int) -> TowerInputs:
        """Write one plan into the static buffers (in stream order) and return the budget's views of them."""
        s, n, h2d = self.static, plan.num_patches, self._h2d
        if self._pin and pixel_values.device.type == "cpu":  # async copy as they are, then the cast on the device
            rows = pixel_values if pixel_values.is_pinned() else pixel_values.pin_memory()
            s.pixel_values[:n].copy_(rows.to(self.device, non_blocking=True))
        else:
            s.pixel_values[:n].copy_(pixel_values)
        s.pixel_values[n:budget].zero_()
        h2d(s.positions[:budget], plan.positions)
        full = _padded_cu(plan.full.cu_seqlens, self.packer.frame_capacity(budget))
        h2d(s.cu_seqlens[: full.numel()], full)
        inputs = TowerInputs(
            pixel_values=s.pixel_values[:budget],
            positions=s.positions[:budget],
            cu_seqlens=s.cu_seqlens[: full.numel()],
            max_seqlen=budget,
            seqlens=None if self.use_graphs else _lengths(full),
        )
        if plan.window is not None:
            # a windowed tower's plans have both orders (make_plan) and its static buffers the window ones (`static`)
            assert s.cu_window_seqlens is not None and s.patch_order is not None and s.token_order is not None
            assert plan.patch_order is not None and plan.token_order is not None
            window = _padded_cu(plan.window.cu_seqlens, self.packer.window_capacity(budget))
            h2d(s.cu_window_seqlens[: window.numel()], window)
            h2d(s.patch_order[:budget], plan.patch_order)
            h2d(s.token_order[: budget // self.cfg.merge_unit], plan.token_order)
            inputs.cu_window_seqlens, inputs.max_window_seqlen = (
                s.cu_window_seqlens[: window.numel()],
                self.window_seqlen,
            )
            inputs.window_seqlens = None if self.use_graphs else _lengths(window)
            inputs.patch_order, inputs.token_order = (
                s.patch_order[:budget],
                s.token_order[: budget // self.cfg.merge_unit],
            )
        if plan.interp_indices is not None:
            # learned positions: the plan's weights and the static buffers come with the indices (make_plan, `static`)
            assert plan.interp_weights is not None and s.interp_indices is not None and s.interp_weights is not None
            h2d(s.interp_indices[:budget], plan.interp_indices)
            h2d(s.interp_weights[:budget], plan.interp_weights)
            inputs.interp_indices, inputs.interp_weights = s.interp_indices[:budget], s.interp_weights[:budget]
        return inputs

    @staticmethod
    def filler_grid(budget: int) -> tuple[int, int, int]:
        """One image of zeros that fills `budget` exactly, its windows within the budget's capacity."""
        rows = 16 if budget % 32 == 0 else 2
        return (1, rows, budget // rows)

    def load_filler(self, budget: int) -> TowerInputs:
        """Load `filler_grid(budget)` into the static buffers: what a budget's graph is captured on, and what makes it
        safe to replay alone, outside a launch (the buffers hold the last plan loaded, whose metadata past its own
        budget, cu_seqlens among it, is not this budget's)."""
        plan = make_plan([self.filler_grid(budget)], self.cfg, pad_to=budget)
        return self._load(plan, torch.zeros(budget, self.cfg.patch_dim), budget)

    # ---- capture -------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every budget, largest first, into one graph memory pool (no-op without CUDA graphs)."""
        if not self.use_graphs or self.graphs:
            return
        with torch.cuda.device(self.device):
            self._capture_all()

    def _capture_all(self) -> None:
        # torch.cuda.graph's default capture stream is one per process, made on whichever device was current at the
        # first capture: a second device's runner must capture on a stream of its own.
        capture_stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # capture empties the cache anyway: measure the pool from the same baseline
        reserved0, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        pool, progress = None, Progress(log, f"CUDA graphs captured on {self.device}", len(self.budgets), "budgets")
        for budget in reversed(self.budgets):
            t0 = time.perf_counter()
            inputs = self.load_filler(budget)
            graph, self.outputs[budget] = capture_graph(lambda: self.tower(inputs), self.device, pool, capture_stream)
            pool = graph.pool()
            self.graphs[budget] = graph
            torch.cuda.synchronize(self.device)
            stats = self.stats.budgets[budget]
            stats.captured, stats.capture_ms = True, (time.perf_counter() - t0) * 1e3
            pool_mib = (torch.cuda.memory_reserved(self.device) - reserved0) / 2**20
            log.debug("captured budget %5d in %7.1f ms, pool %.1f MiB", budget, stats.capture_ms, pool_mib)
            progress.advance(1, f"budget {budget}, pool {pool_mib:.1f} MiB")
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved0


def capture_graph(forward, device=None, pool=None, stream=None):
    """Run `forward()` once on the capture stream (`stream`, else a new one) as the warm-up (cuBLAS workspaces,
    Triton autotuning, cuDNN graph builds and the cuDNN handle's stream, none of which may change during a
    capture), then capture it on that same stream; returns the CUDA graph and what the captured call returned (the
    tensors each replay rewrites)."""
    stream = stream or torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = forward()
    return graph, outputs


def _padded_cu(cu: torch.Tensor, capacity: int) -> torch.Tensor:
    """cu_seqlens extended to `capacity` segments with zero-length ones (a fixed shape for the graph)."""
    if cu.numel() - 1 > capacity:
        raise ValueError(f"{cu.numel() - 1} segments exceed the replay's capacity of {capacity}")
    return torch.cat([cu, cu[-1:].expand(capacity + 1 - cu.numel())])


def _lengths(cu: torch.Tensor) -> list[int]:
    return (cu[1:] - cu[:-1]).tolist()
