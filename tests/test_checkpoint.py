"""Loading: local and sharded directories, the HF cache, only vision shards, and strict, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitserve.encoder import VisionEncoder
from vitserve.encoder.checkpoint import CheckpointError, read_vision_tensors, resolve_checkpoint


def copy_ckpt(checkpoints, name, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints[name][0], dst)
    return dst


def rewrite_single(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints, "qwen2_5_vl", tmp_path)
    rewrite_single(path, lambda t: t.pop("visual.blocks.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing vision tensor visual\.blocks\.1\.mlp\.up_proj\.weight \(90, 64\)"
    ):
        VisionEncoder.from_pretrained(str(path))


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints, "qwen2_vl", tmp_path)
    rewrite_single(path, lambda t: t.__setitem__("visual.blocks.0.attn.q_norm.weight", torch.ones(64)))
    with pytest.raises(CheckpointError, match=r"unexpected vision tensor visual\.blocks\.0\.attn\.q_norm\.weight"):
        VisionEncoder.from_pretrained(str(path))


def test_wrong_shape_is_named(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints, "qwen3_vl", tmp_path)
    rewrite_single(path, lambda t: t.__setitem__("model.visual.pos_embed.weight", torch.zeros(100, 64)))
    with pytest.raises(
        CheckpointError, match=r"visual\.pos_embed\.weight: checkpoint \(100, 64\), qwen3_vl config expects \(64, 64\)"
    ):
        VisionEncoder.from_pretrained(str(path))


def test_missing_shard_is_named(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints, "qwen2_5_vl-sharded", tmp_path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["visual.blocks.2.attn.qkv.weight"]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} .* is missing"):
        VisionEncoder.from_pretrained(str(path))


def test_reads_only_vision_shards(checkpoints, tmp_path):
    """Shards holding only language-model tensors may be absent: they are never opened."""
    path = copy_ckpt(checkpoints, "qwen2_5_vl-sharded", tmp_path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {v for k, v in weight_map.items() if k.startswith("visual.")}
    text_only = set(weight_map.values()) - vision_shards
    assert text_only, "the fixture must have a text-only shard for this test to mean anything"
    for shard in text_only:
        (path / shard).unlink()
    tensors = read_vision_tensors(path)
    assert len(tensors) == 54 and all(not k.startswith("visual.") for k in tensors)
    VisionEncoder.from_pretrained(str(path))


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "not a Qwen-VL checkpoint: model_type 'llama'",
        ),
        ({"model_type": "qwen2_5_vl", "vision_config": {"hidden_size": 64}}, "vision_config lacks or mistypes 'depth'"),
    ],
)
def test_bad_config_is_explained(checkpoints, tmp_path, config, message):
    path = copy_ckpt(checkpoints, "qwen2_5_vl", tmp_path)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        VisionEncoder.from_pretrained(str(path))


def test_no_weights_and_no_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2_vl",
                "vision_config": {"depth": 1, "embed_dim": 64, "num_heads": 4, "hidden_size": 32},
            }
        )
    )
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        VisionEncoder.from_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        VisionEncoder.from_pretrained(str(tmp_path / "nope"))


def test_hub_id_from_local_cache_offline(checkpoints, tmp_path):
    """A hub id resolves through the HF cache layout with downloads disabled, needing only vision shards."""
    src = Path(checkpoints["qwen3_vl-sharded"][0])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    vision_shards = {v for k, v in index["weight_map"].items() if k.startswith("model.visual.")}
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-VL-Tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    for name in ["config.json", "model.safetensors.index.json", *vision_shards]:
        shutil.copy(src / name, snapshot / name)
    resolved = resolve_checkpoint("Qwen/Qwen3-VL-Tiny", allow_download=False, cache_dir=str(tmp_path / "hub"))
    assert resolved == snapshot
    enc = VisionEncoder.from_pretrained("Qwen/Qwen3-VL-Tiny", allow_download=False, cache_dir=str(tmp_path / "hub"))
    assert enc.config.family == "qwen3_vl"
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_checkpoint("Qwen/Absent-VL", allow_download=False, cache_dir=str(tmp_path / "hub"))
