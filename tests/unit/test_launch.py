"""One launch path: flags -> configs (hearth/flags/) -> a worker's argv (`hearth up`) -> the same
configs; the launch modules below the CLI import nothing above their layer; and the module graph
stays legible: no import circle, no basename twice, the cluster below the flags. No model."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hearth import cli
from hearth import flags as hearth_flags
from hearth.router.up import worker_specs

SECRET_FLAGS = {"--api-key", "--api-key-file", "--kv-secret", "--kv-secret-file",
                "--worker-api-key", "--worker-api-key-file"}
ALIAS_FLAGS = {"--speculative-config"}  # its settings travel as the flags it stands for
HEARTH = Path(cli.__file__).parent


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    # argparse has no public list of a parser's options; a test may look (hearth itself does not)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def not_default(action: argparse.Action) -> list[str]:
    """`action`'s flag with a value other than its default, as a command line says it."""
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        return [flag]
    if action.nargs in ("+", "*"):
        return [flag, f"v-{action.dest}", "v-2"]
    if flag == "--speculative-config":  # vLLM's JSON form of the --speculative-* flags
        return [flag, '{"method": "ngram", "max_batch": 4}']
    if action.metavar == "JSON":  # --rope-scaling: checked as it is parsed
        return [flag, '{"rope_type": "linear", "factor": 2.0}']
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if action.type is int:
        return [flag, str((action.default or 0) + 3)]
    if action.type is float:
        return [flag, str((action.default or 0.0) * 2 + 0.25)]
    return [flag, f"v-{action.dest}"]


def every_serve_flag() -> list[str]:
    argv = []
    for action in options(hearth_flags.serve_parser()):
        if not SECRET_FLAGS & set(action.option_strings):
            argv += not_default(action)
    return argv


def configs(argv: list[str]):
    a = hearth_flags.build_parser().parse_args(["serve", *argv])
    hearth_flags.read_secrets(a, {})
    return hearth_flags.engine_config(a), hearth_flags.server_config(a)


def test_every_serve_flag_survives_the_derived_argv():
    engine, server = configs(every_serve_flag())
    argv = hearth_flags.serve_argv(engine, server)
    assert configs(argv) == (engine, server)
    written = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
    flags = {max(a.option_strings, key=len) for a in options(hearth_flags.serve_parser())}
    assert written == flags - SECRET_FLAGS - ALIAS_FLAGS  # every flag given, every flag written


def test_defaults_write_only_the_address_and_odd_values_stay_whole():
    engine, server = configs([])
    assert hearth_flags.serve_argv(engine, server) == ["--host", "127.0.0.1", "--port", "8000"]
    engine, server = configs(["--model=-dash.gguf", "--kv-peers", "a:1,b"])
    argv = hearth_flags.serve_argv(engine, server)
    assert "--model=-dash.gguf" in argv and configs(argv) == (engine, server)


def test_secrets_never_reach_the_argv():
    engine, server = configs(["--kv-secret", "kv-s3cret", "--api-key", "api-s3cret"])
    assert engine.kv_transfer.secret == "kv-s3cret" and server.api_key == "api-s3cret"
    argv = hearth_flags.serve_argv(engine, server)
    assert not [arg for arg in argv if "s3cret" in arg]
    back_engine, back_server = configs(argv)
    assert back_engine.kv_transfer.secret == "" and back_server.api_key is None


def test_a_field_no_flag_sets_is_refused_by_name():
    engine, server = configs([])
    odd = replace(engine, kv_transfer=replace(engine.kv_transfer, max_leased_fraction=0.9))
    with pytest.raises(ValueError, match=r"no flag for kv_transfer\.max_leased_fraction"):
        hearth_flags.serve_argv(odd, replace(server, cpu_threads=7))
    with pytest.raises(ValueError, match=r"cpu_threads"):
        hearth_flags.serve_argv(engine, replace(server, cpu_threads=7))


