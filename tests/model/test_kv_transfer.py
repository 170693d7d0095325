"""Prefill/decode disaggregation between two real engines over the TCP transport on loopback.

The prefill engine computes each prompt and samples the first token; the decode engine pulls
the KV it lacks and continues. Greedy PD output must equal the reference (the golden file, which
the monolithic engine matches in test_greedy_parity), the decode engine must compute none of the
prompt tokens it received, only missing blocks may cross the wire, and every failure path
(expired lease, reject, dead peer, wrong secret) must end with whole pools on both sides.
"""

import json
import socket
import threading
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from hearth.config import KVTransferConfig
from hearth.kv_transfer.connector import DisaggConnector
from hearth.kv_transfer.tcp_transport import TransferClient
from hearth.kv_transfer.peers import PeerAllowlist
from hearth.kv_transfer.wire import SERVER, HEADER_BYTES, Header, MsgType, proof, recv_exact, send_header
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.engine import LLMEngine
from hearth.engine.kv.cache import cdiv
from hearth.engine.sampling_params import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())
CASES = GOLDEN["cases"]
BLOCK = 16
SECRET = "test-secret"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(models, role: str, clock=None) -> LLMEngine:
    config = replace(models.config(num_blocks=96),
                     kv_transfer=KVTransferConfig(role=role, secret=SECRET, lease_seconds=30))

    def factory(cfg, kv_cache, geometry):
        return DisaggConnector(cfg, kv_cache, geometry, clock=clock or FakeClock())
    return models.engine(config, connector_factory=factory)


@pytest.fixture(scope="module")
def pd(models):
    """(prefill engine, decode engine, the prefill side's lease clock)."""
    clock = FakeClock()
    prefill, decode = make_engine(models, "prefill", clock), make_engine(models, "decode")
    yield prefill, decode, clock
    prefill.close()
    decode.close()


@pytest.fixture
def fresh(pd):
    """Both engines idle, whole and with empty prefix caches, so block counts are exact."""
    prefill, decode, clock = pd
    for engine in (prefill, decode):
        assert engine.kv_pool_is_whole()
        engine.pool.reset_cache()
    return pd


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine) -> dict:
    """Step until idle; the outputs of each request, concatenated."""
    outs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def prefill_all(engine: LLMEngine, prompts: dict) -> dict:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy(1), KVTransfer("prefill", transfer_id=f"x-{rid}"))
    finals = {rid: outs[-1] for rid, outs in run(engine).items()}
    for out in finals.values():
        assert out.finished and out.error is None and out.kv_descriptor is not None
    return finals


def decode_all(engine: LLMEngine, prompts: dict, firsts: dict, max_tokens: int) -> dict:
    """request id -> (all output tokens incl. the first, final output)."""
    for rid, ids in prompts.items():
        first = firsts[rid]
        engine.add_request(rid, ids, greedy(max_tokens), KVTransfer(
            "decode", descriptor=first.kv_descriptor, first_token_id=first.new_token_ids[0]))
    result = {}
    for rid, outs in run(engine).items():
        assert outs[-1].error is None
        tokens = firsts[rid].new_token_ids + [t for o in outs for t in o.new_token_ids]
        result[rid] = (tokens, outs[-1])
    return result


