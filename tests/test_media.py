"""MediaBytes (encoder/media.py): an item's input bytes wherever they lie (a str, a view of a request body, a body
file other processes map) and however they are sent (base64 or raw): its first bytes, all of them, what a decode
worker is sent and reads back, and what a cache key hashes (its pieces, as cache.py documents)."""

import asyncio
import base64
import hashlib
import pickle

import numpy as np
import pytest

from vitserve.encoder.image_errors import InvalidBase64
from vitserve.encoder.media import MediaBytes, MediaHandle, received
from vitserve.encoder.preprocess import PreprocessConfig
from vitserve.service.api.json_body import Text
from vitserve.service.pipeline.cache import CacheKeys

DATA = bytes(range(256)) * 300 + b"tail"  # 76,804 bytes: past a 64 KB head
TEXT = base64.b64encode(DATA).decode()
PREFIX = "data:image/png;base64,"


def expected_key(given, base64_: bool, start: int = 0) -> bytes:
    """The cache key as cache.py documents it, computed from the item as given: the base64's ASCII bytes, or the raw
    bytes: their length, each 512 KiB piece's SHA-256, then how it was sent and the settings."""
    keyed = (
        (given[start:].encode("ascii", "replace") if isinstance(given, str) else bytes(given[start:]))
        if base64_
        else bytes(given)
    )
    digest = hashlib.sha256(len(keyed).to_bytes(8, "big"))
    for at in range(0, max(len(keyed), 1), 512 * 2**10):
        digest.update(hashlib.sha256(keyed[at : at + 512 * 2**10]).digest())
    digest.update(
        f"\0{'base64' if base64_ else 'bytes'}\0m\0{PreprocessConfig().min_pixels}\0"
        f"{PreprocessConfig().max_pixels}\0{0}\0{0}\0".encode()  # the tokens, not widened
    )
    return digest.digest()


@pytest.fixture
def body_file(tmp_path):
    """A request body in a file (as bodies.py writes one) holding a data URI's text at an offset: its path, the
    body's bytes mapped as the server holds them, and where the text starts."""
    body = b'{"images": ["' + (PREFIX + TEXT).encode() + b'"]}'
    path = tmp_path / "body-0"
    path.write_bytes(body)
    start = body.index(b'"', 12) + 1
    return str(path), memoryview(body), start


def cases(body_file):
    """Per location and encoding: (name, MediaBytes, what was given, whether base64, where its payload starts)."""
    path, body, at = body_file
    end = at + len(PREFIX) + len(TEXT)
    view = body[at:end]
    return [
        ("text", MediaBytes(PREFIX + TEXT, len(PREFIX)), PREFIX + TEXT, True, len(PREFIX)),
        ("body view", MediaBytes(view, len(PREFIX)), view, True, len(PREFIX)),
        ("body file", Text(view, (path, at)).skip(len(PREFIX)), view, True, len(PREFIX)),
        ("upload", MediaBytes.of(DATA), DATA, False, 0),
        ("fetched view", MediaBytes(memoryview(DATA), 0, False), memoryview(DATA), False, 0),
    ]


def test_every_location_and_encoding_gives_the_same_bytes_head_and_key(body_file):
    keys = CacheKeys("m")
    for name, media, given, is_base64, start in cases(body_file):
        assert media.base64 is is_base64, name
        assert media.decode() == DATA, name
        for n in (0, 3, 1000, 64 * 2**10, len(DATA) + 10):
            head = media.head(n)  # at least the first n bytes, a bounded prefix (base64: whole quads past them)
            assert head[:n] == DATA[:n] and min(n, len(DATA)) <= len(head) <= n + 192, (name, n)
        assert bytes(media.keyed()) == (TEXT.encode() if is_base64 else DATA), name
        assert keys.key(media, PreprocessConfig(), False) == expected_key(given, is_base64, start), name
        assert media.prefix(4) == (TEXT[:4] if is_base64 else DATA[:4]), name


