"""vitserve as vLLM's encoder tier (service/vllm_tier.py, ec_storage.py, vllm_hash.py): the files vLLM's
ECExampleConnector reads, their bounds and permissions, and a real server writing them from /v1/encode and from the
chat request vLLM's disaggregated-encoder proxy sends. vLLM's own classes read these files and compute these
identifiers in tests/test_engine_contracts.py."""

from __future__ import annotations

import os
import stat
import threading

import httpx
import pytest
import torch
from corpus import encode, photo
from helpers import IMAGES, b64_bf16, client_for, data_uri, serving, wait_until
from safetensors.torch import load, load_file

from vitserve.encoder.features import Features
from vitserve.service.ground.settings_media import EC_HASH_ALGORITHMS
from vitserve.service.tiers import ec_storage
from vitserve.service.tiers.ec_storage import ECStorage
from vitserve.service.tiers.vllm_hash import ALGORITHMS, mm_hash

MODEL = "tiny-qwen3-vl"


def status(error) -> int:
    """The HTTP status a client is answered for a tier's domain error (the edge's one table)."""
    from vitserve.service.api.http_errors import ServiceError

    return ServiceError.of(error).status


def folder(path):
    """An encoder-cache folder (ECStorage takes an existing one)."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def item(rows=12, width=8, levels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), [torch.randn(rows, width, generator=g) for _ in range(levels)]


def test_a_file_holds_the_tokens_then_the_deepstack_features_in_the_consumers_dtype(tmp_path):
    """One tensor `ec_cache`: cat([tokens, ds0, ds1, ds2], -1) in the storage's dtype, at
    <dir>/<identifier>/encoder_cache.safetensors, nothing else in the folder; split over writer threads or not."""
    tokens, deepstack = item(rows=301)
    for writers in (1, 4):
        storage = ECStorage(folder(tmp_path / str(writers)), 2**30, dtype=torch.bfloat16, writers=writers)
        storage.write("abc", Features(tokens, deepstack))
        tensors = load_file(tmp_path / str(writers) / "abc" / "encoder_cache.safetensors")
        assert list(tensors) == ["ec_cache"]
        assert torch.equal(tensors["ec_cache"], torch.cat([tokens, *deepstack], -1).bfloat16())
        assert os.listdir(tmp_path / str(writers)) == ["abc"]
    storage = ECStorage(folder(tmp_path / "f32"), 2**30, dtype=torch.float32)
    storage.write("x", Features(tokens))
    assert torch.equal(load_file(storage.path("x"))["ec_cache"], tokens)


def test_a_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """The consumer takes existence as readiness: the final path appears only by the link of a complete file, and
    a write that fails leaves neither a file nor a temporary one."""
    storage = ECStorage(tmp_path, 2**30)
    tokens, deepstack = item()
    link = os.link
    seen = []

    def checked(src, dst, *, src_dir_fd, dst_dir_fd, follow_symlinks):
        assert not os.path.exists(storage.path("a"))
        with open(os.open(src, os.O_RDONLY, dir_fd=src_dir_fd), "rb") as f:
            written = load(f.read())["ec_cache"]
        seen.append(torch.equal(written, torch.cat([tokens, *deepstack], -1).bfloat16()))
        link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(ec_storage.os, "link", checked)
    storage.write("a", Features(tokens, deepstack))
    assert seen == [True]

    def failing(fd, pieces, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ec_storage.os, "pwritev", failing)
    with pytest.raises(OSError):
        storage.write("b", Features(tokens, deepstack))
    assert sorted(os.listdir(tmp_path)) == ["a"] and storage.bytes == storage.path("a").stat().st_size


def test_the_space_is_bounded_least_recently_written_first(tmp_path):
    """Files stay within max_bytes: the least recently written go (an item written again is recent again); files
    found at start count, oldest first; an item larger than the bound is refused."""
    tokens, _ = item(rows=64, width=64, levels=0)
    size = ECStorage(folder(tmp_path / "probe"), 2**30, dtype=torch.float32).write("p", Features(tokens))
    storage = ECStorage(folder(tmp_path / "s"), 3 * size, dtype=torch.float32)
    for name in "abc":
        storage.write(name, Features(tokens))
    storage.write("a", Features(tokens))  # already there: now the most recent
    storage.write("d", Features(tokens))
    assert sorted(os.listdir(tmp_path / "s")) == ["a", "c", "d"] and storage.bytes == 3 * size
    again = ECStorage(tmp_path / "s", 2 * size, dtype=torch.float32)  # a restart with less room
    assert len(os.listdir(tmp_path / "s")) == 2 and again.bytes == 2 * size
    with pytest.raises(ValueError, match="does not fit"):
        ECStorage(folder(tmp_path / "t"), size - 1, dtype=torch.float32).write("big", Features(tokens))


def test_writes_in_flight_count_within_the_bound(tmp_path, monkeypatch):
    """Overlapping writes: a write that needs room held only by writes still in flight waits for them (it never
    evicts a file before it lands, to have it land uncounted), so the folder never holds more than max_bytes and the
    storage's count is what is on disk."""
    tokens, _ = item(rows=64, width=64, levels=0)
    size = ECStorage(folder(tmp_path / "probe"), 2**30, dtype=torch.float32, writers=1).write("p", Features(tokens))
    storage = ECStorage(folder(tmp_path / "s"), 2 * size, dtype=torch.float32, writers=1)
    entered, release = threading.Semaphore(0), threading.Event()
    write_rows = ec_storage._write_rows

    def held(*args):
        entered.release()
        release.wait(10)
        write_rows(*args)

    monkeypatch.setattr(ec_storage, "_write_rows", held)
    first = [threading.Thread(target=storage.write, args=(name, Features(tokens))) for name in "ab"]
    for thread in first:
        thread.start()
    for _ in first:
        assert entered.acquire(timeout=10)  # a and b are both being written
    third = threading.Thread(target=storage.write, args=("c", Features(tokens)))
    third.start()
    assert not entered.acquire(timeout=0.3)  # c waits for room instead of evicting a write in flight
    release.set()
    for thread in (*first, third):
        thread.join(10)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "s").glob("*/encoder_cache.safetensors"))
    assert on_disk == storage.bytes <= 2 * size and (tmp_path / "s" / "c").is_dir()


