"""`hearth serve`'s options (the engine's, then the HTTP server's), their configs, and
`serve_argv`: the same rows read backwards, to start a worker from its configs."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, is_dataclass, replace
from typing import Any

from hearth.config import SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig
from hearth.api.edge import DoorwayConfig
from hearth.api.harmony_prompt import CHAT_FORMATS
from hearth.server.reasoning_parsers import REASONING_PARSERS
from hearth.server.server_config import ServerConfig
from hearth.flags.options import (Option, _add_groups, _bytes_to_mb, _comma_list, _default_configs,
                                  _field_values, _first, _get, _kwargs, _mb_to_bytes, _names,
                                  _names_flag, _off_switch, _options, _rope_scaling_json)

SERVE_SPECULATIVE_METHOD = "suffix"  # `hearth serve` and `hearth up` workers; EngineConfig: off
# The step-time target of `hearth serve` and `hearth up` workers (SchedulerConfig's: 0, off, so
# the library's batches keep whole chunks): below the ~45 ms p90 inter-token latency vLLM-CPU
# had at 8 streams on a 2-core EPYC (issue 44), with room for the step's own overhead.
SERVE_ITL_TARGET_MS = 40.0
# `hearth up`'s --weight-cache when not given (its workers share one host: EngineConfig's and
# `hearth serve`'s default is none)
UP_WEIGHT_CACHE = "~/.cache/hearth/weights"


# ---- hearth serve: the engine's options, then the HTTP server's -----------------------------

DTYPES = ("float32", "bfloat16", "float16")

ENGINE_OPTIONS = (("engine", (
    Option("--model", "engine.model.model",
           help="HF checkpoint folder, .gguf file, or built-in name (default: %(default)s)"),
    Option("--dtype", "engine.model.dtype", choices=DTYPES),
    Option("--quantization", "engine.model.quantization",
           choices=("auto", "none", "gguf", "q8_0", "gguf-a8", "q8_0-a8"),
           help="weights: gguf = the file's own blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K; no float copy), q8_0 = "
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
           help="compute dtype of prefill chunks and large batches (steps of more than 10 rows) "
                "of a float32 model: bfloat16 runs ~3x faster prefill where the CPU has AMX, not "
                "exact; auto (default) = bfloat16 where AMX runs, else float32, the exact "
                "reference (docs/formats.md)"),
    Option("--cpu-kernels", "engine.model.cpu_kernels",
           choices=("auto", "avx512amx", "avx512vnni", "avx512", "avx2", "off"),
           help="hearth's compiled CPU kernels (built by make setup)"),
    Option("--weight-cache", "engine.model.weight_cache", metavar="DIR", default=None,
           to_config=lambda given: "" if given in (None, "none") else given,
           to_flag=lambda directory: directory or "none",
           help="keep a GGUF's packed block weights in a file under DIR, mapped by every worker "
                "on this machine that loads the same file alike (one copy in memory) and by a "
                "restart (no repack); none: each worker packs its own (default: none for "
                f"hearth serve, {UP_WEIGHT_CACHE} for hearth up on one machine)"),
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
    Option("--itl-target-ms", "engine.scheduler.itl_target_ms", float, default=SERVE_ITL_TARGET_MS,
           help="while any request decodes, a step carries only the prompt tokens that fit a "
                "step of this many ms at the measured cost per prompt token (at least 64), so "
                "streams' next tokens do not wait behind long prompt chunks (one warm next "
                "turn per step passes it whole; a target the decode rows alone exceed bounds "
                "nothing); 0: off, prompts fill --max-num-batched-tokens (default: %(default)s)"),
    Option("--max-prompt-tokens-while-decoding", "engine.scheduler.max_prompt_tokens_while_decoding",
           int, "a fixed cap on a step's prompt tokens while any request decodes (0: none; "
           "with --itl-target-ms the smaller bound applies)"),
    Option("--next-turn-max-bypass", "engine.scheduler.next_turn_max_bypass", int,
           "a waiting request whose prompt is mostly cached (a session's next turn) is admitted "
           "before colder ones ahead of it, each of which it may pass this many times (0: "
           "first come, first served)"),
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
                "recent outputs of other requests), a small model (draft) or an EAGLE-3 head "
                "(eagle3), verified in the same step; output is unchanged"),
    Option("--num-speculative-tokens", "engine.speculative.num_speculative_tokens", int,
           "the most draft tokens per request per step"),
    Option("--speculative-max-batch", "engine.speculative.max_batch", int,
           "no drafts while more requests than this decode at once"),
    Option("--speculative-draft-model", "engine.speculative.draft_model", metavar="MODEL",
           help="with --speculative-method draft: a small model of the same vocabulary that "
                "drafts greedily (GGUF path, HF folder or built-in name); with eagle3: the "
                "head's folder (config.json + model.safetensors)"),
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
           help="auto (by the chat template: harmony channels, its tool-call markers, Llama 3 "
                "headers) | hermes | llama3_json | kimi_k2 | deepseek_v3 | deepseek_v31 | openai "
                "(gpt-oss's harmony)"),
    Option("--reasoning-parser", "server.reasoning_parser", choices=REASONING_PARSERS,
           help="return <think> reasoning apart from content (reasoning_content, reasoning "
                "items, thinking blocks): deepseek_r1 (output starts inside the block) | qwen3 "
                "(a block where the output opens one) | openai_gptoss (alias harmony: gpt-oss's "
                "analysis channel); default: none, openai_gptoss under the harmony format"),
    Option("--chat-format", "server.chat_format", choices=CHAT_FORMATS,
           help="how chat prompts are written: auto (harmony where the model's chat template "
                "writes harmony channels, as gpt-oss's does; else the template) | template | "
                "harmony (hearth's own renderer; reasoning_effort goes in its system message)"),
    _off_switch("--no-guided-auto-tools", "server.guided_auto_tools",
                "do not constrain tool-call arguments under tool_choice=auto"),
    Option("--max-body-mb", "server.max_body_bytes", float, "larger request bodies get 413",
           to_config=_mb_to_bytes, to_flag=_bytes_to_mb),
    Option("--log-level", "server.log_level"),
    *_edge_options("server"),
)),)


SERVE_OPTIONS = _options(ENGINE_OPTIONS + SERVER_OPTIONS)  # every flag of `hearth serve`


# --speculative-config (vLLM's form): its keys -> SpeculativeConfig fields. vLLM's names, then
# hearth's own settings under their field names: only fields a --speculative-* flag carries too
# (serve_argv hands workers those flags). The JSON wins over the separate flags.
SPECULATIVE_JSON_KEYS = {"method": "method", "model": "draft_model",
                         "num_speculative_tokens": "num_speculative_tokens",
                         "max_batch": "max_batch", "draft_num_blocks": "draft_num_blocks"}
SPECULATIVE_JSON_METHODS = {"draft_model": "draft"}  # vLLM's method names where hearth's differ


def speculative_json(text: str) -> dict[str, Any]:
    """--speculative-config's value -> {SpeculativeConfig field: value}, checked here (unknown
    keys, wrong types, a method or k out of range are refused naming the key)."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"speculative_config: not JSON ({e})") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError("speculative_config: must be a JSON object")
    fields_ = {f.name: f for f in fields(SpeculativeConfig)}
    values = {}
    for key, value in given.items():
        name = SPECULATIVE_JSON_KEYS.get(key)
        if name is None:
            raise argparse.ArgumentTypeError(
                f"speculative_config: unknown key {key!r}; known: "
                f"{', '.join(SPECULATIVE_JSON_KEYS)}")
        want = {"int": int, "float": (int, float)}.get(str(fields_[name].type), str)
        if isinstance(value, bool) or not isinstance(value, want):
            raise argparse.ArgumentTypeError(f"speculative_config: {key} must be "
                                             f"{fields_[name].type.split(' ')[0]}, got {value!r}")
        values[name] = SPECULATIVE_JSON_METHODS.get(value, value) if key == "method" else value
    method = values.get("method", "off")
    try:  # the ranges, as the config checks them (the model's presence is checked with the rest)
        SpeculativeConfig(**{**values, "method": method, "draft_model": "-"})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"speculative_config: {e}") from None
    return values