def test_what_a_worker_is_sent_reads_back_as_the_item_or_its_first_bytes(body_file):
    for name, media, _, is_base64, _ in cases(body_file):
        for end in (None, 1000, 30_001):
            for in_file in (True, False):
                payload = media.payload(end, in_file)
                if name == "body file" and in_file:
                    assert isinstance(payload, MediaHandle)
                    payload = pickle.loads(pickle.dumps(payload))  # (it crosses to the worker pickled)
                elif is_base64:
                    assert callable(payload)  # made when a worker takes the job
                    payload = payload()
                # base64 is cut at the whole quads that hold the first `end` bytes; raw bytes at `end` itself
                want = DATA if end is None else DATA[: -(-end // 3) * 3] if is_base64 else DATA[:end]
                assert received(payload, is_base64) == want, (name, end, in_file)


def test_a_body_file_handle_sends_no_bytes_and_refuses_a_short_file(body_file):
    path, body, at = body_file
    media = Text(body[at : at + len(PREFIX) + len(TEXT)], (path, at)).skip(len(PREFIX))
    handle = media.payload(None)
    assert handle == MediaHandle(path, at + len(PREFIX), len(TEXT), None) and len(handle) == len(TEXT)
    with open(path, "r+b") as f:
        f.truncate(at + 10)
    with pytest.raises(OSError, match="short"):
        handle.decode()


def test_line_broken_base64_and_bad_base64():
    wrapped = "\n".join(TEXT[i : i + 76] for i in range(0, len(TEXT), 76))
    media = MediaBytes(wrapped)
    assert media.head(5000)[:5000] == DATA[:5000] and media.decode() == DATA
    assert DATA.startswith(media.head(2**16))  # whitespace counts against the bounded prefix: fewer bytes, same ones
    assert bytes(media.ascii(3)) == TEXT[:4].encode()  # the quad that holds the first 3 bytes
    assert bytes(media.ascii(200)) == wrapped.encode()  # whitespace within the quads: the whole text
    assert bytes(MediaBytes(TEXT).ascii(3)) == TEXT[:4].encode()  # the quad that holds the first 3 bytes
    with pytest.raises(InvalidBase64):
        MediaBytes("not base64 at all!").decode()
    with pytest.raises(InvalidBase64):
        MediaBytes("%%%%" * 50_000).head(100)


def test_text_reads_its_characters_and_stays_a_view():
    body = bytearray(b'"' + TEXT.encode() + b'"')
    text = Text(memoryview(body)[1:-1])
    assert text.prefix(10) == TEXT[:10] and str(text) == TEXT and text.view.obj is body
    assert text.skip(4).decode() == DATA[3:] and text.skip(4).data is text.data


def test_of_takes_a_json_string_as_base64_and_bytes_as_raw():
    text = MediaBytes.of(PREFIX + TEXT)
    assert text.base64 and text.prefix(5) == "data:" and text.skip(len(PREFIX)).decode() == DATA
    assert not MediaBytes.of(DATA).base64 and MediaBytes.of(DATA).decode() is DATA  # no copy of bytes
    media = MediaBytes(TEXT)
    assert MediaBytes.of(media) is media


def test_a_key_covers_every_piece_and_each_item_of_a_request_gets_its_own():
    """The pieces of several items are hashed together: each item's digests must come back to it, in order, and a
    byte changed in any piece must change the key."""
    keys, cfg, piece = CacheKeys("m"), PreprocessConfig(), 512 * 2**10
    rng = np.random.default_rng(0)
    items = [rng.bytes(n) for n in (0, 1, piece - 1, piece, piece + 1, 3 * piece + 5)]
    got = asyncio.run(keys.keys([MediaBytes(d, 0, False) for d in items], cfg, False))
    for data, key in zip(items, got):
        assert key == expected_key(data, False) == keys.key(MediaBytes(data, 0, False), cfg, False), len(data)
        for at in {0, len(data) // 2, len(data) - 1} if data else ():
            changed = bytearray(data)
            changed[at] ^= 1
            assert keys.key(MediaBytes(bytes(changed), 0, False), cfg, False) != key, (len(data), at)
    assert len(set(got)) == len(got)
