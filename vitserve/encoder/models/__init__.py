"""One module per family, each with `build(cfg)`, `hf_layout(cfg)` (published tensor names -> shapes) and
`convert(tensors, cfg)` (published tensors -> our fused, padded state dict); what families share of the last two is
in layout.py."""

from . import qwen2_5_vl, qwen2_vl, qwen3_vl

FAMILY_MODULES = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}
