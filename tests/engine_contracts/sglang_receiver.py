"""Run with SGLang importable (sglang installed without its dependencies beside this project's own; docs/sglang.md
says how): SGLang's own receiving code on the messages a vitserve server pushed for one request.

    python sglang_receiver.py MODEL_TYPE RID MESSAGE...

Each MESSAGE is a message's frame files, comma-separated (`part0.meta,part0.data`; an error message has one frame),
as vitserve's /encode pushed them for the parts `RID_local_part_<k>`; MODEL_TYPE is the language model's
(`qwen3_vl`, `qwen2_5_vl`, ...), which decides the video metadata SGLang keeps. The frames go through a real ZMQ
PUSH to a PULL socket that SGLang's `get_zmq_socket_on_host` binds, and are read there twice, as SGLang's two ZMQ
backends read them: zmq_to_scheduler by a `WaitingZmqRequest` (`consume_parts`, SGLang's restricted unpickler,
part checks and aggregation), zmq_to_tokenizer by `MMReceiverHTTP._recv_mm_data`. Each ends where SGLang hands the
features to its multimodal processor (`get_validated_mm_data`), which a stand-in records. Printed as JSON: SGLang's
version; per message the class and fields SGLang's unpickler made of it; per path its status and error, and what
reached the processor: per modality the tensor's shape, dtype and the SHA-256 of its bytes, and the extra metadata
(`img_grid_thw`, `video_grid_thw`, `video_timestamps`, `second_per_grid_ts`)."""

import asyncio
import hashlib
import json
import os
import sys
import types

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import torch  # noqa: E402

# SGLang imports torchvision (its InternVL and Qwen-VL processors); PyPI's build does not load beside a CPU torch
# until its operators' schemas exist, and nothing here runs them
for _name in ("nms", "qnms"):
    try:
        torch.library.define(f"torchvision::{_name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # a torchvision that loads defines them itself
        pass

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from sglang.srt.disaggregation.encoder import receiver  # noqa: E402
from sglang.srt.utils.common import safe_pickle_loads  # noqa: E402
from sglang.srt.utils.network import get_zmq_socket_on_host  # noqa: E402
from sglang.version import __version__  # noqa: E402


class Processor:
    """Stands for SGLang's multimodal processor: records what the receiver hands it."""

    prefer_tokenized_input = False

    def __init__(self):
        self.received = None

    def get_validated_mm_data(self, prompt, embeddings, **meta):
        self.received = (embeddings, meta)
        return types.SimpleNamespace(input_ids=[1, 2, 3], mm_items=[])


def plain(value):
    """A JSON form of what SGLang decoded: tensors as lists, enums by name, dtypes by name."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if hasattr(value, "name") and type(value).__module__.startswith("sglang"):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def received(processor: Processor) -> dict | None:
    if processor.received is None:
        return None
    embeddings, meta = processor.received
    return {
        "embeddings": {
            modality.name: {"shape": list(t.shape), "dtype": plain(t.dtype), "sha256": digest(t)}
            for modality, t in embeddings.items()
        },
        "meta": {key: plain(value) for key, value in meta.items()},
    }


def frames_of(argument: str) -> list[bytes]:
    return [open(path, "rb").read() for path in argument.split(",")]


def pushed(messages: list[list[bytes]], port: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frames in messages:
        sock.send_multipart(frames)
    sock.close(linger=5000)
    context.term()


def scheduler_path(model_type: str, rid: str, messages: list[list[bytes]]) -> dict:
    """zmq_to_scheduler: a scheduler rank's WaitingZmqRequest consumes the parts from its PULL socket."""
    context = zmq.Context()
    port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
    processor = Processor()
    request = types.SimpleNamespace(rid=rid, num_items_assigned={}, input_ids=None, input_text="prompt", mm_inputs=None)
    waiting = receiver.WaitingZmqRequest(
        rid=rid,
        recv_req=request,
        mm_processor=processor,
        encoder_urls=[],
        model_type=model_type,
        host_name="127.0.0.1",
        receive_count=1,
        zmq_context=context,
        embedding_port=port,
    )
    waiting.recv_socket = sock
    pushed(messages, port)
    for _ in messages:
        waiting.consume_parts(sock.recv_multipart(copy=False))
    sock.close(linger=0)
    return {
        "status": getattr(waiting.status, "name", str(waiting.status)),
        "error_msg": waiting.error_msg,
        "error_code": plain(waiting.error_code),
        "received": received(processor),
    }


async def tokenizer_path(model_type: str, rid: str, messages: list[list[bytes]]) -> dict:
    """zmq_to_tokenizer: the tokenizer's MMReceiverHTTP reads the parts from the request's own PULL socket."""
    context = zmq.asyncio.Context()
    port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
    http = object.__new__(receiver.MMReceiverHTTP)
    http.model_type = model_type
    processor = Processor()
    task = asyncio.create_task(http._recv_mm_data(rid, sock, processor, "prompt"))
    await asyncio.to_thread(pushed, messages, port)
    result = await asyncio.wait_for(task, 30)
    return {"status": "SUCCESS" if result is not None else "FAILED", "received": received(processor)}


def main():
    model_type, rid, *arguments = sys.argv[1:]
    messages = [frames_of(argument) for argument in arguments]
    parts = []
    for frames in messages:
        data = safe_pickle_loads(frames[0])
        parts.append(
            {
                "class": f"{type(data).__module__}.{type(data).__qualname__}",
                "is_embedding_data": isinstance(data, receiver.EmbeddingData),
                "modality_class": f"{type(data.modality).__module__}.{type(data.modality).__qualname__}",
                **{key: plain(value) for key, value in vars(data).items()},
            }
        )
    print(
        json.dumps(
            {
                "sglang": __version__,
                "parts": parts,
                "zmq_to_scheduler": scheduler_path(model_type, rid, messages),
                "zmq_to_tokenizer": asyncio.run(tokenizer_path(model_type, rid, messages)),
            }
        )
    )


if __name__ == "__main__":
    main()
