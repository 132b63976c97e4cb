"""The attention interface on the CPU: backend selection and its fallbacks, and the exact backend's contract."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F

from vitserve.encoder import attention


def test_auto_is_exact_sdpa_on_cpu_and_in_float32():
    assert attention.select("auto", torch.device("cpu"), torch.bfloat16, 16, 80).name == "sdpa"
    assert attention.select("auto", torch.device("cuda"), torch.float32, 16, 80).name == "sdpa"


@pytest.mark.parametrize("name", ["cudnn", "fa4", "flash"])
def test_a_gpu_backend_asked_for_where_it_cannot_run_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"'{name}' needs a CUDA device and float16 or bfloat16"):
        attention.select(name, torch.device("cpu"), torch.bfloat16, 16, 80)
    with pytest.raises(ValueError, match="unknown attention backend 'flash2'"):
        attention.select("flash2", torch.device("cpu"), torch.bfloat16, 16, 80)


def test_auto_passes_over_a_missing_package_with_one_log_line(monkeypatch, caplog):
    """With neither cudnn nor flash_attn importable, auto on CUDA falls back to torch's flash kernel and says why,
    once per backend passed over; asking for cudnn by name is an error naming the extra to install."""
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with caplog.at_level(logging.INFO, logger="vitserve.attention"):
        backend = attention.select("auto", torch.device("cuda", 0), torch.bfloat16, 16, 80)
    assert backend.name == "flash"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("attention: fa4 unavailable") and "vitserve[fa4]" in lines[0]
    assert lines[1].startswith("attention: cudnn unavailable") and "vitserve[cudnn]" in lines[1]
    assert lines[2] == "attention: flash (auto: the fastest available on a test GPU)"
    with pytest.raises(
        ValueError, match=r"'cudnn' is unavailable: nvidia-cudnn-frontend is not importable.*vitserve\[cudnn\]"
    ):
        attention.select("cudnn", torch.device("cuda", 0), torch.bfloat16, 16, 80)


def test_sdpa_attends_within_segments_only():
    """Each row's output equals attention over its own segment; zero-length segments are skipped; rows after the
    last segment (padding) come out zero and change nothing."""
    torch.manual_seed(0)
    lengths = [5, 0, 3, 7, 0]
    q, k, v = (torch.randn(18, 2, 8) for _ in range(3))  # 15 real rows, 3 padding
    cu = torch.tensor([0, 5, 5, 8, 15, 15], dtype=torch.int32)
    out = attention.SDPA().bind(cu, 7, lengths)(q, k, v)
    start = 0
    for n in lengths:
        seg = [t[start : start + n].transpose(0, 1)[None] for t in (q, k, v)]
        if n:
            torch.testing.assert_close(out[start : start + n], F.scaled_dot_product_attention(*seg)[0].transpose(0, 1))
        start += n
    assert torch.equal(out[15:], torch.zeros(3, 2, 8))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[15:] = 1e4
    assert torch.equal(attention.SDPA().bind(cu, 7, lengths)(q2, k2, v2)[:15], out[:15])
    with pytest.raises(ValueError, match="host-side segment lengths"):
        attention.SDPA().bind(cu, 7, None)
