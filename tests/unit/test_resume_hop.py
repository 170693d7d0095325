"""The resume hop (`kv_transfer.role == "resume"`): parsing, the worker-role rules and the
engine's checks of a resumed output's ids, with exact refusals."""

import json

import pytest

from hearth.config import Role
from hearth.api.pd_protocol import (MAX_RESUME_TOKEN_IDS, ResumeHop, parse_kv_transfer,
                                       resume_hop)
from hearth.engine.refusals import RequestRejected
from hearth.engine.stops import RESUME_PARAM, check_resume
from hearth.server.pd import parse_hop
from hearth.api.protocol import APIError

VOCAB = 100


def test_resume_hop_round_trips_from_the_router_helper():
    field = json.loads(json.dumps(resume_hop([5, 6, 7], [1, 2])))
    assert field == {"role": "resume", "output_token_ids": [5, 6, 7], "prompt_token_ids": [1, 2]}
    assert parse_kv_transfer(field) == ResumeHop([5, 6, 7], [1, 2])
    bare = json.loads(json.dumps(resume_hop([])))  # nothing sent yet: a plain re-run
    assert parse_kv_transfer(bare) == ResumeHop([], None)
    assert parse_kv_transfer({"role": "resume", "output_token_ids": [3]}) == ResumeHop([3])


@pytest.mark.parametrize("field, message", [
    ({"role": "resume"}, "missing required field `output_token_ids`"),
    ({"role": "resume", "output_token_ids": "1,2"}, "Expected `array`"),
    ({"role": "resume", "output_token_ids": ["1"]}, r"Expected `int`, got `str` - at `\$.output"),
    ({"role": "resume", "output_token_ids": [-1]}, ">= 0"),
    ({"role": "resume", "output_token_ids": [2**31]}, "<= 2147483647"),
    ({"role": "resume", "output_token_ids": [1.5]}, "Expected `int`"),
    ({"role": "resume", "output_token_ids": [1], "first_token_id": 1}, "unknown field"),
    ({"role": "resume", "output_token_ids": [1], "prompt_token_ids": [1, -2]}, ">= 0"),
    ({"role": "resume", "output_token_ids": [1] * (MAX_RESUME_TOKEN_IDS + 1)}, "length <="),
])
def test_malformed_resume_hops_are_refused(field, message):
    with pytest.raises(RequestRejected, match=message) as info:
        parse_kv_transfer(field)
    assert info.value.param == "kv_transfer"


def test_an_empty_prompt_is_refused_by_name():
    with pytest.raises(RequestRejected, match="must not be empty") as info:
        parse_kv_transfer({"role": "resume", "output_token_ids": [1], "prompt_token_ids": []})
    assert info.value.param == "kv_transfer.prompt_token_ids"


@pytest.mark.parametrize("role", [Role.BOTH, Role.DECODE])
def test_a_worker_that_decodes_takes_a_resume_hop(role):
    hop = parse_hop(role, {"role": "resume", "output_token_ids": [4, 5],
                           "prompt_token_ids": [1, 2, 3]}, 1, VOCAB)
    assert hop.is_resume and hop.spec is None  # no connector involved
    assert (hop.output_token_ids, hop.prompt_token_ids) == ([4, 5], [1, 2, 3])
    plain = parse_hop(role, {"role": "resume", "output_token_ids": []}, 1, VOCAB)
    assert plain.prompt_token_ids is None and plain.output_token_ids == []


def api_error(role: Role, field: dict, n: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        parse_hop(role, field, n, VOCAB)
    assert info.value.status == 400
    return info.value


def test_resume_hop_refusals_at_the_worker_edge():
    ok = {"role": "resume", "output_token_ids": [4]}
    error = api_error(Role.PREFILL, ok)
    assert error.param == "kv_transfer" and "role is 'prefill'" in error.message
    assert api_error(Role.BOTH, ok, n=2).param == "n"
    error = api_error(Role.DECODE, {**ok, "prompt_token_ids": [1, VOCAB]})
    assert error.param == "kv_transfer.prompt_token_ids" and "vocabulary" in error.message
    # the PD hops keep their rules: a monolithic worker refuses them
    error = api_error(Role.BOTH, {"role": "prefill", "transfer_id": "x"})
    assert error.param == "kv_transfer" and "--role prefill or decode" in error.message


@pytest.mark.parametrize("ids, num_prompt, max_tokens, message, code", [
    ([1, VOCAB], 4, 8, f"token id {VOCAB} outside the vocabulary", None),
    ([1, 2, 3], 4, 2, r"3 tokens, more than max_tokens \(2\)", None),
    ([1] * 5, 12, 99, "exceed the model's context length", "context_length_exceeded"),
    ([1] * 4, 10, 99, "or the KV cache", "context_length_exceeded"),  # 15 > 14 slots
])
def test_check_resume_refusals(ids, num_prompt, max_tokens, message, code):
    with pytest.raises(RequestRejected, match=message) as info:
        check_resume(ids, num_prompt, max_tokens, VOCAB, max_model_len=16, num_pool_tokens=14)
    assert (info.value.param, info.value.code) == (RESUME_PARAM, code)


def test_check_resume_accepts_an_output_that_fills_the_context_exactly():
    check_resume([1] * 4, 12, 4, VOCAB, max_model_len=16, num_pool_tokens=32)
