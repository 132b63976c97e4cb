"""The client against a scripted server (httpx's MockTransport): retries of 429 and 503 that wait as Retry-After
says and are bounded, typed errors with the server's code, requests split at the server's image limit. Against a
real `vitserve serve` of the tiny model: one image in gives one result out, equal to the library's. Against a closed
port, a server that starts late, a silent one and one that hangs up: connection failures retried with the same
backoff, then `VitserveError`s with no status; timeouts and broken connections not retried."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import types
from pathlib import Path

import httpx
import pytest
import torch
from helpers import SERVED_REL_ERR, STARTUP_S, data_uri, rel_err
from PIL import Image
from safetensors.torch import save

from vitserve.client import AsyncClient, Client, EncodedImage, EncodedVideo, VitserveError
from vitserve.consumers import vllm_multi_modal_data
from vitserve.encoder.video import sniff
from vitserve.service.entry.launch import free_port, start_server

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SAMPLE, PORTRAIT, CLIP = EXAMPLES / "sample.jpg", EXAMPLES / "portrait.png", EXAMPLES / "clip.mp4"
TINY = ("--model", "tiny-qwen2.5-vl", "--load-format", "dummy")


def encode_reply(n: int) -> httpx.Response:
    tensors = {f"images.{i}.embeddings": torch.full((4, 8), float(i)) for i in range(n)}
    body = save(tensors, metadata={"grid_thw": json.dumps([[1, 4, 4]] * n), "model": "m", "dtype": "float32"})
    return httpx.Response(200, content=body)


def test_retries_honour_retry_after_and_are_bounded(monkeypatch):
    waits = []
    monkeypatch.setattr("vitserve.client.time.sleep", waits.append)
    answers = iter(
        [
            httpx.Response(
                429, headers={"retry-after": "2"}, json={"error": {"code": "queue_full", "message": "busy"}}
            ),
            httpx.Response(503, json={"error": {"code": "not_ready", "message": "loading"}}),
            encode_reply(1),
        ]
    )
    with Client(
        "http://vitserve", max_images_per_request=8, transport=httpx.MockTransport(lambda r: next(answers))
    ) as c:
        (item,) = c.encode([b"img"])
    assert waits == [2.0, 1.0] and item.grid_thw == (1, 4, 4) and item.embeddings.shape == (4, 8)
    busy = httpx.MockTransport(lambda r: httpx.Response(429, json={"error": {"code": "queue_full", "message": "x"}}))
    with Client("http://vitserve", retries=2, max_images_per_request=8, transport=busy) as c:
        with pytest.raises(VitserveError) as e:
            c.encode([b"img"])
    assert e.value.status == 429 and e.value.code == "queue_full" and len(waits) == 4


def test_errors_carry_the_servers_code_and_param():
    bad = httpx.MockTransport(
        lambda r: httpx.Response(
            400,
            json={"error": {"code": "undecodable_image", "param": "images[0]", "message": "images[0]: not an image"}},
        )
    )
    with Client("http://vitserve", max_images_per_request=8, transport=bad) as c:
        with pytest.raises(VitserveError) as e:
            c.encode([b"not an image"])
    assert (e.value.status, e.value.code, e.value.param) == (400, "undecodable_image", "images[0]")


def test_many_images_are_split_at_the_servers_limit():
    sizes = []

    def server(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_images_per_request": 3}]})
        n = request.content.count(b'name="images"')
        sizes.append(n)
        return encode_reply(n)

    with Client("http://vitserve", transport=httpx.MockTransport(server)) as c:
        items = c.encode([b"x"] * 7)
    assert sizes == [3, 3, 1] and len(items) == 7


def multipart_kinds(request: httpx.Request) -> list[bool]:
    """Whether each file part of a multipart request is a video (by its bytes, as the server tells them)."""
    boundary = request.headers["content-type"].split("boundary=")[1].encode()
    parts = [part.split(b"\r\n\r\n", 1) for part in request.content.split(b"--" + boundary)[1:-1]]
    return [sniff(body[:512]) is not None for head, body in parts if b"filename=" in head]


def mixed_reply(kinds: list[bool]) -> httpx.Response:
    """A /v1/encode answer of images and videos in the order of `kinds` (whether each is a video)."""
    tensors = {f"images.{i}.embeddings": torch.full((4, 8), float(i)) for i in range(len(kinds))}
    timing = [
        {"frame_indices": [0, 1], "fps": 2.0, "timestamps": [0.5], "second_per_grid_t": 1.0} if video else None
        for video in kinds
    ]
    body = save(tensors, metadata={"grid_thw": json.dumps([[1, 4, 4]] * len(kinds)), "videos": json.dumps(timing)})
    return httpx.Response(200, content=body)


def test_videos_are_split_at_the_servers_video_limit_in_order():
    """encode() of 3 videos and 2 images against a server taking 2 images and 1 video a request: 3 requests, the
    results in the order given (a video, an image, ...); embed of videos likewise, with modality video."""
    sent = []

    def server(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"max_images_per_request": 2, "max_videos_per_request": 1}]})
        if request.url.path == "/v1/embeddings":
            body = json.loads(request.content)
            sent.append((body["modality"], len(body["input"]), body["num_frames"]))
            return httpx.Response(
                200, json={"data": [{"embedding": base64.b64encode(bytes(32)).decode()} for _ in body["input"]]}
            )
        sent.append(multipart_kinds(request))
        return mixed_reply(sent[-1])

    clip, image = CLIP.read_bytes(), SAMPLE.read_bytes()
    with Client("http://vitserve", transport=httpx.MockTransport(server)) as c:
        items = c.encode([clip, image, clip, image, clip])
        assert sent == [[True, False], [True, False], [True]]
        assert [type(i) for i in items] == [EncodedVideo, EncodedImage] * 2 + [EncodedVideo]
        assert [i.embeddings[0, 0].item() for i in items] == [0, 1, 0, 1, 0]
        sent.clear()
        vectors = c.embed([clip, clip], modality="video", num_frames=4)
        assert sent == [("video", 1, 4)] * 2 and len(vectors) == 2
        with pytest.raises(ValueError, match="modality is image or video"):
            c.embed([clip], modality="audio")
        with pytest.raises(ValueError, match=r"videos\[1\] is not a video"):
            c.encode_videos([clip, image])

    async def fetch():  # the async client splits and orders alike
        async with AsyncClient("http://vitserve", transport=httpx.MockTransport(server)) as client:
            return await client.encode([image, clip, clip])

    sent.clear()
    items = asyncio.run(fetch())
    assert sent == [[False, True], [True]] and [type(i) for i in items] == [EncodedImage, EncodedVideo, EncodedVideo]


def test_urls_and_data_uris_are_sent_not_opened():
    """A URL goes to the server as it is (a JSON request: the server fetches it), a data URI as its bytes; the
    answer's images-then-videos come back in the order given. Anything else is a TypeError that says what is
    taken."""
    sent = []

    def server(request: httpx.Request):
        if request.headers["content-type"].startswith("multipart/"):
            sent.append(("multipart", multipart_kinds(request)))
            return mixed_reply(sent[-1][1])
        body = json.loads(request.content)
        sent.append(("json", body))
        return mixed_reply([False] * len(body["images"]) + [True] * len(body["videos"]))

    image, clip = SAMPLE.read_bytes(), CLIP.read_bytes()
    uri = data_uri(image, "image/jpeg")
    with Client("http://vitserve", max_images_per_request=8, transport=httpx.MockTransport(server)) as c:
        one = c.encode(uri)
        assert sent.pop() == ("multipart", [False]) and isinstance(one, EncodedImage)
        c.video_batch = 4
        items = c.encode(["https://example.com/clip.mp4?x=1", "https://example.com/cat", clip])
        kind, body = sent.pop()
        assert body["images"] == ["https://example.com/cat"]
        assert body["videos"] == ["https://example.com/clip.mp4?x=1", base64.b64encode(clip).decode()]
        assert [type(i) for i in items] == [EncodedVideo, EncodedImage, EncodedVideo]
        assert [i.embeddings[0, 0].item() for i in items] == [1, 0, 2]
        for bad in (5, None, {"image": image}):
            with pytest.raises(TypeError, match="an image or a video is a path, an http"):
                c.encode(bad)
        with pytest.raises(ValueError, match="a data URI is data:<media type>;base64"):
            c.encode("data:image/png,notbase64")


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(*TINY, timeout=STARTUP_S, capture_log=True)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_one_image_in_one_result_out(server):
    """A path, bytes or a PIL image gives its EncodedImage (embed: its vector), equal to the list's one item and to
    the library's result; a list gives a list. Qwen2.5-VL has no deepstack: an empty list, in the client and in
    the library alike."""
    from vitserve.encoder import VisionEncoder

    with Client(server) as client:
        (listed,) = client.encode([str(SAMPLE)])
        for image in (str(SAMPLE), SAMPLE, SAMPLE.read_bytes(), Image.open(SAMPLE)):
            one = client.encode(image)
            assert isinstance(one, EncodedImage) and one.grid_thw == listed.grid_thw and one.deepstack == []
            assert torch.equal(one.embeddings, listed.embeddings)
        both = client.encode([SAMPLE, PORTRAIT])
        assert [i.grid_thw for i in both] == [listed.grid_thw, client.encode(PORTRAIT).grid_thw] and both[
            0
        ].grid_thw != both[1].grid_thw
        vector, (listed_vector,) = client.embed(str(SAMPLE)), client.embed([str(SAMPLE)])
        assert vector.shape == (listed.embeddings.shape[1],) and torch.equal(vector, listed_vector)
        assert rel_err(vector, listed.embeddings.mean(0)) <= 1e-5
    assert torch.equal(
        vllm_multi_modal_data(listed)["image"]["image_embeds"],  # consumers take one image too
        vllm_multi_modal_data([listed])["image"]["image_embeds"],
    )
    library = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy").encode(str(SAMPLE))
    assert library.deepstack == [] and library.grid_thw == listed.grid_thw
    assert rel_err(listed.embeddings, library.embeddings) <= SERVED_REL_ERR

    async def fetch():
        async with AsyncClient(server) as client:
            return (
                await client.encode(str(SAMPLE)),
                await client.embed(SAMPLE.read_bytes()),
                await client.encode([str(SAMPLE)]),
            )

    one, vector, many = asyncio.run(fetch())
    assert isinstance(one, EncodedImage) and torch.equal(one.embeddings, listed.embeddings) and one.deepstack == []
    assert torch.equal(vector, listed_vector) and len(many) == 1


def no_sleep(monkeypatch, hook=None) -> list[float]:
    """The client's waits, recorded instead of slept (`hook(seconds)` runs in their place)."""
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        if hook:
            hook(seconds)

    async def asleep(seconds):
        sleep(seconds)

    monkeypatch.setattr("vitserve.client.time", types.SimpleNamespace(sleep=sleep))
    monkeypatch.setattr("vitserve.client.asyncio", types.SimpleNamespace(sleep=asleep, gather=asyncio.gather))
    return waits


