"""End to end on the CPU: image files -> `vitserve encode` -> safetensors, against transformers' processor + tower;
both commands failing fast, with one line and exit status 2, on settings, names and files that cannot work; help
without torch; progress while loading, as lines or a bar, and what the startup log says."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SERVED_REL_ERR, STARTUP_S, rel_err
from PIL import Image
from safetensors import safe_open

from vitserve.service.entry.launch import free_port, start_server
from vitserve.service.ground.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def vitserve(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`python -m vitserve ARGV...` with `env` added to the environment (stdout and stderr together)."""
    return subprocess.run(
        [sys.executable, "-m", "vitserve", *argv],
        cwd=ROOT,
        env=os.environ | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def write_images(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(120, 90), (64, 200)]):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_encode_cli_matches_transformers_pipeline(checkpoints, tmp_path, family):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path, hf_tower = checkpoints[family]
    images = write_images(tmp_path)
    out = tmp_path / "out.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "vitserve", "encode", "--model", path, *images, "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "encoded 2 image(s)" in proc.stderr

    qwen3 = family == "qwen3_vl"
    processor = Qwen2VLImageProcessorPil(
        patch_size=16 if qwen3 else 14,
        **(dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if qwen3 else {}),
        size={"shortest_edge": 65536 if qwen3 else 3136, "longest_edge": 16777216 if qwen3 else 12845056},
    )
    batch = processor([Image.open(p) for p in images], return_tensors="pt")
    with torch.no_grad():
        ref = hf_tower(batch["pixel_values"], batch["image_grid_thw"])
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["grid_thw"]) == batch["image_grid_thw"].tolist()
        assert json.loads(meta["sources"]) == images and meta["family"] == family
        ours = torch.cat([f.get_tensor(f"images.{i}.embeddings") for i in range(2)])
        assert rel_err(ours, ref.pooler_output) <= SERVED_REL_ERR
        if qwen3:
            for j, ref_j in enumerate(ref.deepstack_features):
                assert (
                    rel_err(torch.cat([f.get_tensor(f"images.{i}.deepstack.{j}") for i in range(2)]), ref_j)
                    <= SERVED_REL_ERR
                )
        else:
            assert not any(".deepstack." in k for k in f.keys())


