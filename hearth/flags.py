"""`hearth`'s command line: the one module that reads flags (and the environment they fall back to).

Every sub-command's flags are declared here and mapped onto frozen configs here and nowhere
else: `engine_config` (hearth/config.py), `server_config` (hearth/server/server_config.py),
`router_config` and `up_config` (hearth/router/router_config.py). The layers below take configs
only: `serve(EngineConfig, ServerConfig)` (hearth/server/launch.py), `route(RouterConfig)`
(hearth/router/launch.py) and `up(UpConfig, ...)` (hearth/router/up.py) parse nothing and never
import this module. `hearth up` starts each worker as `hearth serve` with flags derived from that
worker's configs by `serve_argv`, the same mapping read backwards (and checked by parsing it
back), so no flag is ever forwarded by name. The sub-commands themselves (what each one runs)
are hearth/cli.py's.

The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is read here
too, by `torchrun_env`: under a launcher, rank 0 runs the command as the driver and every other
rank serves the driver's steps instead (hearth/cli.py's `main` decides which).

Secrets (`--api-key`, `--worker-api-key`, `--kv-secret`) are read here too, by `read_secrets`:
from `--NAME-file`, else from the environment (`SECRET_ENV`), else from the flag itself, which
works but is visible to every local user in `ps` (so it logs a warning). `hearth up` hands its
workers their secrets through the environment, never on their command lines.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

from hearth.cluster.cluster_config import STAGE_STRATEGIES, AutoscaleConfig, ClusterConfig
from hearth.config import (DEFAULT_MODEL, SPECULATIVE_METHODS, CacheConfig, EngineConfig,
                           GuidedConfig, KVOffloadConfig, SpeculativeConfig,
                           KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig)
from hearth.models.rope_scaling import parse_rope_scaling
from hearth.router.hops import HopTimeouts
from hearth.router.policy import POLICIES, PolicyConfig
from hearth.api.edge import DoorwayConfig
from hearth.router.router_config import HealthConfig, RouterConfig, SupervisorConfig, UpConfig
from hearth.server.server_config import ServerConfig

SERVE_SPECULATIVE_METHOD = "suffix"  # `hearth serve` and `hearth up` workers; EngineConfig: off


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint folder, .gguf file, or built-in name (default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "q8_0",
                                                                  "gguf-a8", "q8_0-a8"],
                   help="decode-path weights: gguf = the file's own blocks (Q4_0/Q4_1/Q8_0), "
                        "q8_0 = requantized; auto = gguf for a GGUF file when hearth's CPU "
                        "kernels run here (docs/formats.md)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "model", "float32", "bfloat16", "float16", "int8", "fp8"],
                   help="KV cache storage: auto (default) = bfloat16 for a float32 model on "
                        "hearth's CPU kernels (half the bytes, not exact), else the model "
                        "dtype; model = the model dtype (exact); int8 / fp8 (e4m3) = 8-bit "
                        "values with a scale per token and head (~1.9x bf16's tokens per GB, "
                        "not exact)")
    g.add_argument("--prefill-dtype", default="auto", choices=["float32", "bfloat16", "auto"],
                   help="compute dtype of prefill chunks and large batches (steps of more than "
                        "16 rows) of a float32 model: bfloat16 runs ~3x faster prefill where the "
                        "CPU has AMX, not exact; auto (default) = bfloat16 where AMX runs, else "
                        "float32, the exact reference (docs/formats.md)")
    g.add_argument("--cpu-kernels", default="auto", choices=["auto", "avx512amx", "avx512vnni", "avx512", "avx2", "off"],
                   help="hearth's compiled CPU kernels (built by make setup)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--rope-scaling", type=_rope_scaling_json, default=None, metavar="JSON",
                   help="replace the checkpoint's RoPE scaling (as vLLM's --hf-overrides "
                        "rope_scaling), e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 8192}': linear, llama3 or yarn "
                        "(dynamic is refused); the context grows to original x factor, which "
                        "--max-model-len may then ask for")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the memory budget")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-waiting", type=int, default=ServerConfig.max_waiting,
                   help="requests queued beyond the running ones before the server answers 429")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="a Mixture-of-Experts model's experts are split whole across the "
                        "tensor-parallel ranks (EP size = TP size) instead of each expert cut "
                        "along its width; attention stays tensor-parallel")
    g.add_argument("--num-micro-batches", type=int, default=0,
                   help="micro-batches per step in flight through the pipeline (0: one per stage)")
    g.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds a rank waits on a peer before the step fails")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may give as `model` (the first is the one responses "
                        "carry; default: the model's own name)")
    kv = p.add_argument_group("prefill/decode disaggregation (docs/pd_protocol.md)")
    kv.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    kv.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake"])
    kv.add_argument("--kv-host", default="127.0.0.1",
                    help="interface the KV transfer server binds (prefill role)")
    kv.add_argument("--kv-port", type=int, default=0, help="KV transfer port (0: any free one)")
    kv.add_argument("--kv-advertise-host", default=None,
                    help="address put in KV descriptors (default: --kv-host)")
    add_secret_args(kv, "--kv-secret",
                    "shared secret of the KV transfer handshake (visible in ps: prefer "
                    "$HEARTH_KV_SECRET or --kv-secret-file)",
                    "read the KV secret from this file")
    kv.add_argument("--kv-lease-seconds", type=float, default=30.0,
                    help="how long exported KV blocks wait for the decode worker")
    kv.add_argument("--kv-peers", default="", help="KV servers a decode worker may pull from: "
                    "comma-separated host:port or host (default: loopback only)")
    kv.add_argument("--kv-peers-file", default=None, metavar="PATH",
                    help="more KV peers, one entry per line or comma-separated, read again "
                         "whenever the file changes (hearth up --cluster writes it)")
    sp = p.add_argument_group("speculative decoding (docs/speculative.md)")
    # The server drafts by default (EngineConfig's default stays off, for the library): on agent
    # traffic, which repeats itself and its prompts, suffix drafts cut the replay's wall time, and
    # greedy output is unchanged (docs/speculative.md, "Default").
    sp.add_argument("--speculative-method", default=SERVE_SPECULATIVE_METHOD,
                    choices=list(SPECULATIVE_METHODS),
                    help="draft tokens from the request's own context (ngram: prompt lookup; "
                         "suffix: plus recent outputs of other requests), verified in the same "
                         "step; output is unchanged")
    sp.add_argument("--num-speculative-tokens", type=int,
                    default=SpeculativeConfig.num_speculative_tokens,
                    help="the most draft tokens per request per step")
    sp.add_argument("--speculative-max-batch", type=int, default=SpeculativeConfig.max_batch,
                    help="no drafts while more requests than this decode at once")
    sp.add_argument("--speculative-draft-model", default=None, metavar="MODEL",
                    help="with --speculative-method draft: a small model of the same "
                         "vocabulary that drafts greedily (GGUF path, HF folder or built-in name)")
    sp.add_argument("--speculative-draft-num-blocks", type=int,
                    default=SpeculativeConfig.draft_num_blocks,
                    help="the draft model's own KV pool, in blocks")
    p.add_argument_group("structured output").add_argument(
        "--no-jump-forward", action="store_true",
        help="decode the tokens a grammar forces (tool-call wrappers, keys) one step each "
             "instead of appending them at once; the output is the same")
    t = p.add_argument_group("KV tiers below the pool (docs/kv_tiers.md)")
    t.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="write KV blocks evicted from the pool here and load them back on a "
                        "prefix hit (a restart finds them again)")
    t.add_argument("--kv-offload-gb", type=float, default=KVOffloadConfig.max_gb,
                   help="size cap of --kv-offload-dir (least recently used blocks go first)")
    t.add_argument("--kv-offload-shared", action="store_true",
                   help="--kv-offload-dir is shared by several workers on this machine")
    t.add_argument("--kv-offload-host-gb", type=float, default=0.0,
                   help="a host-memory tier above the directory (for a pool on a GPU; on the "
                        "CPU the pool already is host memory: give it --kv-cache-memory-gb)")
    t.add_argument("--kv-offload-load-timeout", type=float,
                   default=KVOffloadConfig.load_timeout_seconds,
                   help="seconds a load from the tiers may take before the rest is recomputed")
    t.add_argument("--kv-offload-mooncake-master", default=None, metavar="HOST:PORT",
                   help="a Mooncake Store tier (shared by every worker of the cluster) instead of "
                        "--kv-offload-dir: its mooncake_master")
    t.add_argument("--kv-offload-mooncake-metadata", default="", metavar="URL",
                   help="its metadata service (default: http://MASTER_HOST:8080/metadata)")
    t.add_argument("--kv-offload-mooncake-gb", type=float,
                   default=KVOffloadConfig.mooncake_segment_gb,
                   help="memory this worker contributes to the Mooncake Store")


def _rope_scaling_json(text: str) -> str:
    """--rope-scaling's value, checked here so a bad one fails before any process starts."""
    try:
        parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _first(values: list[str] | None) -> str | None:
    return values[0] if values else None


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                          rope_scaling=a.rope_scaling,
                          served_model_name=_first(a.served_model_name), seed=a.seed,
                          quantization=a.quantization, cpu_kernels=a.cpu_kernels,
                          prefill_dtype=a.prefill_dtype),
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory_gb=a.kv_cache_memory_gb,
                          kv_cache_dtype=a.kv_cache_dtype,
                          num_blocks=a.num_kv_blocks,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size,
                                pipeline_parallel_size=a.pipeline_parallel_size, device=a.device,
                                num_micro_batches=a.num_micro_batches,
                                enable_expert_parallel=a.enable_expert_parallel,
                                collective_timeout_s=a.collective_timeout,
                                **_launcher_rendezvous(a)),
        kv_transfer=KVTransferConfig(role=a.role, transport=a.kv_transport, host=a.kv_host,
                                     port=a.kv_port, advertise_host=a.kv_advertise_host,
                                     secret=a.kv_secret or "", lease_seconds=a.kv_lease_seconds,
                                     peers=tuple(p for p in a.kv_peers.split(",") if p.strip()),
                                     peers_file=a.kv_peers_file),
        speculative=SpeculativeConfig(method=a.speculative_method,
                                      num_speculative_tokens=a.num_speculative_tokens,
                                      max_batch=a.speculative_max_batch,
                                      draft_model=a.speculative_draft_model,
                                      draft_num_blocks=a.speculative_draft_num_blocks),
        kv_offload=KVOffloadConfig(directory=a.kv_offload_dir, max_gb=a.kv_offload_gb,
                                   shared=a.kv_offload_shared, host_gb=a.kv_offload_host_gb,
                                   load_timeout_seconds=a.kv_offload_load_timeout,
                                   mooncake_master=a.kv_offload_mooncake_master,
                                   mooncake_metadata=a.kv_offload_mooncake_metadata,
                                   mooncake_segment_gb=a.kv_offload_mooncake_gb),
        guided=GuidedConfig(jump_forward=not a.no_jump_forward),
    )


