"""json_splice: base64 spliced into serialized JSON as bytes gives the bytes the serializer would have written for the
strings themselves, with both serializers the project uses (json.dumps in the client, pydantic's in the server); and
the client's JSON requests carry each item as the server reads it."""

from __future__ import annotations

import base64
import json
import os

from pydantic_core import to_json

from vitserve import client
from vitserve.encoder.json_splice import MARK, MARK_JSON, placeholder, spliced


def test_the_mark_is_written_alike_by_both_serializers():
    assert json.dumps(MARK).encode()[1:-1] == MARK_JSON == to_json(MARK)[1:-1]


def test_spliced_strings_are_what_the_serializer_writes_for_them():
    strings = [base64.b64encode(os.urandom(n)) for n in (0, 1, 2, 3, 4000, 60_001)]
    body = {"input": [placeholder(i) for i in range(len(strings))][::-1], "pooling": "mean", "note": 'a "quote"'}
    whole = {**body, "input": [s.decode() for s in strings][::-1]}
    for dump in (lambda b: json.dumps(b).encode(), to_json):
        assert b"".join(spliced(dump(body), strings)) == dump(whole)
    assert spliced(b'{"a":1}', []) == [b'{"a":1}']


def test_the_clients_json_requests_carry_each_item_as_sent():
    """Bytes go as their base64, URLs as they are (JSON-escaped where they need it), in the items' order."""
    images = [os.urandom(1000), 'https://example.com/a"b\\c?d=é', os.urandom(7)]
    request = client._embed_request(images, "mean", True, 1024, "image")
    assert request["headers"]["content-type"] == "application/json"
    body = json.loads(request["content"])
    assert body["input"] == [base64.b64encode(images[0]).decode(), images[1], base64.b64encode(images[2]).decode()]
    assert (body["pooling"], body["normalize"], body["max_pixels"], body["encoding_format"]) == (
        "mean",
        True,
        1024,
        "base64",
    )
    request = client._encode_request(images, [False, False, True], "bfloat16", True, "tokens", None, [None] * 3)
    body = json.loads(request["content"])
    assert body["images"] == [base64.b64encode(images[0]).decode(), images[1]]
    assert body["videos"] == [base64.b64encode(images[2]).decode()]
    assert request["headers"]["accept"] == "application/octet-stream"
