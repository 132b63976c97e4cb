"""The records at the process boundaries: one error record that brings an exception back as itself across any
pipe, and the decode pool's Call and JobResult."""

from __future__ import annotations

import pickle
import threading

import torch
from helpers import wait_until

from vitserve.encoder.preprocess import ImageTooLarge, UndecodableImage
from vitserve.encoder.video import VideoTooLong
from vitserve.service.decoding.decode_protocol import ANSWER_HEADER, Call, JobResult
from vitserve.service.ground.errors import ErrorRecord, ImageLost, InputRejected, QueueFull, Unavailable


def crossed(error: BaseException) -> BaseException:
    """`error` as the other end of a pipe gets it: its record pickled, unpickled and turned back."""
    return pickle.loads(pickle.dumps(ErrorRecord.of(error))).error()


def test_a_domain_error_comes_back_with_its_class_code_and_param():
    for error in (
        InputRejected("images[1]: bad", "invalid_base64", "images[1]"),
        QueueFull("full"),
        Unavailable("gone", "device_lost"),
    ):
        back = crossed(error)
        assert type(back) is type(error)
        assert (back.message, back.code, back.param) == (error.message, error.code, error.param)


def test_an_image_error_keeps_what_the_client_is_told_apart_from_the_decoders_words():
    back = crossed(UndecodableImage("cannot decode the image", "libjpeg: premature end"))
    assert type(back) is UndecodableImage and back.code == "undecodable_image"
    assert back.public == "cannot decode the image" and str(back) == "cannot decode the image: libjpeg: premature end"
    odd = UndecodableImage("no")
    odd.code = "odd_reason"  # a code set on the instance crosses too
    assert crossed(odd).code == "odd_reason"
    assert isinstance(crossed(VideoTooLong("too long")), ImageTooLarge)


def test_other_kinds_come_back_as_themselves_or_named():
    assert type(crossed(ValueError("x"))) is ValueError and str(crossed(ValueError("x"))) == "x"
    assert type(crossed(ImageLost("gone"))) is ImageLost
    assert type(crossed(torch.OutOfMemoryError("oom"))) is torch.OutOfMemoryError

    class Private(Exception):
        pass

    back = crossed(Private("what"))
    assert type(back) is RuntimeError and str(back) == "Private: what"


def test_a_call_answers_its_value_or_its_error_and_an_unpicklable_value_as_an_error():
    assert Call(bytes.upper, ()).run(b"abc") == JobResult(b"ABC")
    assert Call(len, (), "inline", True).run(b"") == JobResult(6)
    failed = Call(int, ()).run(b"x")
    assert failed.value is None and failed.error.kind == "ValueError"
    frame = JobResult(lambda: None).frame()
    result = pickle.loads(frame[ANSWER_HEADER.size :])
    assert ANSWER_HEADER.unpack_from(frame)[0] == len(frame) - ANSWER_HEADER.size
    assert result.value is None and isinstance(result.error.error(), (pickle.PicklingError, AttributeError, TypeError))


def test_a_device_answers_an_image_as_its_output_record_or_its_error_record(tmp_path, monkeypatch):
    """device_protocol: an image's tensors go out as an Output (a spool file and their layout) and come back equal,
    the file removed once they are let go, on the release thread (the pages freed there); an image the device could
    not decode goes out as its ErrorRecord and comes back as its ImageError."""
    from vitserve.service.decoding import spool
    from vitserve.service.devices.device_protocol import Output, packed, unpacked

    tokens, deepstack = torch.randn(6, 8, dtype=torch.bfloat16), [torch.randn(6, 8, dtype=torch.bfloat16)]
    output = pickle.loads(pickle.dumps(packed((tokens, deepstack), str(tmp_path / "out-0"))))
    assert isinstance(output, Output)
    removed_by = []
    remove = spool.remove
    monkeypatch.setattr(
        spool, "remove", lambda path: (removed_by.append(threading.current_thread().name), remove(path))
    )
    back = unpacked(output)
    assert torch.equal(back.tokens, tokens) and torch.equal(back.deepstack[0], deepstack[0])
    assert (tmp_path / "out-0").exists()  # the file is the holder's: removed once it no longer maps it
    del back
    wait_until(lambda: not (tmp_path / "out-0").exists(), 5, "the answer's file removed once unmapped")
    assert removed_by == ["vitserve-release"]  # (where its pages are freed: not the thread that let it go)
    record = pickle.loads(pickle.dumps(packed(UndecodableImage("cannot decode the image", "nvjpeg"), "unused")))
    assert isinstance(record, ErrorRecord)
    error = unpacked(record)
    assert isinstance(error, UndecodableImage) and (error.public, error.code) == (
        "cannot decode the image",
        "undecodable_image",
    )


