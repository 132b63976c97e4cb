"""`vitserve` command line: `serve` the HTTP API, or `encode` image files into a safetensors file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    from ..encoder.vision_encoder import DTYPES, LOAD_FORMATS

    p.add_argument("--model", required=True, help="checkpoint directory, hub id, or built-in name (tiny-qwen2.5-vl, ...)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: seeded random weights from a built-in config, no files read")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--min-pixels", type=int, default=None, help="override the checkpoint's preprocessing minimum")
    p.add_argument("--max-pixels", type=int, default=None, help="override the checkpoint's preprocessing maximum")


def cmd_encode(args: argparse.Namespace) -> int:
    from ..encoder import VisionEncoder
    from ..encoder.preprocess import ImageError, load_image

    from .outputs import OUTPUT_DTYPES, safetensors_body

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
    dtype = next(name for name, t in OUTPUT_DTYPES.items() if t == enc.dtype)
    metadata = {"model": args.model, "family": enc.config.family, "dtype": dtype,
                "grid_thw": json.dumps([list(r.grid_thw) for r in results]), "sources": json.dumps(args.images)}
    body = safetensors_body([(r.embeddings, r.deepstack or []) for r in results], dtype, metadata)
    with open(args.output, "wb") as f:
        f.write(body)
    tokens = sum(r.num_tokens for r in results)
    print(f"encoded {len(results)} image(s), {tokens} tokens, in {seconds * 1e3:.1f} ms -> {args.output}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .engine import State
    from .logs import configure_logging
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

        async def on_tick(self, counter: int) -> bool:
            """Exit once the engine has failed (a model that did not load, a lost device): for a restart."""
            return await super().on_tick(counter) or engine.state is State.FAILED

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on",
                            log_level=settings.log_level, access_log=False,
                            timeout_keep_alive=settings.timeout_keep_alive)
    server = Server(config)
    server.run()
    if server.force_exit:  # "exit now": no interpreter teardown (seconds, with torch and a process pool loaded)
        engine.abandon()
        logging.shutdown()
        os._exit(1)
    return 1 if engine.state is State.FAILED else 0


def build_parser() -> argparse.ArgumentParser:
    from .settings import add_arguments

    from .. import __version__

    parser = argparse.ArgumentParser(prog="vitserve", description="Qwen-VL vision encoding")
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
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
    from ..encoder.checkpoint import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:  # bad model, config or flag: a message, not a traceback
        print(f"vitserve {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
