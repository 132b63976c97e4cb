"""Start-up: seconds from launching `vitserve serve` to its first 200 from /ready, for this checkout and optionally
another (--server-tree, an A/B), alternated over --runs launches each so that a drift favours neither. Each server
runs alone (dummy weights), logs at info, and is stopped once ready; the lines that time its steps (the steps'
`... in N s` ends and the core's `ready in`) are printed from the last run's log, which the JSON keeps whole. Prints
a table, writes JSON (--out).

`--checkpoint DIR` serves real weights instead: a checkpoint of --model's tower written there first by
transformers' `save_pretrained` (its vision config from ours, random weights in bfloat16, a one-layer text model
beside it), and, with `--cold`, its files dropped from the page cache before each launch (POSIX_FADV_DONTNEED, after
a sync), so that the shards are read from the disk as on a machine's first start.

    PYTHONPATH=$PWD python3 bench/startup.py --model Qwen/Qwen3-VL-8B-Instruct --server-tree .baseline --out s.json
    PYTHONPATH=$PWD python3 bench/startup.py --checkpoint /tmp/qwen3-8b --cold --out s.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache import serve_from  # noqa: E402

from vitserve.service.entry.launch import free_port, stop_server  # noqa: E402

TIMED = re.compile(r"( in \d+\.\d+ s\b|ready in )")


def write_checkpoint(model: str, path: Path) -> None:
    """A transformers-written checkpoint of `model`'s tower (published dims, random weights, bfloat16) at `path`."""
    import torch
    import transformers as tf
    from hf_reference import vision_config

    from vitserve.encoder.config import BUILTIN_CONFIGS

    cfg = BUILTIN_CONFIGS[model]
    config_cls, model_cls = {
        "qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
    }[cfg.family]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        vocab_size=128,
        hidden_size=cfg.out_hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_parameters=rope,
    )
    config = config_cls(
        text_config=text,
        vision_config=vision_config(cfg),
        image_token_id=120,  # the special tokens inside the one-layer model's vocabulary
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    t = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = model_cls(config).to(torch.bfloat16).eval()
    hf.save_pretrained(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint written to {path} in {time.perf_counter() - t:.1f} s: {size / 2**30:.2f} GiB", flush=True)


def drop_page_cache(path: Path) -> None:
    """The checkpoint's files out of the page cache: the next read comes from the disk."""
    os.sync()
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def launch_to_ready(flags: list[str], env: dict, cwd, timeout: float) -> tuple[float, list[str]]:
    """Seconds from the launch to /ready's first 200 (polled every 20 ms), and the server's log (its first 400
    lines, the access log's left out)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # (a file, not a pipe: a full pipe would stall the server's logging)
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitserve", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds = None
    try:
        while time.perf_counter() - t < timeout and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    seconds = time.perf_counter() - t
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        stop_server(proc, 60)
        log.seek(0)
        out = log.read()
        log.close()
    if seconds is None:
        raise RuntimeError("not ready:\n" + "\n".join(out.splitlines()[-30:]))
    return seconds, [line.rstrip()[-300:] for line in out.splitlines() if "vitserve.access" not in line][:400]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-VL-8B-Instruct")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--runs", type=int, default=3, help="launches of each tree")
    ap.add_argument("--server-tree", default=None, help="another checkout, launched alternately with this one")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--checkpoint", default=None, help="serve real weights written here by transformers first")
    ap.add_argument("--cold", action="store_true", help="the checkpoint's files out of the page cache at each launch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
        if not (checkpoint / "config.json").exists():
            write_checkpoint(args.model, checkpoint)
        flags = ["--model", str(checkpoint)]
    else:
        flags = ["--model", args.model, "--load-format", "dummy"]
    flags += ["--device", args.device, "--log-level", "info"]
    flags += args.server_flags.split()
    base = os.environ | {"PYTHONUNBUFFERED": "1"}
    trees: dict[str, tuple[dict[str, str], Path | None]] = {"this": (base, None)}
    if args.server_tree:
        other = dict(base)
        saved = os.environ.get("PYTHONPATH")
        cwd = serve_from(args.server_tree)
        other["PYTHONPATH"] = os.environ["PYTHONPATH"]
        os.environ["PYTHONPATH"] = saved or ""
        trees["other"] = (other, cwd)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.runs):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            env, cwd = trees[name]
            if args.checkpoint and args.cold:
                drop_page_cache(checkpoint)
            seconds, lines = launch_to_ready(flags, env, cwd, args.timeout)
            runs[name].append({"seconds": seconds, "log": lines})
            print(f"{name} run {i + 1}: ready after {seconds:.2f} s", flush=True)
    weights = f"{args.checkpoint}{', cold' if args.cold else ''}" if args.checkpoint else "dummy weights"
    print(f"\nstart-up to /ready, {args.model} ({weights}, {args.device}), {args.runs} launches each")
    print(f"{'tree':<8}{'min':>8}{'median':>8}{'max':>8}")
    summary = {}
    for name, rs in runs.items():
        s = [r["seconds"] for r in rs]
        summary[name] = {"min": min(s), "median": statistics.median(s), "max": max(s)}
        print(f"{name:<8}{min(s):>8.2f}{statistics.median(s):>8.2f}{max(s):>8.2f}")
    if "other" in summary:
        print(f"this / other, medians: {summary['this']['median'] / summary['other']['median']:.2f}")
    for name, rs in runs.items():
        print(f"\n{name}, last run's timed lines:")
        for line in rs[-1]["log"]:
            if TIMED.search(line):
                print("  " + line)
    if args.out:
        record = {"model": args.model, "device": args.device, "weights": weights, "server_tree": args.server_tree}
        record["summary"] = summary
        Path(args.out).write_text(json.dumps(record | {"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