# ---- hearth serve: the HTTP server's own flags ----------------------------------------------


def add_server_args(p: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=defaults.host)
    g.add_argument("--port", type=int, default=defaults.port)
    add_secret_args(g, "--api-key",
                    "require 'Authorization: Bearer KEY' (visible in ps: prefer "
                    "$HEARTH_API_KEY or --api-key-file)",
                    "read the API key from this file")
    g.add_argument("--tool-call-parser", default=defaults.tool_call_parser,
                   help="auto (by the chat template: its tool-call markers, Llama 3 headers) | "
                        "hermes | llama3_json | kimi_k2 | deepseek_v3 | deepseek_v31")
    g.add_argument("--no-guided-auto-tools", action="store_true",
                   help="do not constrain tool-call arguments under tool_choice=auto")
    g.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20,
                   help="larger request bodies get 413")
    g.add_argument("--log-level", default=defaults.log_level)
    add_edge_args(g)


def add_secret_args(g, flag: str, help: str, file_help: str) -> None:
    """A secret flag and its `FLAG-file` twin, the pair `read_secrets` reads (with the
    environment variable of SECRET_ENV as the third source)."""
    g.add_argument(flag, default=None, help=help)
    g.add_argument(flag + "-file", default=None, metavar="PATH", help=file_help)


