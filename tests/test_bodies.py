"""Large request bodies in shared memory (service/bodies.py): read once into a body file of the spool, their images
read there by the decode workers (nothing sent over a socket), the file given back when the request ends whatever
its outcome, used again, removed where a view of it outlives its request, and never left behind."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket

import httpx
import numpy as np
import pytest
from helpers import STARTUP_S, data_uri, png, until, wait_until

from vitserve.encoder.media import MediaBytes
from vitserve.encoder.preprocess import load_image, resize_rgb
from vitserve.service.api.inputs import decode_input
from vitserve.service.api.json_body import read_json
from vitserve.service.api.schemas import EncodeRequest
from vitserve.service.decoding import decode_pool, spool
from vitserve.service.decoding.bodies import SHARED
from vitserve.service.entry import launch
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.engine import Engine


def body_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if "-body-" in name)


class Arriving:
    """A request whose declared body arrives in chunks (what read_json reads: headers, scope, stream)."""

    def __init__(self, body: bytes, chunk: int = 65536 + 7):
        self.headers = {"content-length": str(len(body))}
        self.scope = {"state": {}}
        self.pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    async def stream(self):
        for piece in self.pieces:
            yield piece

    def end(self) -> None:
        """What the gate does when the request ends."""
        for callback in self.scope["state"].pop("on_end", ()):
            callback()


def test_a_large_body_reaches_its_decode_worker_in_place(encoders, tmp_path, monkeypatch):
    """A body of a MiB or more is read into a body file; its images go to the worker as where they lie (0 bytes
    sent), and decode to the pixels the same text sent over the socket gives, the junk after an image left out as
    before. When the request ends the file is idle and the next body uses it (no new file); a file a view of which
    outlives its request is removed instead of used again; the server's stop leaves nothing."""
    enc, sent = encoders["tiny-qwen2.5-vl"], []
    send = decode_pool._Link.send
    monkeypatch.setattr(
        decode_pool._Link, "send", lambda link, call, payload: (sent.append(len(payload)), send(link, call, payload))
    )
    large, small = png(600, 600, 5), png(16, 16, 6)
    texts = [data_uri(large), base64.b64encode(small).decode() + "QUJD" * 100_000]  # a PNG, then junk after IEND
    body = ('{"images": ["%s", "%s"]}' % tuple(texts)).encode()
    assert len(body) > SHARED

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, decode_workers=1, spool_dir=str(tmp_path)), encoders=enc)
        await engine.start()
        decoder, cfg, bodies = engine.decoder, engine.model.preprocess_config, engine.decoder.bodies
        try:
            request = Arriving(body)
            parsed = await read_json(request, EncodeRequest, 64, ("images",), bodies)
            images = [decode_input(item, i, False, "images") for i, item in enumerate(parsed.images)]
            assert all(image.shared is not None for image in images)
            shared = [spool.pixels([image])[0] for image, _ in await decoder.decode(images, cfg)]
            sent_shared = list(sent)
            plain = [
                spool.pixels([image])[0]
                for image, _ in await decoder.decode([MediaBytes(text, text.find(",") + 1) for text in texts], cfg)
            ]
            files = body_files(tmp_path)
            del parsed, images  # the request's views of its body: gone with it
            request.end()
            await until(lambda: bodies._idle, what="the body file idle")
            again = Arriving(body)
            parsed = await read_json(again, EncodeRequest, 64, ("images",), bodies)
            reused = (bodies.made, body_files(tmp_path))
            kept = parsed.images[0]  # a view of the body outlives its request
            again.end()
            await until(lambda: body_files(tmp_path) == [], what="the file of a body still viewed removed")
            assert bytes(kept.view[:22]) == b"data:image/png;base64,"  # the mapping itself lives while viewed
            alone = load_image(small)  # the PNG without what follows it; full size where the devices resize (GPU)
            alone = np.asarray(alone) if decoder.full_size else resize_rgb(alone, cfg)
            return shared, plain, sent_shared, files, reused, bodies.made, alone
        finally:
            await engine.stop()

    shared, plain, sent_shared, files, (made, files_again), made_after, alone = asyncio.run(scenario())
    assert sent_shared == [0, 0]  # both decodes sent where the text lies, no byte of it
    assert all(np.array_equal(a, b) for a, b in zip(shared, plain)) and np.array_equal(shared[1], alone)
    assert len(files) == 1 and made == made_after == 1 and files_again == files  # used again, not made anew
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_body_files_are_given_back_whatever_the_request_becomes(tmp_path):
    """A real server (its spool in tmp_path), large bodies that succeed, fail (a bad image: 400), are cut off by
    their client halfway, or are refused as too many values: each gives its body file back when it ends, so one
    file serves them all in turn (a lost release would leave a file per request); the answers are those of the same
    images in a chunked body (not shared: sent to the worker); SIGTERM leaves no file."""
    proc, url = launch.start_server(
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        "--cache-bytes",
        "0",
        "--spool-dir",
        str(tmp_path),
        "--decode-workers",
        "1",
        "--api-servers",
        "1",
        timeout=STARTUP_S,
    )  # one front end: its body files are the ones counted
    try:
        port = int(url.rsplit(":", 1)[1])
        image = png(700, 700, 7)  # ~1.5 MB: its body is shared
        big = {"input": [data_uri(image)], "pooling": "mean"}
        for _ in range(3):
            r = httpx.post(url + "/v1/embeddings", json=big, timeout=60)
            assert r.status_code == 200
        assert len(body_files(tmp_path)) == 1
        bad = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(image), "A" * 2**20 + "!"]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1]"
        many = httpx.post(
            url + "/v1/embeddings",
            content=b'{"input": [' + b",".join([b"1"] * 600_000) + b"]}",
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert many.status_code == 413
        payload = httpx.Request("POST", url + "/v1/embeddings", json=big).read()
        with socket.create_connection(("127.0.0.1", port)) as sock:  # half the body, then gone
            sock.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(payload) + payload[: len(payload) // 2]
            )
            wait_until(lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == 1, 10, "the body read")
        wait_until(lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == 0, 10, "the request ended")
        r = httpx.post(url + "/v1/embeddings", json=big, timeout=60)
        chunked = httpx.post(
            url + "/v1/embeddings",
            content=iter([payload]),  # no length: not shared, sent
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == chunked.status_code == 200
        assert r.json()["data"] == chunked.json()["data"]
        wait_until(lambda: len(body_files(tmp_path)) == 1, 5, "one body file, idle")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert os.listdir(tmp_path) == []
