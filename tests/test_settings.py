"""Settings: flags and VITSERVE_* variables (old names kept as aliases), validation before anything loads (values,
then this machine's devices, the model's whereabouts and the attention backend), device resolution, sizes with
units, --help, and the CPUs the decode workers default to."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import fields

import huggingface_hub.constants
import pytest
import torch

from vitserve.encoder.config import BUILTIN_CONFIGS
from vitserve.service.entry.cli import build_parser, main
from vitserve.service.ground.flags import (
    GROUPS,
    Parser,
    add_arguments,
    format_size,
    from_args,
    parse_size,
    settings_fields,
)
from vitserve.service.ground.machine import available_cpus
from vitserve.service.ground.preflight import prepare
from vitserve.service.ground.settings import Settings
from vitserve.service.ground.settings_groups import DTYPE_NAMES, PREPROCESS_MODES


def flat(settings: Settings) -> dict:
    """The settings by their flat names (the flags')."""
    return {
        f.name: getattr(group, f.name)
        for group in (getattr(settings, g.name) for g in fields(settings))
        for f in fields(group)
    }


def parse(*argv: str) -> Settings:
    parser = Parser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("VITSERVE_MODEL", "tiny-qwen2-vl")
    monkeypatch.setenv("VITSERVE_MAX_BATCH_TOKENS", "1024")
    monkeypatch.setenv("VITSERVE_ALLOW_URL_FETCH", "true")
    monkeypatch.setenv("VITSERVE_ATTENTION_BACKEND", "cudnn")
    s = parse("--port", "9000")
    assert (s.model.model, s.batching.max_batch_tokens, s.server.allow_url_fetch, s.server.port) == (
        "tiny-qwen2-vl",
        1024,
        True,
        9000,
    )
    # the attention backend reaches from_pretrained wherever a device loads (in-process or a device process)
    assert s.devices.attention_backend == "cudnn" and s.encoder_kwargs()["attention_backend"] == "cudnn"
    with pytest.raises(ValueError, match="model"):
        Settings.of()
    with pytest.raises(ValueError, match="--attention-backend must be one of auto, cudnn, fa4, flash, sdpa"):
        Settings.of(model="m", attention_backend="flash2")
    assert json.loads(json.dumps(dataclasses.asdict(s)))["model"]["model"] == "tiny-qwen2-vl"


def test_renamed_flags_keep_their_old_names(monkeypatch):
    """--decode-workers / --decode-processes were --preprocess-workers / --preprocess-processes: both spellings,
    as flags and as variables, set the same setting; the new name wins over the old variable."""
    assert parse("--model", "m", "--preprocess-workers", "3").decoding.decode_workers == 3
    assert (
        parse("--model", "m", "--decode-workers", "5", "--preprocess-processes", "false").decoding.decode_processes
        is False
    )
    monkeypatch.setenv("VITSERVE_PREPROCESS_WORKERS", "7")
    assert parse("--model", "m").decoding.decode_workers == 7
    monkeypatch.setenv("VITSERVE_DECODE_WORKERS", "2")
    assert parse("--model", "m").decoding.decode_workers == 2


def test_device_resolution():
    assert Settings.of(model="m", device="cpu").devices.resolve() == (["cpu"], "float32")
    assert Settings.of(model="m", devices="cuda:0, cuda:1", dtype="float16").devices.resolve() == (
        ["cuda:0", "cuda:1"],
        "float16",
    )
    assert Settings.of(model="m", devices="cuda:2").devices.resolve()[1] == "bfloat16"
    if not torch.cuda.is_available():
        assert Settings.of(model="m", devices="all").devices.resolve() == (["cpu"], "float32")


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("VITSERVE_PORT", "abc", "VITSERVE_PORT: invalid int value: 'abc'"),
        ("VITSERVE_MAX_BATCH_WAIT_MS", "soon", "VITSERVE_MAX_BATCH_WAIT_MS: invalid float value: 'soon'"),
        ("VITSERVE_ALLOW_URL_FETCH", "maybe", "VITSERVE_ALLOW_URL_FETCH: not a boolean: 'maybe'"),
        ("VITSERVE_PREPROCESS_PROCESSES", "2", "VITSERVE_PREPROCESS_PROCESSES: not a boolean: '2'"),
    ],
)
@pytest.mark.parametrize("argv", [["serve", "--help"], ["serve", "--model", "tiny-qwen2-vl"]])
def test_a_bad_variable_is_one_line_and_exit_2(monkeypatch, capsys, variable, value, message, argv):
    """Checked before any flag is read, so `--help` reports it too (no help, no traceback)."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "" and err == f"vitserve serve: {message}\n"


def test_a_bad_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", "m", "--port", "abc"])
    assert (
        exit.value.code == 2
        and capsys.readouterr().err == "vitserve serve: argument --port: invalid int value: 'abc'\n"
    )
    assert main(["serve", "--model", "tiny-qwen2-vl", "--dtype", "float8"]) == 2
    assert capsys.readouterr().err.startswith("vitserve serve: --dtype must be auto or one of float32, float16, ")


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(dtype="float8"), "--dtype must be auto or one of float32, float16, bfloat16, fp32, fp16, bf16, half"),
        (dict(device="gpu"), "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (dict(device="cuda:x"), "--device must be"),
        (dict(devices="cuda:0,auto"), "--devices must be all or a comma-separated list"),
        (dict(devices=" , "), "--devices must be"),
        (dict(budgets="256,x"), "--budgets must be comma-separated positive multiples of 16, got '256,x'"),
        (dict(budgets="100"), "--budgets must be"),
        (dict(budgets="0"), "--budgets must be"),
        (dict(load_format="pt"), "--load-format must be one of auto, safetensors, dummy"),
        (dict(log_level="loud"), "--log-level must be one of debug, info, warning, error"),
        (dict(log_format="xml"), "--log-format must be text or json"),
        (dict(min_pixels=1000, max_pixels=10), "--min-pixels must not exceed --max-pixels"),
        (dict(url_fetch_timeout=0), "--url-fetch-timeout must be positive"),
        (dict(video_fps=0), "^--video-fps must be positive"),  # one flag named, not five
        (dict(max_video_frames=0), "^--max-video-frames must be positive$"),
        (dict(video_decode_work=0), "^--video-decode-work must be positive$"),
        (dict(video_min_pixels=1000, video_max_pixels=10), "--video-min-pixels must not exceed --video-max-pixels"),
        (dict(port=0), "--port must be 1-65535"),
    ],
)
def test_bad_values_are_rejected(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Settings.of(model="m", **values)


def test_good_values_pass():
    for dtype in ("auto", "float32", "fp32", "fp16", "bf16", "half", "bfloat16"):
        assert Settings.of(model="m", dtype=dtype).devices.dtype == dtype
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        Settings.of(model="m", device=device)
    assert Settings.of(model="m", devices="all").devices.devices == "all"
    assert Settings.of(model="m", budgets="256, 1024,").devices.budget_list() == (256, 1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("values", [dict(device="cuda"), dict(device="cuda:1"), dict(devices="cpu,cuda:0")])
def test_cuda_on_a_machine_without_it_is_rejected(values):
    with pytest.raises(ValueError, match=r"CUDA is not available on this machine \(torch.cuda.is_available\(\) is "):
        prepare(Settings.of(model="tiny-qwen2-vl", **values))
    assert prepare(Settings.of(model="tiny-qwen2-vl", load_format="dummy", devices="all")) == []  # else the CPU


def test_a_cuda_index_beyond_the_devices_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    prepare(Settings.of(model="tiny-qwen2-vl", load_format="dummy", devices="cuda:0,cuda:1"))
    with pytest.raises(
        ValueError,
        match=r"device cuda:2 asked for, but this machine has 2 CUDA device\(s\): "
        "cuda:0 to cuda:1",
    ):
        prepare(Settings.of(model="tiny-qwen2-vl", load_format="dummy", devices="cuda:0,cuda:2"))


def test_a_tiny_builtin_implies_dummy_weights():
    s = Settings.of(model="tiny-qwen2.5-vl", device="cpu")
    notes = prepare(s)
    assert s.model.load_format == "dummy" and s.encoder_kwargs()["load_format"] == "dummy"
    assert notes == [
        "tiny-qwen2.5-vl is a built-in test tower with no checkpoint: using seeded random weights (--load-format dummy)"
    ]
    assert prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="dummy")) == []
    with pytest.raises(ValueError, match="no checkpoint: use --load-format dummy"):
        prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="safetensors"))


def test_a_builtin_hub_id_not_in_the_cache_fails_at_once_with_the_fix(monkeypatch, tmp_path):
    """Downloads off (HF_HUB_OFFLINE=1, conftest): the cache is looked up offline and the message says what to add."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ValueError) as error:
        prepare(Settings.of(model="Qwen/Qwen2.5-VL-3B-Instruct"))
    assert time.perf_counter() - start < 2
    message = str(error.value)
    assert "not in the Hugging Face cache" in message and str(tmp_path) in message
    assert "add --load-format dummy" in message and "hf download Qwen/Qwen2.5-VL-3B-Instruct" in message
    assert "unset HF_HUB_OFFLINE" in message
    assert prepare(Settings.of(model="Qwen/Qwen2.5-VL-3B-Instruct", load_format="dummy")) == []
    # once in the cache it passes, found offline
    repo = tmp_path / "models--Qwen--Qwen2.5-VL-3B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert prepare(Settings.of(model="Qwen/Qwen2.5-VL-3B-Instruct")) == []