def test_pd_greedy_matches_reference_and_decode_computes_no_prompt(fresh):
    prefill, decode, _ = fresh
    cases = CASES[:4]
    prompts = {f"p{i}": c["prompt_ids"] for i, c in enumerate(cases)}
    before = decode.stats()
    firsts = prefill_all(prefill, prompts)
    assert prefill.stats().num_leases_active == 4
    results = decode_all(decode, prompts, firsts, GOLDEN["num_new"])
    num_blocks = sum(cdiv(len(ids), BLOCK) for ids in prompts.values())
    after = decode.stats()
    for (rid, ids), case in zip(prompts.items(), cases):
        tokens, final = results[rid]
        assert tokens == case["output_ids"]
        assert final.num_transferred_tokens == len(ids)
        assert final.num_transferred_blocks == cdiv(len(ids), BLOCK)
    assert after.num_computed_prompt_tokens == before.num_computed_prompt_tokens
    assert after.num_transferred_tokens - before.num_transferred_tokens == sum(
        len(ids) for ids in prompts.values())
    assert after.num_transferred_blocks - before.num_transferred_blocks == num_blocks
    assert (after.num_transferred_bytes - before.num_transferred_bytes
            == num_blocks * firsts["p0"].kv_descriptor.bytes_per_block)
    # every decode acknowledged: the prefill side's leases are gone and its pool is whole
    assert prefill.stats().num_leases_active == 0
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_next_turn_pulls_only_blocks_the_decode_side_lacks(fresh):
    prefill, decode, _ = fresh
    case, extra = CASES[0], CASES[1]["prompt_ids"][1:]
    turn1 = {"t1": case["prompt_ids"]}
    firsts = prefill_all(prefill, turn1)
    (tokens, final), = decode_all(decode, turn1, firsts, 12).values()
    assert tokens == case["output_ids"][:12]
    # turn 2 = turn 1's prompt and answer plus a new message; the decode side holds the full
    # blocks of turn 1's prompt + 11 computed answer tokens (37 + 11 = 3 blocks)
    turn2 = {"t2": case["prompt_ids"] + tokens + extra}
    held = (len(case["prompt_ids"]) + 11) // BLOCK
    assert held == 3
    before = decode.stats().num_computed_prompt_tokens
    firsts = prefill_all(prefill, turn2)
    (_, final), = decode_all(decode, turn2, firsts, 2).values()
    assert final.num_cached_tokens == held * BLOCK
    assert final.num_transferred_blocks == cdiv(len(turn2["t2"]), BLOCK) - held
    assert final.num_transferred_tokens == len(turn2["t2"]) - held * BLOCK
    assert decode.stats().num_computed_prompt_tokens == before
    # the same prompt again: only its partial last block is missing on the decode side
    again = {"t3": turn2["t2"]}
    firsts = prefill_all(prefill, again)
    (_, final), = decode_all(decode, again, firsts, 2).values()
    num_tokens = len(again["t3"])
    assert final.num_transferred_blocks == cdiv(num_tokens, BLOCK) - num_tokens // BLOCK == 1
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_fully_cached_prompt_pulls_nothing_and_only_acknowledges(fresh):
    prefill, decode, _ = fresh
    case = CASES[3]
    prompts = {"f": case["prompt_ids"]}
    assert len(case["prompt_ids"]) % BLOCK == 0  # no partial block
    for _ in range(2):
        firsts = prefill_all(prefill, prompts)
        (tokens, final), = decode_all(decode, prompts, firsts, 3).values()
        assert tokens == case["output_ids"][:3]
    assert final.num_transferred_blocks == 0 and final.num_cached_tokens == len(case["prompt_ids"])
    assert prefill.stats().num_leases_active == 0  # released by the ACK alone
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_expired_lease_releases_blocks_and_decode_recomputes(fresh):
    prefill, decode, clock = fresh
    case = CASES[2]
    prompts = {"e": case["prompt_ids"]}
    firsts = prefill_all(prefill, prompts)
    assert not prefill.kv_pool_is_whole()
    clock.now += 31  # past --kv-lease-seconds
    assert prefill.kv_pool_is_whole() and prefill.stats().num_leases_active == 0
    before = decode.stats()
    (tokens, final), = decode_all(decode, prompts, firsts, 6).values()
    assert tokens == case["output_ids"][:6]  # recomputed locally: still the reference output
    after = decode.stats()
    assert final.num_transferred_blocks == 0
    assert after.num_kv_transfer_failures == before.num_kv_transfer_failures + 1
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == len(
        case["prompt_ids"])
    assert decode.kv_pool_is_whole()


