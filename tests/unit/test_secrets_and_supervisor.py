"""Secret flags (hearth/flags.py `read_secrets`) and the supervisor's restart rule
(hearth/router/supervisor.py) with real, short-lived child processes: no model, seconds."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import pytest

from hearth.flags import read_secrets
from hearth.router.router_config import SupervisorConfig
from hearth.router.supervisor import Supervisor, WorkerSpec


def namespace(**values) -> argparse.Namespace:
    base = dict(api_key=None, api_key_file=None, kv_secret=None, kv_secret_file=None)
    return argparse.Namespace(**{**base, **values})


def test_secret_comes_from_its_file_then_the_environment_then_the_flag(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"HEARTH_API_KEY": "from-env", "HEARTH_KV_SECRET": "kv-from-env"}

    a = namespace(api_key_file=str(key_file))
    read_secrets(a, env)
    assert (a.api_key, a.kv_secret) == ("from-file", "kv-from-env")

    a = namespace(api_key="from-flag")
    read_secrets(a, env)
    assert a.api_key == "from-flag"

    a = namespace()
    read_secrets(a, {})
    assert (a.api_key, a.kv_secret) == (None, None)
    assert not hasattr(a, "worker_api_key")  # only the secrets this command has


def test_bad_secret_sources_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--api-key or --api-key-file, not both"):
        read_secrets(namespace(api_key="k", api_key_file=str(tmp_path / "k")), {})
    with pytest.raises(ValueError, match="--kv-secret-file: cannot read"):
        read_secrets(namespace(kv_secret_file=str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_secrets(namespace(api_key_file=str(tmp_path / "empty")), {})


def spec(tmp_path, code: str) -> WorkerSpec:
    return WorkerSpec("both", 1, [sys.executable, "-c", code], {**os.environ, "SECRET": "s3cret"},
                      log_path=tmp_path / "worker.log")


def test_a_worker_that_keeps_exiting_is_restarted_then_given_up_on(tmp_path):
    config = SupervisorConfig(max_restarts=2, window_seconds=600, backoff_seconds=0.01)
    supervisor = Supervisor([spec(tmp_path, "import sys; sys.exit(3)")], config)
    gave_up = threading.Event()
    supervisor.start()
    supervisor.watch(on_give_up=gave_up.set)
    try:
        assert gave_up.wait(60)
        state = supervisor.state()
        assert state == {"gave_up": True, "workers": [
            {"name": "both-0", "role": "both", "state": "failed", "restarts": 2,
             "last_exit_code": 3}]}
    finally:
        supervisor.stop()


def test_the_worker_gets_its_environment_and_stop_ends_it(tmp_path):
    code = "import os, time; print(os.environ['SECRET'], flush=True); time.sleep(600)"
    supervisor = Supervisor([spec(tmp_path, code)], SupervisorConfig())
    supervisor.start()
    [worker] = supervisor.workers
    log = tmp_path / "worker.log"
    try:
        deadline = time.monotonic() + 30
        while log.read_text() != "s3cret\n" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.read_text() == "s3cret\n"  # the secret arrived in its environment
        assert "s3cret" not in " ".join(worker.spec.command)
    finally:
        supervisor.stop()
    assert worker.process.returncode == -15 and worker.state == "stopped"