def test_any_hub_id_not_in_the_cache_fails_at_once(monkeypatch, tmp_path):
    """Downloads off: a hub id that is not built in fails before loading too (without the dummy hint); a directory
    is read when it loads."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        ValueError, match="'someone/some-vl' is not a local directory and is not in the Hugging Face cache"
    ) as error:
        prepare(Settings.of(model="someone/some-vl"))
    assert "--load-format dummy" not in str(error.value)
    assert prepare(Settings.of(model=str(tmp_path / "missing"))) == []


def test_encode_reads_the_model_settings_only(monkeypatch):
    """`encode` has the model's flags and variables (same names, same defaults), not the server's."""
    from vitserve.service.entry.cli import build_parser

    monkeypatch.setenv("VITSERVE_DTYPE", "bf16")
    monkeypatch.setenv("VITSERVE_DEVICE", "cpu")
    monkeypatch.setenv("VITSERVE_DEVICES", "cuda:0,cuda:1")  # a server's setting: encode uses one device
    args = build_parser().parse_args(
        ["encode", "--model", "tiny-qwen3-vl", "--attention-backend", "sdpa", "a.png", "-o", "out"]
    )
    s = from_args(args)
    assert (s.devices.dtype, s.devices.device, s.devices.devices, s.devices.attention_backend) == (
        "bf16",
        "cpu",
        None,
        "sdpa",
    )
    assert s.devices.resolve() == (["cpu"], "bf16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["encode", "--model", "m", "--port", "1", "a.png", "-o", "out"])


# ---- sizes, help and flags (issue 25, item 19) -------------------------------------------------------------------
SIZES = [
    "payload_limit",
    "decode_memory_per_request",
    "decode_memory",
    "body_memory",
    "cache_bytes",
    "max_header_bytes",
    "url_fetch_memory",
    "ec_storage_bytes",
]


def test_every_byte_count_is_a_size():
    """Every field that counts bytes reads sizes, and only those (a new one left out would take integers only)."""
    assert sorted(f.name for f in settings_fields() if f.metadata["size"]) == sorted(SIZES)


@pytest.mark.parametrize(
    "text, value",
    [
        ("32MiB", 32 * 2**20),
        ("4GiB", 4 * 2**30),
        ("512KiB", 512 * 2**10),
        ("1GB", 10**9),
        ("1.5GB", 1_500_000_000),
        ("2 mib", 2 * 2**20),
        ("3Gi", 3 * 2**30),
        ("0.5KiB", 512),
        ("12345", 12345),
    ],
)
def test_sizes_take_units_as_flags_and_variables(monkeypatch, text, value):
    for name in SIZES:
        assert flat(parse("--model", "m", f"--{name.replace('_', '-')}", text))[name] == value, name
        monkeypatch.setenv(f"VITSERVE_{name.upper()}", text)
    s = parse("--model", "m")
    assert all(flat(s)[name] == value for name in SIZES)


@pytest.mark.parametrize("text", ["1G", "1M", "12XB", "-1", "1e3", "MiB", ""])
def test_a_size_that_is_not_one_is_one_line_and_exit_2(monkeypatch, capsys, text):
    """A bare G or M is refused: 1000 to Kubernetes, 1024 to Docker."""
    hint = "(bytes, or with a unit: 512KiB, 32MiB, 4GiB; KB, MB, GB are powers of 1000)"
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", "m", "--cache-bytes", text])
    assert exit.value.code == 2
    assert capsys.readouterr().err == f"vitserve serve: argument --cache-bytes: not a size: {text!r} {hint}\n"
    monkeypatch.setenv("VITSERVE_PAYLOAD_LIMIT", text)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m"])
    assert capsys.readouterr().err == f"vitserve serve: VITSERVE_PAYLOAD_LIMIT: not a size: {text!r} {hint}\n"


def test_sizes_print_as_they_are_read():
    for value in (32 * 2**20, 2 * 2**30, 64 * 2**10, 1000, 10**9, 3 * 2**40, 1, 0):
        assert parse_size(format_size(value)) == value
    assert (format_size(32 * 2**20), format_size(64 * 2**10), format_size(10**9)) == ("32MiB", "64KiB", "1000000000")


def help_text(*argv: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return "".join(help_text.capsys.readouterr())


@pytest.fixture
def help_of(capsys):
    help_text.capsys = capsys
    return help_text


def test_serve_help_groups_the_flags_and_shows_choices_defaults_and_examples(help_of):
    text = help_of("serve")
    headers = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headers[: len(GROUPS) + 1] == ["options", *GROUPS], headers
    for shown in (
        "--load-format {auto,safetensors,dummy}",
        "--dtype {auto,float32,float16,bfloat16,fp32,fp16,bf16,half}",
        "--device {auto,cpu,cuda,cuda:N}",
        "--attention-backend {auto,cudnn,fa4,flash,sdpa}",
        "--preprocess {exact,fast}",
        "--log-format {text,json}",
        "--log-level {debug,info,warning,error}",
        "--cache-scope {server,api-key}",
        "--payload-limit SIZE",
    ):
        assert shown in text, shown
    flat = " ".join(text.split())
    assert "[env VITSERVE_MODEL; required]" in flat and "None" not in text
    assert "[env VITSERVE_PAYLOAD_LIMIT; default 32MiB]" in flat
    assert "[env VITSERVE_DECODE_MEMORY; default 4GiB]" in flat
    assert "[env VITSERVE_REVISION]" in flat  # no default to show
    assert all(name in flat for name in BUILTIN_CONFIGS if not name.endswith("-Thinking"))
    assert "GB (powers of 1000)" in flat
    examples = [line.strip().split()[1:] for line in text.splitlines() if line.strip().startswith("vitserve serve ")]
    assert len(examples) == 3
    for argv in examples:  # the examples are real command lines
        assert build_parser().parse_args(argv).model


def test_encode_help_has_the_model_flags_only_and_its_examples(help_of):
    text = help_of("encode")
    assert "model:" in text and "server:" not in text and "--port" not in text and "--payload-limit" not in text
    examples = [line.strip().split()[1:] for line in text.splitlines() if line.strip().startswith("vitserve encode ")]
    assert len(examples) == 3  # images on the CPU, on a GPU, and a video
    for argv in examples:
        args = build_parser().parse_args(argv)
        assert args.images and args.output


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--prot", "8001"], "vitserve serve: unrecognized arguments: --prot 8001; did you mean --port?"),
        (
            ["serve", "--model", "m", "--mod", "x"],
            "vitserve serve: unrecognized arguments: --mod x; did you mean --model?",
        ),
        (
            ["serve", "--payload=1"],
            "vitserve serve: unrecognized arguments: --payload=1; did you mean --payload-limit?",
        ),
        (
            ["encode", "--modle", "m", "a.png", "-o", "out"],
            "vitserve encode: unrecognized arguments: --modle; did you mean --model?",
        ),
        (
            ["encode", "--model", "m", "--port", "1", "a.png", "-o", "out"],
            "vitserve encode: unrecognized arguments: --port",
        ),
        (["serve", "--model", "m", "--zzzzzz"], "vitserve serve: unrecognized arguments: --zzzzzz"),
    ],
)
def test_flags_are_never_abbreviated_and_an_unknown_one_gets_a_suggestion(capsys, argv, message):
    """--mod was taken as --model (argparse abbreviates by default); now it is an error, as every unknown flag."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and capsys.readouterr().err == message + "\n"


