"""Each option is declared once, as a row of hearth/flags.py: every field of EngineConfig and
ServerConfig is either set by exactly one `hearth serve` row or listed below as flagless; every
such row's field, set to a value other than its default, survives `serve_argv` and the parse
back; and each router and `hearth up` row sets the field its path names. No model."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import pytest

from hearth import flags
from hearth.config import EngineConfig
from hearth.router.router_config import RouterConfig, UpConfig
from hearth.server.server_config import ServerConfig

# Fields `hearth serve` leaves at their defaults: no flag sets them. A new field gets an Option in
# hearth/flags.py or a line here.
FLAGLESS = {
    "engine.model.tokenizer",
    *(f"engine.guided.{name}" for name in (
        "max_spec_bytes", "max_schema_depth", "max_length_bound", "max_total_length_bound",
        "max_count_bound", "compile_timeout_s", "num_compile_threads", "max_compiles_in_flight",
        "cache_size")),
    # the launcher's rendezvous (torchrun_env), not a flag
    "engine.parallel.master_addr", "engine.parallel.master_port", "engine.parallel.agent_store",
    "engine.kv_transfer.max_leased_fraction", "engine.kv_transfer.io_timeout_seconds",
    "engine.kv_transfer.handshake_timeout_seconds", "engine.kv_transfer.num_transfer_threads",
    "engine.kv_offload.max_pending_blocks", "engine.kv_offload.num_load_threads",
    "engine.kv_offload.max_prefetch_blocks",
    "engine.speculative.ngram_min", "engine.speculative.ngram_max",
    "engine.speculative.suffix_global_tokens", "engine.speculative.min_confidence",
    "server.cpu_threads", "server.exit_on_engine_failure",
}
# The same for the router's and hearth up's configs (hearth route passes the worker URLs and key
# to router_config as arguments).
ROUTER_AND_UP_FLAGLESS = {
    "router.prefill", "router.decode", "router.workers", "router.worker_api_key",
    "router.cpu_threads", "router.session_capacity", "router.policy.affinity_slack",
    "router.health.max_interval_seconds", "router.health.discovery_interval_seconds",
    "up.supervisor.max_backoff_seconds",
}
# A value each option whose type is a checker of its own accepts.
SAMPLES = {"--rope-scaling": '{"rope_type": "linear", "factor": 2.0}',
           "--disagg-threshold": 0.5}  # within [0, 1]
PUBLIC_OPTIONS = [o for o in flags.SERVE_OPTIONS if o.file_help is None]  # secrets: never argv


def leaf_paths(config, prefix: str) -> set[str]:
    if not is_dataclass(config):
        return {prefix.rstrip(".")}
    return {path for f in fields(config)
            for path in leaf_paths(getattr(config, f.name), f"{prefix}{f.name}.")}


def with_field(configs: dict, path: str, value) -> dict:
    root, *names = path.split(".")

    def set_in(config, names):
        head, *rest = names
        return replace(config, **{head: set_in(getattr(config, head), rest) if rest else value})

    return {**configs, root: set_in(configs[root], names)}


def serve_defaults() -> dict:
    a = flags.serve_parser().parse_args([])
    return {"engine": flags.engine_config(a), "server": flags.server_config(a)}


def other_value(option: flags.Option, default):
    """A value of `option`'s flag other than its default, as argparse would hand it over."""
    if option.flag in SAMPLES:
        return SAMPLES[option.flag]
    if option.type is bool:
        return True
    if option.nargs == "+":
        return ["v-1", "v-2"]
    if option.choices:
        return next(c for c in option.choices if c != default)
    if option.type is int:
        return (default or 0) + 3
    if option.type is float:
        return (default or 0.0) * 2 + 0.25
    assert option.type is str, f"{option.flag}: give it a value in SAMPLES"
    return f"v-{option.dest}"


def test_every_field_is_set_by_one_option_or_listed_as_flagless():
    set_by = [o.path for o in flags.SERVE_OPTIONS]
    set_by += [o.also[0] for o in flags.SERVE_OPTIONS if o.also is not None]
    assert len(set_by) == len(set(set_by)), "a field set by two options"
    assert set(set_by) & FLAGLESS == set()
    every_field = leaf_paths(EngineConfig(), "engine.") | leaf_paths(ServerConfig(), "server.")
    assert set(set_by) | FLAGLESS == every_field


