"""Videos through real servers (tiny towers on the CPU): /v1/encode in JSON and multipart, /v1/embeddings with
`modality: "video"`, the safetensors answer, several front ends, and bad videos answered with 4xx while their
neighbours are served. The reference is the library (VisionEncoder.encode_videos, itself held to transformers' tower
in tests/test_video.py) and, on a checkpoint written by save_pretrained, transformers' tower itself. Where CUDA is
present the servers run on it in bfloat16, and their answers are held to the bf16 bound (helpers.assert_served)."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import httpx
import numpy as np
import pytest
import torch
from corpus import encode, photo
from helpers import BF16_REL_ERR, SERVER_ON_GPU, assert_served, rel_err, serving
from safetensors.torch import load as load_safetensors
from videos import make_video

from vitserve.client import Client, EncodedImage, EncodedVideo, VitserveError
from vitserve.encoder import VisionEncoder, video_nvdec

pytest.importorskip("av")
pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3-vl"


def video_uri(data: bytes, media: str = "video/mp4") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def tensor(item: dict, key: str = "embeddings", index: int | None = None) -> torch.Tensor:
    text = item[key] if index is None else item[key][index]
    shape = item["shape"] if key == "embeddings" else [item["shape"][0], -1]
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), "<f4").reshape(shape).copy())


@pytest.fixture(scope="module")
def server():
    yield from serving("--model", MODEL, "--load-format", "dummy", "--max-videos-per-request", "3")


@pytest.fixture(scope="module")
def library():
    return VisionEncoder.from_pretrained(MODEL, load_format="dummy")


CLIP = make_video(30, 10, 160, 120)
OTHER = make_video(13, 6, 96, 128, codec="libvpx-vp9", container="webm", photo="portrait.png")


def test_json_images_and_videos_match_the_library(server, library):
    """An image and two videos in one request: each item is what the library gives it alone (bit for bit on the
    same CPU), videos after images, each with its timing; the safetensors answer carries the same tensors and the
    timing in its metadata."""
    _, url = server
    image = encode(photo(96, 64, 5), "PNG")
    body = {
        "images": [f"data:image/png;base64,{base64.b64encode(image).decode()}"],
        "videos": [video_uri(CLIP), video_uri(OTHER, "video/webm")],
        "num_frames": 6,
    }
    r = httpx.post(url + "/v1/encode", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [(d["modality"], d["index"]) for d in data] == [("image", 0), ("video", 0), ("video", 1)]
    assert_served(tensor(data[0]), library.encode(image).embeddings)
    for item, clip in zip(data[1:], (CLIP, OTHER)):
        ref = library.encode_videos(clip, num_frames=6)
        assert tuple(item["grid_thw"]) == ref.grid_thw and ref.grid_thw[0] == 3
        assert_served(tensor(item), ref.embeddings)
        for j, d in enumerate(ref.deepstack):
            assert_served(tensor(item, "deepstack", j), d)
        assert item["frame_indices"] == ref.frame_indices and item["timestamps"] == ref.timestamps
        assert item["second_per_grid_t"] == ref.second_per_grid_t and item["fps"] == ref.fps
    r = httpx.post(url + "/v1/encode", json=body, headers={"accept": "application/octet-stream"}, timeout=120)
    assert r.status_code == 200
    tensors = load_safetensors(r.content)
    metadata = json.loads(r.content[8 : 8 + int.from_bytes(r.content[:8], "little")])["__metadata__"]
    timing = json.loads(metadata["videos"])
    assert timing[0] is None and timing[1]["frame_indices"] == data[1]["frame_indices"]
    assert torch.equal(tensors["images.2.embeddings"], tensor(data[2]))


def test_multipart_tells_videos_from_images_by_content(server, library):
    """File parts named anything: the MP4 is a video, the JPEG an image, whatever the field or file names say. The
    answer keeps the files' order (a video, an image, a video), in JSON, in safetensors and through the client."""
    _, url = server
    jpeg = encode(photo(64, 64, 9), "JPEG")
    files = [
        ("images", ("clip.jpg", CLIP, "image/jpeg")),
        ("images", ("x.bin", jpeg, "application/octet-stream")),
        ("images", ("other", OTHER, "video/webm")),
    ]
    r = httpx.post(url + "/v1/encode", files=files, data={"fps": "2"}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [(d["modality"], d["index"]) for d in data] == [("video", 0), ("image", 0), ("video", 1)]
    clips = [library.encode_videos(clip, fps=2) for clip in (CLIP, OTHER)]
    assert_served(tensor(data[0]), clips[0].embeddings)
    assert_served(tensor(data[2]), clips[1].embeddings)
    assert_served(tensor(data[1]), library.encode(jpeg).embeddings)
    r = httpx.post(
        url + "/v1/encode", files=files, data={"fps": "2"}, timeout=120, headers={"accept": "application/octet-stream"}
    )
    tensors = load_safetensors(r.content)
    metadata = json.loads(r.content[8 : 8 + int.from_bytes(r.content[:8], "little")])["__metadata__"]
    assert [t is None for t in json.loads(metadata["videos"])] == [False, True, False]
    assert torch.equal(tensors["images.0.embeddings"], tensor(data[0]))
    assert torch.equal(tensors["images.1.embeddings"], tensor(data[1]))
    with Client(url) as client:
        got = client.encode([CLIP, jpeg])
    assert [type(item) for item in got] == [EncodedVideo, EncodedImage]
    assert got[1].grid_thw == tuple(data[1]["grid_thw"]) and got[0].frame_indices == data[0]["frame_indices"]


def test_the_client_splits_videos_embeds_them_and_sends_urls(server, library):
    """Through the client, against a server of 3 videos a request: 4 videos and an image in one `encode` are two
    requests, answered in order; `embed(modality="video")` is the mean of the video's tokens; a data URI is its
    bytes; a URL reaches the server (which, without --allow-url-fetch, refuses it by its name)."""
    _, url = server
    jpeg = encode(photo(64, 64, 9), "JPEG")
    with Client(url) as client:
        items = client.encode([CLIP, CLIP, jpeg, OTHER, video_uri(CLIP)], layout="vllm")
        vector = client.embed(CLIP, modality="video", fps=2)
        with pytest.raises(VitserveError) as error:
            client.encode(["https://example.com/clip.mp4"])
    assert [type(i) for i in items] == [EncodedVideo, EncodedVideo, EncodedImage, EncodedVideo, EncodedVideo]
    clip, other = library.encode_videos(CLIP), library.encode_videos(OTHER)
    for i in (0, 1, 4):
        assert_served(items[i].embeddings, torch.cat([clip.embeddings, *clip.deepstack], -1))
    assert_served(items[3].embeddings, torch.cat([other.embeddings, *other.deepstack], -1))
    assert_served(vector, library.encode_videos(CLIP, fps=2).embeddings.mean(0), exact=False)
    assert (error.value.status, error.value.code, error.value.param) == (400, "url_fetch_disabled", "videos[0]")


def test_embeddings_pool_a_video(server, library):
    """/v1/embeddings with modality video: one vector per video, the mean of its tokens."""
    _, url = server
    r = httpx.post(
        url + "/v1/embeddings", json={"input": [video_uri(CLIP)], "modality": "video", "fps": 2}, timeout=120
    )
    assert r.status_code == 200, r.text
    vector = torch.tensor(r.json()["data"][0]["embedding"])
    assert_served(vector, library.encode_videos(CLIP, fps=2).embeddings.mean(0), exact=False)


def series(url: str, name: str) -> float:
    """The sum of a /metrics series over its labels."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def test_a_video_sent_again_is_answered_from_the_cache(server):
    """The same video with the same options is answered from its cached slices, without decoding (the decode count
    stays, a cache hit is counted), bit for bit the same, and pooled from the same slices on /v1/embeddings; other
    sampling options are another entry (decoded again)."""
    _, url = server
    clip = make_video(26, 10, 128, 96, photo="portrait.png")  # a video no other test sends
    body = {"videos": [video_uri(clip)], "num_frames": 6}
    before = [series(url, n) for n in ("vitserve_videos_decoded_total", "vitserve_cache_hits_total")]
    first = httpx.post(url + "/v1/encode", json=body, timeout=120)
    again = httpx.post(url + "/v1/encode", json=body, timeout=120)
    pooled = httpx.post(
        url + "/v1/embeddings", json={"input": [video_uri(clip)], "modality": "video", "num_frames": 6}, timeout=120
    )
    assert first.status_code == again.status_code == pooled.status_code == 200, (first.text, again.text)
    tokens = tensor(first.json()["data"][0])
    assert torch.equal(tensor(again.json()["data"][0]), tokens)
    assert again.json()["data"][0]["frame_indices"] == first.json()["data"][0]["frame_indices"]
    assert torch.equal(torch.tensor(pooled.json()["data"][0]["embedding"]), tokens.mean(0))
    after = [series(url, n) for n in ("vitserve_videos_decoded_total", "vitserve_cache_hits_total")]
    assert after == [before[0] + 1, before[1] + 2]  # decoded once; the second and the pooled one from the cache
    assert float(again.headers["x-decode-time"]) == 0.0  # its header not read again (VideoPlans)
    other = httpx.post(url + "/v1/encode", json=body | {"num_frames": 4}, timeout=120)
    assert other.status_code == 200 and series(url, "vitserve_videos_decoded_total") == before[0] + 2


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"videos": [base64.b64encode(encode(photo(32, 32, 1), "PNG")).decode()]}, 400, "not_a_video"),
        ({"videos": [video_uri(CLIP[:2000])]}, 400, "undecodable_video"),
        (
            {"videos": [video_uri(make_video(6, 6, 64, 64, codec="ffv1", container="matroska"))]},
            400,
            "unsupported_codec",
        ),
        ({"videos": [video_uri(CLIP)], "num_frames": 5000}, 413, "too_many_frames"),
        ({"videos": [video_uri(CLIP)] * 4}, 413, "too_many_videos"),
        ({"videos": [video_uri(CLIP)], "fps": 2, "num_frames": 4}, 422, "invalid_request"),
        ({}, 422, "invalid_request"),
        ({"images": [base64.b64encode(CLIP).decode()]}, 400, "video_input"),
        ({"videos": ["file:///tmp/clip.mp4"]}, 400, "invalid_url"),
        (
            {"videos": [f"data:image/png;base64,{base64.b64encode(encode(photo(32, 32, 1), 'PNG')).decode()}"]},
            400,
            "not_a_video",
        ),
        ({"videos": ["%%%"]}, 400, "invalid_base64"),
    ],
)
def test_bad_videos_get_a_4xx_and_their_neighbours_an_answer(server, body, status, code):
    """Each bad request fails alone, with its code, while a good video request sent at the same time is served."""
    _, url = server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(httpx.post, url + "/v1/encode", json={"videos": [video_uri(CLIP)]}, timeout=120)
        r = httpx.post(url + "/v1/encode", json=body, timeout=120)
        assert good.result().status_code == 200
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text


def test_several_front_ends_serve_videos(library):
    """With two front ends the slices cross the core like images: the same answer."""
    for proc, url in serving(
        "--model", MODEL, "--load-format", "dummy", "--api-servers", "2", "--device-processes", "true"
    ):
        r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], "num_frames": 6}, timeout=120)
        assert r.status_code == 200, r.text
        assert_served(tensor(r.json()["data"][0]), library.encode_videos(CLIP, num_frames=6).embeddings)


@pytest.mark.parametrize("preprocess", ["exact", "fast"])
def test_videos_converted_on_the_devices_are_answered_the_same(library, preprocess):
    """--video-convert device: the decode workers hand the sampled frames' planes on, the devices convert and
    resize them (CPU tensors here, CUDA's where it runs; through two front ends and device processes: the planes
    cross the core and a process boundary as spool files), beside an image in the same batch, with either image
    preprocessing: each video's answer is the library's (and the image's, with exact preprocessing)."""
    image = encode(photo(96, 64, 5), "PNG")
    mjpeg = make_video(20, 10, 160, 120, codec="mjpeg", container="avi")
    flags = ("--api-servers", "2", "--device-processes", "true", "--video-convert", "device")
    flags += ("--preprocess", preprocess)
    for _, url in serving("--model", MODEL, "--load-format", "dummy", *flags):
        body = {
            "images": [f"data:image/png;base64,{base64.b64encode(image).decode()}"],
            "videos": [video_uri(CLIP), video_uri(OTHER, "video/webm"), video_uri(mjpeg, "video/x-msvideo")],
            "num_frames": 6,
        }
        r = httpx.post(url + "/v1/encode", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        if preprocess == "exact":
            assert_served(tensor(data[0]), library.encode([image])[0].embeddings)
        for item, clip in zip(data[1:], (CLIP, OTHER, mjpeg)):
            assert_served(tensor(item), library.encode_videos(clip, num_frames=6).embeddings)


@pytest.mark.parametrize("convert", ["worker", "device"])
def test_a_video_split_among_decode_workers_is_answered_the_same(library, convert):
    """Four decode workers, all of them for videos: a video of six groups of pictures is split among them, its
    parts' slices cross as spool files and go to the device as each part is decoded; the answer is the library's
    whole decode (the timing too), with the frames made in the workers or converted on the device."""
    from vitserve.encoder.config import builtin_config
    from vitserve.encoder.video import VideoConfig, video_plan

    clip = make_video(120, 12, 192, 108, options={"preset": "veryfast", "g": "20"}, photo="portrait.png")
    cfg = VideoConfig.for_model(builtin_config(MODEL)).with_request(fps=4)
    assert len(video_plan(clip, cfg, groups=True).parts(2)) == 2  # four workers: two parts (one per two of them)
    flags = ("--decode-workers", "4", "--video-decode-workers", "4", "--video-convert", convert)
    for _, url in serving("--model", MODEL, "--load-format", "dummy", *flags):
        before = series(url, "vitserve_videos_decoded_total")
        r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(clip)], "fps": 4}, timeout=120)
        assert r.status_code == 200, r.text
        expected = library.encode_videos(clip, fps=4)
        assert_served(tensor(r.json()["data"][0]), expected.embeddings)
        assert r.json()["data"][0]["frame_indices"] == expected.frame_indices
        assert series(url, "vitserve_videos_decoded_total") == before + 1  # one video, however many parts


