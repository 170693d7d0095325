"""The kv_transfer JSON extension and the descriptor: round trips and exact refusals."""

import json
from dataclasses import replace

import pytest

from hearth.kv_transfer.descriptor import (DESCRIPTOR_VERSION, KVDescriptor, check_against,
                                      descriptor_from_json, descriptor_to_json, tokens_hash)
from hearth.api.pd_protocol import (DecodeHop, PrefillHop, decode_request_field,
                                       decode_result, parse_kv_transfer, prefill_result, to_engine)
from hearth.config import Role
from hearth.engine.kv.block_hash import hash_blocks
from hearth.engine.kv.transfer_api import KVCacheGeometry, KVTransfer

PROMPT = list(range(100, 137))  # 37 tokens: 2 full blocks of 16 + 5
GEOMETRY = KVCacheGeometry(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=3,
                           head_dim=8, dtype="float32")


def make_descriptor(**changes) -> dict:
    hashes = hash_blocks(PROMPT, 16)
    d = descriptor_to_json(KVDescriptor(
        version=DESCRIPTOR_VERSION, transfer_id="x1", transport="tcp", host="127.0.0.1",
        port=4000, num_tokens=len(PROMPT), block_size=16, block_ids=[9, 4, 7],
        block_hashes=hashes, tokens_hash=tokens_hash(PROMPT, hashes, 16), num_layers=2,
        num_kv_heads=3, head_dim=8, dtype="float32", bytes_per_block=GEOMETRY.bytes_per_block,
        expires_at=1e9))
    d.update(changes)
    return json.loads(json.dumps(d))  # exactly what crosses HTTP


def test_router_round_trip_from_prefill_response_to_engine_spec():
    field = prefill_result("x1", PROMPT, 504, -0.25, 32, make_descriptor())
    assert field["num_prompt_tokens"] == 37 and field["first_token_logprob"] == -0.25
    decode_field = json.loads(json.dumps(decode_request_field(field)))
    assert decode_field["role"] == "decode" and decode_field["transfer_id"] == "x1"
    hop = parse_kv_transfer(decode_field)
    assert isinstance(hop, DecodeHop) and hop.prompt_token_ids == PROMPT
    spec = to_engine(hop)
    assert spec == KVTransfer("decode", "x1", descriptor_from_json(make_descriptor()), 504)
    assert isinstance(spec.descriptor, KVDescriptor) and spec.role is Role.DECODE
    check_against(spec.descriptor, GEOMETRY, PROMPT)
    assert decode_result(5, 1, 100) == {"num_transferred_tokens": 5, "num_transferred_blocks": 1,
                                        "num_transferred_bytes": 100}


def test_prefill_hop_parses():
    hop = parse_kv_transfer({"role": "prefill", "transfer_id": "abc"})
    assert hop == PrefillHop("abc") and to_engine(hop) == KVTransfer("prefill", "abc")


