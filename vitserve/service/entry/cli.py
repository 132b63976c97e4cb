"""`vitserve` command line: `serve` the HTTP API, or `encode` image files into a safetensors file.

Everything up to running a command (--help, --version, parsing and checking the settings and the inputs) imports no
torch: help is instant, and a mistake is one line (exit status 2) before anything loads."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from ..devices import prestart
from ..ground.flags import Parser, add_arguments, builtin_names, from_args
from ..ground.preflight import prepare
from ..ground.settings import Settings

log = logging.getLogger("vitserve.cli")

HEADER_BYTES = 64 * 2**10  # of an input file, read to check that it is an image before the model loads

SERVE_EXAMPLES = """\
examples:
  # the CPU, the tiny built-in tower with seeded random weights (no GPU, no download):
  vitserve serve --model tiny-qwen2.5-vl --load-format dummy
  # a GPU, real weights (from the Hugging Face cache, else downloaded: only the vision shards):
  vitserve serve --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0
  # every GPU, each served by a process of its own:
  vitserve serve --model Qwen/Qwen2.5-VL-7B-Instruct --devices all
"""
ENCODE_EXAMPLES = """\
examples:
  # the CPU, the tiny built-in tower with seeded random weights:
  vitserve encode --model tiny-qwen2.5-vl --load-format dummy examples/sample.jpg -o /tmp/sample.safetensors
  # a GPU, real weights:
  vitserve encode --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 a.jpg b.png -o embeddings.safetensors
  # a video, 2 frames a second (pip install 'vitserve[video]'):
  vitserve encode --model Qwen/Qwen3-VL-8B-Instruct --device cuda:0 --fps 2 clip.mp4 -o clip.safetensors
