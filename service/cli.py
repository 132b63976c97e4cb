"""`vitserve` command line: `serve` the HTTP API, or `encode` image files into a safetensors file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .settings import Parser, Settings, add_arguments, from_args

log = logging.getLogger("vitserve.cli")


def cmd_encode(settings: Settings, args: argparse.Namespace) -> int:
    from ..encoder import VisionEncoder
    from ..encoder.preprocess import ImageError, load_image

    from .outputs import OUTPUT_DTYPES, safetensors_body
    from .settings import resolve_devices

    (device,), dtype = resolve_devices(settings)
    enc = VisionEncoder.from_pretrained(settings.model, device=device, dtype=dtype, **settings.encoder_kwargs())
    try:
        images = [load_image(path) for path in args.images]
    except (ImageError, OSError) as e:
        print(f"vitserve encode: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = enc.encode(images)
    seconds = time.perf_counter() - start
    name = next(name for name, t in OUTPUT_DTYPES.items() if t == enc.dtype)  # an alias's canonical name
    metadata = {"model": settings.model, "family": enc.config.family, "dtype": name,
                "grid_thw": json.dumps([list(r.grid_thw) for r in results]), "sources": json.dumps(args.images)}
    body = safetensors_body([(r.embeddings, r.deepstack or []) for r in results], name, metadata)
    with open(args.output, "wb") as f:
        f.write(body)
    tokens = sum(r.num_tokens for r in results)
    print(f"encoded {len(results)} image(s), {tokens} tokens, on {device} in {name}, in {seconds * 1e3:.1f} ms "
          f"-> {args.output}", file=sys.stderr)
    return 0


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .engine import State
    from .http import connection_limit, guarded_h11

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
                            timeout_keep_alive=settings.timeout_keep_alive,
                            http=guarded_h11(settings.header_timeout, connection_limit(settings.max_connections)),
                            h11_max_incomplete_event_size=settings.max_header_bytes)
    server = Server(config)
    server.run()
    if server.force_exit:  # "exit now": no interpreter teardown (seconds, with torch and a process pool loaded)
        engine.abandon()
        logging.shutdown()
        os._exit(1)
    return 1 if engine.state is State.FAILED else 0


def build_parser() -> Parser:
    from .. import __version__

    parser = Parser(prog="vitserve", description="Qwen-VL vision encoding")
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    enc = sub.add_parser("encode", help="encode image files into one safetensors file")
    add_arguments(enc, encode=True)
    enc.add_argument("images", nargs="+", help="image files")
    enc.add_argument("-o", "--output", required=True, help="output .safetensors path")
    enc.set_defaults(func=cmd_encode)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and check every setting (exit 2 with one line when one is wrong), then run the command."""
    from ..encoder.checkpoint import CheckpointError
    from .logs import configure_logging

    args = build_parser().parse_args(argv)
    try:
        settings = from_args(args)
        notes = settings.prepare()
        configure_logging(settings.log_format, settings.log_level)
        for note in notes:
            log.warning(note)
        return args.func(settings, args)
    except (CheckpointError, ValueError) as e:  # bad model, config or flag: a message, not a traceback
        print(f"vitserve {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
