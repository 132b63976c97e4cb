"""The benchmark (issue 5): one process, one GPU, every way a user could run a Qwen-VL tower, per family and case.

Columns (GPU ms per call, median of CUDA-event timings): the bf16 matmul ceiling and the FLOP floor; our graph
runner's replays with each attention backend installed (`g-flash`, `g-cudnn`, `g-fa4`: that kernel in every
layer) and with `auto` (`g-auto`: the fastest for full attention, flash for Qwen2.5's windows); then, with auto, the
whole `runner.run` call including planning and copies, and our eager tower; transformers' eager tower (sdpa);
transformers + torch.compile (one case, compile time reported); per-shape CUDA graphs over transformers' own modules
with torch's flash varlen kernel (SGLang's technique, metadata precomputed). `graph%` is the FLOP floor over auto's
graph time.
Prints a table, writes JSON and a PNG plot.

    PYTHONPATH=$PWD python3 bench/bench.py --out bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_reference import hf_vision_tower  # noqa: E402

from vitserve.encoder import VisionEncoder  # noqa: E402
from vitserve.encoder.checkpoint import dummy_tensors  # noqa: E402
from vitserve.encoder.layers import rotary_cos_sin  # noqa: E402
from vitserve.encoder.plan import make_plan, to_device  # noqa: E402
from vitserve.encoder.runner import capture_graph  # noqa: E402

MODELS = ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"]
CASES = {
    "224²": [(224, 224)],
    "448²": [(448, 448)],
    "448×896": [(448, 896)],
    "896²": [(896, 896)],
    "1344²": [(1344, 1344)],
    "8×448²": [(448, 448)] * 8,
    "32×224²": [(224, 224)] * 32,
}
EXTRA_CASES = {"qwen3_vl": {"8×512²": [(512, 512)] * 8}}  # 8192 patches at Qwen3's 16-pixel patches, as for the others
_MAX = [0]  # the max_seqlen the registered attention uses when transformers hands it a tensor


def gpu_ms(fn, warmup=3, reps=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / gpu_ms(lambda: a @ b, warmup=5, reps=20) / 1e9


def tower_flops(cfg, grids) -> float:
    """Matmul FLOPs of one forward at the published (unpadded) widths, attention included."""
    d, i, n = cfg.hidden_size, cfg.intermediate_size, sum(t * h * w for t, h, w in grids)
    mlp = (3 if cfg.hidden_act == "silu" else 2) * 2 * d * i
    total = n * (2 * cfg.patch_dim * d + cfg.depth * (2 * d * 3 * d + 2 * d * d + mlp))
    plan = make_plan(grids, cfg)
    for layer in range(cfg.depth):
        full = not cfg.window_size or layer in cfg.fullatt_block_indexes
        total += sum(4 * L * L * d for L in (plan.full.lengths if full else plan.window.lengths))
    u = cfg.merge_unit
    merger = n // u * (2 * u * d * u * d + 2 * u * d * cfg.out_hidden_size)
    return total + merger * (1 + len(cfg.deepstack_visual_indexes))


def register_varlen_attention() -> str:
    """Back transformers' "flash_attention_2" entry with torch's flash varlen kernel (the flash-attn package is not
    installed); towers are built with sdpa and switched to it afterwards (`use_varlen`), skipping the package check."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface

    def attention(
        module,
        query,
        key,
        value,
        attention_mask=None,
        scaling=None,
        dropout=0.0,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        **kwargs,
    ):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        m = max_length_q if isinstance(max_length_q, int) else _MAX[0]
        return varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, m, m).unsqueeze(0), None

    AttentionInterface.register("flash_attention_2", attention)
    return "flash_attention_2"


def use_varlen(tower, name: str):
    tower.config._attn_implementation_internal = name
    return tower