def add_edge_args(g) -> None:
    """The HTTP edge's flags, the same on a worker and the router (hearth/api/middleware.py)."""
    g.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="CORS: browser origins allowed to call this server, e.g. "
                        "http://localhost:3000, or * for any (default: none, CORS off)")
    g.add_argument("--no-access-log", action="store_true",
                   help="no log line per request (method, path, status, ms, request id)")
    d = DoorwayConfig()
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_seconds,
                   metavar="SECONDS", help="a request's headers must be complete this soon after "
                                           "its first byte, else the connection is closed "
                                           "(default: %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_seconds, metavar="SECONDS",
                   help="a request body that sends no byte for this long gets 408 and the "
                        "connection is closed (default: %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_seconds,
                   metavar="SECONDS", help="an idle connection between requests is closed after "
                                           "this (default: %(default)s)")
    g.add_argument("--max-connections-per-ip", type=int, default=d.max_connections_per_ip,
                   metavar="N", help="open connections one client address may hold; a request "
                                     "on one more gets 429 (0: no cap; default: %(default)s)")


def doorway_config(a: argparse.Namespace, max_connections_per_ip: int | None = None) -> DoorwayConfig:
    """`add_edge_args`' timeouts and cap (`max_connections_per_ip`: instead of the flag's)."""
    return DoorwayConfig(
        header_timeout_seconds=a.header_timeout, body_timeout_seconds=a.body_timeout,
        keep_alive_seconds=a.keep_alive_timeout,
        max_connections_per_ip=(a.max_connections_per_ip if max_connections_per_ip is None
                                else max_connections_per_ip))