def up_args(*extra: str) -> argparse.Namespace:
    engine_flags = []
    parser = argparse.ArgumentParser()
    hearth_flags.add_engine_args(parser)
    for action in options(parser):
        flags = set(action.option_strings)
        if not SECRET_FLAGS & flags and not flags & {"--role"}:
            engine_flags += not_default(action)
    a = hearth_flags.build_parser().parse_args(["up", *engine_flags, "--max-body-mb", "9", *extra])
    hearth_flags.read_secrets(a, {})
    return a


def test_up_hands_every_engine_flag_to_each_worker_and_secrets_only_in_the_environment():
    a = up_args("--prefill", "1", "--decode", "1", "--workers", "1", "--kv-secret", "kv-s3cret",
                "--worker-arg=--kv-lease-seconds=7", "--port", "9999")
    engine, stack = hearth_flags.engine_config(a), hearth_flags.up_config(a)
    specs = worker_specs(stack, engine, hearth_flags.up_worker_server_config(a), cli.worker_command,
                         "api-s3cret", engine.kv_transfer.secret)
    assert [s.role for s in specs] == ["prefill", "decode", "both"]
    for spec in specs:
        assert spec.command[:4] == [sys.executable, "-m", "hearth.cli", "serve"]
        assert spec.command[-1] == "--kv-lease-seconds=7"  # --worker-arg goes last, verbatim
        assert not [arg for arg in spec.command if "s3cret" in arg]
        worker_engine, worker_server = configs(spec.command[4:-1])
        assert worker_engine == replace(engine, kv_transfer=replace(
            engine.kv_transfer, role=spec.role, secret=""))
        assert (worker_server.host, worker_server.port) == ("127.0.0.1", spec.port)
        assert worker_server.max_body_bytes == 9 * 2**20  # shared with the router's flag
        assert worker_server.max_waiting == a.max_waiting
        assert spec.env["HEARTH_API_KEY"] == "api-s3cret"
        assert spec.env.get("HEARTH_KV_SECRET") == (None if spec.role == "both" else "kv-s3cret")
    router = hearth_flags.router_config(a)
    assert (router.port, router.tokenizer_model, router.policy.block_size) == \
        (9999, engine.model.model, engine.cache.block_size)
    assert (router.prefill, router.decode, router.workers) == ((), (), ())  # up adds its workers


def test_up_gives_workers_the_routers_doorway_timeouts_and_no_per_address_cap():
    a = up_args("--header-timeout", "3", "--body-timeout", "4", "--keep-alive-timeout", "6",
                "--max-connections-per-ip", "9")
    router = hearth_flags.router_config(a).doorway
    assert (router.header_timeout_seconds, router.body_timeout_seconds, router.keep_alive_seconds,
            router.max_connections_per_ip) == (3, 4, 6, 9)
    specs = worker_specs(hearth_flags.up_config(a), hearth_flags.engine_config(a),
                         hearth_flags.up_worker_server_config(a), cli.worker_command, "k", "s")
    for spec in specs:  # every hop comes from the router's one address: no cap on the workers
        assert configs(spec.command[4:])[1].doorway == replace(router, max_connections_per_ip=0)


@pytest.mark.parametrize("flags, error", [
    (("--prefill", "1", "--decode", "0"), "needs --decode >= 1 or --workers >= 1"),
    (("--prefill", "1", "--decode", "0", "--workers", "1"), "need --decode workers"),
])
def test_up_refuses_a_stack_without_decoders(flags, error):
    a = up_args(*flags)
    with pytest.raises(ValueError, match=error):
        worker_specs(hearth_flags.up_config(a), hearth_flags.engine_config(a), hearth_flags.up_worker_server_config(a),
                     cli.worker_command, "k", "s")


