"""The HTTP edge's body checks and key comparison (hearth/api/edge.py), without a server."""

from __future__ import annotations

import pytest

from hearth.api.edge import MAX_JSON_DEPTH, bearer_matches, decode_json
from hearth.api.protocol import APIError
from hearth.server.serving import wrap_int64


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_nesting_up_to_the_limit_decodes_and_one_more_is_400():
    assert decode_json(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(APIError) as info:
        decode_json(nested(MAX_JSON_DEPTH + 1))
    assert info.value.status == 400 and "nested" in info.value.message
    with pytest.raises(APIError):
        decode_json(b'{"a": ' + nested(100_000) + b"}")  # past the interpreter's recursion limit


@pytest.mark.parametrize("body", [
    b'{"x": NaN}', b'{"x": -Infinity}', b'{"x": 1e999}', b'{"x": ' + b"1" * 5000 + b"}",
    b'{"x": "\\ud800"}', b'{"\\udfff": 1}', b'["ok", ["\\ud83d"]]', b"\xff", b"{",
])
def test_unusable_json_is_400(body):
    with pytest.raises(APIError) as info:
        decode_json(body)
    assert info.value.status == 400


def test_surrogate_pairs_and_plain_text_are_fine():
    assert decode_json(b'{"x": "\\ud83d\\ude00", "y": "caf\xc3\xa9", "z": 1e300}') == \
        {"x": "😀", "y": "café", "z": 1e300}


@pytest.mark.parametrize("header, ok", [
    ("Bearer sekrit", True), ("bearer  sekrit ", True), ("Bearer sekri", False), ("sekrit", False),
    ("Bearer clé".encode().decode("latin-1"), False), ("Basic sekrit", False), ("", False),
])
def test_bearer_matches_compares_bytes(header, ok):
    assert bearer_matches(header, "sekrit") is ok


def test_bearer_matches_a_non_ascii_key_sent_as_utf8():
    sent = "Bearer clé".encode().decode("latin-1")  # how an HTTP server hands over the raw bytes
    assert bearer_matches(sent, "clé") is True and bearer_matches("Bearer cle", "clé") is False


def test_seed_plus_offset_stays_int64():
    assert wrap_int64(2**63 - 1 + 1) == -(2**63)
    assert wrap_int64(-(2**63)) == -(2**63) and wrap_int64(5) == 5