@pytest.mark.parametrize("option", PUBLIC_OPTIONS, ids=lambda o: o.flag)
def test_each_option_sets_its_field_and_survives_serve_argv(option):
    defaults = serve_defaults()
    given = other_value(option, getattr(flags.serve_parser().parse_args([]), option.dest))
    configs = with_field(defaults, option.path, option.to_config(given))
    if option.also is not None:
        path, to_config = option.also
        configs = with_field(configs, path, to_config(given))
    assert configs != defaults  # the value reaches a field and is not its default

    argv = flags.serve_argv(configs["engine"], configs["server"])
    assert option.flag in {arg.split("=")[0] for arg in argv}
    assert {arg.split("=")[0] for arg in argv if arg.startswith("--")} <= \
        {option.flag, "--host", "--port"}  # and no other flag than the address
    back = flags.serve_parser().parse_args(argv)
    assert {"engine": flags.engine_config(back), "server": flags.server_config(back)} == configs


def flag_argv(option: flags.Option, value) -> list[str]:
    if option.type is bool:
        return [option.flag]
    if option.nargs == "+":
        return [option.flag, *value]
    return [f"{option.flag}={value}"]


# One parser for the file (argparse keeps no state between parses; building one is ~12 ms, and
# the rows below parse four times each).
PARSER = flags.build_parser()


def command_configs(command: str, *argv: str) -> dict:
    a = PARSER.parse_args([command, *argv])
    flags.read_secrets(a, {})
    configs = {"router": flags.router_config(a)}
    return configs if command == "route" else {**configs, "up": flags.up_config(a)}


ROUTER_AND_UP_ROWS = [("route", o) for o in flags.ROUTER_OPTIONS + flags.ROUTE_MODEL_OPTIONS] + \
    [("up", o) for _, rows in flags.UP_OPTIONS for o in rows]


def test_every_router_and_up_field_is_set_by_one_row_or_listed_as_flagless():
    set_by = [o.path for _, o in ROUTER_AND_UP_ROWS]
    assert len(set_by) == len(set(set_by)), "a field set by two rows"
    assert set(set_by) & ROUTER_AND_UP_FLAGLESS == set()
    every_field = leaf_paths(RouterConfig(), "router.") | leaf_paths(UpConfig(), "up.")
    assert set(set_by) | ROUTER_AND_UP_FLAGLESS == every_field


@pytest.mark.parametrize("command, option", ROUTER_AND_UP_ROWS,
                         ids=[f"{c} {o.flag}" for c, o in ROUTER_AND_UP_ROWS])
def test_each_router_and_up_row_sets_the_field_its_path_names(command, option):
    a = PARSER.parse_args([command])
    given = other_value(option, getattr(a, option.dest))
    parsed = PARSER.parse_args([command, *flag_argv(option, given)])
    expected = with_field(command_configs(command), option.path,
                          option.to_config(getattr(parsed, option.dest)))
    assert command_configs(command, *flag_argv(option, given)) == expected


def test_every_secret_row_has_an_environment_variable():
    rows = list(flags.SERVE_OPTIONS) + [o for _, o in ROUTER_AND_UP_ROWS]
    assert {o.dest for o in rows if o.file_help is not None} == set(flags.SECRET_ENV)
    assert all(o.path.endswith(("api_key", "secret")) for o in rows if o.file_help is not None)


def test_weight_cache_is_off_for_serve_and_shared_for_up_unless_none():
    parser = flags.build_parser()

    def cache(argv: list[str], config=flags.engine_config) -> str:
        return config(parser.parse_args(argv)).model.weight_cache

    assert cache(["serve"]) == "" and cache(["serve", "--weight-cache", "none"]) == ""
    assert cache(["serve", "--weight-cache", "/w"]) == "/w"
    assert cache(["up"], flags.up_engine_config) == "~/.cache/hearth/weights"
    assert cache(["up", "--weight-cache", "none"], flags.up_engine_config) == ""
    assert cache(["up", "--weight-cache", "/w"], flags.up_engine_config) == "/w"
    # up hands its workers the directory, and a worker reads it back
    engine = flags.up_engine_config(parser.parse_args(["up"]))
    argv = flags.serve_argv(engine, ServerConfig())
    assert argv[argv.index("--weight-cache") + 1] == "~/.cache/hearth/weights"
    assert cache(["serve", *argv]) == "~/.cache/hearth/weights"