@pytest.mark.slow
def test_encode_cli_takes_videos_beside_images(checkpoints, tmp_path):
    """An image, an MP4 and a WebM in one call (told apart by content, not by name): the videos' tokens and
    deepstack are transformers' tower's on their pixel_values_videos, their timing is in the metadata, and a
    broken video fails the call with one line and exit status 2."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from videos import make_video

    from vitserve.encoder import VisionEncoder

    path, hf_tower = checkpoints["qwen3_vl"]
    image = write_images(tmp_path)[0]
    clips = [tmp_path / "clip.bin", tmp_path / "clip2"]
    clips[0].write_bytes(make_video(30, 10, 160, 120))
    clips[1].write_bytes(make_video(12, 6, 64, 48, codec="libvpx-vp9", container="webm"))
    out = tmp_path / "out.safetensors"
    proc = vitserve("encode", "--model", path, image, *map(str, clips), "--fps", "2", "-o", str(out))
    assert proc.returncode == 0 and "encoded 1 image(s) and 2 video(s)" in proc.stdout, proc.stdout
    enc = VisionEncoder.from_pretrained(path)
    pixels, grids = enc.preprocess_videos([c.read_bytes() for c in clips], fps=2)
    with torch.no_grad():
        ref = hf_tower(pixels, grids)
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["grid_thw"])[1:] == grids.tolist()
        ours = torch.cat([f.get_tensor(f"images.{i}.embeddings") for i in (1, 2)])
        assert rel_err(ours, ref.pooler_output) <= SERVED_REL_ERR
        for j, ref_j in enumerate(ref.deepstack_features):
            assert (
                rel_err(torch.cat([f.get_tensor(f"images.{i}.deepstack.{j}") for i in (1, 2)]), ref_j) <= SERVED_REL_ERR
            )
    timing = json.loads(meta["videos"])
    assert timing[0] is None and timing[1]["fps"] == 10.0
    assert timing[1]["timestamps"] == Qwen3VLProcessor._calculate_timestamps(None, timing[1]["frame_indices"], 10.0, 2)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(clips[0].read_bytes()[:3000])
    proc = vitserve("encode", "--model", path, str(broken), "-o", str(out))
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1].startswith("vitserve encode: "), proc.stdout


@pytest.mark.slow
def test_encode_cli_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    cmd = [sys.executable, "-m", "vitserve", "encode", "--model", "tiny-qwen2-vl", "--load-format", "dummy"]
    proc = subprocess.run(
        cmd + [str(bad), "-o", str(tmp_path / "o.safetensors")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "vitserve encode:" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitserve",
            "encode",
            "--model",
            str(tmp_path / "missing"),
            write_images(tmp_path)[0],
            "-o",
            "x",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["--model", "tiny-qwen2.5-vl"]])
def test_a_bad_variable_fails_in_one_line(argv):
    proc = vitserve("serve", *argv, timeout=60, VITSERVE_PORT="abc")
    assert (proc.returncode, proc.stdout) == (2, "vitserve serve: VITSERVE_PORT: invalid int value: 'abc'\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--dtype", "float8"],
            "vitserve serve: --dtype must be auto or one of float32, float16, bfloat16, fp32, fp16, "
            "bf16, half, got 'float8'",
        ),
        pytest.param(
            ["--device", "cuda"],
            "vitserve serve: device cuda asked for, but CUDA is not available on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_serve_rejects_what_cannot_load_before_it_starts(flags, message):
    proc = vitserve(
        "serve",
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *flags,
        timeout=60,
    )
    assert proc.returncode == 2 and "Uvicorn running" not in proc.stdout and "Traceback" not in proc.stdout
    assert proc.stdout.startswith(message) and proc.stdout.count("\n") == 1, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, flags, dtype",
    [
        ({"VITSERVE_DTYPE": "bf16", "VITSERVE_DEVICE": "cpu"}, [], "bfloat16"),
        ({"VITSERVE_DTYPE": "bf16"}, ["--dtype", "fp16"], "float16"),
    ],
)  # the flag wins over its variable
def test_encode_reads_the_settings_of_serve(tmp_path, env, flags, dtype):
    """A tiny built-in without --load-format dummy: dummy weights, said so; VITSERVE_* and the dtype aliases as
    `serve` has them; --device auto is the CPU here."""
    out = tmp_path / "out.safetensors"
    proc = vitserve("encode", "--model", "tiny-qwen2.5-vl", *flags, *write_images(tmp_path), "-o", str(out), **env)
    assert proc.returncode == 0, proc.stdout
    assert (
        "tiny-qwen2.5-vl is a built-in test tower with no checkpoint: using seeded random weights "
        "(--load-format dummy)" in proc.stdout
    )
    device = "cpu" if "VITSERVE_DEVICE" in env or not torch.cuda.is_available() else "cuda:0"
    assert "encoded 2 image(s), " in proc.stdout and f" tokens, on {device} in {dtype}, in " in proc.stdout
    with safe_open(out, framework="pt") as f:
        assert f.metadata()["dtype"] == dtype and f.get_tensor("images.0.embeddings").dtype == getattr(torch, dtype)


@pytest.mark.slow
def test_encode_a_builtin_hub_id_not_in_the_cache_fails_at_once_with_the_fix(tmp_path):
    start = time.perf_counter()
    proc = vitserve(
        "encode",
        "--model",
        "Qwen/Qwen2.5-VL-3B-Instruct",
        *write_images(tmp_path),
        "-o",
        str(tmp_path / "out"),
        timeout=60,
        HF_HUB_CACHE=str(tmp_path / "hub"),
        HF_HUB_OFFLINE="1",
    )
    assert time.perf_counter() - start < 20  # an interpreter and torch starting; no retries
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout
    assert proc.stdout.startswith(
        "vitserve encode: 'Qwen/Qwen2.5-VL-3B-Instruct' is not a local directory and not in the Hugging Face cache"
    )
    assert "add --load-format dummy for seeded random weights" in proc.stdout
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct" in proc.stdout and not (tmp_path / "out").exists()


# ---- help without torch, and typos refused at once (issue 25, items 11 and 19) -------------------------------------
def test_help_and_version_import_no_torch():
    """--help and --version read only the settings: no torch (seconds), no numpy, no PIL."""
    code = (
        "import sys\nfrom vitserve.service.entry.cli import main\n"
        "for argv in (['--help'], ['--version'], ['serve', '--help'], ['encode', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
        "print(sorted({'torch', 'numpy', 'PIL'} & set(sys.modules)), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "[]\n", proc.stderr
    assert "devices and kernels:" in proc.stdout and "vitserve 0.2" in proc.stdout


def one_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The one line a refused command prints, after checking that it is one, and that nothing started."""
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1 and proc.stdout.startswith(prefix), proc.stdout
    assert "Uvicorn running" not in proc.stdout and "Traceback" not in proc.stdout
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prot", "8001"], "did you mean --port?"),
        (["--model", "tiny-qwen2.5-vl", "--mod", "x"], "did you mean --model?"),
        (
            ["--model", "tiny-qwen2.5vl", "--load-format", "dummy"],
            "with --load-format dummy: not a built-in name, and no "
            "local checkpoint directory of that name; did you mean "
            "tiny-qwen2.5-vl?",
        ),
        (
            ["--model", "tiny-qwen2.5vl"],
            "not a local directory, a built-in name or a hub id (org/name); did you mean tiny-qwen2.5-vl?",
        ),
        (
            ["--model", "tiny-qwen2.5-vl", "--attention-backend", "flash", "--device", "cpu"],
            "attention backend 'flash' needs a CUDA device and float16 or bfloat16 (here cpu, float32); "
            "use sdpa or auto",
        ),
    ],
)
def test_serve_refuses_a_typo_before_it_binds(argv, message):
    """With downloads allowed, as for a user: a model name that cannot load was found only after the port was bound
    and 24 s of hub retries."""
    start = time.perf_counter()
    proc = vitserve("serve", "--host", "127.0.0.1", "--port", str(free_port()), *argv, timeout=60, HF_HUB_OFFLINE="0")
    assert message in one_line(proc, "vitserve serve: ")
    assert time.perf_counter() - start < 20  # an interpreter starting (and torch, for the attention check)


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder, message",
    [
        ("typo", "--ec-shared-storage {tmp}/typo: no such directory"),
        ("file", "--ec-shared-storage {tmp}/file: not a directory"),
    ],
)
def test_a_bad_encoder_cache_folder_is_refused_before_it_binds(tmp_path, folder, message):
    """--ec-shared-storage names the folder vLLM's consumer reads: one that is missing (a typo) is refused in one
    line before anything binds, not created; a file is refused too."""
    (tmp_path / "file").write_text("x")
    proc = vitserve(
        "serve",
        "--model",
        "tiny-qwen2.5-vl",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--ec-shared-storage",
        str(tmp_path / folder),
        timeout=60,
    )
    assert message.format(tmp=tmp_path) in one_line(proc, "vitserve serve: ")
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "flags, module, message",
    [
        ({"ec_shared_storage": "."}, "blake3", "pip install 'vitserve[ec]'"),
        ({"sglang_encoder": True}, "zmq", "pip install 'vitserve[sglang]'"),
    ],
)
def test_an_encoder_tier_without_its_package_is_refused_before_it_binds(monkeypatch, flags, module, message):
    """blake3 (vLLM's default digest) for --ec-shared-storage, pyzmq for --sglang-encoder: missing, a ValueError
    from the checks before anything loads or binds (the CLI's one line), naming the extra."""
    from vitserve.service.ground import preflight
    from vitserve.service.ground.preflight import prepare

    installed = preflight.installed
    monkeypatch.setattr(preflight, "installed", lambda name: name != module and installed(name))
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="dummy", **flags))
    if module == "blake3":  # a consumer started with another digest needs no blake3
        prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="dummy", ec_hash_algorithm="sha256", **flags))