def test_a_file_under_an_identifier_is_never_replaced(tmp_path):
    """The first write of an identifier is its file: a later write of the same size counts it as written again,
    another size is refused (FileExistsError) and the file stays the first item's."""
    storage = ECStorage(tmp_path, 2**30, dtype=torch.float32)
    first, _ = item(rows=12, seed=1)
    storage.write("x", Features(first))
    storage.write("x", Features(item(rows=12, seed=2)[0]))  # same size: the file there counts (one item)
    with pytest.raises(FileExistsError):
        storage.write("x", Features(item(rows=20, seed=3)[0]))
    assert torch.equal(load_file(storage.path("x"))["ec_cache"], first)
    assert storage.bytes == storage.path("x").stat().st_size


def test_links_and_other_users_folders_are_never_written_through(tmp_path):
    """A link planted under an identifier (to a private folder) is refused without touching its target (no chmod,
    no file); so is a folder another user owns; neither is counted at start or removed."""
    shared, private = folder(tmp_path / "shared"), folder(tmp_path / "private")
    private.chmod(0o700)
    (shared / "planted").symlink_to(private, target_is_directory=True)
    storage = ECStorage(shared, 2**30)
    with pytest.raises(FileExistsError):
        storage.write("planted", Features(*item()))
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and not list(private.iterdir())
    if os.geteuid() == 0:  # another user's folder, with a file in it
        other = folder(shared / "other")
        (other / "encoder_cache.safetensors").write_bytes(b"x" * 4096)
        os.chown(other, 4321, -1)
        again = ECStorage(shared, 2048)  # too small for the file: it would be evicted if it were counted
        with pytest.raises(FileExistsError):
            again.write("other", Features(*item()))
        assert again.bytes == 0 and (other / "encoder_cache.safetensors").read_bytes() == b"x" * 4096


