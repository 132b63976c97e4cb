"""`vitserve` command line: `serve` the HTTP API, or `encode` image files into a safetensors file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory, hub id, or built-in name (tiny-qwen2.5-vl, ...)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: seeded random weights from a built-in config, no files read")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--min-pixels", type=int, default=None, help="override the checkpoint's preprocessing minimum")
    p.add_argument("--max-pixels", type=int, default=None, help="override the checkpoint's preprocessing maximum")


def cmd_encode(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from encoder import VisionEncoder
    from encoder.preprocess import ImageError, load_image

    enc = VisionEncoder.from_pretrained(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                                        revision=args.revision, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    try:
        images = [load_image(path) for path in args.images]
    except (ImageError, OSError) as e:
        print(f"vitserve encode: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = enc.encode(images)
    seconds = time.perf_counter() - start
    tensors = {}
    for i, r in enumerate(results):
        tensors[f"images.{i}.embeddings"] = r.embeddings.contiguous()
        for j, d in enumerate(r.deepstack or []):
            tensors[f"images.{i}.deepstack.{j}"] = d.contiguous()
    metadata = {"model": args.model, "family": enc.config.family, "dtype": args.dtype,
                "grid_thw": json.dumps([list(r.grid_thw) for r in results]), "sources": json.dumps(args.images)}
    save_file(tensors, args.output, metadata=metadata)
    tokens = sum(r.num_tokens for r in results)
    print(f"encoded {len(results)} image(s), {tokens} tokens, in {seconds * 1e3:.1f} ms -> {args.output}", file=sys.stderr)
    return 0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .settings import from_args

    settings = from_args(args)
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    engine = app.state.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """First SIGTERM/SIGINT: not ready, stop accepting, answer everything in flight, exit 0. A second: exit
            now. (Unlike uvicorn's own handler, the signal is not re-raised after a graceful shutdown.)"""
            engine.drain()
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on",
                            log_level=settings.log_level, access_log=False,
                            timeout_keep_alive=settings.timeout_keep_alive)
    server = Server(config)
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if server.force_exit:  # "exit now": no interpreter teardown (seconds, with torch and a process pool loaded)
        engine.abandon()
        logging.shutdown()
        os._exit(1)
    return 1 if engine.state == "failed" else 0


def build_parser() -> argparse.ArgumentParser:
    from .settings import add_arguments

    parser = argparse.ArgumentParser(prog="vitserve", description="Qwen-VL vision encoding")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    enc = sub.add_parser("encode", help="encode image files into one safetensors file")
    add_model_args(enc)
    enc.add_argument("images", nargs="+", help="image files")
    enc.add_argument("-o", "--output", required=True, help="output .safetensors path")
    enc.set_defaults(func=cmd_encode)
    return parser


def main(argv: list[str] | None = None) -> int:
    from encoder.checkpoint import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:  # bad model, config or flag: a message, not a traceback
        print(f"vitserve {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
