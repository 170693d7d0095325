"""`hearth serve | route | up | scale | generate | bench`: what each sub-command runs.

The flags are declared and mapped onto configs in hearth/flags/ (the one module that reads
flags and the environment they fall back to); this module is the console script's entry point
(`hearth = "hearth.cli:main"`, also `python -m hearth.cli`): `main` parses, then hands the
configs to the layer that runs them: `serve` (hearth/server/worker_launch.py), `route`
(hearth/router/router_launch.py), `up` (hearth/router/up.py, or with `--cluster` hearth/cluster/commands.py),
`scale` (hearth/cluster/commands.py), the offline `LLM` or the engine
benchmark. Under torchrun every rank but 0 serves the driver's steps instead (`_serve_rank`).
`hearth up` starts its workers as `python -m hearth.cli serve ...` (`worker_command`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hearth.config import EngineConfig
from hearth.flags import (build_parser, cluster_config, engine_config, read_secrets,
                          router_config, serve_argv, server_config, torchrun_env, up_config,
                          up_engine_config, up_worker_server_config)
from hearth.logs import setup_logging
from hearth.server.server_config import ServerConfig


def cmd_serve(a: argparse.Namespace) -> int:
    from hearth.server.engine_client import spawn_core  # no FastAPI, no torch: ~0.1 s

    engine, server = engine_config(a), server_config(a)
    # The engine core imports torch and loads the model while this process imports its HTTP
    # stack and builds the tokenizer: on two cores that overlap is ~1 s of a cold start.
    core = spawn_core(engine, server.log_level.upper())
    try:
        from hearth.server.worker_launch import serve

        return serve(engine, server, core)
    finally:
        if core.process.poll() is None:  # the server failed before its engine client took over
            core.kill()


def cmd_route(a: argparse.Namespace) -> int:
    from hearth.router.router_launch import route

    if not a.decode and not a.worker:
        raise ValueError("hearth route needs at least one --decode or --worker URL")
    if a.prefill and not a.decode:
        raise ValueError("--prefill endpoints need --decode endpoints to hand their KV to")
    return route(router_config(a, a.prefill, a.decode, a.worker, a.worker_api_key))


def cmd_up(a: argparse.Namespace) -> int:
    if a.cluster is not None:  # Ray is imported only on this path
        from hearth.cluster.commands import up_cluster

        return up_cluster(cluster_config(a), up_config(a), engine_config(a),
                          up_worker_server_config(a), router_config(a), serve_argv)
    from hearth.router.up import up

    return up(up_config(a), up_engine_config(a), up_worker_server_config(a), router_config(a),
              worker_command)


def cmd_scale(a: argparse.Namespace) -> int:
    from hearth.cluster.commands import scale

    targets = {role: n for role, n in (("prefill", a.prefill), ("decode", a.decode),
                                       ("both", a.workers)) if n is not None}
    status = scale(cluster_config(a), targets, a.wait, a.timeout)
    print(json.dumps(status, indent=1))
    return 0


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


def cmd_bench(a: argparse.Namespace) -> int:
    from hearth.bench.engine_bench import format_table, plot, run_engine_bench

    rows = run_engine_bench(
        a.model, a.dtype, prefill_len=512 if a.quick else a.prefill_tokens,
        new_tokens=16 if a.quick else a.new_tokens,
        batches=tuple(int(b) for b in a.batches.split(",")),
        compare_transformers=a.compare == "transformers",
        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps([[r.metric, r.hearth, r.transformers] for r in rows],
                                           indent=1))
    if a.plot:
        plot(rows, a.plot, f"hearth vs transformers, {a.model}, {a.dtype}, CPU")
    return 0


def worker_command(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """argv of a `hearth serve` child that serves `engine` and `server` (hearth up's workers)."""
    module = __spec__.name if __spec__ is not None else "hearth.cli"
    return [sys.executable, "-m", module, "serve", *serve_argv(engine, server)]


COMMANDS = {"serve": cmd_serve, "route": cmd_route, "up": cmd_up, "generate": cmd_generate,
            "bench": cmd_bench, "scale": cmd_scale}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging("info")
    try:
        read_secrets(a)
    except ValueError as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2
    a.launcher = torchrun_env(os.environ) if hasattr(a, "tensor_parallel_size") else None
    if a.launcher is not None and a.launcher["rank"] != 0:
        return _serve_rank(a)
    try:
        return COMMANDS[a.command](a)
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        print(f"hearth: error: {exc}", file=sys.stderr)
        return 2


def _serve_rank(a: argparse.Namespace) -> int:
    """A torchrun rank other than 0: join the driver's rank set and run its steps."""
    from hearth.engine.parallel.rank import RankSpec, serve_rank

    parallel = engine_config(a).parallel  # validates the world size
    launcher = a.launcher
    return serve_rank(RankSpec(
        rank=launcher["rank"], tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        store_host=parallel.master_addr, store_port=parallel.master_port, store_is_master=False,
        device=parallel.device, local_rank=launcher["local_rank"],
        timeout_s=parallel.collective_timeout_s))


if __name__ == "__main__":
    sys.exit(main())
