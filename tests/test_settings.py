"""Settings: flags and VITSERVE_* variables (old names kept as aliases), validation before anything loads (values,
then this machine's devices and the model's whereabouts), and device resolution."""

from __future__ import annotations

import json
import time

import huggingface_hub.constants
import pytest
import torch

from vitserve.service.cli import main
from vitserve.service.settings import Parser, Settings, add_arguments, from_args, resolve_devices


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
    assert (s.model, s.max_batch_tokens, s.allow_url_fetch, s.port) == ("tiny-qwen2-vl", 1024, True, 9000)
    # the attention backend reaches from_pretrained wherever a device loads (in-process or a device process)
    assert s.attention_backend == "cudnn" and s.encoder_kwargs()["attention_backend"] == "cudnn"
    with pytest.raises(ValueError, match="model"):
        Settings()
    with pytest.raises(ValueError, match="--attention-backend must be one of auto, cudnn, fa4, flash, sdpa"):
        Settings(model="m", attention_backend="flash2")
    assert json.loads(json.dumps(s.__dict__))["model"] == "tiny-qwen2-vl"


def test_renamed_flags_keep_their_old_names(monkeypatch):
    """--decode-workers / --decode-processes were --preprocess-workers / --preprocess-processes: both spellings,
    as flags and as variables, set the same setting; the new name wins over the old variable."""
    assert parse("--model", "m", "--preprocess-workers", "3").decode_workers == 3
    assert parse("--model", "m", "--decode-workers", "5", "--preprocess-processes", "false").decode_processes is False
    monkeypatch.setenv("VITSERVE_PREPROCESS_WORKERS", "7")
    assert parse("--model", "m").decode_workers == 7
    monkeypatch.setenv("VITSERVE_DECODE_WORKERS", "2")
    assert parse("--model", "m").decode_workers == 2


def test_device_resolution():
    assert resolve_devices(Settings(model="m", device="cpu")) == (["cpu"], "float32")
    assert resolve_devices(Settings(model="m", devices="cuda:0, cuda:1", dtype="float16")) == (["cuda:0", "cuda:1"],
                                                                                               "float16")
    assert resolve_devices(Settings(model="m", devices="cuda:2"))[1] == "bfloat16"
    if not torch.cuda.is_available():
        assert resolve_devices(Settings(model="m", devices="all")) == (["cpu"], "float32")


@pytest.mark.parametrize("variable, value, message", [
    ("VITSERVE_PORT", "abc", "VITSERVE_PORT: invalid int value: 'abc'"),
    ("VITSERVE_MAX_BATCH_WAIT_MS", "soon", "VITSERVE_MAX_BATCH_WAIT_MS: invalid float value: 'soon'"),
    ("VITSERVE_ALLOW_URL_FETCH", "maybe", "VITSERVE_ALLOW_URL_FETCH: not a boolean: 'maybe'"),
    ("VITSERVE_PREPROCESS_PROCESSES", "2", "VITSERVE_PREPROCESS_PROCESSES: not a boolean: '2'")])
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
    assert exit.value.code == 2 and capsys.readouterr().err == "vitserve serve: argument --port: invalid int value: 'abc'\n"
    assert main(["serve", "--model", "tiny-qwen2-vl", "--dtype", "float8"]) == 2
    assert capsys.readouterr().err.startswith("vitserve serve: --dtype must be auto or one of float32, float16, ")


@pytest.mark.parametrize("values, message", [
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
    (dict(port=0), "--port must be 1-65535")])
