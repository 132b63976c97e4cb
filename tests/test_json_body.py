"""JSON bodies read by a scan for their strings: the strings found are the parser's, long image strings come back as
views of the body equal to what the parser would give, and the bound on values holds whatever their type."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from fastapi.exceptions import RequestValidationError

from vitserve.service.api.http_errors import ServiceError
from vitserve.service.api.json_body import LONG, Scan, Text, parse_body
from vitserve.service.api.landing import LAND
from vitserve.service.api.schemas import EmbeddingRequest, EncodeRequest


def reference_spans(text: bytes) -> list[tuple[int, int]]:
    """A byte-by-byte JSON string scanner: where each string opens and closes."""
    spans, inside, escape, start = [], False, False, 0
    for i, c in enumerate(text):
        if inside:
            if escape:
                escape = False
            elif c == 0x5C:
                escape = True
            elif c == 0x22:
                inside = False
                spans.append((start, i))
        elif c == 0x22:
            inside, start = True, i
    return spans


def scanned(text: bytes, limit: int = 10**6, pieces: int = 1, rng=random) -> Scan | None:
    """`text` scanned as it would arrive in `pieces` chunks cut at random; None when over the limit."""
    scan, cuts = Scan(limit), sorted(rng.sample(range(len(text) + 1), min(pieces - 1, len(text) + 1)))
    for end in [*cuts, len(text)]:
        if not scan.feed(text, end):
            return None
    return scan


def reference_commas(text: bytes) -> int:
    spans, inside = reference_spans(text), bytearray(len(text))
    for start, end in spans:
        inside[start : end + 1] = b"\x01" * (end + 1 - start)
    return sum(1 for c, i in zip(text, inside) if c == 0x2C and not i)


def test_the_scan_matches_a_byte_by_byte_scanner_however_the_text_arrives():
    rng = random.Random(1)
    for _ in range(20000):
        text = bytes(rng.choice(b'"\\,ab') for _ in range(rng.randint(0, 40)))
        scan = scanned(text, pieces=rng.randint(1, 6), rng=rng)
        assert scan.spans == reference_spans(text), text
        if scan._open is None:  # (an unterminated string holds the commas after its quote)
            assert scan.commas == reference_commas(text), text
    for value in ["plain", 'quote " inside', "back\\slash", '\\\\\\"', "", "x" * 5000 + '\\"' + "y"]:
        text = json.dumps({"a": value, "b": [1, value]}).encode()
        scan = scanned(text, 100, pieces=3, rng=rng)
        assert scan.spans == reference_spans(text) and scan.commas == 2
    assert scanned(b'"a" "b" "c"', 5) is None  # more quotes than the limit
    assert scanned(b"[" + b"0," * 6 + b"0]", 5) is None  # more commas than the limit
    assert scanned(b"[" + b"0," * 5 + b"0]", 5).commas == 5


def test_a_long_run_of_backslashes_costs_little():
    text = b'{"user": "' + b"\\\\" * 5_000_000 + b'", "input": ["a"]}'
    start = time.perf_counter()
    assert len(scanned(text, 100, pieces=50).spans) == 4
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("field, model", [("input", EmbeddingRequest), ("images", EncodeRequest)])
def test_long_image_strings_are_views_of_the_body_and_equal_the_parsed_ones(field, model):
    plain = "data:image/png;base64," + "QUJD" * 4000
    escaped = "QUJD" * 2000 + "\\/" + "QUJD" * 2000  # a JSON encoder that escapes slashes (PHP's)
    short = "QUJD"
    body = json.dumps({field: [plain, short, escaped], "model": "m" * (LONG + 10)}).encode()
    parsed = parse_body(model, body, 64, (field,))
    items = getattr(parsed, field)
    expected = json.loads(body)[field]
    assert isinstance(items[0], Text) and str(items[0]) == expected[0]
    assert items[0].view.obj is body  # the body's own bytes, not a copy
    assert items[1] == expected[1] and items[2] == expected[2] and isinstance(items[2], str)
    assert parsed.model == "m" * (LONG + 10)  # a long string elsewhere is decoded as the parser does
    single = parse_body(EmbeddingRequest, json.dumps({"input": plain}).encode(), 64, ("input",))
    assert isinstance(single.input, Text) and str(single.input) == plain


@pytest.mark.parametrize("item", [b"0", b"null", b"{}", b"[]", b"true", b'"a"'])
def test_more_values_than_images_and_fields_is_413_whatever_their_type(item):
    body = b'{"images": [' + b",".join([item] * 200) + b"]}"
    with pytest.raises(ServiceError) as e:
        parse_body(EncodeRequest, body, 64, ("images",))
    assert e.value.status == 413 and e.value.code == "too_many_images"
    ok = b'{"images": [' + b",".join([b'"QUJD"'] * 64) + b'], "dtype": "float16"}'
    assert len(parse_body(EncodeRequest, ok, 64, ("images",)).images) == 64


def test_errors_stay_the_parsers_and_name_no_placeholder():
    long = "QUJD" * 2000
    with pytest.raises(ServiceError) as e:
        parse_body(EncodeRequest, b'{"images": ["' + long.encode() + b'"', 64, ("images",))
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(RequestValidationError) as e:  # a long string where an integer goes
        parse_body(EncodeRequest, json.dumps({"images": ["QUJD"], "max_pixels": long}).encode(), 64, ("images",))
    assert e.value.errors()[0]["loc"] == ("max_pixels",)
    with pytest.raises(RequestValidationError) as e:  # a long unknown key stays a key
        parse_body(EncodeRequest, json.dumps({"images": ["QUJD"], long: 1}).encode(), 64, ("images",))
    assert e.value.errors()[0]["loc"] == (long,)


def test_long_strings_in_a_dict_come_back_as_sent():
    """A uuid over LONG bytes in `multi_modal_uuids` (a dict of lists) is the uuid sent, never a placeholder."""
    uuid = "u" * (LONG + 100)
    body = json.dumps({"images": ["QUJD", "QUJD"], "multi_modal_uuids": {"image": [uuid, None]}}).encode()
    assert parse_body(EncodeRequest, body, 64, ("images",)).multi_modal_uuids == {"image": [uuid, None]}


class Arriving:
    """A request whose body arrives in chunks (what read_json reads: its headers, scope and stream); `landing`: as
    the HTTP protocol does with a buffer handed over (`vitserve.land`), the chunks after that are written into it and
    come as views of it where they lie."""

    def __init__(self, body: bytes, chunk: int, declared: bool = True, landing: bool = False):
        self.headers = {"content-length": str(len(body))} if declared else {}
        self.pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
        self.scope = {"extensions": {LAND: self.land}} if landing else {}
        self.buffer, self.landed = None, 0

    def land(self, buffer) -> bool:
        self.buffer = memoryview(buffer).cast("B")
        return True

    async def stream(self):
        at = 0
        for piece in self.pieces:
            if self.buffer is None:
                yield piece
            else:
                self.buffer[at : at + len(piece)] = piece
                self.landed += len(piece)
                yield self.buffer[at : at + len(piece)]
            at += len(piece)


@pytest.mark.parametrize("declared,landing", [(True, False), (False, False), (True, True)])
def test_a_large_body_read_as_it_arrives_gives_what_the_parser_gives(declared, landing):
    """A declared body of a MiB or more is read into a mapping, a chunked one into a growing buffer: either way its
    images are views of it equal to the parsed strings, and its other values are the parser's."""
    from vitserve.service.api.json_body import read_json
    from vitserve.service.decoding.bodies import SHARED as MAPPED

    images = ["data:image/png;base64," + "QUJD" * (MAPPED // 3), "QUJD" * 3000, "QUJD"]
    body = json.dumps({"images": images, "dtype": "bf16", "model": "m"}).encode()
    assert len(body) > MAPPED
    arriving = Arriving(body, 65536 + 7, declared, landing)
    parsed = asyncio.run(read_json(arriving, EncodeRequest, 64, ("images",)))
    assert [str(x) for x in parsed.images] == images and isinstance(parsed.images[0], Text)
    assert arriving.landed == (len(body) if landing else 0)  # a declared body's buffer is handed over at once
    assert parsed.dtype == "bfloat16" and parsed.model == "m"
    bomb = b'{"images": [' + b",".join([b"0"] * 200_000) + b"]}"
    request = Arriving(bomb, 65536, declared)
    with pytest.raises(ServiceError) as e:
        asyncio.run(read_json(request, EncodeRequest, 64, ("images",)))
    assert e.value.status == 413  # at its first chunk: the rest is never read
