"""`/load` as one type (hearth/api/load_report.py): what a worker writes is what the router
reads, field for field, and the router refuses a worker whose KV block size differs from its own.

The refusal runs the router's real health checker against a real HTTP server on loopback that
answers `/load` with a LoadReport (a stand-in worker: no model, milliseconds).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest

from hearth.config import Role
from hearth.engine.stats import EngineStats
from hearth.router.endpoints import EndpointPool
from hearth.router.health import HealthChecker, ModelInfo
from hearth.router.router_config import HealthConfig
from hearth.api.load_report import (BlockEvents, LoadReport, TierEvents, decode_load_report,
                                       encode_load_report)


def make_report(block_size: int = 16, **changes) -> LoadReport:
    stats = EngineStats(num_running=2, num_waiting=1, num_free_blocks=90, num_total_blocks=128,
                        num_prefill_tokens_inflight=300, num_decode_tokens_active=700,
                        kv_tiers={"disk": {"blocks": 4.0}})
    fields = dict(msgspec.structs.asdict(stats), role=Role.DECODE, block_size=block_size,
                  num_requests_inflight=3)
    return LoadReport(**{**fields, **changes})


def test_what_the_worker_writes_the_router_reads():
    report = make_report(kv_pool_is_whole=True, block_events=BlockEvents(
        7, [1, 2], [3], tiers={"disk": TierEvents([4], [])}))
    body = encode_load_report(report)
    assert decode_load_report(body) == report
    keys = set(json.loads(body))
    # every engine stat reaches the router under its own name: none is filtered on the way
    assert set(EngineStats.__struct_fields__) <= keys
    assert {"role", "block_size", "num_requests_inflight", "kv_pool_is_whole", "block_events"} <= keys
    assert json.loads(body)["role"] == "decode"


def test_optional_parts_are_absent_unless_asked():
    body = json.loads(encode_load_report(make_report()))
    assert "kv_pool_is_whole" not in body and "block_events" not in body
    body = json.loads(encode_load_report(make_report(block_events=BlockEvents(0))))
    assert body["block_events"] == {"cursor": 0, "stored": [], "evicted": []}  # no "tiers"


@pytest.mark.parametrize("body, message", [
    (b"[]", "load report"),
    (b'{"role": "decode"}', "block_size"),
    (b'{"role": "middle", "block_size": 16}', "role"),
    (b'{"role": "decode", "block_size": "16"}', "block_size"),
    (b'{"role": "decode", "block_size": 16, "block_events": {"stored": []}}', "cursor"),
    (b"not json", "load report"),
])
def test_a_body_that_is_not_a_load_report_is_refused(body, message):
    with pytest.raises(ValueError, match=message):
        decode_load_report(body)


class StandInWorker:
    """A loopback HTTP server answering /load with `self.report` and /v1/models."""

    def __init__(self) -> None:
        self.report = make_report()
        self.raw: bytes | None = None  # answered instead of `report` when set
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/load"):
                    body = owner.raw or encode_load_report(owner.report)
                else:
                    body = json.dumps({"data": [{"id": "m", "max_model_len": 2048}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits for the loop's next look (0.5 s by default)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def worker():
    stand_in = StandInWorker()
    yield stand_in
    stand_in.close()


def test_router_refuses_a_worker_with_another_block_size_until_it_agrees(worker, caplog):
    pool = EndpointPool([], [worker.url], [])
    endpoint = pool[worker.url]

    async def check() -> None:
        async with httpx.AsyncClient() as client:
            await HealthChecker(pool, client, HealthConfig(), None, ModelInfo(), 16).check(endpoint)

    worker.report = make_report(block_size=32)
    asyncio.run(check())
    assert not endpoint.healthy and not pool.is_ready()
    assert endpoint.refusal == endpoint.last_error
    assert "block size is 32 tokens, the router's is 16" in endpoint.refusal
    assert endpoint.report is None and endpoint.cache.capacity != 128  # nothing of it was used
    assert "block size is 32" in caplog.text
    asyncio.run(check())  # still refused, still out
    assert not endpoint.healthy

    worker.report = make_report(block_size=16)  # restarted with the router's block size
    asyncio.run(check())
    assert endpoint.healthy and endpoint.refusal is None and endpoint.last_error is None
    assert endpoint.report == worker.report and endpoint.cache.capacity == 128
    assert endpoint.extra_decode_tokens == 700


def test_router_marks_a_worker_down_when_load_is_not_a_report(worker):
    pool = EndpointPool([], [worker.url], [])
    endpoint = pool[worker.url]
    endpoint.healthy = True
    body = json.loads(encode_load_report(make_report()))
    worker.raw = json.dumps({**body, "block_size": "sixteen"}).encode()  # another /load dialect

    async def check() -> None:
        async with httpx.AsyncClient() as client:
            await HealthChecker(pool, client, HealthConfig(), None, ModelInfo(), 16).check(endpoint)

    asyncio.run(check())
    assert not endpoint.healthy and "not a load report" in endpoint.last_error
    assert endpoint.refusal is None