def test_explicit_reject_and_abort_before_pull_release_the_lease(fresh):
    prefill, decode, _ = fresh
    firsts = prefill_all(prefill, {"a": CASES[3]["prompt_ids"], "b": CASES[4]["prompt_ids"]})
    assert prefill.stats().num_leases_active == 2
    descriptor = firsts["a"].kv_descriptor
    client = TransferClient(SECRET)
    with client.connect(descriptor.host, descriptor.port, "x-a") as sock:
        client.finish(sock, "x-a", ack=False)
    assert prefill.stats().num_leases_active == 1
    # a decode request aborted before its transfer starts rejects the lease in the background
    first = firsts["b"]
    decode.add_request("b", CASES[4]["prompt_ids"], greedy(4), KVTransfer(
        "decode", descriptor=first.kv_descriptor, first_token_id=first.new_token_ids[0]))
    decode.abort_request("b")
    assert run(decode)["b"][-1].finish_reason == "abort"
    wait_for(lambda: prefill.stats().num_leases_active == 0)
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


@pytest.mark.parametrize("peer", ["dies_mid_transfer", "gone"])
def test_dead_prefill_peer_falls_back_to_recompute(fresh, peer):
    prefill, decode, clock = fresh
    case = CASES[5]
    prompts = {"d": case["prompt_ids"]}
    firsts = prefill_all(prefill, prompts)
    if peer == "gone":  # a port nothing listens on: connection refused
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        listener = thread = None
    else:
        listener, thread = serve_half_then_die(firsts["d"].kv_descriptor.bytes_per_block)
        port = listener.getsockname()[1]
    firsts["d"].kv_descriptor = msgspec.structs.replace(firsts["d"].kv_descriptor, port=port)
    before = decode.stats()
    (tokens, _), = decode_all(decode, prompts, firsts, 6).values()
    if thread is not None:
        thread.join()
        listener.close()
    assert tokens == case["output_ids"][:6]
    assert decode.stats().num_kv_transfer_failures == before.num_kv_transfer_failures + 1
    assert decode.kv_pool_is_whole()
    clock.now += 31  # the real lease was never read: it expires
    assert prefill.kv_pool_is_whole()