"""


def epilog(examples: str) -> str:
    notes = [
        "sizes: bytes, or a number and a unit: 512KiB, 32MiB, 4GiB (powers of 1024), or KB, MB, GB (powers of 1000)",
        "every flag is also an environment variable, VITSERVE_ and the flag in upper snake case; a "
        "flag wins over its variable",
        f"built-in models (--model): {builtin_names()}",
        "more: docs/configuration.md",
    ]
    return examples + "\n" + "\n".join(textwrap.fill(n, 116, subsequent_indent="  ") for n in notes)


def check_encode_paths(images: list[str], output: str) -> None:
    """Before the model loads (ValueError naming the path): every input a readable file whose first bytes are an
    image's header (encoder.headers.probe; all of it where the header lies further), and the output a file in an
    existing, writable folder."""
    from ...encoder.headers import probe
    from ...encoder.image_errors import HeaderNotFound, ImageError
    from ...encoder.video import sniff

    for name in images:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"input {name}: " + ("not a file" if path.exists() else "no such file"))
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
                if sniff(head):  # a video: PyAV reads it when it is encoded
                    continue
                try:
                    probe(head)
                except HeaderNotFound:  # further in, or a format read by PIL: the whole file
                    probe(head + f.read(), whole=True)
        except OSError as e:
            raise ValueError(f"input {name}: cannot be read ({e.strerror})") from None
        except ImageError as e:
            raise ValueError(f"input {name}: {e}") from None
    out = Path(output)
    folder = out.parent
    if out.is_dir():
        raise ValueError(f"output {output}: is a directory, not a file")
    if not folder.is_dir():
        raise ValueError(f"output {output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"output {output}: not writable")


def check_sampling(fps: float | None, num_frames: int | None) -> None:
    """`encode`'s video sampling, before the model loads (ValueError naming the flag), within what a request may ask
    (schemas.VideoOptions: fps in (0, 240], num_frames at least 1)."""
    if fps is not None and not 0 < fps <= 240:  # (NaN is no rate either)
        raise ValueError(f"--fps must be above 0 and at most 240 frames a second, not {fps:g}")
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"--num-frames must be at least 1, not {num_frames}")


def write_output(args: argparse.Namespace, model: str, family: str, dtype: str, results: list, videos: list) -> None:
    """`vitserve encode`'s safetensors file: each input's embeddings and deepstack, their grids, the sources and,
    per input, a video's timing (null for an image: what an LLM needs to place a video's tokens)."""
    from ...encoder.features import Features
    from ..api.outputs import safetensors_body

    metadata = {
        "model": model,
        "family": family,
        "dtype": dtype,
        "grid_thw": json.dumps([list(r.grid_thw) for r in results]),
        "sources": json.dumps(args.images),
    }
    if any(videos):
        metadata["videos"] = json.dumps([video_metadata(r) if v else None for r, v in zip(results, videos)])
    body = safetensors_body([Features(r.embeddings, r.deepstack or [], r.grid_thw) for r in results], dtype, metadata)
    with open(args.output, "wb") as f:
        f.write(body)


def cmd_encode(settings: Settings, args: argparse.Namespace) -> int:
    # logged before the imports: torch's take seconds
    log.info("loading %s (%s)", settings.model.model, settings.model.load_format)
    start = time.perf_counter()
    from ... import __version__
    from ...encoder import VisionEncoder
    from ...encoder.preprocess import ImageError, load_image
    from ...encoder.video import VideoUnavailable, sniff
    from ..api.outputs import OUTPUT_DTYPES
    from ..ground.logs import attention_text

    (device,), dtype = settings.devices.resolve()
    enc = VisionEncoder.from_pretrained(settings.model.model, device=device, dtype=dtype, **settings.encoder_kwargs())
    log.info(
        "loaded in %.2f s: vitserve %s on %s (%s, attention %s)",
        time.perf_counter() - start,
        __version__,
        device,
        dtype,
        attention_text(enc.runner.stats.attention),
    )
    videos = []
    for path in args.images:  # each file's first bytes tell a video from an image
        with open(path, "rb") as f:
            videos.append(sniff(f.read(HEADER_BYTES)) is not None)
    start = time.perf_counter()
    try:
        images = [load_image(path) for path, is_video in zip(args.images, videos) if not is_video]
        clips = [path for path, is_video in zip(args.images, videos) if is_video]
        log.info("encoding %d image(s) and %d video(s)", len(images), len(clips))
        encoded = iter(enc.encode(images) if images else [])
        encoded_videos = iter(enc.encode_videos(clips, fps=args.fps, num_frames=args.num_frames) if clips else [])
        results = [next(encoded_videos) if is_video else next(encoded) for is_video in videos]
    except (ImageError, OSError, VideoUnavailable) as e:
        print(f"vitserve encode: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    name = next(name for name, t in OUTPUT_DTYPES.items() if t == enc.dtype)  # an alias's canonical name
    write_output(args, settings.model.model, enc.config.family, name, results, videos)
    tokens = sum(r.num_tokens for r in results)
    videos_text = f" and {len(clips)} video(s)" if clips else ""
    print(
        f"encoded {len(images)} image(s){videos_text}, {tokens} tokens, on {device} in {name}, in "
        f"{seconds * 1e3:.1f} ms -> {args.output}",
        file=sys.stderr,
    )
    return 0


def video_metadata(result) -> dict:
    """A video's timing as the safetensors metadata of `vitserve encode` carries it (EncodedVideo)."""
    return {
        "frame_indices": result.frame_indices,
        "fps": result.fps,
        "timestamps": result.timestamps,
        "second_per_grid_t": result.second_per_grid_t,
    }


