"""`hearth up` end to end: secrets never on a command line, and a supervisor that restarts dead
workers (and gives up, non-zero, on one that keeps dying).

Every stack runs a tiny random-weight model (written here), so a worker starts in seconds.
Waits are polls with a deadline on what the stack reports (`/health`, the workers' own /health,
the process exit), never sleeps standing in for an event.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from hearth.models.random_checkpoint import write_random_checkpoint
from tests.e2e.conftest import EXACT_FLAGS, REPO, free_port, wait_for
from tests.e2e.test_pd import process_tree

CLIENT_KEY = "client-key-5f0e1c"
PROMPT = " ".join(f"t{i}" for i in range(5, 45))  # 40 tokens of the tiny word tokenizer
DEADLINE = 120.0


@dataclass
class Stack:
    process: subprocess.Popen
    url: str
    log_path: Path
    model: str

    def health(self) -> tuple[int, dict]:
        response = httpx.get(self.url + "/health", timeout=5)
        return response.status_code, response.json()

    def client(self, api_key: str = CLIENT_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def complete(self, **kwargs) -> openai.types.Completion:
        return self.client().completions.create(model=self.model, prompt=PROMPT, max_tokens=6,
                                                temperature=0, **kwargs)

    def exited(self) -> bool:
        return self.process.poll() is not None

    def supervised(self) -> dict[str, dict]:
        """/health's supervisor view by worker name (decode-0, ...): state, restarts, exit code."""
        return {w["name"]: w for w in self.health()[1]["supervisor"]["workers"]}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()




def start_up(tmp: Path, model: str, *flags: str, env: dict | None = None,
             wait: bool = True, exact: bool = True) -> Stack:
    """`hearth up` with test-sized limits; `exact`: with conftest.EXACT_FLAGS before `flags`."""
    port = free_port()
    log_path = tmp / f"up-{port}.log"
    cmd = [sys.executable, "-m", "hearth.cli", "up", "--model", model, "--port", str(port),
           "--num-kv-blocks", "64", "--max-num-seqs", "4", "--health-interval", "0.3",
           "--restart-backoff", "0.1", "--log-dir", str(tmp / f"workers-{port}"),
           *(EXACT_FLAGS if exact else ()), *flags]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    stack = Stack(process, f"http://127.0.0.1:{port}", log_path, Path(model).name)
    if wait:
        wait_for(lambda: stack.exited() or stack.health()[0] == 200, "stack healthy", stack.log_path)
        assert process.poll() is None, f"hearth up exited:\n{log_path.read_text()[-4000:]}"
    return stack


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", num_layers=2))


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory, tiny):
    """1 prefill + 1 decode worker; the router's client key comes from the environment."""
    stack = start_up(tmp_path_factory.mktemp("up"), tiny, "--prefill", "1", "--decode", "1",
                     env={"HEARTH_API_KEY": CLIENT_KEY})
    yield stack
    stack.stop()


def cmdline(pid: int) -> str:
    """The process's argv as one line ("" once it is gone: a worker may exit while we look)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def maps(pid: int) -> str:
    """The process's memory map ("" once it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in raw if b"=" in entry)


def worker_pids(stack: Stack, role: str | None = None) -> list[int]:
    """The stack's worker (HTTP) processes: all, or those of a prefill/decode role."""
    pids = [p for p in process_tree(stack.process.pid) if "hearth.cli serve " in cmdline(p)]
    return [pid for pid in pids if role is None or f"--role {role} " in cmdline(pid)]


def worker_url(pid: int) -> str:
    argv = cmdline(pid).split()
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def worker_healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=5).status_code == 200


# ---- secrets ---------------------------------------------------------------------------------


def test_no_secret_on_any_command_line_and_auth_still_holds(pd_stack):
    pids = worker_pids(pd_stack)
    assert len(pids) == 2
    worker_key = {environ(pid)["HEARTH_API_KEY"] for pid in pids}
    kv_secret = {environ(pid)["HEARTH_KV_SECRET"] for pid in pids}
    assert len(worker_key) == 1 and len(kv_secret) == 1  # one key and one secret for the stack
    secrets = {CLIENT_KEY, *worker_key, *kv_secret}
    assert all(len(s) >= 16 for s in secrets) and len(secrets) == 3
    for pid in process_tree(pd_stack.process.pid):
        line = cmdline(pid)
        assert not [s for s in secrets if s in line], line

    # The router asks clients for the key from the environment; the workers for theirs.
    with pytest.raises(openai.AuthenticationError):
        pd_stack.client(api_key="wrong").completions.create(model=pd_stack.model, prompt=PROMPT,
                                                            max_tokens=2)
    decode = worker_url(worker_pids(pd_stack, "decode")[0])
    assert httpx.get(decode + "/load", timeout=10).status_code == 401
    key = {"Authorization": f"Bearer {worker_key.pop()}"}
    before = httpx.get(decode + "/load", headers=key, timeout=10).json()
    response = pd_stack.complete()
    assert response.usage.completion_tokens == 6 or response.choices[0].finish_reason == "stop"
    after = httpx.get(decode + "/load", headers=key, timeout=10).json()
    # The KV crossed from prefill to decode: the transport authenticated with the secret.
    assert after["num_transferred_tokens"] > before["num_transferred_tokens"]
    assert after["num_kv_transfer_failures"] == before["num_kv_transfer_failures"]


