"""The engine-core loop's contract, over a real socketpair, with a scripted stand-in engine.

(The real engine behind the real loop is covered end to end in tests/e2e.)
"""

from __future__ import annotations

import socket
import struct
import threading

import msgspec
import pytest

from hearth.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddResult,
    BlockingChannel,
    ChannelClosed,
    FromCore,
    LoadReply,
    QueryLoad,
    Shutdown,
    StepOutputs,
    ToCore,
)
from hearth.engine.core_process import EngineCore
from hearth.engine.refusals import Rejection, RequestRejected
from hearth.engine.request import RequestOutput
from hearth.engine.sampling_params import GuidedSpec, SamplingParams


class ScriptedEngine:
    """Each request produces `length` tokens, one per step; "boom" makes step() raise once."""

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.explode_once = False
        self.admissions = []  # this stand-in never defers a request for its grammar
        self.produced = 0

    def is_waiting_for_grammar(self, request_id):
        return False

    def add_request(self, request_id, prompt_token_ids, params):
        if not prompt_token_ids:
            raise RequestRejected("prompt", "prompt: must contain at least one token")
        if request_id == "boom":
            self.explode_once = True
        self.requests[request_id] = 0

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def fatal_error(self):
        return None

    def has_unfinished(self):
        return bool(self.requests) or bool(self.aborted)

    def step(self):
        if self.explode_once:
            self.explode_once = False
            raise RuntimeError("kernel fault")
        outputs = [RequestOutput(r, [], "", True, "abort") for r in self.aborted]
        self.aborted = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            self.produced += 1
            done = self.requests[request_id] >= self.length
            outputs.append(RequestOutput(request_id, [7], "x", done, "length" if done else None))
            if done:
                del self.requests[request_id]
        return outputs

    def stats(self, expert_load=True):
        from hearth.engine.stats import EngineStats

        # a MoE engine's per-expert counts: one layer, the tokens produced so far
        counts = {0: [self.produced]} if expert_load else {}
        return EngineStats(num_running=len(self.requests), num_free_blocks=10, num_total_blocks=10,
                           moe_expert_tokens=counts)

    def kv_pool_is_whole(self):
        return not self.requests


@pytest.fixture
def core_pair():
    core_sock, server_sock = socket.socketpair()
    engine = ScriptedEngine()
    core = EngineCore(engine, BlockingChannel(core_sock, ToCore))
    thread = threading.Thread(target=core.serve, daemon=True)
    thread.start()
    server = BlockingChannel(server_sock, FromCore)
    yield engine, server
    server.send(Shutdown())
    thread.join(timeout=5)
    assert not thread.is_alive()
    core_sock.close()
    server_sock.close()


def receive_until_finished(server: BlockingChannel, request_ids: set[str]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {r: [] for r in request_ids}
    unfinished = set(request_ids)
    while unfinished:
        message = server.recv()
        if isinstance(message, StepOutputs):
            for output in message.outputs:
                outputs[output.request_id].append(output)
                if output.finished:
                    unfinished.discard(output.request_id)
    return outputs


def test_add_step_finish(core_pair):
    _, server = core_pair
    server.send(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    assert server.recv() == AddResult("a", None)
    outputs = receive_until_finished(server, {"a"})["a"]
    assert [o.new_text for o in outputs] == ["x", "x", "x"] and outputs[-1].finish_reason == "length"


def test_step_outputs_carry_expert_counts_when_a_request_ends_not_every_token(core_pair):
    """Per-expert counts (DeepSeek-V3: 58 x 256 of them) ride the first step's outputs, then
    only those of a step where a request ends (or a second later): exact totals once a request
    is answered, no per-token cost."""
    engine, server = core_pair
    engine.length = 5
    server.send(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    assert server.recv() == AddResult("a", None)
    reports = []
    while len(reports) < 5:
        message = server.recv()
        if isinstance(message, StepOutputs):
            reports.append(message.stats.moe_expert_tokens)
    assert reports[0] == {0: [1]}  # the first report of the process
    assert reports[1:4] == [{}, {}, {}]  # no news within the second
    assert reports[4] == {0: [5]}  # the request ended: the exact total


def test_rejected_request_is_an_add_result_with_the_error(core_pair):
    _, server = core_pair
    server.send(AddRequest("bad", [], SamplingParams()))
    result = server.recv()
    assert isinstance(result, AddResult)
    assert result.rejection == Rejection("prompt: must contain at least one token", param="prompt")
    server.send(QueryLoad(1, check_pool=True))
    report = server.recv()
    assert isinstance(report, LoadReply) and report.kv_pool_is_whole is True


def test_step_exception_fails_requests_in_flight_and_the_loop_survives(core_pair):
    _, server = core_pair
    server.send(AddRequest("boom", [1], SamplingParams()))
    assert server.recv().rejection is None
    failed = receive_until_finished(server, {"boom"})["boom"][-1]
    assert failed.finish_reason == "error" and "kernel fault" in failed.error
    server.send(AddRequest("after", [1], SamplingParams()))  # the loop still serves
    assert server.recv().rejection is None
    assert receive_until_finished(server, {"after"})["after"][-1].finish_reason == "length"


def test_abort_reports_abort(core_pair):
    engine, server = core_pair
    engine.length = 10**9
    server.send(AddRequest("long", [1], SamplingParams()))
    assert server.recv().rejection is None
    server.send(AbortRequests(["long", "unknown-id"]))
    assert receive_until_finished(server, {"long"})["long"][-1].finish_reason == "abort"


def test_messages_round_trip_and_reject_garbage():
    a, b = socket.socketpair()
    sender, receiver = BlockingChannel(a, FromCore), BlockingChannel(b, ToCore)
    params = SamplingParams(max_tokens=5, stop=("x",), guided=GuidedSpec("regex", "a+"), seed=3)
    BlockingChannel(a, ToCore).send(AddRequest("r", [1, 2], params))
    assert receiver.recv() == AddRequest("r", [1, 2], params)
    body = b"\x93\x01\x02\x03"  # valid msgpack, not a message
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(msgspec.ValidationError):
        receiver.recv()
    bad_params = msgspec.msgpack.encode({"type": 2, "request_id": "r", "prompt_token_ids": [1],
                                         "params": {"max_tokens": 0}})
    a.sendall(struct.pack(">I", len(bad_params)) + bad_params)
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        receiver.recv()
    del sender
    a.close()
    with pytest.raises(ChannelClosed):
        receiver.recv()
    b.close()
