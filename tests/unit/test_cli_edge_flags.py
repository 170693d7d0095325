"""The flags of issue 9 (aliases, CORS, access log) map onto the configs and survive the trip
`hearth up` makes them take (config -> `hearth serve` argv -> config)."""

from __future__ import annotations

from hearth.flags import build_parser, engine_config, router_config, serve_argv, server_config


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_served_model_names_and_edge_flags_reach_the_configs():
    a = parse("serve", "--served-model-name", "smol", "gpt-4o-mini", "default",
              "--allowed-origins", "http://localhost:3000", "*", "--no-access-log")
    server, engine = server_config(a), engine_config(a)
    assert server.served_model_names == ("smol", "gpt-4o-mini", "default")
    assert engine.model.served_model_name == "smol"  # the engine knows the primary name
    assert server.allowed_origins == ("http://localhost:3000", "*")
    assert server.access_log is False


def test_defaults_are_no_aliases_no_cors_and_an_access_log():
    server = server_config(parse("serve"))
    assert (server.served_model_names, server.allowed_origins, server.access_log) == ((), (), True)


def test_serve_argv_carries_aliases_and_edge_flags():
    a = parse("serve", "--served-model-name", "a", "b", "--allowed-origins", "*",
              "--no-access-log")
    argv = serve_argv(engine_config(a), server_config(a))
    assert argv[argv.index("--served-model-name") + 1:][:2] == ["a", "b"]
    back = parse("serve", *argv)
    assert server_config(back) == server_config(a)
    assert engine_config(back).model == engine_config(a).model


def test_router_flags():
    a = parse("route", "--worker", "http://127.0.0.1:1", "--served-model-name", "x", "y",
              "--allowed-origins", "http://a.example", "--no-access-log")
    config = router_config(a, workers=a.worker)
    assert config.served_model_names == ("x", "y")
    assert config.allowed_origins == ("http://a.example",) and config.access_log is False