# ---- supervision -----------------------------------------------------------------------------


def test_killed_worker_is_restarted_on_its_port_and_the_stack_serves_again(pd_stack):
    [pid] = worker_pids(pd_stack, "decode")
    url, before = worker_url(pid), pd_stack.supervised()["decode-0"]
    os.kill(pid, signal.SIGKILL)

    def restarted():
        w = pd_stack.supervised()["decode-0"]
        new = worker_pids(pd_stack, "decode")
        return (w["restarts"] == before["restarts"] + 1 and w["last_exit_code"] == -signal.SIGKILL
                and new and new[0] != pid and worker_url(new[0]) == url and worker_healthy(url)
                and pd_stack.health()[0] == 200)

    wait_for(restarted, "the decode worker restarted and healthy", pd_stack.log_path)
    response = pd_stack.complete()
    assert response.usage.completion_tokens >= 1
    assert "restarting it in" in pd_stack.log_path.read_text()


def test_worker_that_keeps_dying_makes_up_exit_non_zero(tmp_path, tiny):
    stack = start_up(tmp_path, tiny, "--prefill", "0", "--decode", "0", "--workers", "1",
                     "--max-restarts", "1", "--restart-window", "600")
    try:
        [first] = worker_pids(stack)
        url = worker_url(first)
        os.kill(first, signal.SIGKILL)

        def restarted_once():
            pids = worker_pids(stack)
            return (stack.supervised()["both-0"]["restarts"] == 1 and pids and pids[0] != first
                    and worker_healthy(worker_url(pids[0])) and pids[0])

        second = wait_for(restarted_once, "the first restart", stack.log_path)
        assert worker_url(second) == url
        os.kill(second, signal.SIGKILL)
        wait_for(stack.exited, "hearth up exiting", stack.log_path)
        assert stack.process.returncode == 1
        assert "giving up" in stack.log_path.read_text()
    finally:
        stack.stop()


def test_worker_that_never_starts_makes_up_exit_non_zero(tmp_path):
    stack = start_up(tmp_path, str(tmp_path / "no-such-model"), "--prefill", "0", "--decode", "0",
                     "--workers", "1", wait=False)
    try:
        wait_for(stack.exited, "hearth up exiting", stack.log_path)
        assert stack.process.returncode == 1
        log = stack.log_path.read_text()
        # One clear line with the worker's log tail, not a traceback of hearth up itself.
        assert "both worker" in log and "before it was healthy" in log
        assert "hearth/router/up.py" not in log
    finally:
        stack.stop()


# ---- the packed-weight cache (--weight-cache, issue 42) ----------------------------------------


def test_a_pd_pair_on_one_host_packs_once_and_maps_one_file(tmp_path):
    """Two workers of one GGUF started together: one packs and writes the cache file, the
    other waits on its lock and maps it; both engines map the same file, and the pair serves."""
    from hearth.models.loader import resolve_builtin
    from hearth.models.random_gguf import write_random_gguf
    from tests.model.test_blocks_only import TINY

    gguf = write_random_gguf(tmp_path / "tiny-q4km.gguf", TINY,
                             resolve_builtin("smollm2-135m-instruct"), "q4_k_m", seed=5,
                             context_length=4096)
    cache = tmp_path / "weights"
    stack = start_up(tmp_path, str(gguf), "--prefill", "1", "--decode", "1", "--quantization",
                     "gguf", "--weight-cache", str(cache))
    try:
        stack.model = stack.client().models.list().data[0].id
        assert stack.complete().usage.completion_tokens >= 1
        [packed] = cache.glob("*.bin")
        logs = "".join(p.read_text() for p in tmp_path.glob("workers-*/*"))
        assert logs.count("weight cache miss") == 1 and logs.count("weight cache hit") == 1
        mapping = [pid for pid in process_tree(stack.process.pid) if str(packed) in maps(pid)]
        assert len(mapping) == 2  # the two engine processes
    finally:
        stack.stop()
