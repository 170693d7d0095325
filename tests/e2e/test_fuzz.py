"""Fuzzing the HTTP edge: hostile and careless bodies for chat, completions and /tokenize, sent to
a worker and to a router in front of it. Every answer must be a 2xx or a 4xx with the OpenAI
error body: never a 5xx, an error event inside a 200 stream, a dropped connection or a hang.
Afterwards the worker holds no request and its KV pool is whole.

Each test gathers the outcome of every example and asserts once at the end, so one run reports
all failing inputs (and the counts) instead of stopping at the first. Run with `-s` to see the
tally per target. Examples are bounded (count, sizes, max_tokens <= 4), so the file stays fast.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import MODEL, Server

EXAMPLES = 25
REQUEST_TIMEOUT = 60  # an answer slower than this is counted as a hang
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- values ------------------------------------------------------------------------------------

HUGE = st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**70, -(2**63) - 1, 10**30, -(10**40)])
INTS = st.integers(-3, 5) | HUGE | st.integers()
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 1, -1, 0.5, 2.0])
NASTY_TEXT = st.sampled_from([
    "\ud800", "a\udfffb", "<|im_start|>system\n", "<|im_end|>", "{{ 7 * 7 }}", "{% if %}", "\x00",
    "\u202e", "😀" * 3, " " * 50, "\\", '"', "null", "",
])
TEXT = st.text(max_size=30) | NASTY_TEXT
LEAF = st.none() | st.booleans() | INTS | FLOATS | TEXT
ANY = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
VOCAB = 49152  # the default model's
NAME = st.text("abcdefgh_", min_size=1, max_size=8)

# ---- well-formed pieces ------------------------------------------------------------------------

PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
TOOL_CALL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAME, "arguments": st.sampled_from(['{"a": 1}', "{}", "not json", '{"a": "\\ud800"}'])})},
    optional={"id": NAME})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
     "content": TEXT | st.lists(PART, max_size=2) | st.none()},
    optional={"name": NAME, "tool_calls": st.lists(TOOL_CALL, max_size=2), "tool_call_id": NAME})
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
LENGTH = st.integers(0, 40) | st.sampled_from(["two", [1], 2.5, None, -1])
PROPERTY = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "integer", "number", "boolean", "array", "object", "bogus"])},
    optional={"minLength": LENGTH, "maxLength": LENGTH, "enum": st.lists(LEAF, max_size=3),
              "pattern": st.sampled_from(["^a+$", "(", "[", "\\d{2,3}"]), "minimum": INTS | TEXT,
              "items": st.just({"type": "string"}), "format": st.sampled_from(["date", "email", "x"])})
SCHEMA = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "object", "string", "array", "bogus"])},
    optional={"properties": st.dictionaries(NAME, PROPERTY, max_size=3),
              "required": st.lists(NAME, max_size=2), "additionalProperties": st.booleans(),
              "minProperties": LENGTH})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAME}, optional={"parameters": SCHEMA, "description": TEXT})})
RESPONSE_FORMAT = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.fixed_dictionaries(
    {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": NAME, "schema": SCHEMA})})
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)

# ---- bodies: a well-formed request, then up to two fields made hostile --------------------------

SAMPLING = {  # field: (well-formed, hostile); both endpoints take these
    "model": (st.just(MODEL), TEXT),
    "temperature": (st.floats(0, 2), FLOATS | ANY),
    "top_p": (st.floats(0.05, 1), FLOATS | ANY),
    "n": (st.integers(1, 2), st.integers(-1, 0) | HUGE | ANY),
    "seed": (st.integers(-(2**63), 2**63 - 1), INTS | ANY),
    "stop": (TEXT | st.lists(TEXT, max_size=3), ANY),
    "stream": (st.booleans(), ANY),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), ANY),
    "presence_penalty": (st.floats(-2, 2), FLOATS | ANY),
    "frequency_penalty": (st.floats(-2, 2), FLOATS | ANY),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
                   st.dictionaries(TEXT | st.integers(-5, 2**70).map(str), FLOATS, max_size=3) | ANY),
    "top_k": (st.integers(-1, 50), INTS | ANY),
    "min_p": (st.floats(0, 1), FLOATS | ANY),
    "repetition_penalty": (st.floats(0.5, 2), FLOATS | ANY),
    "ignore_eos": (st.booleans(), ANY),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(INTS, max_size=3) | ANY),
    "skip_special_tokens": (st.booleans(), ANY),
    "user": (TEXT, ANY),
    "kv_transfer": (st.none(), st.dictionaries(TEXT, LEAF, max_size=2) | ANY),
}
MAX_TOKENS = (st.integers(1, 4), st.sampled_from([0, -1, 10**6, 2**31, 2**63, 2**70]) | TEXT | FLOATS)
CHAT_FIELDS = {
    **SAMPLING,
    "messages": (MESSAGES, st.lists(MESSAGE, max_size=0) | ANY),
    "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS,
    "logprobs": (st.booleans(), ANY), "top_logprobs": (st.integers(0, 5), INTS | ANY),
    "response_format": (RESPONSE_FORMAT, ANY),
    "tools": (st.lists(TOOL, max_size=2), ANY),
    "tool_choice": (st.sampled_from(["none", "auto", "required"]), st.just("bogus") | ANY
                    | st.just({"type": "function", "function": {"name": "nope"}})),
    "parallel_tool_calls": (st.booleans(), ANY),
    "add_generation_prompt": (st.booleans(), ANY),
    "chat_template_kwargs": (st.dictionaries(st.sampled_from(["x", "bos_token", "date"]), LEAF, max_size=2),
                             st.dictionaries(st.sampled_from(["special_tokens", "tools", "messages", "self",
                                                              "template", "add_generation_prompt"]), ANY,
                                             min_size=1, max_size=2) | ANY),
}
COMPLETION_FIELDS = {
    **SAMPLING,
    "prompt": (TEXT | TOKEN_IDS | st.lists(TEXT, min_size=1, max_size=2)
               | st.lists(TOKEN_IDS, min_size=1, max_size=2),
               st.lists(st.integers(-2, 2 * VOCAB) | HUGE, max_size=6)
               | st.lists(st.integers(0, VOCAB - 1) | HUGE, min_size=16, max_size=20) | ANY),
    "max_tokens": MAX_TOKENS,
    "echo": (st.booleans(), ANY), "logprobs": (st.integers(0, 3), INTS | ANY),
    "suffix": (st.none(), TEXT | ANY), "best_of": (st.none(), INTS | ANY),
    "response_format": (RESPONSE_FORMAT, ANY),
}
TOKENIZE_FIELDS = {
    "model": (st.just(MODEL), TEXT),
    "prompt": (TEXT, ANY), "messages": (MESSAGES, ANY), "tools": (st.lists(TOOL, max_size=2), ANY),
    "add_special_tokens": (st.booleans(), ANY), "add_generation_prompt": (st.booleans(), ANY),
}
REQUIRED = {"/v1/chat/completions": ("messages", "max_tokens"), "/v1/completions": ("prompt", "max_tokens"),
            "/tokenize": ()}


def request_bodies(fields: dict, required: tuple[str, ...]) -> st.SearchStrategy:
    """A well-formed body (`required` fields always present) with 0-2 fields made hostile."""
    base = st.fixed_dictionaries({k: fields[k][0] for k in required},
                                 optional={k: v[0] for k, v in fields.items() if k not in required})
    hostile_keys = st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)
    hostile = hostile_keys.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k][1] for k in keys}))
    return st.tuples(base, hostile).map(lambda pair: {**pair[0], **pair[1]})


RAW = st.sampled_from([  # bodies no JSON encoder writes
    b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"max_tokens": ' + b"9" * 5000 + b', "messages": [], "prompt": "x"}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\udc00", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "max_tokens": 2, "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "max_tokens": 1e999}',
]) | st.binary(max_size=40)


def encoded(body: dict) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity literals on purpose


def bodies(path: str) -> st.SearchStrategy:
    fields = {"/v1/chat/completions": CHAT_FIELDS, "/v1/completions": COMPLETION_FIELDS,
              "/tokenize": TOKENIZE_FIELDS}[path]
    body = request_bodies(fields, REQUIRED[path]).map(encoded)
    return st.one_of(body, body, body, RAW)  # mostly requests, sometimes raw bytes


# ---- outcomes ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes of one test's examples; `failures` keeps the inputs that broke a rule."""

    counts: Counter = field(default_factory=Counter)
    failures: list[tuple[str, bytes, str]] = field(default_factory=list)

    def record(self, outcome: str, body: bytes, detail: str = "") -> None:
        self.counts["cases"] += 1
        self.counts[outcome] += 1
        if outcome not in ("2xx", "4xx"):
            self.failures.append((outcome, body[:300], detail[:300]))


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} \
        and isinstance(error["message"], str) and bool(error["message"])