def test_the_checks_read_the_same_names_as_the_library():
    """--dtype's and --preprocess's names are written out in settings (no torch, numpy or PIL to read the flags)."""
    from vitserve.encoder.preprocess import PREPROCESS_MODES as modes
    from vitserve.encoder.vision_encoder import DTYPES

    assert DTYPE_NAMES == tuple(DTYPES) and PREPROCESS_MODES == modes


# ---- refused before anything loads or binds (issue 25, item 11) ----------------------------------------------------
@pytest.fixture
def no_network(monkeypatch):
    """Downloads allowed (as for a user), and any hub call an error: a check that passes must not have asked."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            dict(model="tiny-qwen2.5vl", load_format="dummy"),
            "--model 'tiny-qwen2.5vl' with --load-format dummy: not a "
            "built-in name, and no local checkpoint directory of that name; did you mean tiny-qwen2.5-vl?",
        ),
        (
            dict(model="Qwen/Qwen2.5-VL-7B-Instruct-AWQ", load_format="dummy"),
            "with --load-format dummy: not a built-in "
            "name, and no local checkpoint directory of that name; did you mean Qwen/Qwen2.5-VL-7B-Instruct?",
        ),
        (
            dict(model="someone/some-vl", load_format="dummy"),
            "dummy: not a built-in name, and no local checkpoint "
            "directory of that name; --help lists the built-in names",
        ),
        (
            dict(model="tiny-qwen2.5vl"),
            "--model 'tiny-qwen2.5vl': not a local directory, a built-in name or a hub id "
            "(org/name); did you mean tiny-qwen2.5-vl?",
        ),
        (
            dict(model="qwen2-vl-7b-instruct"),
            "--model 'qwen2-vl-7b-instruct': a built-in name, but not a hub id "
            "(org/name); did you mean Qwen/Qwen2-VL-7B-Instruct?",
        ),
    ],
)
def test_a_model_name_that_cannot_load_is_refused_at_once(no_network, values, message):
    with pytest.raises(ValueError) as error:
        prepare(Settings.of(**values))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_model_names_that_can_load_pass(no_network, tmp_path):
    for values in (
        dict(model="tiny-qwen3-vl", load_format="dummy"),
        dict(model="qwen2.5-vl-3b", load_format="dummy"),
        dict(model="Qwen/Qwen3-VL-8B-Thinking", load_format="dummy"),
        dict(model=str(tmp_path), load_format="dummy"),
        dict(model="someone/some-vl"),
        dict(model="Qwen/Qwen2.5-VL-7B-Instruct"),
    ):
        assert prepare(Settings.of(**values)) == [], values


@pytest.mark.parametrize("backend", ["flash", "fa4", "cudnn"])
def test_an_attention_backend_that_cannot_run_here_is_refused(backend):
    s = Settings.of(model="tiny-qwen2.5-vl", load_format="dummy", device="cpu", attention_backend=backend)
    with pytest.raises(
        ValueError,
        match=rf"attention backend '{backend}' needs a CUDA device and float16 or "
        r"bfloat16 \(here cpu, float32\); use sdpa or auto",
    ):
        prepare(s)
    for ok in ("auto", "sdpa"):
        prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="dummy", device="cpu", attention_backend=ok))


def test_an_attention_backend_not_installed_is_refused_on_cuda(monkeypatch):
    """On CUDA in half precision, fa4 and cudnn need their packages: looked for, not imported (nothing is built in
    this process); float32 is refused as select refuses it; torch's flash is always there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "cudnn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    for backend, extra in (("cudnn", "cudnn"), ("fa4", "fa4")):
        with pytest.raises(
            ValueError,
            match=rf"attention backend '{backend}' is unavailable: .* is not installed; "
            rf"pip install 'vitserve\[{extra}\]'",
        ):
            prepare(
                Settings.of(
                    model="tiny-qwen2.5-vl", load_format="dummy", devices="cuda:0,cuda:1", attention_backend=backend
                )
            )
    with pytest.raises(ValueError, match="needs a CUDA device and float16 or bfloat16 \\(here cuda, float32\\)"):
        prepare(
            Settings.of(
                model="tiny-qwen2.5-vl", load_format="dummy", device="cuda:1", dtype="fp32", attention_backend="flash"
            )
        )
    prepare(Settings.of(model="tiny-qwen2.5-vl", load_format="dummy", device="cuda:1", attention_backend="flash"))


