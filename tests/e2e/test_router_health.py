"""The router's view of worker health under a slow `/load`: a late load report is not a dead
worker. The peer is a real tiny-model worker behind a real proxy (tests/e2e/slow_load_proxy.py)
that delays only `/load`, as a saturated CPU does; the router is a real `hearth route` process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from hearth.models.random_checkpoint import write_random_checkpoint
from tests.e2e.conftest import REPO, Server, free_port, start_server, wait_for

HEALTH_TIMEOUT = 0.5  # the router's --health-timeout: polls slower than this are "slow"
LOAD_DELAY = 3.0  # what the proxy makes every /load wait once slowed down
PROMPT = " ".join(f"t{i}" for i in range(5, 25))




def start_process(cmd: list[str], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """worker <- proxy (slow /load on demand) <- router (--worker PROXY)."""
    tmp = tmp_path_factory.mktemp("slow-load")
    tiny = str(write_random_checkpoint(tmp / "tiny", num_layers=2))
    worker = start_server(tmp, "--model", tiny, "--num-kv-blocks", "64", "--max-num-seqs", "4")
    proxy_port, router_port = free_port(), free_port()
    proxy = start_process([sys.executable, "-m", "tests.e2e.slow_load_proxy", "--upstream",
                           worker.url, "--port", str(proxy_port)], tmp / "proxy.log")
    router = Server(start_process(
        [sys.executable, "-m", "hearth.cli", "route", "--worker", f"http://127.0.0.1:{proxy_port}",
         "--model", tiny, "--port", str(router_port), "--health-interval", "0.2",
         "--health-timeout", str(HEALTH_TIMEOUT)], tmp / "router.log"),
        f"http://127.0.0.1:{router_port}", None, tmp / "router.log")
    try:
        wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200,
                 "router healthy", router.log_path)
        yield router, f"http://127.0.0.1:{proxy_port}", Path(tiny).name
    finally:
        router.stop()
        proxy.terminate()
        proxy.wait()
        worker.stop()


def test_slow_load_polls_keep_the_worker_in_and_requests_flowing(stack):
    router, proxy, model = stack
    client = router.client()
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    first = next(stream)  # a request in flight while the polls turn slow

    httpx.post(proxy + "/_proxy/slow", params={"seconds": LOAD_DELAY}, timeout=5)
    # More slow polls than the router ever tolerated before (3), each past --health-timeout.
    stats = lambda: httpx.get(proxy + "/_proxy/stats", timeout=5).json()  # noqa: E731
    wait_for(lambda: stats()["num_slow_load_polls"] >= 5, "five slow /load polls", router.log_path)

    chunks = [first, *stream]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    [endpoint] = httpx.get(router.url + "/load", timeout=5).json()["endpoints"]
    assert endpoint["healthy"] is True and endpoint["failures"] == 0
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 8
    assert "load report stale" in router.log_path.read_text()