def hf_module_forward(tower, cfg, px, grids):
    """transformers' modules driven with host-precomputed metadata (no host sync left): patch embedding, blocks,
    merger (+ deepstack mergers). Returns the forward as a closure."""
    plan = make_plan(grids, cfg)
    dev = px.device
    cos, sin = rotary_cos_sin(plan.positions.to(dev), tower.rotary_pos_emb.inv_freq.to(dev))  # transformers' layout
    full = (plan.full.cu_seqlens.to(dev), plan.full.max_seqlen)
    window = (plan.window.cu_seqlens.to(dev), plan.window.max_seqlen) if plan.window else full
    window_index = plan.token_order.argsort().to(dev) if plan.window else None
    reverse = plan.token_order.to(dev) if plan.window else None
    interp = (plan.interp_indices.to(dev), plan.interp_weights.to(dev)) if plan.interp_indices is not None else None
    _MAX[0] = sum(t * h * w for t, h, w in grids)
    unit = cfg.merge_unit

    def forward():
        h = tower.patch_embed(px)
        if interp is not None:
            h = h + (tower.pos_embed(interp[0]) * interp[1][:, :, None]).sum(1).to(h.dtype)
        if window_index is not None:
            h = h.reshape(-1, unit, h.shape[-1])[window_index].reshape(h.shape)
        for i, blk in enumerate(tower.blocks):
            cu, mx = full if (not cfg.window_size or i in cfg.fullatt_block_indexes) else window
            h = blk(h, cu_seqlens=cu, max_seqlen=mx, position_embeddings=(cos, sin))
            if i in cfg.deepstack_visual_indexes:
                tower.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](h)
        out = tower.merger(h)
        return out if reverse is None else out[reverse]

    return forward