# Every flag each command had before the flags moved into hearth/cli.py (issue 10).
FLAGS_BEFORE = {
    "serve": """--api-key --api-key-file --block-size --collective-timeout --cpu-kernels --device
        --dtype --host --kv-advertise-host --kv-cache-dtype --kv-cache-memory-gb --kv-host
        --kv-lease-seconds --kv-peers --kv-port --kv-secret --kv-secret-file --kv-transport
        --log-level --max-body-mb --max-model-len --max-num-batched-tokens --max-num-seqs
        --max-waiting --model --no-guided-auto-tools --no-prefix-caching --num-kv-blocks
        --num-micro-batches --pipeline-parallel-size --port --quantization --role --seed
        --served-model-name --tensor-parallel-size --tool-call-parser -pp -tp""",
    "up": """--affinity-max-cost-ratio --api-key --api-key-file --block-size --collective-timeout
        --connect-timeout --cpu-kernels --decode --decode-weight --device --disagg-threshold
        --dtype --eject-seconds --health-interval --health-timeout --host --kv-advertise-host
        --kv-cache-dtype --kv-cache-memory-gb --kv-host --kv-lease-seconds --kv-peers --kv-port
        --kv-secret --kv-secret-file --kv-transport --log-dir --log-level --max-body-mb
        --max-model-len --max-num-batched-tokens --max-num-seqs --max-restarts --max-retries
        --max-waiting --min-disagg-tokens --model --no-prefix-caching --num-kv-blocks
        --num-micro-batches --pin --pipeline-parallel-size --policy --port --prefill
        --prefill-weight --quantization --request-timeout --restart-backoff --restart-window
        --role --seed --served-model-name --show-worker-urls --startup-timeout
        --stream-idle-timeout --tensor-parallel-size --transfer-weight --worker-api-key
        --worker-api-key-file --worker-arg --workers -pp -tp""",
    "route": """--affinity-max-cost-ratio --api-key --api-key-file --block-size --connect-timeout
        --decode --decode-weight --disagg-threshold --eject-seconds --health-interval
        --health-timeout --host --log-level --max-body-mb --max-retries --min-disagg-tokens
        --model --policy --port --prefill --prefill-weight --request-timeout --served-model-name
        --show-worker-urls --stream-idle-timeout --transfer-weight --worker --worker-api-key
        --worker-api-key-file""",
}


@pytest.mark.parametrize("command", sorted(FLAGS_BEFORE))
def test_every_flag_a_command_had_is_still_there(command, capsys):
    with pytest.raises(SystemExit):
        hearth_flags.build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]  # lists every option by its first name
    aliases = re.findall(r", (-{1,2}[a-z][\w-]*)", text)  # "--tensor-parallel-size N, -tp N"
    listed = set(re.findall(r"\[(-{1,2}[a-z][\w-]*)", usage)) | set(aliases)
    assert set(FLAGS_BEFORE[command].split()) - listed == set()


# ---- layers -----------------------------------------------------------------------------------

# DESIGN.md's import order, lowest first (bench, the load generator, sits beside the CLI; cluster
# sits below flags, which builds its ClusterConfig and hands it `serve_argv`)
LAYERS = ["config", "ops", "models", "engine", "kv_transfer", "kv_tiers", "api", "server", "router",
          "cluster", "bench", "flags", "cli"]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "hearth" and len(parts) > 1 else None


def upward_imports(path: Path) -> list[str]:
    """Imports in `path` (at any depth: function-level ones count) of a higher layer."""
    module = ".".join(path.relative_to(HEARTH.parent).with_suffix("").parts)
    mine = layer_of(module)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
        for name in names:
            other = layer_of(name)
            if mine in LAYERS and other in LAYERS and LAYERS.index(other) > LAYERS.index(mine):
                found.append(f"{module}:{node.lineno} imports {name}")
    return found


def test_no_module_imports_a_layer_above_its_own():
    paths = [p for p in HEARTH.rglob("*.py") if p.name != "__init__.py" or p.parent != HEARTH]
    assert [line for p in sorted(paths) for line in upward_imports(p)] == []