def send(target: Server, path: str, body: bytes, tally: Tally) -> None:
    headers = {**target.headers(), "content-type": "application/json"}
    try:
        with httpx.stream("POST", target.url + path, content=body, headers=headers,
                          timeout=REQUEST_TIMEOUT) as response:
            text = response.read().decode("utf-8", errors="replace")
    except httpx.TimeoutException as exc:
        tally.record("hang", body, repr(exc))
        return
    except httpx.TransportError as exc:
        tally.record("dropped", body, repr(exc))
        return
    status = response.status_code
    if status >= 500:
        tally.record("5xx", body, text)
    elif status >= 400:
        tally.record("4xx" if is_openai_error(response) else "4xx_not_openai", body, text)
    elif "text/event-stream" in response.headers.get("content-type", ""):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        broken = not events or events[-1] != "[DONE]" or any('"error"' in e[:20] for e in events)
        tally.record("stream_error" if broken else "2xx", body, text)
    else:
        tally.record("2xx", body)


def check(target: Server, worker: Server, tally: Tally, name: str) -> None:
    report = worker.wait_idle_and_whole()
    print(f"\nfuzz {name}: {dict(tally.counts)}")
    assert tally.failures == [], tally.failures[:5]
    assert (report["num_requests_inflight"], report["num_waiting"], report["num_running"]) == (0, 0, 0)
    assert report["kv_pool_is_whole"] is True


PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize"]


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_worker(server, path):
    tally = Tally()

    @FUZZ
    @given(bodies(path))
    def run(body: bytes) -> None:
        send(server, path, body, tally)

    run()
    check(server, server, tally, f"worker {path}")


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_router(edge_router, server, path):
    tally = Tally()

    @FUZZ
    @given(bodies(path))
    def run(body: bytes) -> None:
        send(edge_router, path, body, tally)

    run()
    check(edge_router, server, tally, f"router {path}")
