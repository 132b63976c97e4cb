"""Long strings outside JSON's serializers and parsers: a placeholder stands for each in the small structure the
serializer writes or the parser reads, and the strings themselves are spliced in (or kept) as bytes, never scanned
for escapes nor copied into a str. Base64 has nothing to escape, so its bytes go between the quotes as they are.

The server renders answers so (service/api/outputs.py) and parses long request strings so
(service/api/json_body.py); the client builds its JSON requests so (client.py): a 600 KB image's base64 costs
json.dumps 1.6 ms and splicing 0.01 ms on a 2-core machine.
"""

from __future__ import annotations

import json
import secrets

MARK = "\x00vitserve-" + secrets.token_hex(8) + "-"  # a placeholder's prefix: no other value can hold one
MARK_JSON = MARK.replace("\x00", "\\u0000").encode()  # the prefix as a JSON serializer writes it (its NUL escaped)


def placeholder(index: int) -> str:
    """The string value that stands for the `index`-th long string."""
    return f"{MARK}{index}"


def spliced(text: bytes, strings: list[bytes]) -> list[bytes]:
    """Serialized JSON `text` whose `placeholder(i)` string values hold strings[i] instead (ASCII with nothing to
    escape, e.g. base64), in pieces: the text between them, and the strings as they are."""
    if not strings:
        return [text]
    pieces = text.split(MARK_JSON)
    parts = [pieces[0]]
    for piece in pieces[1:]:
        index, rest = piece.split(b'"', 1)
        parts += [strings[int(index)], b'"' + rest]
    return parts


def json_bytes(value, strings: list[bytes]) -> bytes:
    """`value` as compact JSON (json.dumps) with its `placeholder(i)` strings holding strings[i]: a request body."""
    return b"".join(spliced(json.dumps(value, separators=(",", ":")).encode(), strings))
