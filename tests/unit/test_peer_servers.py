"""The peer benchmarks' command lines (hearth/bench/peer_servers.py): exact argv, port filled in."""

from __future__ import annotations

import os

from hearth.bench.peer_servers import HEARTH, default_gguf, hearth_argv, llama_argv, vllm_argv, vllm_env
from hearth.bench.server_process import ServerSpec


def test_hearth_argv_takes_the_port_of_its_spec() -> None:
    spec = ServerSpec("h", tuple(hearth_argv("up", ["--workers", "2"])), 8123)
    assert spec.command() == [HEARTH, "up", "--host", "127.0.0.1", "--port", "8123", "--workers", "2"]


def test_llama_argv_unified_kv_flags_sit_before_the_threads() -> None:
    threads = ["-t", str(os.cpu_count())]
    base = ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "{port}", "-c", "4096",
            "-np", "4"]
    assert llama_argv("llama-server", "m.gguf", 4096, 4, extra=["--jinja"]) == [*base, *threads, "--jinja"]
    assert llama_argv("llama-server", "m.gguf", 4096, 4, unified_kv=True, per_slot_context=1024) == [
        *base, "--kv-unified", "--kv-unified-per-slot", "1024", *threads]


def test_vllm_argv_and_env() -> None:
    assert vllm_argv("py", "/hf", 2048, ["--dtype", "bfloat16"]) == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/hf", "--host", "127.0.0.1",
        "--port", "{port}", "--max-model-len", "2048", "--dtype", "bfloat16"]
    assert vllm_env(2) == {"VLLM_CPU_KVCACHE_SPACE": "2",
                           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}


def test_default_gguf_is_the_installed_file() -> None:
    path = default_gguf()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