def test_a_checkpoint_served_matches_transformers_tower(checkpoints):
    """A Qwen2.5-VL checkpoint written by save_pretrained, served: its video tokens are transformers' tower's on
    the same pixel_values_videos, within 1e-5 (the bf16 bound where the server runs on a GPU)."""
    path, hf_tower = checkpoints["qwen2_5_vl"]
    pixels, grids = VisionEncoder.from_pretrained(path).preprocess_videos(CLIP, fps=2)
    with torch.no_grad():
        ref = hf_tower(pixels, grids).pooler_output
    for _, url in serving("--model", path):
        r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], "fps": 2}, timeout=120)
        assert r.status_code == 200, r.text
        assert rel_err(tensor(r.json()["data"][0]), ref) <= (BF16_REL_ERR if SERVER_ON_GPU else 1e-5)


def test_fast_preprocessing_serves_the_same_videos(library):
    """--preprocess fast resizes images on the device; videos are sampled and resized as transformers' video
    processor does either way, so their answer is the exact one, beside an image in the same request. With
    --video-decoder nvdec the videos decode on NVDEC where it runs (the same frames), in software elsewhere, and
    /metrics counts each video by the decoder that decoded it."""
    image = encode(photo(96, 64, 5), "JPEG")
    for _, url in serving(
        "--model", MODEL, "--load-format", "dummy", "--preprocess", "fast", "--video-decoder", "nvdec"
    ):
        body = {
            "images": [f"data:image/jpeg;base64,{base64.b64encode(image).decode()}"],
            "videos": [video_uri(CLIP)],
            "num_frames": 6,
        }
        r = httpx.post(url + "/v1/encode", json=body, timeout=120)
        assert r.status_code == 200, r.text
        decoder = "nvdec" if video_nvdec.unavailable() is None else "cpu"
        assert_served(tensor(r.json()["data"][1]), library.encode_videos(CLIP, num_frames=6).embeddings)
        assert f'vitserve_videos_decoded_total{{decoder="{decoder}"}} 1.0' in httpx.get(url + "/metrics").text