def test_a_restart_survives_hidden_names_in_the_folder(tmp_path):
    """Hidden names are the storage's own (its temporary files): not identifiers; a folder named like a temporary
    file does not stop a restart."""
    with pytest.raises(ValueError):
        ECStorage(tmp_path, 2**30).write(".ec-planted.tmp", Features(*item()))
    (tmp_path / ".ec-planted.tmp").mkdir()
    ECStorage(tmp_path, 2**30).write("a", Features(*item()))
    assert sorted(os.listdir(tmp_path)) == [".ec-planted.tmp", "a"]


def test_files_and_folders_get_the_operators_permissions(tmp_path):
    """--ec-file-mode: the file's mode as given (not the umask's), its folder the same with x wherever r."""
    old = os.umask(0o077)
    try:
        ECStorage(tmp_path, 2**30, file_mode=0o640).write("m", Features(*item()))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m" / "encoder_cache.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o750


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x" * 256, ".hidden"])
def test_an_identifier_is_one_folder_name(tmp_path, bad):
    with pytest.raises(ValueError):
        ECStorage(tmp_path, 2**30).write(bad, Features(*item()))


def test_identifiers_follow_vllms_rules():
    """A uuid is the identifier as it is, unless the request has hash factors (then it is hashed with them, the same
    for every image); an image without one is named by its bytes (PNG and JPEG of one picture differ), with vLLM's
    conversion settings where its loader converts the mode; a video needs a uuid. The algorithms are the settings'."""
    pixels = photo(40, 30, 3)
    png, jpeg = encode(pixels, "PNG"), encode(pixels, "JPEG")
    assert mm_hash("image", "m", uuid="u-1") == "u-1"
    hashed = mm_hash("image", "m", uuid="u-1", mm_processor_kwargs={"max_pixels": 1000})
    assert hashed != "u-1" and len(hashed) == 64
    assert mm_hash("image", "m", data=png) != mm_hash("image", "m", data=jpeg)
    assert mm_hash("image", "m", data=png) != mm_hash("image", "other", data=png)
    assert len(mm_hash("image", "m", "sha512", data=png)) == 128
    rgba = encode(pixels.convert("RGBA"), "PNG")
    from vitserve.service.tiers.vllm_hash import image_io_config

    assert image_io_config(png) is None and image_io_config(rgba) is not None
    with pytest.raises(ValueError):
        mm_hash("video", "m", data=b"...")
    assert ALGORITHMS == EC_HASH_ALGORITHMS


def test_an_image_pil_will_not_open_has_no_identifier_a_400(tmp_path, monkeypatch):
    """An image over PIL's decompression-bomb bound (which a raised --max-image-pixels lets the encode take): vLLM's
    loader, PIL too, will not read it, so it has no identifier there: a 400 `unidentified_image`, not a 500 out of
    the hashing pool."""
    import asyncio

    from PIL import Image

    from vitserve.service.ground.errors import EngineError
    from vitserve.service.ground.media import MediaItem
    from vitserve.service.ground.settings import Settings
    from vitserve.service.tiers.vllm_tier import VLLMTier

    tier = VLLMTier(Settings.of(model=MODEL, ec_shared_storage=str(tmp_path)).tiers, MODEL, "float32")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 40x30 is over twice that: PIL refuses to open it
    try:
        with pytest.raises(EngineError) as e:
            asyncio.run(tier.identifiers([MediaItem("image", encode(photo(40, 30, 3), "PNG"), None, "images[0]")]))
        assert (status(e.value), e.value.code) == (400, "unidentified_image")
    finally:
        tier.close()


