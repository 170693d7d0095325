"""`hearth`'s command line: the one module that reads flags (and the environment they fall back to).

Every sub-command's flags are declared here and mapped onto frozen configs here and nowhere
else: `engine_config` (hearth/config.py), `server_config` (hearth/server/server_config.py),
`router_config` and `up_config` (hearth/router/router_config.py). The layers below take configs
only: `serve(EngineConfig, ServerConfig)` (hearth/server/launch.py), `route(RouterConfig)`
(hearth/router/launch.py) and `up(UpConfig, ...)` (hearth/router/up.py) parse nothing and never
import this module. The sub-commands themselves (what each one runs) are hearth/cli.py's.

Each option is declared once, as one `Option` row: its flag, the config field it sets (a path
such as "engine.scheduler.max_num_seqs") and, for the few whose flag value is not the field's
value as it is, a converter each way (MB <-> bytes, a comma list <-> a tuple, `--no-X` <-> `X`).
Everything else is read off the rows: the argparse declarations (the default is the field's own
unless the row says otherwise), the Namespace -> config mappings, and, for `hearth serve`
(SERVE_OPTIONS), the config -> argv mapping `serve_argv` with which `hearth up` and the cluster
start each worker. That argv is parsed back and compared, so a setting no flag carries is an
error, never silently dropped; tests/unit/test_serve_options.py fails when a field of
EngineConfig or ServerConfig is neither set by a row nor listed there as flagless.

The rows live in tables here, keyed by config path, in --help order, rather than as metadata on
the config fields: the configs are read by the engine, the server and tests that never parse a
flag, while help texts, choices and converters are the command line's business (STYLE: flags
are read in one module). Nor is the mapping one flag -> one config: --served-model-name sets the
engine's name and the server's list, --max-waiting sits with the engine flags but is the
server's, and the router and `hearth up` take the engine's --model and --block-size.

Still declared by hand: the cluster's and `hearth scale`'s flags (`add_cluster_args`, whose
values are reshaped: per-role maps, MIN:MAX ranges), `hearth route`'s worker URLs and key
(`router_config`'s arguments), and `hearth generate`'s and `hearth bench`'s own flags.

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
import operator
import os
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import reduce
from pathlib import Path
from typing import Any, Callable

from hearth.cluster.cluster_config import STAGE_STRATEGIES, AutoscaleConfig, ClusterConfig
from hearth.config import DEFAULT_MODEL, SPECULATIVE_METHODS, EngineConfig
from hearth.models.rope_scaling import parse_rope_scaling
from hearth.router.policy import POLICIES
from hearth.api.edge import DoorwayConfig
from hearth.router.router_config import RouterConfig, SupervisorConfig, UpConfig
from hearth.server.server_config import ServerConfig

SERVE_SPECULATIVE_METHOD = "suffix"  # `hearth serve` and `hearth up` workers; EngineConfig: off


# ---- Option: one row per flag, read three ways -----------------------------------------------

FROM_CONFIG = "<the field's default>"  # an Option's default: the config field's, via to_flag


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Option:
    """One flag and the config field it sets (hearth serve's, the router's, hearth up's)."""

    flag: str  # "--max-num-seqs"; its Namespace attribute is `dest`
    # The field, as ROOT.PATH: ROOT is engine (EngineConfig), server (ServerConfig), router
    # (RouterConfig) or up (UpConfig), PATH the field's dotted path in it.
    path: str
    type: Callable[[str], Any] = str  # argparse's type=; bool: a switch (store_true)
    help: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = FROM_CONFIG  # the flag's default when not the field's
    metavar: str | None = None
    nargs: str | None = None  # "+": a list of values
    action: str | None = None  # "append": a list, one value per use of the flag
    aliases: tuple[str, ...] = ()  # "-tp"
    to_config: Callable[[Any], Any] = _same  # the flag's value -> the field's
    to_flag: Callable[[Any], Any] = _same  # the field's value -> the flag's (serve_argv)
    also: tuple[str, Callable[[Any], Any]] | None = None  # another field it sets: path, to_config
    file_help: str | None = None  # a secret: has a FLAG-file twin (read_secrets); never on an argv
    always: bool = False  # serve_argv writes it even at its default (the worker's address)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _off_switch(flag: str, path: str, help: str | None = None) -> Option:
    """`--no-X`: given, the boolean field X is False."""
    return Option(flag, path, bool, help, to_config=operator.not_, to_flag=operator.not_)


def _rope_scaling_json(text: str) -> str:
    """--rope-scaling's value, checked here so a bad one fails before any process starts."""
    try:
        parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _first(values: list[str] | None) -> str | None:
    return values[0] if values else None


def _names(values: list[str] | None) -> tuple[str, ...]:
    return tuple(values or ())


def _names_flag(names: tuple[str, ...]) -> list[str] | None:
    return list(names) or None


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(p for p in text.split(",") if p.strip())


def _mb_to_bytes(mb: float) -> int:
    return int(mb * 2**20)


def _bytes_to_mb(num_bytes: int) -> float:
    return num_bytes / 2**20


def _options(groups) -> tuple[Option, ...]:
    return tuple(o for _, options in groups for o in options)


def _default_configs() -> dict[str, Any]:
    """Every config an Option may set, at its defaults, by the root of the Option's path."""
    return {"engine": EngineConfig(), "server": ServerConfig(), "router": RouterConfig(),
            "up": UpConfig()}


def _get(configs: dict[str, Any], path: str) -> Any:
    root, *names = path.split(".")
    return reduce(getattr, names, configs[root])


def _flag_default(o: Option) -> Any:
    if o.default is not FROM_CONFIG:
        return o.default
    return o.to_flag(_get(_default_configs(), o.path))


def _add_options(g, options) -> None:
    """argparse declarations of `options` in group (or parser) `g`."""
    for o in options:
        if o.file_help is not None:
            add_secret_args(g, o.flag, o.help, o.file_help)
        elif o.type is bool:
            g.add_argument(o.flag, *o.aliases, action="store_true", help=o.help)
        else:
            extra = {key: getattr(o, key) for key in ("choices", "metavar", "nargs", "action")
                     if getattr(o, key) is not None}
            if o.type is not str:
                extra["type"] = o.type
            g.add_argument(o.flag, *o.aliases, default=_flag_default(o), help=o.help, **extra)


def _add_groups(p: argparse.ArgumentParser, groups) -> None:
    for title, options in groups:
        _add_options(p.add_argument_group(title), options)


def add_secret_args(g, flag: str, help: str | None, file_help: str) -> None:
    """A secret flag and its `FLAG-file` twin, the pair `read_secrets` reads (with the
    environment variable of SECRET_ENV as the third source)."""
    g.add_argument(flag, default=None, help=help)
    g.add_argument(flag + "-file", default=None, metavar="PATH", help=file_help)


def _field_values(options, a: argparse.Namespace) -> dict[str, Any]:
    """The value each of `options` gives its field(s) in `a`, by config path."""
    values = {}
    for o in options:
        given = getattr(a, o.dest)
        values[o.path] = o.to_config(given)
        if o.also is not None:
            path, to_config = o.also
            values[path] = to_config(given)
    return values


def _kwargs(cls: type, values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`cls`'s keyword arguments from the `values` whose paths start with `prefix`; a nested
    config is built whole from its own paths (its other fields keep their defaults)."""
    kwargs, nested = {}, set()
    for path, value in values.items():
        if path.startswith(prefix):
            name, _, rest = path[len(prefix):].partition(".")
            if rest:
                nested.add(name)
            else:
                kwargs[name] = value
    factories = {f.name: f.default_factory for f in fields(cls)}
    for name in nested:
        kwargs[name] = factories[name](**_kwargs(factories[name], values, f"{prefix}{name}."))
    return kwargs


# ---- hearth serve: the engine's options, then the HTTP server's -----------------------------

DTYPES = ("float32", "bfloat16", "float16")

ENGINE_OPTIONS = (("engine", (
    Option("--model", "engine.model.model",
           help="HF checkpoint folder, .gguf file, or built-in name (default: %(default)s)"),
    Option("--dtype", "engine.model.dtype", choices=DTYPES),
    Option("--quantization", "engine.model.quantization",
           choices=("auto", "none", "gguf", "q8_0", "gguf-a8", "q8_0-a8"),
           help="decode-path weights: gguf = the file's own blocks (Q4_0/Q4_1/Q8_0), q8_0 = "
                "requantized; auto = gguf for a GGUF file when hearth's CPU kernels run here "
                "(docs/formats.md)"),
    Option("--kv-cache-dtype", "engine.cache.kv_cache_dtype", default="auto",
           choices=("auto", "model", *DTYPES, "int8", "fp8"),
           help="KV cache storage: auto (default) = bfloat16 for a float32 model on hearth's CPU "
                "kernels (half the bytes, not exact), else the model dtype; model = the model "
                "dtype (exact); int8 / fp8 (e4m3) = 8-bit values with a scale per token and head "
                "(~1.9x bf16's tokens per GB, not exact)"),
    Option("--prefill-dtype", "engine.model.prefill_dtype", default="auto",
           choices=("float32", "bfloat16", "auto"),
           help="compute dtype of prefill chunks and large batches (steps of more than 16 rows) "
                "of a float32 model: bfloat16 runs ~3x faster prefill where the CPU has AMX, not "
                "exact; auto (default) = bfloat16 where AMX runs, else float32, the exact "
                "reference (docs/formats.md)"),
    Option("--cpu-kernels", "engine.model.cpu_kernels",
           choices=("auto", "avx512amx", "avx512vnni", "avx512", "avx2", "off"),
           help="hearth's compiled CPU kernels (built by make setup)"),
    Option("--max-model-len", "engine.model.max_model_len", int),
    Option("--rope-scaling", "engine.model.rope_scaling", _rope_scaling_json, metavar="JSON",
           help="replace the checkpoint's RoPE scaling (as vLLM's --hf-overrides rope_scaling), "
                "e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                "\"original_max_position_embeddings\": 8192}': linear, llama3 or yarn (dynamic "
                "is refused); the context grows to original x factor, which --max-model-len may "
                "then ask for"),
    Option("--seed", "engine.model.seed", int),
    Option("--block-size", "engine.cache.block_size", int),
    Option("--kv-cache-memory-gb", "engine.cache.kv_cache_memory_gb", float),
    Option("--num-kv-blocks", "engine.cache.num_blocks", int, "override the memory budget"),
    _off_switch("--no-prefix-caching", "engine.cache.enable_prefix_caching"),
    Option("--max-num-batched-tokens", "engine.scheduler.max_num_batched_tokens", int),
    Option("--max-num-seqs", "engine.scheduler.max_num_seqs", int),
    Option("--max-waiting", "server.max_waiting", int,
           "requests queued beyond the running ones before the server answers 429"),
    Option("--tensor-parallel-size", "engine.parallel.tensor_parallel_size", int, aliases=("-tp",)),
    Option("--pipeline-parallel-size", "engine.parallel.pipeline_parallel_size", int,
           aliases=("-pp",)),
    Option("--enable-expert-parallel", "engine.parallel.enable_expert_parallel", bool,
           "a Mixture-of-Experts model's experts are split whole across the tensor-parallel "
           "ranks (EP size = TP size) instead of each expert cut along its width; attention "
           "stays tensor-parallel"),
    Option("--num-micro-batches", "engine.parallel.num_micro_batches", int,
           "micro-batches per step in flight through the pipeline (0: one per stage)"),
    Option("--collective-timeout", "engine.parallel.collective_timeout_s", float,
           "seconds a rank waits on a peer before the step fails"),
    Option("--device", "engine.parallel.device", choices=("cpu", "cuda")),
    Option("--served-model-name", "server.served_model_names", nargs="+", metavar="NAME",
           to_config=_names, to_flag=_names_flag,
           also=("engine.model.served_model_name", _first),  # the engine knows the first
           help="the names clients may give as `model` (the first is the one responses carry; "
                "default: the model's own name)"),
)), ("prefill/decode disaggregation (docs/pd_protocol.md)", (
    Option("--role", "engine.kv_transfer.role", choices=("both", "prefill", "decode"), to_flag=str),
    Option("--kv-transport", "engine.kv_transfer.transport", choices=("tcp", "mooncake")),
    Option("--kv-host", "engine.kv_transfer.host",
           help="interface the KV transfer server binds (prefill role)"),
    Option("--kv-port", "engine.kv_transfer.port", int, "KV transfer port (0: any free one)"),
    Option("--kv-advertise-host", "engine.kv_transfer.advertise_host",
           help="address put in KV descriptors (default: --kv-host)"),
    Option("--kv-secret", "engine.kv_transfer.secret", to_config=lambda secret: secret or "",
           help="shared secret of the KV transfer handshake (visible in ps: prefer "
                "$HEARTH_KV_SECRET or --kv-secret-file)",
           file_help="read the KV secret from this file"),
    Option("--kv-lease-seconds", "engine.kv_transfer.lease_seconds", float,
           "how long exported KV blocks wait for the decode worker"),
    Option("--kv-peers", "engine.kv_transfer.peers", to_config=_comma_list, to_flag=",".join,
           help="KV servers a decode worker may pull from: comma-separated host:port or host "
                "(default: loopback only)"),
    Option("--kv-peers-file", "engine.kv_transfer.peers_file", metavar="PATH",
           help="more KV peers, one entry per line or comma-separated, read again whenever the "
                "file changes (hearth up --cluster writes it)"),
)), ("speculative decoding (docs/speculative.md)", (
    # The server drafts by default (EngineConfig's default stays off, for the library): on agent
    # traffic, which repeats itself and its prompts, suffix drafts cut the replay's wall time,
    # and greedy output is unchanged (docs/speculative.md, "Default").
    Option("--speculative-method", "engine.speculative.method", default=SERVE_SPECULATIVE_METHOD,
           choices=SPECULATIVE_METHODS,
           help="draft tokens from the request's own context (ngram: prompt lookup; suffix: plus "
                "recent outputs of other requests), verified in the same step; output is "
                "unchanged"),
    Option("--num-speculative-tokens", "engine.speculative.num_speculative_tokens", int,
           "the most draft tokens per request per step"),
    Option("--speculative-max-batch", "engine.speculative.max_batch", int,
           "no drafts while more requests than this decode at once"),
    Option("--speculative-draft-model", "engine.speculative.draft_model", metavar="MODEL",
           help="with --speculative-method draft: a small model of the same vocabulary that "
                "drafts greedily (GGUF path, HF folder or built-in name)"),
    Option("--speculative-draft-num-blocks", "engine.speculative.draft_num_blocks", int,
           "the draft model's own KV pool, in blocks"),
)), ("structured output", (
    _off_switch("--no-jump-forward", "engine.guided.jump_forward",
                "decode the tokens a grammar forces (tool-call wrappers, keys) one step each "
                "instead of appending them at once; the output is the same"),
)), ("KV tiers below the pool (docs/kv_tiers.md)", (
    Option("--kv-offload-dir", "engine.kv_offload.directory", metavar="DIR",
           help="write KV blocks evicted from the pool here and load them back on a prefix hit "
                "(a restart finds them again)"),
    Option("--kv-offload-gb", "engine.kv_offload.max_gb", float,
           "size cap of --kv-offload-dir (least recently used blocks go first)"),
    Option("--kv-offload-shared", "engine.kv_offload.shared", bool,
           "--kv-offload-dir is shared by several workers on this machine"),
    Option("--kv-offload-host-gb", "engine.kv_offload.host_gb", float,
           "a host-memory tier above the directory (for a pool on a GPU; on the CPU the pool "
           "already is host memory: give it --kv-cache-memory-gb)"),
    Option("--kv-offload-load-timeout", "engine.kv_offload.load_timeout_seconds", float,
           "seconds a load from the tiers may take before the rest is recomputed"),
    Option("--kv-offload-mooncake-master", "engine.kv_offload.mooncake_master",
           metavar="HOST:PORT",
           help="a Mooncake Store tier (shared by every worker of the cluster) instead of "
                "--kv-offload-dir: its mooncake_master"),
    Option("--kv-offload-mooncake-metadata", "engine.kv_offload.mooncake_metadata", metavar="URL",
           help="its metadata service (default: http://MASTER_HOST:8080/metadata)"),
    Option("--kv-offload-mooncake-gb", "engine.kv_offload.mooncake_segment_gb", float,
           "memory this worker contributes to the Mooncake Store"),
)))

def _edge_options(root: str) -> tuple[Option, ...]:
    """The HTTP edge's options (hearth/api/middleware.py, hearth/api/edge.py), the same on a
    worker (root "server") and on the router ("router"): both configs name these fields alike."""
    return (
        Option("--allowed-origins", f"{root}.allowed_origins", nargs="+", metavar="ORIGIN",
               to_config=tuple, to_flag=list,
               help="CORS: browser origins allowed to call this server, e.g. "
                    "http://localhost:3000, or * for any (default: none, CORS off)"),
        _off_switch("--no-access-log", f"{root}.access_log",
                    "no log line per request (method, path, status, ms, request id)"),
        Option("--header-timeout", f"{root}.doorway.header_timeout_seconds", float,
               metavar="SECONDS",
               help="a request's headers must be complete this soon after its first byte, else "
                    "the connection is closed (default: %(default)s)"),
        Option("--body-timeout", f"{root}.doorway.body_timeout_seconds", float, metavar="SECONDS",
               help="a request body that sends no byte for this long gets 408 and the connection "
                    "is closed (default: %(default)s)"),
        Option("--keep-alive-timeout", f"{root}.doorway.keep_alive_seconds", float,
               metavar="SECONDS",
               help="an idle connection between requests is closed after this (default: "
                    "%(default)s)"),
        Option("--max-connections-per-ip", f"{root}.doorway.max_connections_per_ip", int,
               metavar="N",
               help="open connections one client address may hold; a request on one more gets "
                    "429 (0: no cap; default: %(default)s)"),
    )


SERVER_OPTIONS = (("server", (
    Option("--host", "server.host", always=True),
    Option("--port", "server.port", int, always=True),
    Option("--api-key", "server.api_key",
           help="require 'Authorization: Bearer KEY' (visible in ps: prefer $HEARTH_API_KEY or "
                "--api-key-file)",
           file_help="read the API key from this file"),
    Option("--tool-call-parser", "server.tool_call_parser",
           help="auto (by the chat template: its tool-call markers, Llama 3 headers) | hermes | "
                "llama3_json | kimi_k2 | deepseek_v3 | deepseek_v31"),
    _off_switch("--no-guided-auto-tools", "server.guided_auto_tools",
                "do not constrain tool-call arguments under tool_choice=auto"),
    Option("--max-body-mb", "server.max_body_bytes", float, "larger request bodies get 413",
           to_config=_mb_to_bytes, to_flag=_bytes_to_mb),
    Option("--log-level", "server.log_level"),
    *_edge_options("server"),
)),)


SERVE_OPTIONS = _options(ENGINE_OPTIONS + SERVER_OPTIONS)  # every flag of `hearth serve`


def add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_groups(p, ENGINE_OPTIONS)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    values = _field_values(_options(ENGINE_OPTIONS), a)
    values.update({f"engine.parallel.{name}": value
                   for name, value in _launcher_rendezvous(a).items()})
    return EngineConfig(**_kwargs(EngineConfig, values, "engine."))


def add_server_args(p: argparse.ArgumentParser) -> None:
    _add_groups(p, SERVER_OPTIONS)


def doorway_config(a: argparse.Namespace, max_connections_per_ip: int | None = None) -> DoorwayConfig:
    """The edge flags' timeouts and cap (`max_connections_per_ip`: instead of the flag's)."""
    doorway = DoorwayConfig(**_kwargs(DoorwayConfig, _field_values(_edge_options("server"), a),
                                      "server.doorway."))
    if max_connections_per_ip is None:
        return doorway
    return replace(doorway, max_connections_per_ip=max_connections_per_ip)


def server_config(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**_kwargs(ServerConfig, _field_values(SERVE_OPTIONS, a), "server."))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `hearth serve`: the engine's and the server's."""
    add_engine_args(p)
    add_server_args(p)


def serve_parser() -> argparse.ArgumentParser:
    """`hearth serve`'s flags on a parser of their own (to read a worker's argv back)."""
    p = argparse.ArgumentParser(prog="hearth serve", add_help=False)
    add_serve_args(p)
    return p


def serve_argv(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """The `hearth serve` flags that rebuild `engine` and `server`: the address always, every
    other flag only where it differs from its default. No secret is written (`engine`'s KV
    secret and `server`'s API key travel in the worker's environment, SECRET_ENV).

    The flags are parsed back and compared: ValueError names any field they cannot carry
    (one no Option sets, or an Option whose converters do not undo each other)."""
    parser = serve_parser()
    defaults = parser.parse_args([])
    given = _configs(engine, server)
    default = _configs(engine_config(defaults), server_config(defaults))
    argv: list[str] = []
    for o in sorted(SERVE_OPTIONS, key=lambda o: not o.always):  # the address first
        value = o.to_flag(_get(given, o.path))
        if o.file_help is not None or (value == o.to_flag(_get(default, o.path))
                                       and not o.always):
            continue
        if isinstance(value, bool):
            argv.append(o.flag)  # a switch (its default is off)
        elif isinstance(value, (list, tuple)):  # an nargs="+" flag
            argv += [o.flag, *map(str, value)]
        else:
            text = str(value)
            argv += [f"{o.flag}={text}"] if text.startswith("-") else [o.flag, text]
    back = parser.parse_args(argv)
    given, back = _public(given), _public(_configs(engine_config(back), server_config(back)))
    lost = [name for root in given for name in _differences(given[root], back[root])]
    if lost:
        raise ValueError(f"hearth serve has no flag for {', '.join(lost)}")
    return argv


def _configs(engine: EngineConfig, server: ServerConfig) -> dict[str, Any]:
    """`hearth serve`'s configs by the root an Option's path starts from."""
    return {"engine": engine, "server": server}


def _public(configs: dict[str, Any]) -> dict[str, Any]:
    """`configs` with every secret at its default (no secret is on an argv)."""
    blank = _default_configs()
    for o in SERVE_OPTIONS:
        if o.file_help is not None:
            root, *names = o.path.split(".")
            configs = {**configs, root: _replaced(configs[root], names, _get(blank, o.path))}
    return configs


def _replaced(config, names: list[str], value: Any):
    """`config` with the field at path `names` set to `value` (nested configs copied)."""
    head, *rest = names
    return replace(config, **{head: _replaced(getattr(config, head), rest, value) if rest
                              else value})


def _differences(a, b, prefix: str = "") -> list[str]:
    """Dotted names of the fields where two configs differ."""
    if is_dataclass(a) and type(a) is type(b):
        return [name for f in fields(a)
                for name in _differences(getattr(a, f.name), getattr(b, f.name),
                                         f"{prefix}{f.name}.")]
    return [] if a == b else [prefix.rstrip(".")]


# ---- hearth route and hearth up: the router's flags, and the stack's -------------------------


ROUTER_OPTIONS = (  # `hearth route`'s and `hearth up`'s, the "router" group
    Option("--host", "router.host"),
    Option("--port", "router.port", int),
    Option("--api-key", "router.api_key",
           help="clients must send 'Authorization: Bearer KEY' (visible in ps: prefer "
                "$HEARTH_API_KEY or --api-key-file)",
           file_help="read the API key from this file"),
    Option("--policy", "router.policy.name", choices=POLICIES,
           help="cost: token- and cache-aware (default); round_robin: the cache-blind baseline"),
    Option("--block-size", "router.policy.block_size", int,  # up: the engine's --block-size
           "the workers' KV block size (the router hashes prompts the same way)"),
    Option("--disagg-threshold", "router.policy.disagg_threshold", float,
           "skip the prefill hop when the decode endpoint holds at least this fraction of the "
           "prompt (1.0: only when it holds all of it)"),
    Option("--min-disagg-tokens", "router.policy.min_disagg_tokens", int,
           "shorter prompts are prefilled by the decode endpoint itself"),
    Option("--prefill-weight", "router.policy.prefill_weight", float),
    Option("--decode-weight", "router.policy.decode_weight", float),
    Option("--transfer-weight", "router.policy.transfer_weight", float),
    Option("--tier-weight", "router.policy.tier_weight", float,
           "cost per prompt token a worker loads from its KV tiers (docs/kv_tiers.md)"),
    Option("--affinity-max-cost-ratio", "router.policy.affinity_max_cost_ratio", float,
           "a session's endpoints are left when they cost more than this times the best"),
    Option("--health-interval", "router.health.interval_seconds", float,
           "seconds between /load polls of each endpoint"),
    Option("--health-timeout", "router.health.timeout_seconds", float,
           "a slower /load answer is a stale load report: the endpoint stays in and its polls "
           "back off (a refused connection or an error status takes it out)"),
    Option("--eject-seconds", "router.health.eject_seconds", float),
    Option("--max-retries", "router.health.max_retries", int),
    Option("--connect-timeout", "router.timeouts.connect", float),
    Option("--request-timeout", "router.timeouts.request", float),
    Option("--stream-idle-timeout", "router.timeouts.stream_idle", float),
    Option("--max-body-mb", "router.max_body_bytes", float, "larger request bodies get 413",
           to_config=_mb_to_bytes, to_flag=_bytes_to_mb),
    Option("--show-worker-urls", "router.show_worker_urls", bool,
           "list worker URLs on /load even without --api-key (with a key they are shown to key "
           "holders)"),
    Option("--log-level", "router.log_level"),
    *_edge_options("router"),
)
ROUTE_MODEL_OPTIONS = (  # `hearth route`'s; `hearth up` has the engine's flags of these names
    Option("--model", "router.tokenizer_model",
           help="tokenize in the router with this model's tokenizer (built-in name, .gguf or HF "
                "folder); without it the router asks a worker's /tokenize"),
    Option("--served-model-name", "router.served_model_names", nargs="+", metavar="NAME",
           to_config=_names, to_flag=_names_flag,
           help="the names clients may give as `model` (the first is the one responses carry; "
                "default: the model's own name)"),
)


def add_router_args(p: argparse.ArgumentParser, with_block_size: bool = True) -> None:
    """Flags shared by `route` and `up` (policy, health, timeouts, the router's own address)."""
    _add_options(p.add_argument_group("router"),
                 [o for o in ROUTER_OPTIONS if with_block_size or o.flag != "--block-size"])


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
    _add_options(g, ROUTE_MODEL_OPTIONS)
    add_router_args(p)


def router_config(a: argparse.Namespace, prefill=(), decode=(), workers=(),
                  worker_api_key: str | None = None) -> RouterConfig:
    """The router `a` asks for, in front of these worker URLs (`hearth up` adds its own)."""
    values = _field_values(ROUTER_OPTIONS + ROUTE_MODEL_OPTIONS, a)
    return RouterConfig(prefill=tuple(prefill), decode=tuple(decode), workers=tuple(workers),
                        worker_api_key=worker_api_key,
                        **_kwargs(RouterConfig, values, "router."))


UP_OPTIONS = (("stack", (
    Option("--prefill", "up.num_prefill", int, "prefill workers (default: %(default)s)"),
    Option("--decode", "up.num_decode", int, "decode workers (default: %(default)s)"),
    Option("--workers", "up.num_workers", int, "monolithic workers (role both)"),
    Option("--pin", "up.pin", bool, "give each worker its own CPU cores"),
    Option("--worker-arg", "up.worker_args", action="append", metavar="FLAG", to_config=tuple,
           to_flag=list,
           help="an extra flag for every worker, e.g. --worker-arg=--kv-lease-seconds=10"),
    Option("--worker-api-key", "up.worker_api_key",
           help="the workers' API key (default: a random one only the router knows; visible in "
                "ps: prefer $HEARTH_WORKER_API_KEY or --worker-api-key-file)",
           file_help="read the workers' API key from this file"),
    Option("--startup-timeout", "up.startup_timeout_seconds", float),
    Option("--log-dir", "up.log_dir", help="worker logs go here instead of this terminal"),
    Option("--max-restarts", "up.supervisor.max_restarts", int,
           "restarts of one worker within --restart-window before hearth up gives up and exits 1 "
           "(default: %(default)s)"),
    Option("--restart-window", "up.supervisor.window_seconds", float, metavar="SECONDS"),
    Option("--restart-backoff", "up.supervisor.backoff_seconds", float, metavar="SECONDS",
           help="pause before a restart, doubled per restart in the window (default: "
                f"%(default)s, at most {SupervisorConfig.max_backoff_seconds:g})"),
)),)


def add_up_args(p: argparse.ArgumentParser) -> None:
    _add_groups(p, UP_OPTIONS)


def up_config(a: argparse.Namespace) -> UpConfig:
    return UpConfig(**_kwargs(UpConfig, _field_values(_options(UP_OPTIONS), a), "up."))


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


def up_worker_server_config(a: argparse.Namespace) -> ServerConfig:
    """What every `hearth up` worker's server gets from up's flags (its address is up's choice;
    up has no server flags of its own but the ones it shares with the router). Its workers
    keep the router's timeouts but no per-address cap: every hop comes from the router's."""
    return ServerConfig(served_model_names=_names(a.served_model_name),
                        max_waiting=a.max_waiting, max_body_bytes=_mb_to_bytes(a.max_body_mb),
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