def test_bad_values_are_rejected(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Settings(model="m", **values)


def test_good_values_pass():
    for dtype in ("auto", "float32", "fp32", "fp16", "bf16", "half", "bfloat16"):
        assert Settings(model="m", dtype=dtype).dtype == dtype
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        Settings(model="m", device=device)
    assert Settings(model="m", devices="all").devices == "all"
    assert Settings(model="m", budgets="256, 1024,").budget_list() == (256, 1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("values", [dict(device="cuda"), dict(device="cuda:1"), dict(devices="cpu,cuda:0")])
def test_cuda_on_a_machine_without_it_is_rejected(values):
    with pytest.raises(ValueError, match=r"CUDA is not available on this machine \(torch.cuda.is_available\(\) is "):
        Settings(model="tiny-qwen2-vl", **values).prepare()
    assert Settings(model="tiny-qwen2-vl", load_format="dummy", devices="all").prepare() == []  # else the CPU


def test_a_cuda_index_beyond_the_devices_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    Settings(model="tiny-qwen2-vl", load_format="dummy", devices="cuda:0,cuda:1").prepare()
    with pytest.raises(ValueError, match=r"device cuda:2 asked for, but this machine has 2 CUDA device\(s\): "
                                         "cuda:0 to cuda:1"):
        Settings(model="tiny-qwen2-vl", load_format="dummy", devices="cuda:0,cuda:2").prepare()


def test_a_tiny_builtin_implies_dummy_weights():
    s = Settings(model="tiny-qwen2.5-vl", device="cpu")
    notes = s.prepare()
    assert s.load_format == "dummy" and s.encoder_kwargs()["load_format"] == "dummy"
    assert notes == ["tiny-qwen2.5-vl is a built-in test tower with no checkpoint: using seeded random weights "
                     "(--load-format dummy)"]
    assert Settings(model="tiny-qwen2.5-vl", load_format="dummy").prepare() == []
    with pytest.raises(ValueError, match="no checkpoint: use --load-format dummy"):
        Settings(model="tiny-qwen2.5-vl", load_format="safetensors").prepare()


def test_a_builtin_hub_id_not_in_the_cache_fails_at_once_with_the_fix(monkeypatch, tmp_path):
    """Downloads off (HF_HUB_OFFLINE=1, conftest): the cache is looked up offline and the message says what to add."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ValueError) as error:
        Settings(model="Qwen/Qwen2.5-VL-3B-Instruct").prepare()
    assert time.perf_counter() - start < 2
    message = str(error.value)
    assert "not in the Hugging Face cache" in message and str(tmp_path) in message
    assert "add --load-format dummy" in message and "hf download Qwen/Qwen2.5-VL-3B-Instruct" in message
    assert "unset HF_HUB_OFFLINE" in message
    assert Settings(model="Qwen/Qwen2.5-VL-3B-Instruct", load_format="dummy").prepare() == []
    # once in the cache it passes, found offline
    repo = tmp_path / "models--Qwen--Qwen2.5-VL-3B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert Settings(model="Qwen/Qwen2.5-VL-3B-Instruct").prepare() == []


def test_any_hub_id_not_in_the_cache_fails_at_once(monkeypatch, tmp_path):
    """Downloads off: a hub id that is not built in fails before loading too (without the dummy hint); a directory
    is read when it loads."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="'someone/some-vl' is not a local directory and is not in the Hugging Face "
                                         "cache") as error:
        Settings(model="someone/some-vl").prepare()
    assert "--load-format dummy" not in str(error.value)
    assert Settings(model=str(tmp_path / "missing")).prepare() == []


def test_encode_reads_the_model_settings_only(monkeypatch):
    """`encode` has the model's flags and variables (same names, same defaults), not the server's."""
    from vitserve.service.cli import build_parser

    monkeypatch.setenv("VITSERVE_DTYPE", "bf16")
    monkeypatch.setenv("VITSERVE_DEVICE", "cpu")
    monkeypatch.setenv("VITSERVE_DEVICES", "cuda:0,cuda:1")  # a server's setting: encode uses one device
    args = build_parser().parse_args(["encode", "--model", "tiny-qwen3-vl", "--attention-backend", "sdpa", "a.png",
                                      "-o", "out"])
    s = from_args(args)
    assert (s.dtype, s.device, s.devices, s.attention_backend) == ("bf16", "cpu", None, "sdpa")
    assert resolve_devices(s) == (["cpu"], "bf16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["encode", "--model", "m", "--port", "1", "a.png", "-o", "out"])