# ---- the decode workers' default (issue 25, item 20c) --------------------------------------------------------------
def cgroup_tree(root, cgroup: str, files: dict[str, str]):
    """A fake /proc/self/cgroup (`cgroup`'s lines) and /sys/fs/cgroup (`files`: path -> text)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (root / "sys/fs/cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "sys/fs/cgroup" / path).write_text(text)
    return root


@pytest.mark.parametrize(
    "cgroup, files, cpus",
    [
        ("0::/\n", {"cpu.max": "max 100000\n"}, 16),  # v2, no limit
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2),  # v2, a container's own namespace: its limit at the root
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ("0::/\n", {"cpu.max": "10000 100000\n"}, 1),  # a tenth: at least one
        (
            "0::/kubepods/pod1/c1\n",
            {"kubepods/pod1/cpu.max": "400000 100000\n", "kubepods/pod1/c1/cpu.max": "max 100000\n"},
            4,
        ),  # v2, the pod's limit on a parent of the process's cgroup
        (
            "0::/kubepods/pod1/c1\n",
            {"kubepods/pod1/cpu.max": "800000 100000\n", "kubepods/pod1/c1/cpu.max": "300000 100000\n"},
            3,
        ),  # the smallest along the path
        (
            "4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            3,
        ),  # v1
        (
            "4:cpu,cpuacct:/docker/abc\n",
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            1,
        ),
        (
            "4:cpu,cpuacct:/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            16,
        ),
        ("", {}, 16),
    ],
)  # no cgroup at all
def test_available_cpus_reads_the_cgroup_quota(monkeypatch, tmp_path, cgroup, files, cpus):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert available_cpus(cgroup_tree(tmp_path, cgroup, files)) == cpus


def test_available_cpus_is_bounded_by_the_affinity_mask(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7})
    assert available_cpus(cgroup_tree(tmp_path, "0::/\n", {"cpu.max": "800000 100000\n"})) == 3


def test_the_decode_workers_default_to_the_cpus_available(monkeypatch):
    """--decode-workers 0 starts one worker per CPU of the pod's quota, not per core of the node."""
    from vitserve.service.decoding.decoder import Decoder
    from vitserve.service.ground import settings_media
    from vitserve.service.ground.metrics import Metrics

    monkeypatch.setattr(settings_media, "available_cpus", lambda: 3)
    assert Settings.of(model="m").decoding.worker_count() == 3
    assert Settings.of(model="m", decode_workers=5).decoding.worker_count() == 5
    settings = Settings.of(model="m", decode_processes=False)
    decoder = Decoder(settings.decoding, settings.limits, Metrics(), on_broken=lambda reason: None)
    try:
        assert decoder.threads._max_workers == 3
    finally:
        decoder.threads.shutdown()


