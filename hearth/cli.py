"""`hearth serve | route | up | generate | bench`: the one module that reads flags.

Flags map onto the frozen configs in `hearth/config.py` here and nowhere else; so does the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): under a launcher,
rank 0 runs the command as the driver and every other rank serves the driver's steps instead.

Secrets (`--api-key`, `--worker-api-key`, `--kv-secret`) are read here too, by `read_secrets`:
from `--NAME-file`, else from the environment (`SECRET_ENV`), else from the flag itself, which
works but is visible to every local user in `ps` (so it logs a warning). `hearth up` hands its
workers their secrets through the environment, never on their command lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from hearth.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, KVTransferConfig,
                           ModelConfig, ParallelConfig, SchedulerConfig)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint folder, .gguf file, or built-in name (default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "q8_0"],
                   help="decode-path weights: gguf = the file's own blocks (Q4_0/Q4_1/Q8_0), "
                        "q8_0 = requantized; auto = gguf for a GGUF file when hearth's CPU "
                        "kernels run here (docs/formats.md)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache storage (auto: the model dtype; bfloat16 halves it)")
    g.add_argument("--cpu-kernels", default="auto", choices=["auto", "avx512", "avx2", "off"],
                   help="hearth's compiled CPU kernels (built by make setup)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the memory budget")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-waiting", type=int, default=256)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--num-micro-batches", type=int, default=0,
                   help="micro-batches per step in flight through the pipeline (0: one per stage)")
    g.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds a rank waits on a peer before the step fails")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--served-model-name", default=None)
    kv = p.add_argument_group("prefill/decode disaggregation (docs/pd_protocol.md)")
    kv.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    kv.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake"])
    kv.add_argument("--kv-host", default="127.0.0.1",
                    help="interface the KV transfer server binds (prefill role)")
    kv.add_argument("--kv-port", type=int, default=0, help="KV transfer port (0: any free one)")
    kv.add_argument("--kv-advertise-host", default=None,
                    help="address put in KV descriptors (default: --kv-host)")
    kv.add_argument("--kv-secret", default=None,
                    help="shared secret of the KV transfer handshake (visible in ps: prefer "
                         "$HEARTH_KV_SECRET or --kv-secret-file)")
    kv.add_argument("--kv-secret-file", default=None, metavar="PATH",
                    help="read the KV secret from this file")
    kv.add_argument("--kv-lease-seconds", type=float, default=30.0,
                    help="how long exported KV blocks wait for the decode worker")
    kv.add_argument("--kv-peers", default="", help="KV servers a decode worker may pull from: "
                    "comma-separated host:port or host (default: loopback only)")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                          served_model_name=a.served_model_name, seed=a.seed,
                          quantization=a.quantization, cpu_kernels=a.cpu_kernels),
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory_gb=a.kv_cache_memory_gb,
                          kv_cache_dtype=a.kv_cache_dtype,
                          num_blocks=a.num_kv_blocks,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs, max_waiting=a.max_waiting),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size,
                                pipeline_parallel_size=a.pipeline_parallel_size, device=a.device,
                                num_micro_batches=a.num_micro_batches,
                                collective_timeout_s=a.collective_timeout,
                                **_launcher_rendezvous(a)),
        kv_transfer=KVTransferConfig(role=a.role, transport=a.kv_transport, host=a.kv_host,
                                     port=a.kv_port, advertise_host=a.kv_advertise_host,
                                     secret=a.kv_secret or "", lease_seconds=a.kv_lease_seconds,
                                     peers=tuple(p for p in a.kv_peers.split(",") if p.strip())),
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from hearth.engine.llm import LLM
    from hearth.engine.sampling_params import SamplingParams

    t0 = time.monotonic()
    llm = LLM(config=engine_config(a))
    ready = time.monotonic() - t0
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.sampling_seed, ignore_eos=a.ignore_eos)
    try:
        if a.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params)
        else:
            results = llm.generate(list(a.prompts), params)
    finally:
        llm.engine.close()  # with T x P > 1 this shuts the rank processes down
    for prompt, r in zip(a.prompts, results):
        if a.json:
            print(json.dumps(r.to_json(), ensure_ascii=False))
        else:
            print(f"--- {prompt!r} ({r.finish_reason}, {len(r.token_ids)} tokens)\n{r.text}")
    if not a.json:
        print(f"(ready in {ready:.2f}s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hearth", description="LLM serving for AI agents")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation, all prompts as one batch")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(func=cmd_generate)

    for extra in _extra_commands():
        extra(sub, add_engine_args, engine_config)

    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        read_secrets(a)
    except ValueError as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2
    a.launcher = _torchrun_env(os.environ) if hasattr(a, "tensor_parallel_size") else None
    if a.launcher is not None and a.launcher["rank"] != 0:
        return _serve_rank(a)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2


# The secret flags (argparse dests) and the environment variable each one falls back to.
SECRET_ENV = {"api_key": "HEARTH_API_KEY", "worker_api_key": "HEARTH_WORKER_API_KEY",
              "kv_secret": "HEARTH_KV_SECRET"}


def read_secrets(a: argparse.Namespace, environ=None) -> None:
    """Fill every secret flag `a` has (see SECRET_ENV) from its file, its environment variable
    or the flag itself; at most one of the flag and its file may be given. Sets `NAME` on `a`
    (None when no source has it) and drops nothing else."""
    environ = os.environ if environ is None else environ
    for dest, env_name in SECRET_ENV.items():
        if not hasattr(a, dest):
            continue
        flag = "--" + dest.replace("_", "-")
        value, path = getattr(a, dest), getattr(a, dest + "_file", None)
        if value is not None and path is not None:
            raise ValueError(f"give {flag} or {flag}-file, not both")
        if path is not None:
            try:
                value = Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(f"{flag}-file: cannot read {path}: {exc.strerror}") from None
            if not value:
                raise ValueError(f"{flag}-file: {path} is empty")
        elif value is not None:
            logging.getLogger("hearth").warning(
                "%s on the command line is visible to every local user (ps); prefer $%s or "
                "%s-file", flag, env_name, flag)
        else:
            value = environ.get(env_name) or None
        setattr(a, dest, value)


def _torchrun_env(environ) -> dict | None:
    """This process's place in a rank set started by torchrun (or any launcher that sets the
    same variables); None when hearth runs alone and spawns its own ranks."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in environ:
        return None
    return dict(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                local_rank=int(environ.get("LOCAL_RANK", "0")),
                master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(environ.get("MASTER_PORT", "29500")),
                agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _launcher_rendezvous(a: argparse.Namespace) -> dict:
    launcher = getattr(a, "launcher", None)
    if launcher is None:
        return {}
    if launcher["world_size"] != a.tensor_parallel_size * a.pipeline_parallel_size:
        raise ValueError(f"the launcher started {launcher['world_size']} processes, but "
                         f"--tensor-parallel-size x --pipeline-parallel-size is "
                         f"{a.tensor_parallel_size * a.pipeline_parallel_size}")
    return dict(master_addr=launcher["master_addr"], master_port=launcher["master_port"],
                agent_store=launcher["agent_store"])


def _serve_rank(a: argparse.Namespace) -> int:
    """A torchrun rank other than 0: join the driver's rank set and run its steps."""
    from hearth.engine.parallel.worker import RankSpec, serve_rank

    parallel = engine_config(a).parallel  # validates the world size
    launcher = a.launcher
    return serve_rank(RankSpec(
        rank=launcher["rank"], tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        store_host=parallel.master_addr, store_port=parallel.master_port, store_is_master=False,
        device=parallel.device, local_rank=launcher["local_rank"],
        timeout_s=parallel.collective_timeout_s))


def _extra_commands():
    """Sub-commands of the higher layers: each declares its flags on the parser given here."""
    from hearth.router.launch import register as register_router
    from hearth.server.launch import register as register_serve

    return [register_serve, register_router]


if __name__ == "__main__":
    sys.exit(main())