def test_a_uuid_never_names_another_items_file(tmp_path):
    """A uuid shaped like a content hash (which could be another image's name) is a 400 `invalid_uuid`, and a write
    under an identifier whose file holds another item is a 409 `ec_id_taken` that leaves the file as it was."""
    import asyncio

    from vitserve.service.ground.errors import EngineError
    from vitserve.service.ground.media import MediaItem
    from vitserve.service.ground.settings import Settings
    from vitserve.service.tiers.vllm_tier import VLLMTier

    tier = VLLMTier(
        Settings.of(model=MODEL, ec_shared_storage=str(tmp_path), ec_dtype="float32").tiers, MODEL, "float32"
    )
    image = encode(photo(40, 30, 3), "PNG")
    victim = mm_hash("image", MODEL, data=image)
    try:
        with pytest.raises(EngineError) as e:
            asyncio.run(
                tier.identifiers(
                    [
                        MediaItem("image", image, None, "images[0]"),
                        MediaItem("image", encode(photo(40, 30, 4), "PNG"), victim, "images[1]"),
                    ]
                )
            )
        assert (status(e.value), e.value.code, e.value.param) == (400, "invalid_uuid", "images[1]")
        first = item(rows=6, levels=0)
        asyncio.run(tier.write(["taken"], [Features(*first)]))
        with pytest.raises(EngineError) as e:
            asyncio.run(tier.write(["taken"], [Features(*item(rows=9, levels=0, seed=1))]))
        assert (status(e.value), e.value.code) == (409, "ec_id_taken")
        assert torch.equal(load_file(tmp_path / "taken" / "encoder_cache.safetensors")["ec_cache"], first[0])
    finally:
        tier.close()


def test_the_tier_counts_its_files_and_failed_writes(tmp_path):
    """What /stats and /metrics report of the encoder cache: bytes, files, writes, evictions, and the writes that
    failed (an item too large for --ec-storage-bytes: a 507)."""
    import asyncio

    from vitserve.service.ground.errors import EngineError
    from vitserve.service.ground.settings import Settings
    from vitserve.service.tiers.vllm_tier import VLLMTier

    tier = VLLMTier(
        Settings.of(model=MODEL, ec_shared_storage=str(tmp_path), ec_storage_bytes=2000).tiers, MODEL, "float32"
    )
    try:
        tokens, deepstack = item(rows=6)  # a file of some 850 bytes: two fit
        for name in ("a", "b", "c"):
            asyncio.run(tier.write([name], [Features(tokens, deepstack)]))
        stats = tier.stats()
        size = (tmp_path / "c" / ec_storage.FILE_NAME).stat().st_size
        assert 2000 // size == 2
        assert stats == {
            "limit_bytes": 2000,
            "bytes": 2 * size,
            "files": 2,
            "writes": 3,
            "evictions": 1,
            "write_failures": 0,
        }
        with pytest.raises(EngineError) as e:
            asyncio.run(tier.write(["big"], [Features(*item(rows=100))]))
        assert status(e.value) == 507 and tier.stats()["write_failures"] == 1
    finally:
        tier.close()


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ec")
    for _, url in serving(
        "--model", MODEL, "--load-format", "dummy", "--ec-shared-storage", str(directory), "--ec-dtype", "bfloat16"
    ):
        yield url, directory


def written(path):
    """The file at `path` once it is there (/v1/encode answers without waiting for its files)."""
    wait_until(path.exists, 10, f"{path} written")
    return load_file(path)


def bf16(x: dict) -> torch.Tensor:
    return b64_bf16(x["embeddings"], x["shape"])