def test_a_batch_s_answers_are_written_side_by_side_in_order_or_not_at_all(tmp_path, monkeypatch):
    """device_protocol.written: a batch's outputs are written by several threads at once (one finishing last on
    purpose; each output a run of its own here, WRITER_BYTES being 1) and come back as records in the outputs'
    order, each over its own file; when one output cannot be written, the batch's answer is its error and every
    other output's file is removed, including a write that finished after the failure (a write left behind would
    leak its file). With the default WRITER_BYTES, small answers are written by the answering thread alone."""
    import itertools
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from vitserve.service.decoding import spool
    from vitserve.service.devices import device_protocol
    from vitserve.service.devices.device_protocol import Output, unpacked

    outputs = [(torch.randn(5 + i, 8, dtype=torch.bfloat16), [torch.randn(5 + i, 8)]) for i in range(6)]
    outputs.insert(2, UndecodableImage("cannot decode the image", "nvjpeg"))
    started: list[str] = []
    overlapped: list[bool] = []  # per batch: whether the others began while its first write waited
    real_write = spool.write

    def write(path, arrays):  # a batch's first write ends last, once every other write of it has begun
        started.append(path)
        if len(started) == 1:
            deadline = time.time() + 5
            while len(started) < 6 and time.time() < deadline:
                time.sleep(0.01)
            overlapped.append(len(started) == 6)
        return real_write(path, arrays)

    monkeypatch.setattr(spool, "write", write)
    names = (str(tmp_path / f"out-{n}") for n in itertools.count())

    class Counted(ThreadPoolExecutor):
        handed = 0

        def submit(self, *args, **kwargs):
            Counted.handed += 1
            return super().submit(*args, **kwargs)

    with Counted(device_protocol.ANSWER_WRITERS) as writers:
        started.append("")  # (no wait: written here, in one run)
        records, error = device_protocol.written(outputs, names, writers)
        assert error is None and Counted.handed == 0 and len(records) == len(outputs)
        for record in records:
            if isinstance(record, Output):
                record.discard()
    started.clear()
    monkeypatch.setattr(device_protocol, "WRITER_BYTES", 1)
    with Counted(device_protocol.ANSWER_WRITERS) as writers:
        records, error = device_protocol.written(outputs, names, writers)
        assert error is None and records is not None and overlapped == [True]
        for record, output in zip(records, outputs):
            if isinstance(output, Exception):
                assert isinstance(record, ErrorRecord)
                continue
            assert isinstance(record, Output) and record.path is not None
            back = unpacked(record)
            assert torch.equal(back.tokens, output[0]) and torch.equal(back.deepstack[0], output[1][0])
        del back
        wait_until(lambda: list(tmp_path.iterdir()) == [], 5, "the answers' files removed once unmapped")

        failing = threading.get_ident  # not a tensor: packing it raises
        started.clear()
        records, error = device_protocol.written([*outputs[:3], failing, *outputs[3:]], names, writers)
        assert records is None and error is not None
        assert overlapped == [True, True] and list(tmp_path.iterdir()) == []  # every write done, its file removed


def test_the_domain_errors_and_the_pipes_records_import_no_web_framework():
    """errors.py and the records of the decode pipe load without FastAPI or Starlette (nor torch: a decode worker
    imports them), and the tiers raise domain errors, never an HTTP answer of their own."""
    import pathlib
    import subprocess
    import sys

    code = (
        "import sys; import vitserve.service.ground.errors, vitserve.service.decoding.decode_protocol, "
        "vitserve.service.ground.limits; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'torch') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    service = pathlib.Path(__file__).resolve().parents[1] / "vitserve" / "service" / "tiers"
    for tier in ("vllm_tier.py", "sglang_tier.py"):
        source = (service / tier).read_text()
        assert not any(name in source for name in ("ServiceError", "HTTPException", "JSONResponse", "fastapi")), tier