def test_video_convert_names_where_video_frames_become_rgb():
    """auto (the default): the devices where they are GPUs, the workers on the CPU; worker: the decode workers;
    device: the devices, whatever they are."""
    from vitserve.service.ground.settings_media import DecodingSettings

    assert DecodingSettings().video_convert == "auto"
    cases = {("worker", "cuda:0"): False, ("device", "cpu"): True, ("auto", "cuda:0"): True, ("auto", "cpu"): False}
    for (convert, device), planes in cases.items():
        assert DecodingSettings(video_convert=convert).video_planes([device]) is planes, (convert, device)
    with pytest.raises(ValueError, match="--video-convert"):
        DecodingSettings(video_convert="gpu")


def test_image_resize_names_where_images_are_resized():
    """auto (the default): the devices where they are GPUs, the workers on the CPU; worker: the decode workers;
    device: the devices, whatever they are; the fast preprocessing resizes on the devices whatever it says."""
    from vitserve.service.ground.settings_media import DecodingSettings

    assert DecodingSettings().image_resize == "auto"
    cases = {("worker", "cuda:0"): False, ("device", "cpu"): True, ("auto", "cuda:0"): True, ("auto", "cpu"): False}
    for (resize, device), full_size in cases.items():
        assert DecodingSettings(image_resize=resize).images_full_size([device]) is full_size, (resize, device)
    assert DecodingSettings(image_resize="worker", preprocess="fast").images_full_size(["cpu"])
    with pytest.raises(ValueError, match="--image-resize"):
        DecodingSettings(image_resize="gpu")