def test_a_closed_port_is_retried_then_reported(monkeypatch):
    waits = no_sleep(monkeypatch)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(url, retries=2) as client:
        with pytest.raises(VitserveError) as e:
            client.encode([SAMPLE])
    assert (e.value.status, e.value.code) == (None, "unreachable") and "3 attempts" in e.value.message
    assert f"the server at {url} " in e.value.message and "/v1/models" not in e.value.message  # whatever it asked
    assert isinstance(e.value.__cause__, httpx.ConnectError) and waits == [0.5, 1.0]  # 429/503's backoff

    async def fetch():
        async with AsyncClient(url, retries=1, max_images_per_request=4) as client:
            return await client.embed([SAMPLE])

    with pytest.raises(VitserveError) as e:
        asyncio.run(fetch())
    assert (e.value.status, e.value.code) == (None, "unreachable") and waits == [0.5, 1.0, 0.5]


@pytest.mark.slow
def test_a_server_that_starts_late_answers_the_retry(monkeypatch):
    """The first connection fails; while the client waits to retry, a real server starts on the port."""
    port, started = free_port(), []

    def start(seconds):
        started.append(start_server(*TINY, port=port, timeout=STARTUP_S, capture_log=True)[0])

    waits = no_sleep(monkeypatch, start)
    try:
        with Client(f"http://127.0.0.1:{port}") as client:
            (item,) = client.encode([SAMPLE])
        assert waits == [0.5] and item.num_tokens > 0
    finally:
        for proc in started:
            proc.terminate()
            proc.wait(timeout=30)