# ---- encode checks its files first (issue 25, item 12) --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "inputs, output, message",
    [
        (["missing.png"], "out.safetensors", "vitserve encode: input {tmp}/missing.png: no such file"),
        (["folder"], "out.safetensors", "vitserve encode: input {tmp}/folder: not a file"),
        (["text.png"], "out.safetensors", "vitserve encode: input {tmp}/text.png: not a recognized image format"),
        (["image.ppm"], "out.safetensors", "vitserve encode: input {tmp}/image.ppm: PPM images are not accepted"),
        (
            ["img0.png"],
            "missing/out.safetensors",
            "vitserve encode: output {tmp}/missing/out.safetensors: folder {tmp}/missing does not exist",
        ),
        (["img0.png"], "folder", "vitserve encode: output {tmp}/folder: is a directory, not a file"),
    ],
)
def test_encode_checks_its_files_before_the_model_loads(tmp_path, inputs, output, message):
    """A missing input was found after the model had loaded (17 s on a CPU), a missing output folder after all the
    encoding, as a traceback: now one line, before anything loads."""
    write_images(tmp_path)
    (tmp_path / "text.png").write_text("not an image\n")
    (tmp_path / "folder").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "image.ppm")
    proc = vitserve(
        "encode",
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        *[str(tmp_path / name) for name in inputs],
        "-o",
        str(tmp_path / output),
        timeout=60,
    )
    assert one_line(proc, message.format(tmp=tmp_path))
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fps", "0"], "--fps must be above 0 and at most 240 frames a second, not 0"),
        (["--fps", "nan"], "--fps must be above 0 and at most 240 frames a second, not nan"),
        (["--fps", "1000"], "--fps must be above 0 and at most 240 frames a second, not 1000"),
        (["--num-frames", "0"], "--num-frames must be at least 1, not 0"),
    ],
)
def test_encode_checks_its_sampling_before_the_model_loads(tmp_path, flags, message):
    """A bad --fps or --num-frames was reported after the model had loaded: now one line, before anything loads."""
    proc = vitserve(
        "encode",
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        str(ROOT / "examples/clip.mp4"),
        *flags,
        "-o",
        str(tmp_path / "out.safetensors"),
        timeout=60,
    )
    assert one_line(proc, f"vitserve encode: {message}")