def test_wrong_secret_is_refused_and_decode_recomputes(fresh):
    prefill, decode, clock = fresh
    case = CASES[6]
    prompts = {"w": case["prompt_ids"]}
    firsts = prefill_all(prefill, prompts)
    connector = decode.pd.connector
    good, connector.client = connector.client, TransferClient("not-the-secret", io_timeout=5)
    try:
        (tokens, final), = decode_all(decode, prompts, firsts, 4).values()
    finally:
        connector.client = good
    assert tokens == case["output_ids"][:4] and final.num_transferred_blocks == 0
    assert prefill.stats().num_leases_active == 1  # nothing was read or released
    clock.now += 31
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_untrusted_peer_is_never_contacted_and_decode_recomputes(fresh):
    """A decode hop's descriptor names where the decode worker connects: one naming a peer
    off the allowlist gets no connection at all (the listener below is never dialled), and the
    request recomputes its prompt as after any failed pull."""
    prefill, decode, clock = fresh
    case = CASES[7]
    prompts = {"u": case["prompt_ids"]}
    firsts = prefill_all(prefill, prompts)
    real = firsts["u"].kv_descriptor
    connector = decode.pd.connector
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    good, connector.peers = connector.peers, PeerAllowlist.parse((f"127.0.0.1:{real.port}",))
    try:
        firsts["u"].kv_descriptor = msgspec.structs.replace(real, port=listener.getsockname()[1])
        before = decode.stats()
        (tokens, final), = decode_all(decode, prompts, firsts, 5).values()
        assert tokens == case["output_ids"][:5] and final.num_transferred_blocks == 0
        assert decode.stats().num_kv_transfer_failures == before.num_kv_transfer_failures + 1
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
        # the same allowlist lets the configured peer through
        firsts["u"].kv_descriptor = real
        decode.pool.reset_cache()
        (tokens, final), = decode_all(decode, prompts, firsts, 5).values()
        assert tokens == case["output_ids"][:5]
        assert final.num_transferred_blocks == cdiv(len(case["prompt_ids"]), BLOCK)
    finally:
        connector.peers = good
        listener.close()
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_leases_whose_decode_hop_never_comes_cannot_starve_new_prefills(fresh):
    """Exports nobody pulls (clients that left after the first token) hold at most
    max_leased_fraction of the pool: the oldest lease makes room, new prefills keep running,
    and a decode hop that comes late for an evicted lease recomputes."""
    prefill, decode, clock = fresh
    leases = prefill.pd.connector.leases
    long_prompts = {f"s{i}": [t for c in CASES[i:] + CASES[:i] for t in c["prompt_ids"]][:200]
                    for i in range(8)}  # 13 blocks each; 8 of them would need 104 of 96
    firsts = {}
    for rid, ids in long_prompts.items():
        prefill.add_request(rid, ids, greedy(1), KVTransfer("prefill", transfer_id=f"x-{rid}"))
        for _ in range(1000):  # bounded: a starved prefill would wait here for ever
            if not prefill.has_unfinished():
                break
            for out in prefill.step():
                firsts[out.request_id] = out
        assert firsts[rid].finished and firsts[rid].kv_descriptor is not None, rid
        assert leases.num_held_blocks <= leases.max_blocks == 48
    assert leases.counts["evicted"] > 0 and not leases.contains("x-s0") and leases.contains("x-s7")
    late = {"s0": long_prompts["s0"], "s7": long_prompts["s7"]}
    before = decode.stats()
    results = decode_all(decode, late, {rid: firsts[rid] for rid in late}, 3)
    assert results["s0"][1].num_transferred_blocks == 0  # evicted: recomputed
    assert results["s7"][1].num_transferred_blocks == 13  # still leased: pulled
    assert decode.stats().num_kv_transfer_failures == before.num_kv_transfer_failures + 1
    clock.now += 31
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_bad_specs_are_refused_at_add_request(fresh):
    prefill, decode, _ = fresh
    ids = CASES[0]["prompt_ids"]
    with pytest.raises(ValueError, match="max_tokens=1"):
        prefill.add_request("q", ids, greedy(2), KVTransfer("prefill", transfer_id="q"))
    with pytest.raises(ValueError, match="does not import"):
        prefill.add_request("q", ids, greedy(4), KVTransfer("decode", descriptor={},
                                                            first_token_id=1))
    firsts = prefill_all(prefill, {"q": ids})
    d = firsts["q"].kv_descriptor
    spec = KVTransfer("decode", descriptor=d, first_token_id=firsts["q"].new_token_ids[0])
    with pytest.raises(ValueError, match="another prompt"):
        decode.add_request("q", ids[:-1] + [ids[-1] + 1], greedy(4), spec)
    with pytest.raises(ValueError, match="num_tokens"):
        decode.add_request("q", ids + [5], greedy(4), spec)
    with pytest.raises(ValueError, match="KV layout"):
        decode.add_request("q", ids, greedy(4), replace(spec, descriptor=msgspec.structs.replace(d, head_dim=32)))
    with pytest.raises(ValueError, match="already leased"):
        prefill.add_request("q2", ids, greedy(1), KVTransfer("prefill", transfer_id="x-q"))
    assert decode.kv_pool_is_whole()
    client = TransferClient(SECRET)
    with client.connect(d.host, d.port, "x-q") as sock:
        client.finish(sock, "x-q", ack=False)
    assert prefill.kv_pool_is_whole()


def wait_for(predicate, timeout: float = 10.0) -> None:
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached in time")


def serve_half_then_die(bytes_per_block: int):
    """A transfer peer that knows the secret, sends half of the DATA, then hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        hello = Header.unpack(recv_exact(conn, HEADER_BYTES))
        tid, nonce = hello.transfer_id, b"n" * 32
        send_header(conn, Header(MsgType.HELLO, transfer_id=tid, auth=nonce))
        recv_exact(conn, HEADER_BYTES)
        send_header(conn, Header(MsgType.OK, transfer_id=tid,
                                 auth=proof(SECRET, SERVER, hello.auth, nonce, tid)))
        pull = Header.unpack(recv_exact(conn, HEADER_BYTES))
        recv_exact(conn, pull.payload_bytes)
        size = pull.num_blocks * bytes_per_block
        send_header(conn, Header(MsgType.DATA, num_blocks=pull.num_blocks,
                                 bytes_per_block=bytes_per_block, payload_bytes=size))
        conn.sendall(b"\x7f" * (size // 2))
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    return listener, thread