@pytest.mark.parametrize("field, message", [
    ({"role": "middle", "transfer_id": "a"}, "kv_transfer"),
    ({"role": "prefill"}, "transfer_id"),
    ({"role": "prefill", "transfer_id": ""}, "non-empty"),
    ({"role": "prefill", "transfer_id": "x" * 65}, "at most 64 bytes"),
    ({"role": "prefill", "transfer_id": "a", "extra": 1}, "extra"),
    ({"role": "decode", "prompt_token_ids": [], "first_token_id": 1,
      "descriptor": make_descriptor()}, "empty"),
    ({"role": "decode", "prompt_token_ids": [1], "first_token_id": "1",
      "descriptor": make_descriptor()}, "int"),
    ({"role": "decode", "prompt_token_ids": [1], "first_token_id": 1,
      "descriptor": make_descriptor(transfer_id="a"), "transfer_id": "b"}, "differs"),
    ({"role": "decode", "prompt_token_ids": [1], "first_token_id": 1, "descriptor": {}},
     "descriptor"),
    ({"role": "decode", "prompt_token_ids": [1], "first_token_id": 1,
      "descriptor": make_descriptor(port=0)}, "port"),
])
def test_malformed_fields_are_refused(field, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer(field)


@pytest.mark.parametrize("changes, message", [
    (dict(version=2), "version"),
    (dict(block_ids=[1, 2]), "block_ids"),
    (dict(block_hashes=[1]), "one hash per full block"),
    (dict(port=0), "port"),
    (dict(num_tokens="37"), "num_tokens"),
])
def test_inconsistent_descriptors_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        descriptor_from_json(make_descriptor(**changes))


def test_descriptor_must_match_prompt_and_geometry():
    d = descriptor_from_json(make_descriptor())
    check_against(d, GEOMETRY, PROMPT)
    with pytest.raises(ValueError, match="another prompt"):  # differs only in the partial block
        check_against(d, GEOMETRY, PROMPT[:-1] + [7])
    with pytest.raises(ValueError, match="num_tokens"):
        check_against(d, GEOMETRY, PROMPT + [7])
    with pytest.raises(ValueError, match="KV layout"):
        check_against(d, KVCacheGeometry(2, 64, 16, 3, 8, "bfloat16"), PROMPT)


@pytest.mark.parametrize("scaled", ["int8", "fp8_e4m3"])
def test_a_descriptor_of_another_kv_dtype_is_refused_naming_both(scaled):
    """An int8 / fp8 decode worker (rows of 64 values + a 4-byte scale: head_dim 68) and a
    float32 prefill worker's descriptor: refused before any byte moves, saying which flag to
    align. So is the other scaled format's, though its blocks have the very same size."""
    geometry = KVCacheGeometry(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=3,
                               head_dim=68, dtype=scaled)
    assert geometry.bytes_per_block == 2 * 2 * 16 * 3 * 68
    with pytest.raises(ValueError, match=f"KV layout differs.*float32, this worker's {scaled} "
                                         f".*same --kv-cache-dtype"):
        check_against(descriptor_from_json(make_descriptor()), geometry, PROMPT)
    other = "fp8_e4m3" if scaled == "int8" else "int8"
    theirs = replace(geometry, dtype=other)
    d = descriptor_from_json(make_descriptor(dtype=other, head_dim=68,
                                             bytes_per_block=theirs.bytes_per_block))
    with pytest.raises(ValueError, match=f"{other}, this worker's {scaled}"):
        check_against(d, geometry, PROMPT)


def test_descriptor_stays_one_type_from_export_to_the_decode_engine():
    """The path a descriptor takes, each hop with its real codec: engine core -> server
    (msgpack RequestOutput), prefill response (JSON), router (PrefillResult -> DecodeHop),
    decode request (JSON), decode server -> engine core (msgpack AddRequest)."""
    import msgspec

    from hearth.engine.core_messages import AddRequest, FrameCodec, FromCore, StepOutputs, ToCore
    from hearth.engine.request import RequestOutput
    from hearth.engine.sampling_params import SamplingParams
    from hearth.engine.stats import EngineStats
    from hearth.router.pd_fields import PrefillDone, decode_body

    exported = descriptor_from_json(make_descriptor())
    up = FrameCodec(FromCore)
    frame = up.encode(StepOutputs([RequestOutput("r", [504], "x", True, kv_descriptor=exported)],
                                  EngineStats()))
    output = up.decode_body(frame[4:]).outputs[0]
    assert isinstance(output.kv_descriptor, KVDescriptor) and output.kv_descriptor == exported

    response = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 37, "completion_tokens": 1},
                "kv_transfer": prefill_result("x1", PROMPT, 504, None, 0, output.kv_descriptor)}
    done = PrefillDone.from_response("http://p", json.loads(json.dumps(response)), chat=False)
    assert isinstance(done.kv_transfer, DecodeHop) and done.kv_transfer.descriptor == exported
    body = json.loads(json.dumps(decode_body({"prompt": "hi"}, done.kv_transfer)))

    spec = to_engine(parse_kv_transfer(body["kv_transfer"]))
    down = FrameCodec(ToCore)
    add = down.decode_body(down.encode(AddRequest("r", PROMPT, SamplingParams(max_tokens=4),
                                                  spec))[4:])
    assert add.kv_transfer == spec and add.kv_transfer.descriptor == exported
    assert add.kv_transfer.role is Role.DECODE and add.kv_transfer.first_token_id == 504
    assert msgspec.to_builtins(add.kv_transfer.descriptor) == make_descriptor()


def test_a_prefill_response_with_a_malformed_descriptor_is_the_workers_bug():
    from hearth.router.hops import HopError
    from hearth.router.pd_fields import PrefillDone

    field = prefill_result("x1", PROMPT, 504, None, 0, descriptor_from_json(make_descriptor()))
    response = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 37, "completion_tokens": 1},
                "kv_transfer": {**field, "descriptor": {"transfer_id": "x1"}}}
    with pytest.raises(HopError, match="malformed prefill response.*descriptor"):
        PrefillDone.from_response("http://p", response, chat=False)