@pytest.mark.slow
def test_ctrl_c_stops_encode_in_one_line(tmp_path):
    """Ctrl-C while `vitserve encode` loads (SIGINT once it says it is loading): one line and exit 130, not a
    traceback."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitserve",
            "encode",
            "--model",
            "tiny-qwen2.5-vl",
            "--load-format",
            "dummy",
            *write_images(tmp_path),
            "-o",
            str(tmp_path / "out.safetensors"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = [proc.stdout.readline()]
    assert "loading tiny-qwen2.5-vl" in lines[0], lines
    proc.send_signal(signal.SIGINT)
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=60) == 130 and lines[-1] == "vitserve encode: interrupted\n", lines
    assert "Traceback" not in "".join(lines) and not (tmp_path / "out.safetensors").exists()


def test_an_image_whose_header_lies_past_the_first_bytes_is_accepted(tmp_path):
    """A JPEG whose metadata segments fill the first 64 KiB: its header is read from the whole file."""
    from vitserve.service.entry.cli import HEADER_BYTES, check_encode_paths

    path = tmp_path / "late.jpg"
    Image.new("RGB", (16, 16)).save(path)
    data = path.read_bytes()
    filler = b"".join(b"\xff\xe1\xff\xff" + bytes(65533) for _ in range(2))  # two APP1 segments of 64 KiB
    path.write_bytes(data[:2] + filler + data[2:])
    assert path.stat().st_size > HEADER_BYTES
    check_encode_paths([str(path)], str(tmp_path / "out.safetensors"))
    path.write_bytes(b"\xff\xd8" + filler + b"not the rest of an image")
    with pytest.raises(ValueError, match="late.jpg: "):
        check_encode_paths([str(path)], str(tmp_path / "out.safetensors"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
def test_encode_refuses_files_it_cannot_read_or_write(tmp_path):
    from vitserve.service.entry.cli import check_encode_paths

    image, locked = write_images(tmp_path)[0], tmp_path / "locked"
    locked.mkdir()
    os.chmod(image, 0)
    with pytest.raises(ValueError, match="cannot be read"):
        check_encode_paths([image], str(tmp_path / "out"))
    os.chmod(image, 0o644)
    os.chmod(locked, 0o500)
    with pytest.raises(ValueError, match="not writable"):
        check_encode_paths([image], str(locked / "out"))


# ---- progress while loading, and what the startup log names (issue 25, item 13) ------------------------------------
@pytest.mark.slow
def test_encode_logs_the_load_as_it_goes(checkpoints, tmp_path):
    """A sharded checkpoint on the CPU, as log lines (stderr is a pipe): the shards read, the weights moved, what
    loaded; no bar."""
    path, _ = checkpoints["qwen2_5_vl-sharded"]
    weight_map = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    shards = len({shard for name, shard in weight_map.items() if "visual." in name})
    assert shards > 1
    proc = vitserve(
        "encode", "--model", path, "--device", "cpu", *write_images(tmp_path), "-o", str(tmp_path / "out.safetensors")
    )
    assert proc.returncode == 0, proc.stdout
    out = proc.stdout
    assert "\r" not in out and "[#" not in out
    assert re.search(rf"INFO vitserve.checkpoint: checkpoint read \({shards} shard\(s\)\): (\d+)/\1 tensors \(", out)
    assert re.search(r"INFO vitserve.checkpoint: weights to cpu as float32: ([\d.]+)/\1 MiB in ", out)
    assert re.search(
        r"INFO vitserve.cli: loaded in [\d.]+ s: vitserve 0\.2\.\d+ on cpu \(float32, attention sdpa\)", out
    ), out


@pytest.mark.slow
def test_encode_draws_a_bar_on_a_terminal(tmp_path):
    """stderr a terminal (a pty), the text format: the load's steps as a bar redrawn in place, each ending as the
    line it is."""
    import pty

    main_fd, term = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitserve",
            "encode",
            "--model",
            "tiny-qwen3-vl",
            "--device",
            "cpu",
            *write_images(tmp_path),
            "-o",
            str(tmp_path / "out.safetensors"),
        ],
        cwd=ROOT,
        stdout=term,
        stderr=term,
    )
    os.close(term)
    out = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(main_fd)
    assert proc.wait(timeout=120) == 0
    text = out.decode()
    # the step's start as a bar, any redraws in place, its last record as a line (which replaces the bar)
    assert re.search(
        r"\n\[\.{24}\] weights to cpu as float32: 0\.0/([\d.]+) MiB(\r\x1b\[K\[[#.]{24}\] [^\r\n]*)*"
        r"\r\x1b\[K[\d-]+ [\d:,]+ INFO vitserve.checkpoint: weights to cpu as float32: \1/\1 MiB in ",
        text,
    ), text


def progress_record(step: int, done: int, total: int, message: str = "step") -> logging.LogRecord:
    record = logging.LogRecord("vitserve.test", logging.INFO, __file__, 0, message, (), None)
    record.progress = (step, done, total)
    return record


def test_progress_as_lines_keeps_a_steps_last_and_one_every_few_seconds(monkeypatch):
    from vitserve.service.ground import logs

    now = [0.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    handler = logs.ProgressHandler(stream, bar=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for i, t in enumerate([0, 1, 2, 6, 7, 12]):  # a slow step: its start, then a line per LINE_INTERVAL
        now[0] = t
        handler.handle(progress_record(1, i, 10, f"slow {i}"))
    handler.handle(progress_record(1, 10, 10, "slow done"))
    handler.handle(progress_record(2, 0, 3, "fast 0"))  # a step that ends within LINE_INTERVAL: one line
    handler.handle(progress_record(2, 3, 3, "fast done"))
    assert stream.getvalue().split("\n") == ["slow 3", "slow 5", "slow done", "fast done", ""]


def test_progress_as_a_bar_stays_on_the_last_line():
    from vitserve.service.ground.logs import ProgressHandler

    stream = io.StringIO()
    handler = ProgressHandler(stream, bar=True)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.handle(progress_record(1, 0, 4, "step 0/4"))
    handler.handle(progress_record(1, 2, 4, "step 2/4"))
    handler.handle(logging.LogRecord("x", logging.WARNING, __file__, 0, "meanwhile", (), None))
    handler.handle(progress_record(1, 3, 4, "step 3/4"))
    handler.handle(progress_record(1, 4, 4, "step 4/4"))
    bar = "[" + "#" * 12 + "." * 12 + "]"
    assert stream.getvalue() == (
        "["
        + "." * 24
        + "] step 0/4"
        + f"\r\x1b[K{bar} step 2/4"
        + "\r\x1b[KWARNING meanwhile\n"  # the bar's line taken, and drawn again below
        + "["
        + "#" * 18
        + "." * 6
        + "] step 3/4"
        + "\r\x1b[KINFO step 4/4\n"
    )


@pytest.mark.slow
def test_the_startup_log_says_what_serves():
    """Device processes log through the same logging, their lines named by their device; the ready line names the
    version, devices, dtype, attention kernel, decode workers and cache (sizes as written)."""
    proc, url = start_server(
        "--devices",
        "cpu,cpu",
        "--device-processes",
        "--decode-workers",
        "2",
        "--cache-bytes",
        "64MiB",
        "--cache-scope",
        "api-key",
        "--api-key",
        "k",
        "--model",
        "tiny-qwen2.5-vl",
        timeout=STARTUP_S,
        capture_log=True,
    )
    try:
        ready = next(line for line in proc.log if "ready in" in line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert re.search(
        r"INFO vitserve.engine: ready in [\d.]+ s: vitserve 0\.2\.\d+, tiny-qwen2.5-vl on cpu#0, cpu#1, "
        r"one process each \(float32, attention sdpa\), 2 decode processes, cache 64MiB per API key$",
        ready.strip(),
    ), ready
    log = "".join(proc.log)
    assert "INFO vitserve.checkpoint[cpu]: weights to cpu as float32: " in log and "\r" not in log


@pytest.mark.slow
def test_the_startup_log_of_several_front_ends_says_what_serves():
    """With --api-servers the core's ready line says as much: version, devices, dtype, attention, the decode workers
    of all the front ends and the cache, then the front ends and the port."""
    proc, url = start_server(
        "--api-servers",
        "2",
        "--decode-workers",
        "2",
        "--cache-bytes",
        "64MiB",
        "--model",
        "tiny-qwen2.5-vl",
        "--device",
        "cpu",
        timeout=STARTUP_S,
        capture_log=True,
    )
    try:
        ready = next(line for line in proc.log if "ready in" in line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    port = url.rsplit(":", 1)[1]
    assert re.search(
        r"INFO vitserve.core: ready in [\d.]+ s: vitserve 0\.2\.\d+, tiny-qwen2.5-vl on cpu, one process "
        r"each \(float32, attention sdpa\), 2 decode processes, cache 64MiB per server, 2 front ends on "
        rf"port {port}$",
        ready.strip(),
    ), ready
