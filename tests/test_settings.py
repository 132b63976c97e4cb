"""Settings: flags and VITSERVE_* variables (old names kept as aliases), validation, and device resolution."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from vitserve.service.settings import Settings, add_arguments, from_args, resolve_devices


def parse(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
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
    with pytest.raises(ValueError, match="attention-backend must be one of auto, cudnn, fa4, flash, sdpa"):
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