def module_name(path: Path) -> str:
    parts = path.relative_to(HEARTH.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in HEARTH.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The hearth modules `path` imports, at any depth (a function-level import hides a circle,
    it does not remove one) but outside `if TYPE_CHECKING:` (never run). `from p import x`
    names the module p.x when x is one, else p; a parent package's own run is not counted."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level` - 1 steps up
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                         for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in MODULES and name != module}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_the_circle_finder_finds_a_circle_and_only_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_hearth_modules():
    graph = {module: imported_modules(path) for module, path in MODULES.items()}
    assert graph["hearth.server.serving_chat"] >= {"hearth.server.tool_parsers"}  # it sees edges
    assert import_circles(graph) == []


def test_no_module_basename_twice():
    """A module is named after what it holds: two different things never share a file name
    (a package's __init__.py aside), so a name says its room without its folder.
    A model family's folder (hearth/models/families/NAME/) names its files by their role, the
    same in every family (model.py, arch_fields.py, loading.py): those count once, as one thing, but
    may not share a name with any module outside the family folders."""
    families = HEARTH / "models" / "families"
    folders: dict[str, set[str]] = {}
    for path in sorted(HEARTH.rglob("*.py")):
        if path.name != "__init__.py":
            room = ("hearth/models/families/*" if path.parent.parent == families
                    else str(path.parent.relative_to(HEARTH.parent)))
            folders.setdefault(path.name, set()).add(room)
    assert {name: where for name, where in folders.items() if len(where) > 1} == {}


def test_the_cluster_never_imports_the_flags():
    """hearth/flags/ builds the cluster's ClusterConfig and hands it `serve_argv`; an arrow back
    (at any depth, __init__.py included) would make the two one knot."""
    cluster = [p for p in MODULES.values() if p.is_relative_to(HEARTH / "cluster")]
    assert len(cluster) > 5
    assert {module_name(p): sorted(m for m in imported_modules(p) if m.startswith("hearth.flags"))
            for p in cluster} == {module_name(p): [] for p in cluster}


@pytest.mark.parametrize("module, above", [
    ("hearth.server.worker_launch", ("hearth.cli", "hearth.flags", "hearth.router")),
    ("hearth.server.core_main", ("hearth.cli", "hearth.flags", "hearth.router",
                                  "hearth.kv_transfer", "hearth.kv_tiers")),
    ("hearth.router.router_launch", ("hearth.cli", "hearth.flags")),
    ("hearth.router.up", ("hearth.cli", "hearth.flags")),
])
def test_launch_module_imports_alone_without_the_layers_above(module, above):
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120).stdout.split()
    assert [m for m in loaded if m.split(".")[0] == "torch" or m.startswith(above)] == []


def test_a_cluster_worker_gets_its_flags_from_the_serve_argv_handed_down(tmp_path):
    """What `hearth up --cluster` hands the worker actor (hearth/flags/'s serve_argv) rebuilds
    the worker's configs on its node: its role and address, the peers file, no secret. No Ray."""
    from hearth.cluster.worker_actor import WorkerProcess

    engine, server = configs(["--kv-secret", "kv-s3cret", "--max-num-seqs", "5"])
    actor = WorkerProcess("decode-0", "decode", engine, server, ("--seed", "7"),
                          hearth_flags.serve_argv, "registry", "hearth", 0, ())
    actor.peers_path = tmp_path / "w.peers"
    command = actor._command("10.0.0.2", 8123)
    assert command[:4] == [sys.executable, "-m", "hearth.cli", "serve"]
    assert command[-2:] == ["--seed", "7"] and not [a for a in command if "s3cret" in a]
    worker_engine, worker_server = configs(command[4:-2])
    assert (worker_server.host, worker_server.port, worker_server.api_key) == ("10.0.0.2", 8123, None)
    assert worker_engine.kv_transfer.role.value == "decode"
    assert worker_engine.kv_transfer.peers_file == str(tmp_path / "w.peers")
    assert worker_engine.scheduler.max_num_seqs == 5