@pytest.fixture(scope="module")
def qwen2_server():
    """Qwen2.5-VL with the videos' limits and sizes set by flags: 6 frames at most, 4 MiB of frames a request,
    frames of 3136 to 12544 pixels (16·28²; the images keep theirs)."""
    yield from serving(
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        "--max-video-frames",
        "6",
        "--decode-memory-per-request",
        str(4 * 2**20),
        "--video-min-pixels",
        "3136",
        "--video-max-pixels",
        "12544",
    )


def test_the_frame_caps_bound_what_a_qwen2_video_samples(qwen2_server):
    """Qwen2/2.5-VL samples every frame unless asked: --max-video-frames caps it (a 30-frame clip whose every frame
    would take more than --decode-memory-per-request at the default sizes is served, 6 frames spread over it), and a
    request's max_frames, the 413's advice, caps it further."""
    _, url = qwen2_server
    grids = []
    for extra in ({}, {"max_frames": 2}):
        r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], **extra}, timeout=120)
        assert r.status_code == 200, r.text
        grids.append(r.json()["data"][0]["grid_thw"][0])
        frames = r.json()["data"][0]["frame_indices"]
    assert grids == [3, 1] and frames == [0, 15]


def test_video_frame_sizes_have_their_own_flags_and_a_request_under_the_minimum_is_refused(qwen2_server):
    """--video-max-pixels sizes the frames (160x120 = 19200 pixels down to 112x84: grid 6x8, where the processor's
    default minimum of 128·28² scaled them up to 20x28) while an image keeps the images' bounds; a request's
    max_pixels under --video-min-pixels is a 400 naming max_pixels, as for images, not a silent clamp."""
    _, url = qwen2_server
    image = f"data:image/png;base64,{base64.b64encode(encode(photo(160, 120, 3), 'PNG')).decode()}"
    r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], "images": [image]}, timeout=120)
    assert r.status_code == 200, r.text
    assert [item["grid_thw"] for item in r.json()["data"]] == [[1, 8, 12], [3, 6, 8]]
    r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], "max_pixels": 3000}, timeout=120)
    error = r.json()["error"]
    assert r.status_code == 400 and (error["code"], error["param"]) == ("invalid_max_pixels", "max_pixels"), r.text
    assert "3136" in error["message"]


def test_num_frames_errors_name_the_parameter_and_truncate_frames_caps_it(qwen2_server):
    """num_frames 1 (under a temporal patch): a 400 naming num_frames; num_frames over a 4-frame clip's frames: a
    400 saying so, or with truncate_frames (the batch user's opt-in) the clip's every frame."""
    _, url = qwen2_server
    short = make_video(4, 4, 64, 48)
    r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(CLIP)], "num_frames": 1}, timeout=120)
    error = r.json()["error"]
    assert r.status_code == 400 and (error["code"], error["param"]) == ("invalid_num_frames", "num_frames"), r.text
    r = httpx.post(url + "/v1/encode", json={"videos": [video_uri(short)], "num_frames": 6}, timeout=120)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "video_too_short" and error["param"] == "videos[0]", r.text
    assert "num_frames 6 is more than the video's 4 frames" in error["message"]
    r = httpx.post(
        url + "/v1/encode", json={"videos": [video_uri(short)], "num_frames": 6, "truncate_frames": True}, timeout=120
    )
    assert r.status_code == 200 and r.json()["data"][0]["frame_indices"] == [0, 1, 2, 3], r.text