def _stop_starting(signum, frame) -> None:
    """SIGTERM before the server can drain: nothing has been admitted (only the early probes answer) and no process
    runs but those started ahead, so the stop is an exit, 0, at once: they are killed and this process leaves
    without unwinding (an exception raised here would surface inside whatever the main thread is doing, an import
    among others, which turns it into an ImportError)."""
    prestart.release()
    os._exit(0)


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    """The port is bound first and answers its probes at once (early_probes), then the server starts behind it: its
    front ends (supervisor.serve) or its one app (server.run_server), which take the socket over."""
    from ... import __version__
    from .early_probes import EarlyProbes, listening_socket

    host, port = settings.server.host, settings.server.port
    try:
        sock = listening_socket(host, port)
    except OSError as e:  # one line (as uvicorn says it), and uvicorn's exit code for a server that cannot start
        log.error("[Errno %s] error while attempting to bind on address %r: %s", e.errno, (host, port), e.strerror)
        return 3
    signal.signal(signal.SIGTERM, _stop_starting)  # before the port answers; the server's own handler replaces it
    probes = EarlyProbes(sock)
    try:
        fronts = settings.api_server_count()
        log.info(
            "starting vitserve %s for %s%s",
            __version__,
            settings.model.model,
            f", {fronts} front ends" if fronts > 1 else "",
        )
        if fronts > 1:
            from .supervisor import serve

            return serve(settings, fronts, sock, serving=probes.stop)
        from ..pipeline.engine import Engine
        from .server import run_server

        return run_server(settings, Engine(settings), sockets=[sock], serving=probes.stop)
    finally:
        probes.stop()


def build_parser() -> Parser:
    from ... import __version__

    parser = Parser(
        prog="vitserve",
        description="Qwen-VL vision towers: serve image embeddings over HTTP, or encode image files.",
        epilog="`vitserve serve --help` and `vitserve encode --help` list each command's flags, with examples.",
    )
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter
    serve = sub.add_parser(
        "serve",
        help="run the HTTP service",
        description="Run the HTTP service.",
        usage="%(prog)s --model MODEL [options]",
        epilog=epilog(SERVE_EXAMPLES),
        formatter_class=raw,
    )
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    enc = sub.add_parser(
        "encode",
        help="encode image and video files into one safetensors file",
        description="Encode image and video files into one safetensors file.",
        usage="%(prog)s --model MODEL [options] FILE [FILE ...] -o FILE",
        epilog=epilog(ENCODE_EXAMPLES),
        formatter_class=raw,
    )
    files = enc.add_argument_group("files")
    files.add_argument(
        "images",
        nargs="+",
        metavar="FILE",
        help="image and video files (told apart by content; videos need the video extra: PyAV)",
    )
    files.add_argument("-o", "--output", required=True, metavar="FILE", help="output .safetensors path")
    sampling = files.add_mutually_exclusive_group()
    sampling.add_argument(
        "--fps",
        type=float,
        default=None,
        metavar="F",
        help="videos: sample F frames a second (default: the checkpoint's video processor settings)",
    )
    sampling.add_argument(
        "--num-frames", type=int, default=None, metavar="N", help="videos: sample N frames, evenly (instead of --fps)"
    )
    add_arguments(enc, encode=True)
    enc.set_defaults(func=cmd_encode)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and check every setting, and `encode`'s files and sampling (exit 2 with one line when one is wrong), then
    run the command; Ctrl-C is one line too (exit 130). `serve` starts its device processes first, before anything
    here imports torch (the checks of CUDA devices do), so that their imports run beside this process's."""
    from ..ground.logs import configure_logging

    args = build_parser().parse_args(argv)
    try:
        settings = from_args(args)
        if args.command == "serve":
            prestart.start(settings)
        if args.command == "encode":
            check_sampling(args.fps, args.num_frames)
            check_encode_paths(args.images, args.output)
        notes = prepare(settings)
        configure_logging(settings.logging.log_format, settings.logging.log_level)
        for note in notes:
            log.warning(note)
        return args.func(settings, args)
    except ValueError as e:  # bad model, config, flag or file (checkpoint.CheckpointError too): one line
        print(f"vitserve {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (`serve` drains on its own signal handler once it serves): one line
        print(f"vitserve {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:  # a server that ends before its devices took them (a bad flag, a port in use): they go too
        prestart.release()


if __name__ == "__main__":
    sys.exit(main())
