"""Run by tests/test_engine_contracts.py with vLLM importable (vllm installed without its dependencies beside this
project's own; see that test): vLLM's own code on what a vitserve server wrote and answered.

    python vllm_consumer.py CASES.json OUT.json

CASES.json: {"storage": DIR, "model_id": MODEL, "items": [{"identifier", "file", "uuid"?, "algorithm"?,
"mm_processor_kwargs"?}]} where `file` is the image's bytes as sent (for vLLM's hasher). For each item, OUT.json
holds vLLM's version, the metadata fields its Qwen2-VL (Qwen2.5-VL's too) and Qwen3-VL parsers require with
out-of-band embeddings (`placeholder_metadata_fields`), and per item: whether vLLM's ECExampleConnector (consumer
role) finds it (`has_cache_item`), the path of the tensor it loads into its encoder cache (saved with torch.save for
the test to compare), and the identifier vLLM computes for the item (its MultiModalHasher through
`ProcessorInputs.get_mm_hashes`' rules: the uuid as it is without hash factors, else hash_kwargs over the model id, the
item as vLLM's image loader gives it, and the factors)."""

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

# vLLM's Qwen model modules import torchvision, whose PyPI build does not load beside a CPU torch until its operators'
# schemas exist; nothing here runs them (only the parsers' field declarations are read)
for _name in ("nms", "qnms"):
    torch.library.define(f"torchvision::{_name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import vllm  # noqa: E402
from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector  # noqa: E402
from vllm.multimodal.media.image import ImageMediaIO  # noqa: E402
from vllm.multimodal.processing.inputs import ProcessorInputs  # noqa: E402


def connector(storage: str, role) -> ECExampleConnector:
    """vLLM's connector as a consumer builds it: a consumer reads only the config's ec_transfer_config (a full
    VllmConfig on a CPU asks for triton-cpu; the model config serves only a producer's metadata)."""
    config = SimpleNamespace(
        model_config=None,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role="ec_consumer",
            ec_connector_extra_config={"shared_storage_path": storage},
        ),
    )
    return ECExampleConnector(config, role)


def vllm_identifier(model_id: str, data: bytes, uuid, algorithm: str, kwargs) -> str:
    """What vLLM's renderer computes for one image item: ProcessorInputs.get_mm_hashes on the item its image loader
    makes of the bytes, with the request's uuid and mm_processor_kwargs."""
    media = ImageMediaIO().load_bytes(data)
    inputs = ProcessorInputs.__new__(ProcessorInputs)
    fields = {
        "mm_data_items": None,
        "hf_processor_mm_kwargs": kwargs or {},
        "media_io_kwargs": {},
        "mm_uuid_items": {"image": [uuid]} if uuid is not None else {},
    }
    from vllm.multimodal.parse import MultiModalDataParser

    items = MultiModalDataParser().parse_mm_data({"image": [media]})
    fields["mm_data_items"] = items
    for name, value in fields.items():
        object.__setattr__(inputs, name, value)
    return inputs.get_mm_hashes(model_id, algorithm)["image"][0]


def main():
    cases = json.load(open(sys.argv[1]))
    scheduler = connector(cases["storage"], ECConnectorRole.SCHEDULER)
    worker = connector(cases["storage"], ECConnectorRole.WORKER)
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalDataParser

    parsers = {"qwen2_vl": Qwen2VLMultiModalDataParser, "qwen3_vl": Qwen3VLMultiModalDataParser}
    out = {
        "vllm": vllm.__version__,
        "items": [],
        "metadata_fields": {
            family: {m: sorted(parser.placeholder_metadata_fields(m)) for m in ("image", "video")}
            for family, parser in parsers.items()
        },
    }
    for n, case in enumerate(cases["items"]):
        identifier = case["identifier"]
        found = scheduler.has_cache_item(identifier)
        loaded = None
        if found:
            request = SimpleNamespace(
                mm_features=[SimpleNamespace(identifier=identifier)], get_num_encoder_embeds=lambda index: 0
            )
            scheduler.update_state_after_alloc(request, 0)
            worker.bind_connector_metadata(scheduler.build_connector_meta(None))
            cache: dict = {}
            worker.start_load_caches(cache)
            worker.clear_connector_metadata()
            loaded = os.path.join(os.path.dirname(sys.argv[2]), f"loaded-{n}.pt")
            torch.save(cache[identifier], loaded)
        computed = None
        if case.get("file"):
            data = open(case["file"], "rb").read()
            computed = vllm_identifier(
                cases["model_id"],
                data,
                case.get("uuid"),
                case.get("algorithm", "blake3"),
                case.get("mm_processor_kwargs"),
            )
        out["items"].append({"found": found, "loaded": loaded, "vllm_identifier": computed})
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