@pytest.mark.slow
def test_encode_writes_each_item_under_its_identifier(tier):
    """/v1/encode with --ec-shared-storage: each item's answer names its file (`ec_id`: the uuid given, else vLLM's
    hash of the image's bytes), the file holds exactly the answer's vLLM layout, and a video without a uuid is a
    400 before anything is encoded."""
    from videos import make_video

    url, directory = tier
    image = encode(photo(96, 64, 5), "JPEG")
    video = make_video(30, 10, 160, 120)
    body = {
        "images": [data_uri(image, "image/jpeg")],
        "videos": [data_uri(video, "video/mp4")],
        "layout": "vllm",
        "dtype": "bfloat16",
        "multi_modal_uuids": {"video": ["clip-1"]},
    }
    r = httpx.post(url + "/v1/encode", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [x["ec_id"] for x in data] == [mm_hash("image", MODEL, data=image), "clip-1"]
    for x in data:
        assert torch.equal(written(directory / x["ec_id"] / "encoder_cache.safetensors")["ec_cache"], bf16(x))
    r = httpx.post(url + "/v1/encode", json={"videos": [data_uri(video, "video/mp4")]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "uuid_required"
    for bad in ("../x", ".ec-planted.tmp", mm_hash("image", MODEL, data=encode(photo(96, 64, 6), "JPEG"))):
        r = httpx.post(
            url + "/v1/encode",
            json={"images": [data_uri(image, "image/jpeg")], "multi_modal_uuids": {"image": [bad]}},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_uuid", bad


@pytest.mark.slow
def test_multipart_and_the_client_name_items_by_uuid(tier):
    """Multipart takes `multi_modal_uuids` (JSON text, per modality in the files' order) and the client's `uuids=`
    sends it: a video, which only a uuid names, is written under it; without one, the 400 says how to give one; a
    list of the wrong length is refused."""
    from videos import make_video

    from vitserve.client import Client, VitserveError

    url, directory = tier
    video, image = make_video(20, 10, 128, 96), encode(photo(64, 48, 11), "JPEG")
    with Client(url, timeout=60, retries=0) as client:
        clip = client.encode_videos(video, uuids="mp-clip", layout="vllm", dtype="bfloat16")
        images = client.encode([image, image], uuids=["mp-img", None], layout="vllm", dtype="bfloat16")
        with pytest.raises(VitserveError) as e:
            client.encode_videos([video])
    assert (e.value.status, e.value.code, e.value.param) == (400, "uuid_required", "videos[0]")
    assert "multi_modal_uuids.video" in e.value.message
    assert torch.equal(written(directory / "mp-clip" / "encoder_cache.safetensors")["ec_cache"], clip.embeddings)
    for name, answer in (("mp-img", images[0]), (mm_hash("image", MODEL, data=image), images[1])):
        assert torch.equal(written(directory / name / "encoder_cache.safetensors")["ec_cache"], answer.embeddings)
    r = httpx.post(
        url + "/v1/encode",
        files=[("f", ("v", video)), ("f", ("i", image))],
        data={"multi_modal_uuids": '{"video": ["a", "b"]}'},
        timeout=60,
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "multi_modal_uuids", r.text


@pytest.mark.slow
def test_a_uuid_too_long_for_a_folder_is_named_as_sent(tier):
    """A uuid of 5,000 characters (a string the JSON reader keeps out of the parsed skeleton) is refused with its own
    first characters, not the reader's placeholder."""
    url, _ = tier
    uuid = "very-long-uuid-" + "x" * 5000
    r = httpx.post(
        url + "/v1/encode",
        json={"images": [data_uri(encode(photo(32, 32, 1), "PNG"))], "multi_modal_uuids": {"image": [uuid]}},
        timeout=60,
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "invalid_uuid" and error["param"] == "images[0]"
    assert "very-long-uuid-xxx" in error["message"] and "vitserve-" not in error["message"]
    assert len(error["message"]) < 1000


@pytest.mark.slow
def test_the_proxys_chat_request_is_answered_with_ec_transfer_params(tier):
    """The request vLLM's disaggregated-encoder proxy sends (a user message of media parts with uuids, text between)
    gets what the proxy reads of a producer: per identifier its modality, its indices among the media parts (the
    same image twice: both), its grid, and for a Qwen3-VL video its timestamps; the files match /v1/encode's
    answer for the same items."""
    from videos import make_video

    url, directory = tier
    image, video = encode(photo(80, 72, 9), "PNG"), make_video(20, 10, 128, 96)
    parts = [
        {"type": "image_url", "image_url": {"url": data_uri(image, "image/png")}, "uuid": "img"},
        {"type": "text", "text": "what happens?"},
        {"type": "video_url", "video_url": {"url": data_uri(video, "video/mp4")}, "uuid": "vid"},
        {"type": "image_url", "image_url": {"url": data_uri(image, "image/png")}, "uuid": "img"},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "stream": False}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["ec_transfer_params"]
    reference = httpx.post(
        url + "/v1/encode",
        json={
            "images": [data_uri(image, "image/png")],
            "videos": [data_uri(video, "video/mp4")],
            "layout": "vllm",
            "dtype": "bfloat16",
            "multi_modal_uuids": {"image": ["i2"], "video": ["v2"]},
        },
        timeout=60,
    ).json()["data"]
    assert params["img"] == {
        "modality": "image",
        "item_indices": [0, 2],
        "metadata": {"image_grid_thw": reference[0]["grid_thw"]},
    }
    assert params["vid"] == {
        "modality": "video",
        "item_indices": [1],
        "metadata": {"video_grid_thw": reference[1]["grid_thw"], "timestamps": reference[1]["timestamps"]},
    }
    for name, answer in (("img", reference[0]), ("vid", reference[1])):
        assert torch.equal(load_file(directory / name / "encoder_cache.safetensors")["ec_cache"], bf16(answer))
    bad = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content"
    kwargs = dict(body, mm_processor_kwargs={"do_pan_and_scan": True})
    r = httpx.post(url + "/v1/chat/completions", json=kwargs, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_mm_processor_kwargs"


@pytest.mark.slow
def test_the_chat_endpoint_needs_the_encoder_tier():
    for _, url in serving("--model", MODEL, "--load-format", "dummy"):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "encoder_tier_off"


def chat_body(kwargs=None, part_type="image_url", model=MODEL) -> dict:
    part = {"type": part_type, "image_url": {"url": data_uri(IMAGES[0])}, "uuid": "x"}
    return {"model": model, "messages": [{"role": "user", "content": [part]}]} | (
        {"mm_processor_kwargs": kwargs} if kwargs is not None else {}
    )


@pytest.fixture(scope="module")
def chat_client(encoders, tmp_path_factory):
    with client_for(encoders[MODEL], ec_shared_storage=str(tmp_path_factory.mktemp("ec"))) as c:
        yield c


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_pixels": "many"}, "mm_processor_kwargs.max_pixels"),
        ({"max_pixels": [1]}, "mm_processor_kwargs.max_pixels"),
        ({"max_pixels": {"a": 1}}, "mm_processor_kwargs.max_pixels"),
        ({"images_kwargs": [1]}, "mm_processor_kwargs.images_kwargs"),
        ({"images_kwargs": "max_pixels"}, "mm_processor_kwargs.images_kwargs"),
        ({"videos_kwargs": {"fps": 0}}, "mm_processor_kwargs.videos_kwargs.fps"),
        ({"fps": -1}, "mm_processor_kwargs.fps"),
        ({"fps": "x"}, "mm_processor_kwargs.fps"),
        ({"num_frames": -2}, "mm_processor_kwargs.num_frames"),
        ({"num_frames": "four"}, "mm_processor_kwargs.num_frames"),
        ({"max_frames": -1}, "mm_processor_kwargs.max_frames"),
        ({"max_frames": 0.5}, "mm_processor_kwargs.max_frames"),
        ({"fps": 2, "videos_kwargs": {"num_frames": 4}}, "mm_processor_kwargs"),
    ],
)
def test_mm_processor_kwargs_are_validated_as_the_native_fields(chat_client, kwargs, param):
    """What /v1/encode refuses of these options is a 400 naming the option here too, never a 500."""
    r = chat_client.post("/v1/chat/completions", json=chat_body(kwargs))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_mm_processor_kwargs" and r.json()["error"]["param"] == param


def test_mm_processor_kwargs_become_the_native_options():
    from vitserve.service.api.schemas import ChatRequest
    from vitserve.service.tiers.vllm_tier import chat_options

    options = chat_options(
        ChatRequest.model_validate(
            chat_body({"max_pixels": 50176, "videos_kwargs": {"num_frames": "4", "max_frames": 8}})
        )
    )
    assert (options.max_pixels, options.num_frames, options.max_frames, options.fps) == (50176, 4, 8, None)


def test_a_chat_request_echoes_no_long_value(chat_client):
    """A long part type, mm_processor_kwargs key or model comes back clipped (well past the JSON reader's 4 KB);
    a model that is not the served one is a 404."""
    long = "z" * 100_000
    for body, status, code in (
        (chat_body(part_type=long), 400, "unsupported_content"),
        (chat_body({long: 1}), 400, "unsupported_mm_processor_kwargs"),
        (chat_body({"images_kwargs": {long: 1}}), 400, "unsupported_mm_processor_kwargs"),
        (chat_body(model=long), 404, "model_not_found"),
        (chat_body(model="another-model"), 404, "model_not_found"),
    ):
        r = chat_client.post("/v1/chat/completions", json=body)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text[:500]
        assert len(r.content) < 1000, r.text[:500]