def server_config(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=a.host, port=a.port, served_model_names=tuple(a.served_model_name or ()),
        api_key=a.api_key,
        max_waiting=a.max_waiting, max_body_bytes=int(a.max_body_mb * 2**20),
        tool_call_parser=a.tool_call_parser, guided_auto_tools=not a.no_guided_auto_tools,
        log_level=a.log_level, allowed_origins=tuple(a.allowed_origins),
        access_log=not a.no_access_log, doorway=doorway_config(a))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `hearth serve`: the engine's and the server's."""
    add_engine_args(p)
    add_server_args(p)


def serve_parser() -> argparse.ArgumentParser:
    """`hearth serve`'s flags on a parser of their own (to read a worker's argv back)."""
    p = argparse.ArgumentParser(prog="hearth serve", add_help=False)
    add_serve_args(p)
    return p


def _serve_flag_values(e: EngineConfig, s: ServerConfig) -> dict[str, object]:
    """Each `hearth serve` flag's value in (e, s): engine_config and server_config read
    backwards. The secrets are not here: hearth up hands them over in the environment."""
    m, c, sch, par, kv = e.model, e.cache, e.scheduler, e.parallel, e.kv_transfer
    return {
        "--host": s.host, "--port": s.port,
        "--model": m.model, "--dtype": m.dtype, "--quantization": m.quantization,
        "--kv-cache-dtype": c.kv_cache_dtype, "--cpu-kernels": m.cpu_kernels,
        "--prefill-dtype": m.prefill_dtype,
        "--max-model-len": m.max_model_len, "--rope-scaling": m.rope_scaling,
        "--seed": m.seed, "--block-size": c.block_size,
        "--kv-cache-memory-gb": c.kv_cache_memory_gb, "--num-kv-blocks": c.num_blocks,
        "--no-prefix-caching": not c.enable_prefix_caching,
        "--max-num-batched-tokens": sch.max_num_batched_tokens,
        "--max-num-seqs": sch.max_num_seqs, "--max-waiting": s.max_waiting,
        "--tensor-parallel-size": par.tensor_parallel_size,
        "--pipeline-parallel-size": par.pipeline_parallel_size,
        "--num-micro-batches": par.num_micro_batches,
        "--enable-expert-parallel": par.enable_expert_parallel,
        "--collective-timeout": par.collective_timeout_s, "--device": par.device,
        "--no-jump-forward": not e.guided.jump_forward,
        "--served-model-name": s.served_model_names,
        "--role": kv.role, "--kv-transport": kv.transport, "--kv-host": kv.host,
        "--kv-port": kv.port, "--kv-advertise-host": kv.advertise_host,
        "--kv-lease-seconds": kv.lease_seconds, "--kv-peers": ",".join(kv.peers),
        "--kv-peers-file": kv.peers_file,
        "--kv-offload-dir": e.kv_offload.directory, "--kv-offload-gb": e.kv_offload.max_gb,
        "--kv-offload-shared": e.kv_offload.shared,
        "--kv-offload-host-gb": e.kv_offload.host_gb,
        "--kv-offload-load-timeout": e.kv_offload.load_timeout_seconds,
        "--kv-offload-mooncake-master": e.kv_offload.mooncake_master,
        "--kv-offload-mooncake-metadata": e.kv_offload.mooncake_metadata,
        "--kv-offload-mooncake-gb": e.kv_offload.mooncake_segment_gb,
        "--speculative-method": e.speculative.method,
        "--num-speculative-tokens": e.speculative.num_speculative_tokens,
        "--speculative-max-batch": e.speculative.max_batch,
        "--speculative-draft-model": e.speculative.draft_model,
        "--speculative-draft-num-blocks": e.speculative.draft_num_blocks,
        "--tool-call-parser": s.tool_call_parser,
        "--no-guided-auto-tools": not s.guided_auto_tools,
        "--max-body-mb": s.max_body_bytes / 2**20, "--log-level": s.log_level,
        "--allowed-origins": s.allowed_origins, "--no-access-log": not s.access_log,
        "--header-timeout": s.doorway.header_timeout_seconds,
        "--body-timeout": s.doorway.body_timeout_seconds,
        "--keep-alive-timeout": s.doorway.keep_alive_seconds,
        "--max-connections-per-ip": s.doorway.max_connections_per_ip,
    }


def serve_argv(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """The `hearth serve` flags that rebuild `engine` and `server`: the address always, every
    other flag only where it differs from its default. No secret is written (`engine`'s KV
    secret and `server`'s API key travel in the worker's environment, SECRET_ENV).

    The flags are parsed back and compared: ValueError names any field they cannot carry
    (one no flag sets, or a flag whose mapping above was forgotten)."""
    parser = serve_parser()
    defaults = parser.parse_args([])
    default_values = _serve_flag_values(engine_config(defaults), server_config(defaults))
    argv: list[str] = []
    for flag, value in _serve_flag_values(engine, server).items():
        if value == default_values[flag] and flag not in ("--host", "--port"):
            continue
        if isinstance(value, bool):
            argv.append(flag)  # a store_true flag (its default is False)
        elif isinstance(value, tuple):  # an nargs="+" flag
            argv += [flag, *map(str, value)]
        else:
            text = str(value)
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    back = parser.parse_args(argv)
    (engine_given, server_given), (engine_back, server_back) = \
        _public(engine, server), _public(engine_config(back), server_config(back))
    lost = _differences(engine_given, engine_back) + _differences(server_given, server_back)
    if lost:
        raise ValueError(f"hearth serve has no flag for {', '.join(lost)}")
    return argv


def _public(engine: EngineConfig, server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    return (replace(engine, kv_transfer=replace(engine.kv_transfer, secret="")),
            replace(server, api_key=None))


def _differences(a, b, prefix: str = "") -> list[str]:
    """Dotted names of the fields where two configs differ."""
    if is_dataclass(a) and type(a) is type(b):
        return [name for f in fields(a)
                for name in _differences(getattr(a, f.name), getattr(b, f.name),
                                         f"{prefix}{f.name}.")]
    return [] if a == b else [prefix.rstrip(".")]


# ---- hearth route and hearth up: the router's flags, and the stack's -------------------------


def add_router_args(p: argparse.ArgumentParser, with_block_size: bool = True) -> None:
    """Flags shared by `route` and `up` (policy, health, timeouts, the router's own address)."""
    policy, health, timeouts = PolicyConfig(), HealthConfig(), HopTimeouts()
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    add_secret_args(g, "--api-key",
                    "clients must send 'Authorization: Bearer KEY' (visible in ps: prefer "
                    "$HEARTH_API_KEY or --api-key-file)",
                    "read the API key from this file")
    g.add_argument("--policy", default=policy.name, choices=POLICIES,
                   help="cost: token- and cache-aware (default); round_robin: the cache-blind baseline")
    if with_block_size:
        g.add_argument("--block-size", type=int, default=policy.block_size,
                       help="the workers' KV block size (the router hashes prompts the same way)")
    g.add_argument("--disagg-threshold", type=float, default=policy.disagg_threshold,
                   help="skip the prefill hop when the decode endpoint holds at least this "
                        "fraction of the prompt (1.0: only when it holds all of it)")
    g.add_argument("--min-disagg-tokens", type=int, default=policy.min_disagg_tokens,
                   help="shorter prompts are prefilled by the decode endpoint itself")
    g.add_argument("--prefill-weight", type=float, default=policy.prefill_weight)
    g.add_argument("--decode-weight", type=float, default=policy.decode_weight)
    g.add_argument("--transfer-weight", type=float, default=policy.transfer_weight)
    g.add_argument("--tier-weight", type=float, default=policy.tier_weight,
                   help="cost per prompt token a worker loads from its KV tiers (docs/kv_tiers.md)")
    g.add_argument("--affinity-max-cost-ratio", type=float, default=policy.affinity_max_cost_ratio,
                   help="a session's endpoints are left when they cost more than this times the best")
    g.add_argument("--health-interval", type=float, default=health.interval_seconds,
                   help="seconds between /load polls of each endpoint")
    g.add_argument("--health-timeout", type=float, default=health.timeout_seconds,
                   help="a slower /load answer is a stale load report: the endpoint stays in and "
                        "its polls back off (a refused connection or an error status takes it out)")
    g.add_argument("--eject-seconds", type=float, default=health.eject_seconds)
    g.add_argument("--max-retries", type=int, default=health.max_retries)
    g.add_argument("--connect-timeout", type=float, default=timeouts.connect)
    g.add_argument("--request-timeout", type=float, default=timeouts.request)
    g.add_argument("--stream-idle-timeout", type=float, default=timeouts.stream_idle)
    g.add_argument("--max-body-mb", type=float, default=RouterConfig.max_body_bytes / 2**20,
                   help="larger request bodies get 413")
    g.add_argument("--show-worker-urls", action="store_true",
                   help="list worker URLs on /load even without --api-key (with a key they are "
                        "shown to key holders)")
    g.add_argument("--log-level", default="info")
    add_edge_args(g)


def add_route_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoints")
    g.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill-role workers (hearth serve --role prefill)")
    g.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode-role workers (hearth serve --role decode)")
    g.add_argument("--worker", nargs="+", action="extend", default=[], metavar="URL",
                   help="monolithic workers (hearth serve, role both)")
    add_secret_args(g, "--worker-api-key",
                    "the key the router sends to workers (prefer $HEARTH_WORKER_API_KEY)",
                    "read the workers' key from this file")
    g.add_argument("--model", default=None,
                   help="tokenize in the router with this model's tokenizer (built-in name, "
                        ".gguf or HF folder); without it the router asks a worker's /tokenize")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may give as `model` (the first is the one responses "
                        "carry; default: the model's own name)")
    add_router_args(p)


def router_config(a: argparse.Namespace, prefill=(), decode=(), workers=(),
                  worker_api_key: str | None = None) -> RouterConfig:
    """The router `a` asks for, in front of these worker URLs (`hearth up` adds its own)."""
    policy = PolicyConfig(
        name=a.policy, block_size=a.block_size, prefill_weight=a.prefill_weight,
        decode_weight=a.decode_weight, transfer_weight=a.transfer_weight, tier_weight=a.tier_weight,
        disagg_threshold=a.disagg_threshold, min_disagg_tokens=a.min_disagg_tokens,
        affinity_max_cost_ratio=a.affinity_max_cost_ratio)
    return RouterConfig(
        prefill=tuple(prefill), decode=tuple(decode), workers=tuple(workers), host=a.host,
        port=a.port, api_key=a.api_key, worker_api_key=worker_api_key,
        served_model_names=tuple(a.served_model_name or ()), tokenizer_model=a.model,
        log_level=a.log_level, policy=policy, max_body_bytes=int(a.max_body_mb * 2**20),
        show_worker_urls=a.show_worker_urls, allowed_origins=tuple(a.allowed_origins),
        access_log=not a.no_access_log, doorway=doorway_config(a),
        health=HealthConfig(interval_seconds=a.health_interval, eject_seconds=a.eject_seconds,
                            max_retries=a.max_retries, timeout_seconds=a.health_timeout),
        timeouts=HopTimeouts(connect=a.connect_timeout, request=a.request_timeout,
                             stream_idle=a.stream_idle_timeout))


def add_up_args(p: argparse.ArgumentParser) -> None:
    stack, sup = UpConfig(), SupervisorConfig()
    g = p.add_argument_group("stack")
    g.add_argument("--prefill", type=int, default=stack.num_prefill,
                   help="prefill workers (default: %(default)s)")
    g.add_argument("--decode", type=int, default=stack.num_decode,
                   help="decode workers (default: %(default)s)")
    g.add_argument("--workers", type=int, default=stack.num_workers,
                   help="monolithic workers (role both)")
    g.add_argument("--pin", action="store_true", help="give each worker its own CPU cores")
    g.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for every worker, e.g. --worker-arg=--kv-lease-seconds=10")
    add_secret_args(g, "--worker-api-key",
                    "the workers' API key (default: a random one only the router knows; "
                    "visible in ps: prefer $HEARTH_WORKER_API_KEY or --worker-api-key-file)",
                    "read the workers' API key from this file")
    g.add_argument("--startup-timeout", type=float, default=stack.startup_timeout_seconds)
    g.add_argument("--log-dir", default=None, help="worker logs go here instead of this terminal")
    g.add_argument("--max-restarts", type=int, default=sup.max_restarts,
                   help="restarts of one worker within --restart-window before hearth up gives "
                        "up and exits 1 (default: %(default)s)")
    g.add_argument("--restart-window", type=float, default=sup.window_seconds, metavar="SECONDS")
    g.add_argument("--restart-backoff", type=float, default=sup.backoff_seconds, metavar="SECONDS",
                   help="pause before a restart, doubled per restart in the window "
                        f"(default: %(default)s, at most {sup.max_backoff_seconds:g})")


def add_cluster_args(p: argparse.ArgumentParser, full: bool = True) -> None:
    """`hearth up --cluster ...` (and `hearth scale`'s way to the same deployment)."""
    c = ClusterConfig()
    g = p.add_argument_group("cluster (Ray; pip install 'hearth[ray]')")
    g.add_argument("--cluster", default=None if full else c.address, metavar="ADDRESS",
                   help="run on a Ray cluster: auto ($RAY_ADDRESS, else the local head) or its "
                        "address (host:port or ray://host:port)" + (
                            "; without it hearth up runs on this machine alone" if full else ""))
    g.add_argument("--cluster-name", default=c.name,
                   help="the deployment's name on the cluster (default: %(default)s)")
    if not full:
        return
    g.add_argument("--cpus-per-rank", type=float, default=c.cpus_per_rank,
                   help="logical CPUs each rank of a worker reserves in Ray (placement only; "
                        "not its compute threads)")
    g.add_argument("--gpus-per-rank", type=float, default=c.gpus_per_rank)
    g.add_argument("--memory-per-rank-gb", type=float, default=0.0,
                   help="memory each rank reserves in Ray (0: none)")
    g.add_argument("--threads-per-worker", type=int, default=c.threads_per_worker,
                   help="compute threads of each worker (0: torch's default)")
    for role, flag in (("prefill", "--prefill-tp"), ("decode", "--decode-tp"),
                       ("both", "--workers-tp")):
        g.add_argument(flag, type=int, default=None, metavar="T",
                       help=f"tensor parallel size of the {role} workers (default: -tp)")
    g.add_argument("--stage-placement", default="pack",
                   choices=[x.lower().replace("_", "-") for x in STAGE_STRATEGIES],
                   help="how a worker's pipeline stages (-pp > 1) are placed: pack (one node if "
                        "it has room), spread, strict-spread (each stage on its own node)")
    g.add_argument("--no-replace", action="store_true",
                   help="do not replace a worker that dies (its role's target drops by one)")
    g.add_argument("--drain-timeout", type=float, default=c.drain_timeout_seconds,
                   metavar="SECONDS", help="a draining worker is stopped after this regardless")
    auto = c.autoscale
    for role, flag in (("prefill", "--autoscale-prefill"), ("decode", "--autoscale-decode"),
                       ("both", "--autoscale-workers")):
        g.add_argument(flag, type=_min_max, default=None, metavar="MIN:MAX",
                       help=f"the {role} workers follow the router's load between MIN and MAX")
    g.add_argument("--autoscale-target-requests", type=float, default=auto.target_requests,
                   metavar="N", help="requests open per worker the autoscaler aims at "
                                     "(default: %(default)s)")
    g.add_argument("--autoscale-upscale-delay", type=float, default=auto.upscale_delay_seconds,
                   metavar="SECONDS", help="more workers only once wanted this long "
                                           "(default: %(default)s)")
    g.add_argument("--autoscale-downscale-delay", type=float,
                   default=auto.downscale_delay_seconds, metavar="SECONDS",
                   help="fewer workers only once wanted this long (default: %(default)s)")


def _min_max(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX, e.g. 1:4")
    return int(low), int(high)


def cluster_config(a: argparse.Namespace) -> ClusterConfig:
    if not hasattr(a, "cpus_per_rank"):  # hearth scale
        return ClusterConfig(address=a.cluster, name=a.cluster_name)
    tp = {role: t for role, t in (("prefill", a.prefill_tp), ("decode", a.decode_tp),
                                  ("both", a.workers_tp)) if t is not None}
    ranges = {role: r for role, r in (("prefill", a.autoscale_prefill),
                                      ("decode", a.autoscale_decode),
                                      ("both", a.autoscale_workers)) if r is not None}
    autoscale = AutoscaleConfig(ranges=ranges, target_requests=a.autoscale_target_requests,
                                upscale_delay_seconds=a.autoscale_upscale_delay,
                                downscale_delay_seconds=a.autoscale_downscale_delay)
    return ClusterConfig(
        address=a.cluster, name=a.cluster_name, cpus_per_rank=a.cpus_per_rank,
        gpus_per_rank=a.gpus_per_rank, memory_per_rank_bytes=int(a.memory_per_rank_gb * 2**30),
        threads_per_worker=a.threads_per_worker, role_tensor_parallel=tp,
        stage_strategy=a.stage_placement.upper().replace("-", "_"),
        replace_dead_workers=not a.no_replace, drain_timeout_seconds=a.drain_timeout,
        autoscale=autoscale)


def add_scale_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p, full=False)
    g = p.add_argument_group("targets (only the roles given change)")
    g.add_argument("--prefill", type=int, default=None, help="prefill workers")
    g.add_argument("--decode", type=int, default=None, help="decode workers")
    g.add_argument("--workers", type=int, default=None, help="monolithic workers (role both)")
    g.add_argument("--wait", action="store_true",
                   help="return once the deployment serves exactly these targets")
    g.add_argument("--timeout", type=float, default=600.0, help="with --wait: give up after this")


def up_config(a: argparse.Namespace) -> UpConfig:
    return UpConfig(
        num_prefill=a.prefill, num_decode=a.decode, num_workers=a.workers, pin=a.pin,
        worker_args=tuple(a.worker_arg), worker_api_key=a.worker_api_key,
        startup_timeout_seconds=a.startup_timeout, log_dir=a.log_dir,
        supervisor=SupervisorConfig(max_restarts=a.max_restarts, window_seconds=a.restart_window,
                                    backoff_seconds=a.restart_backoff))


def up_worker_server_config(a: argparse.Namespace) -> ServerConfig:
    """What every `hearth up` worker's server gets from up's flags (its address is up's choice;
    up has no server flags of its own but the ones it shares with the router). Its workers
    keep the router's timeouts but no per-address cap: every hop comes from the router's."""
    return ServerConfig(served_model_names=tuple(a.served_model_name or ()),
                        max_waiting=a.max_waiting, max_body_bytes=int(a.max_body_mb * 2**20),
                        access_log=not a.no_access_log,
                        doorway=doorway_config(a, max_connections_per_ip=0))


def build_parser() -> argparse.ArgumentParser:
    """`hearth` with every sub-command and its flags (the command's name is `command`)."""
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

    serve = sub.add_parser("serve", help="an OpenAI-compatible worker for one model")
    add_serve_args(serve)

    route = sub.add_parser("route", help="the token-aware PD router in front of workers")
    add_route_args(route)

    up = sub.add_parser("up", help="router + prefill pool + decode pool on this machine "
                                   "(or on a Ray cluster: --cluster)")
    add_engine_args(up)
    add_up_args(up)
    add_cluster_args(up)
    add_router_args(up, with_block_size=False)  # --block-size comes with the engine flags

    scale = sub.add_parser("scale", help="change the workers of a running cluster deployment "
                                         "(hearth up --cluster)")
    add_scale_args(scale)

    bench = sub.add_parser("bench", help="engine benchmark: cold start, prefill and decode "
                                         "tokens/s (beside transformers), printed as a table")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--prefill-tokens", type=int, default=2048)
    bench.add_argument("--new-tokens", type=int, default=64, help="output tokens per stream")
    bench.add_argument("--batches", default="1,8,32", help="stream counts for decode, comma-separated")
    bench.add_argument("--quick", action="store_true", help="512-token prefill, 16 new tokens")
    bench.add_argument("--compare", choices=["transformers", "none"], default="transformers")
    bench.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart")
    return parser


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


def torchrun_env(environ) -> dict | None:
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