def add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_groups(p, ENGINE_OPTIONS)
    p.add_argument("--speculative-config", type=speculative_json, default=None, metavar="JSON",
                   help="speculative decoding as vLLM takes it, e.g. '{\"method\": \"eagle3\", "
                        "\"model\": DIR, \"num_speculative_tokens\": 4}' (keys: "
                        f"{', '.join(SPECULATIVE_JSON_KEYS)}); wins over the flags above")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    values = _field_values(_options(ENGINE_OPTIONS), a)
    for name, value in (getattr(a, "speculative_config", None) or {}).items():
        values[f"engine.speculative.{name}"] = value
    values.update({f"engine.parallel.{name}": value
                   for name, value in _launcher_rendezvous(a).items()})
    return EngineConfig(**_kwargs(EngineConfig, values, "engine."))


def up_engine_config(a: argparse.Namespace) -> EngineConfig:
    """`engine_config` of `hearth up` on one machine: its workers share the weight cache
    UP_WEIGHT_CACHE unless --weight-cache says otherwise (none: off)."""
    engine = engine_config(a)
    if getattr(a, "weight_cache", None) is not None:
        return engine
    return replace(engine, model=replace(engine.model, weight_cache=UP_WEIGHT_CACHE))


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


# ---- a launcher's rank set (torchrun) ---------------------------------------------------------

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