def hf_graph(tower, cfg, px, grids):
    """SGLang's technique: `hf_module_forward` captured in one CUDA graph for this exact shape; returns replay."""
    forward = hf_module_forward(tower, cfg, px, grids)
    with torch.inference_mode():
        graph, _ = capture_graph(forward)
    return graph.replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--compile-case", default="448²", help="the case timed under torch.compile (first model only)")
    ap.add_argument(
        "--ours-only", action="store_true", help="skip transformers' columns (a quick check, not the table)"
    )
    ap.add_argument(
        "--attention-backends",
        nargs="*",
        default=["flash", "cudnn", "fa4"],
        help="a graph column per attention backend (those not installed are skipped); the others use auto",
    )
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    ceiling = matmul_tflops()
    attn = register_varlen_attention()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul ceiling {ceiling:.0f} TFLOP/s")
    rows, startup = [], {}
    for m, name in enumerate(args.models):
        encoders = {}
        for backend in dict.fromkeys([*args.attention_backends, "auto"]):
            t0 = time.perf_counter()
            try:
                encoders[backend] = VisionEncoder.from_pretrained(
                    name, device="cuda", dtype="bfloat16", load_format="dummy", attention_backend=backend
                )
            except ValueError as e:
                print(f"{backend}: {e}")
                continue
            stats = encoders[backend].runner.stats
            startup[f"{name} {backend}"] = dict(
                seconds=time.perf_counter() - t0, pool_bytes=stats.pool_bytes, capture_seconds=stats.capture_seconds
            )
            print(
                f"{name} [{backend}]: load + capture {time.perf_counter() - t0:.1f} s (capture "
                f"{stats.capture_seconds:.2f} s, pool {stats.pool_bytes / 2**20:.0f} MiB)"
            )
        columns = list(encoders)
        enc = encoders["auto"]
        auto = "+".join(dict.fromkeys(enc.runner.stats.attention.values()))  # full (+ window) backends
        cfg, runner = enc.config, enc.runner
        hf_eager = hf_flash = None
        if not args.ours_only:
            tensors = dummy_tensors(cfg, 0)
            hf_eager = hf_vision_tower(cfg, tensors, "cuda", torch.bfloat16)
            hf_flash = use_varlen(hf_vision_tower(cfg, tensors, "cuda", torch.bfloat16), attn)
            del tensors
        header = (
            f"{'model':14s} {'case':8s} {'patches':>7s} {'floor':>6s} "
            + " ".join(f"{'g-' + b:>7s}" for b in columns)
            + f" {'call':>7s} {'eager':>7s} {'hf-graph':>8s} {'hf-comp':>7s} {'hf-eager':>8s} {'graph%':>6s}"
            f" {'img/s':>7s} replays (auto: {auto})"
        )
        print(header)
        cases = CASES | EXTRA_CASES.get(cfg.family, {})
        for case in args.cases + list(EXTRA_CASES.get(cfg.family, {})):
            grids = [(1, h // cfg.patch_size, w // cfg.patch_size) for h, w in cases[case]]
            n = sum(t * h * w for t, h, w in grids)
            px = torch.randn(n, cfg.patch_dim)
            pxd, thw = px.cuda().bfloat16(), torch.tensor(grids, device="cuda")
            with torch.inference_mode():
                by_backend = {}
                for backend in columns:
                    r = encoders[backend].runner
                    by_backend[backend], replays = 0.0, r.pack(grids)
                    for b in replays:  # each replay alone, its metadata already in the static buffers
                        plan = make_plan([grids[i] for i in b.indices], cfg, pad_to=b.budget)
                        r._load(plan, torch.randn(plan.num_patches, cfg.patch_dim), b.budget)
                        by_backend[backend] += gpu_ms(r.graphs[b.budget].replay)
                replays = runner.pack(grids)
                graph = by_backend["auto"]
                runner.run(px, grids)
                t = time.perf_counter()
                for _ in range(10):
                    runner.run(px, grids)
                call = (time.perf_counter() - t) / 10 * 1e3
                inputs = to_device(make_plan(grids, cfg), px, enc.device, enc.dtype)
                eager = gpu_ms(lambda: enc.tower(inputs), reps=10)
                hf_ms = hf_graph_ms = compiled = float("nan")
                if hf_eager is not None:
                    hf_ms = gpu_ms(lambda: hf_eager(pxd, thw), warmup=2, reps=5)
                    try:
                        hf_graph_ms = gpu_ms(hf_graph(hf_flash, cfg, pxd, grids))
                    except Exception as e:  # reported, not fatal: this column is a peer, not us
                        print(f"  hf-graph failed: {type(e).__name__}: {e}")
                if hf_eager is not None and m == 0 and case == args.compile_case:
                    ct = torch.compile(hf_eager)
                    t = time.perf_counter()
                    ct(pxd, thw)
                    compile_s = time.perf_counter() - t
                    compiled = gpu_ms(lambda: ct(pxd, thw), warmup=1, reps=5)
                    startup["torch.compile first call s"] = compile_s
            flops = tower_flops(cfg, grids)
            row = dict(
                model=name,
                case=case,
                patches=n,
                images=len(grids),
                replays=[b.budget for b in replays],
                attention=auto,
                graph_ms_by_backend=by_backend,
                flops=flops,
                floor_ms=flops / ceiling / 1e9,
                graph_ms=graph,
                call_ms=call,
                eager_ms=eager,
                hf_graph_ms=hf_graph_ms,
                hf_compile_ms=compiled,
                hf_eager_ms=hf_ms,
                graph_frac=flops / graph / 1e9 / ceiling,
                images_per_s=len(grids) / graph * 1e3,
            )
            rows.append(row)
            print(
                f"{name.split('/')[-1][:14]:14s} {case:8s} {n:7d} {row['floor_ms']:6.2f} "
                + " ".join(f"{by_backend[b]:7.2f}" for b in columns)
                + f" {call:7.2f} {eager:7.2f} {hf_graph_ms:8.2f} {compiled:7.2f} {hf_ms:8.2f} "
                f"{100 * row['graph_frac']:5.1f}% {row['images_per_s']:7.1f} "
                f"{'+'.join(str(b.budget) for b in replays)}",
                flush=True,
            )
        encoders = enc = runner = hf_eager = hf_flash = None  # free this model before the next
        torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        matmul_tflops=ceiling,
        startup=startup,
        rows=rows,
    )
    json.dump(result, open(args.out, "w"), indent=1)
    if args.plot:
        plot(result, args.plot)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = [r for r in result["rows"] if r["images"] == 1]
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        x = [r["patches"] for r in mine]
        backends = [b for b in mine[0]["graph_ms_by_backend"] if b != "auto"]
        series = [(lambda r, b=b: r["graph_ms_by_backend"][b], f"vitserve graph, {b}") for b in backends] + [
            (lambda r, k=k: r[k], label)
            for k, label in (
                ("eager_ms", "vitserve eager"),
                ("hf_graph_ms", "transformers + CUDA graph"),
                ("hf_eager_ms", "transformers eager"),
                ("floor_ms", "FLOP floor"),
            )
        ]
        for value, label in series:
            style = "k--" if label == "FLOP floor" else "o-"
            axes[0][col].plot(x, [value(r) for r in mine], style, label=label)
            axes[1][col].plot(x, [1e3 / value(r) for r in mine], style, label=label)
        axes[0][col].set(
            title=f"{model.split('/')[-1]}: latency",
            xscale="log",
            yscale="log",
            xlabel="patches per image",
            ylabel="GPU ms per image",
        )
        axes[1][col].set(
            title="throughput (one image per call)",
            xscale="log",
            yscale="log",
            xlabel="patches per image",
            ylabel="images / s",
        )
        axes[0][col].legend(fontsize=7)
        for ax in (axes[0][col], axes[1][col]):
            ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(
        f"{result['device']}, torch {result['torch']}, bf16, {result['date']} "
        f"(matmul ceiling {result['matmul_tflops']:.0f} TFLOP/s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