def test_timeouts_and_broken_connections_are_reported_not_retried(monkeypatch):
    waits = no_sleep(monkeypatch)
    with socket.socket() as silent:  # the kernel accepts connections into its backlog; nothing answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with Client(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5, max_images_per_request=4) as client:
            with pytest.raises(VitserveError) as e:
                client.encode([SAMPLE])
    assert (e.value.status, e.value.code) == (None, "timeout") and isinstance(e.value.__cause__, httpx.TimeoutException)

    with socket.socket() as rude:  # accepts, reads the request, hangs up without an answer
        rude.bind(("127.0.0.1", 0))
        rude.listen(8)

        def hang_up():
            conn, _ = rude.accept()
            with conn:
                conn.recv(65536)

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        with Client(f"http://127.0.0.1:{rude.getsockname()[1]}", max_images_per_request=4) as client:
            with pytest.raises(VitserveError) as e:
                client.embed([SAMPLE.read_bytes()])
        thread.join(timeout=30)
    assert (e.value.status, e.value.code) == (None, "transport_error") and isinstance(
        e.value.__cause__, httpx.TransportError
    )
    assert waits == []  # neither was retried: the request may have reached the server


@pytest.mark.slow
def test_videos_through_a_real_server(server):
    """Five clips in one encode() (the server takes 4 a request) are all answered, each what encode_videos gives;
    embed(clip, modality="video") is the mean of its tokens; a data URI is an input like its bytes."""
    pytest.importorskip("av")
    from videos import make_video

    clip = make_video(8, 8, 64, 48)
    with Client(server) as client:
        alone = client.encode_videos(clip)
        many = client.encode([clip] * 5)
        assert len(many) == 5 and all(torch.equal(item.embeddings, alone.embeddings) for item in many)
        vector = client.embed(data_uri(clip, "video/mp4"), modality="video")
        assert rel_err(vector, alone.embeddings.mean(0)) <= SERVED_REL_ERR
