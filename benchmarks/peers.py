"""hearth side by side with vLLM-CPU and llama.cpp's llama-server: one server at a time, one run.

Each server is freshly started, timed to its first healthy /health (cold start), warmed with one
short request, then measured over the OpenAI HTTP API (streaming, a fresh connection per request,
output length pinned with max_tokens + ignore_eos). Figures (--figures, all by default):

  cold       process start -> first 200 on /health (or /v1/models); repeats restart the server
  prefill    prompt tok/s of a ~2k-token prompt: usage.prompt_tokens / TTFT with max_tokens=1
  decode100  single-stream decode tok/s at ~100 tokens of context: (completion_tokens - 1) /
             (last token time - first token time)
  decode6k   the same at ~6,000 tokens of context (--long-context-words): one long prompt per
             server whose repeats differ only in a short tail (a prefix hit after the first; only
             the decode after the prefill is timed; distinct outputs, so no draft copies one)
  prefilllong  prompt tok/s of a fresh prompt of --long-context-words (unique head per repeat)
  turn       TTFT (s) of a later agent turn: the long prompt (decode6k's, cached: sent again
             untimed unless decode6k or turn sent it last, not prefilllong, whose fresh long
             prompts may evict it) + an assistant reply + a new user turn of
             --turn-words, max_tokens=1 -- ~1k tokens of work plus attention over the prefix
  batch8     8 concurrent streams, short distinct prompts: total output tokens / wall; ITL p50, p90
  batch32    the same with 32
  agent      real agent sessions from ../shared/traces replayed 8 at once (hearth/bench/agent_replay.py
             for the scaling): wall, output tok/s, cached_tokens hit ratio vs the infinite-cache
             ceiling, TTFT p50/p90 of later turns (a session's every turn but its first), ITL p90
             (between content chunks); on hearth also where a TTFT went (queue, earlier prompt
             chunks, the first-token step, outside the engine: means off /metrics)
  neighbour  decode100 while a spinning python process is pinned (taskset) to the last core

Every figure is measured --repeats times with distinct prompts (--rounds N: every server N times
in turn, samples pooled); tables give min and median, the
ratio table divides hearth's median by each peer's. JSON and a PNG go to benchmarks/results/.

usage (peers installed per ../shared/peers/README.md):
  .venv/bin/python benchmarks/peers.py [--servers hearth,hearth-bf16,vllm,vllm-bf16,llamacpp]
      [--figures cold,prefill,decode100,decode6k,batch8,batch32,agent,neighbour] [--repeats 3]
      [--hearth-args "--dtype bfloat16"] [--server NAME='CMD with {port}' ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import RequestResult, model_of, stream_chat, words  # noqa: E402

from hearth.bench import agent_replay, peer_report  # noqa: E402
from hearth.bench.peer_servers import add_peer_path_args, hearth_argv, llama_argv, vllm_argv, vllm_env  # noqa: E402
from hearth.bench.server_process import (ServerSpec, ServerStartError, start_busy_neighbour,  # noqa: E402
                                         start_server, stop_busy_neighbour, stop_server)

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent
FIGURES = ("cold", "prefill", "decode100", "decode6k", "prefilllong", "turn", "batch8", "batch32",
           "agent", "neighbour")


def builtin_servers(args: argparse.Namespace) -> dict[str, ServerSpec]:
    hearth = hearth_argv(extra=shlex.split(args.hearth_args))
    vllm = vllm_argv(args.vllm_python, args.hf_model, extra=[
        "--enable-prefix-caching", "--enable-prompt-tokens-details", *shlex.split(args.vllm_args)])
    llama = llama_argv(args.llama_server, args.gguf, 65536, 32, unified_kv=True, per_slot_context=8192,
                       extra=shlex.split(args.llamacpp_args))
    return {
        "hearth": ServerSpec("hearth", tuple(hearth), 8100),
        "hearth-bf16": ServerSpec("hearth-bf16", (*hearth, "--dtype", "bfloat16"), 8100),
        "vllm": ServerSpec("vllm", (*vllm, "--dtype", "float32"), 8102, vllm_env()),
        "vllm-bf16": ServerSpec("vllm-bf16", (*vllm, "--dtype", "bfloat16"), 8102, vllm_env()),
        "llamacpp": ServerSpec("llamacpp", tuple(llama), 8101),
    }


def prompt(tag: str, num_words: int) -> list[dict]:
    rng = random.Random(tag)  # a unique head per tag: prefix caches must not turn this into a cache test
    return [{"role": "user", "content": f"Request {tag} {rng.random():.9f}: " + words(rng, num_words)}]


def checked(result: RequestResult, what: str) -> RequestResult:
    if not result.ok:
        raise RuntimeError(f"{what}: {result.error or 'no content streamed'}")
    return result


def decode_rate(result: RequestResult) -> float:
    span = sum(result.itls)  # first content chunk -> last one
    return (result.output_tokens - 1) / span if span > 0 else float("nan")


async def ttft_part_totals(url: str) -> dict[str, tuple[float, float]]:
    """hearth's TTFT-part histograms (sum, count) off /metrics; empty for a peer or on error."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return {}
    return peer_report.histogram_totals(response.text) if response.status_code == 200 else {}


class Bench:
    """The figures of one running server; each method returns one repeat's record."""

    def __init__(self, url: str, model: str, args: argparse.Namespace, name: str):
        self.url, self.model, self.args, self.name = url, model, args, name
        self.long_prompt = prompt(f"{name}-long", args.long_context_words)
        self.long_cached = False  # the long prompt has been sent (decode6k or turn)

    async def chat(self, messages: list[dict], max_tokens: int) -> RequestResult:
        return await stream_chat(self.url, self.model, messages, max_tokens, {})

    async def prefill(self, rep: int) -> dict:
        r = checked(await self.chat(prompt(f"{self.name}-prefill-{rep}", self.args.prefill_words), 1), "prefill")
        return {"value": r.prompt_tokens / r.ttft, "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft}

    async def decode(self, messages: list[dict]) -> dict:
        r = checked(await self.chat(messages, self.args.decode_tokens), "decode")
        return {"value": decode_rate(r), "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens, "ttft_s": r.ttft}

    async def decode100(self, rep: int) -> dict:
        return await self.decode(prompt(f"{self.name}-short-{rep}", self.args.short_context_words))

    async def decode6k(self, rep: int) -> dict:
        # The long part is shared (a prefix hit after the first repeat), the request's own tail
        # is not: an identical request would repeat the first one's output, which suffix drafts
        # (hearth's default speculation) then accept wholesale -- a copy, not a decode rate.
        long = self.long_prompt[0]["content"]
        tail = prompt(f"{self.name}-long-tail-{rep}", 8)[0]["content"]
        result = await self.decode([{"role": "user", "content": f"{long}\n{tail}"}])
        self.long_cached = True
        return result

    async def prefilllong(self, rep: int) -> dict:
        r = checked(await self.chat(prompt(f"{self.name}-prefill-long-{rep}", self.args.long_context_words), 1),
                    "long prefill")
        self.long_cached = False  # a server's cache may have given the long prompt's room to this one
        return {"value": r.prompt_tokens / r.ttft, "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft}

    async def turn(self, rep: int) -> dict:
        if not self.long_cached:  # the session so far, not timed
            checked(await self.chat(self.long_prompt, 1), "turn: the long prompt")
            self.long_cached = True
        new = prompt(f"{self.name}-turn-{rep}", self.args.turn_words)[0]["content"]
        messages = [*self.long_prompt, {"role": "assistant", "content": "Done: the file is updated."},
                    {"role": "user", "content": new}]
        # 4 tokens, TTFT at the first content: with one, this model's first token here is
        # often one that streams no text (both servers then report nothing to time)
        r = checked(await self.chat(messages, 4), "turn")
        return {"value": r.ttft, "prompt_tokens": r.prompt_tokens}

    async def batch(self, rep: int, width: int) -> dict:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            self.chat(prompt(f"{self.name}-b{width}-{rep}-{i}", self.args.short_context_words),
                      self.args.batch_tokens) for i in range(width)))
        wall = time.perf_counter() - start
        for r in results:
            checked(r, f"batch{width}")
        itls = [x for r in results for x in r.itls]
        return {"value": sum(r.output_tokens for r in results) / wall, "wall_s": wall,
                "itl_median_ms": 1000 * statistics.median(itls),
                "itl_p90_ms": 1000 * peer_report.quantile(itls, 0.9)}

    async def batch8(self, rep: int) -> dict:
        return await self.batch(rep, 8)

    async def batch32(self, rep: int) -> dict:
        return await self.batch(rep, 32)

    async def agent(self, rep: int) -> dict:
        sessions = agent_replay.load_sessions(self.args.traces, self.args.replay, salt=f"{self.name}-{rep}")
        sent: list[agent_replay.ReplayRequest] = []  # send order, for the ceiling
        results: list[RequestResult] = []
        later: list[float] = []  # TTFT of every turn but a session's first

        async def session(requests: list[agent_replay.ReplayRequest]) -> None:
            for request in requests:
                await asyncio.sleep(request.think_seconds)
                sent.append(request)
                messages = [{"role": "user", "content": request.prompt}]
                results.append(result := await self.chat(messages, request.max_tokens))
                if request.index > 0 and result.ok:
                    later.append(result.ttft)

        parts_before = await ttft_part_totals(self.url)
        start = time.perf_counter()
        await asyncio.gather(*(session(s) for s in sessions))
        wall = time.perf_counter() - start
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"agent: {len(failed)} of {len(results)} failed, e.g. {failed[0].error}")
        prompt_tokens = sum(r.prompt_tokens for r in results)
        itls = [x for r in results for x in r.itls]
        return {"value": wall, "num_requests": len(results),
                "output_tok_s": sum(r.output_tokens for r in results) / wall,
                "prompt_tokens": prompt_tokens,
                "hit_ratio": sum(r.cached_tokens for r in results) / max(1, prompt_tokens),
                "hit_ceiling": agent_replay.hit_ceiling(sent),
                "ttft_median_s": statistics.median(r.ttft for r in results),
                "later_ttft_p50_s": statistics.median(later) if later else float("nan"),
                "later_ttft_p90_s": peer_report.quantile(later, 0.9),
                "itl_p90_ms": 1000 * peer_report.quantile(itls, 0.9),
                # hearth only: where a TTFT went, mean per request of this replay (all turns)
                **peer_report.ttft_part_means(parts_before, await ttft_part_totals(self.url))}

    async def neighbour(self, rep: int) -> dict:
        spinner = start_busy_neighbour(os.cpu_count() - 1)
        try:
            await asyncio.sleep(0.5)
            return await self.decode(prompt(f"{self.name}-neighbour-{rep}", self.args.short_context_words))
        finally:
            stop_busy_neighbour(spinner)


async def measure_server(spec: ServerSpec, args: argparse.Namespace, first_rep: int = 0) -> dict:
    log = RESULTS / f"peers-{spec.name}.log"
    record: dict = {"command": shlex.join(spec.command()), "env": spec.env, "figures": {}}
    print(f"\n## {spec.name}: {record['command']}", flush=True)
    try:
        server = start_server(spec, log, args.start_timeout)
    except ServerStartError as exc:
        print(f"   not measured: {exc}", flush=True)
        return {**record, "error": str(exc)}
    cold = [server.cold_start_s]
    print(f"   cold start {server.cold_start_s:.1f} s", flush=True)
    try:
        await measure_figures(spec, args, record, first_rep)
    except (httpx.HTTPError, RuntimeError) as exc:  # the server broke: keep what was measured
        print(f"   stopped measuring: {exc}", flush=True)
        record["error"] = str(exc)
    finally:
        stop_server(server)
    if "cold" in args.figures:
        for _ in range(args.repeats - 1):
            try:
                restarted = start_server(spec, log.with_suffix(".restart.log"), args.start_timeout)
            except ServerStartError as exc:
                print(f"   restart failed: {exc}", flush=True)
                break
            cold.append(restarted.cold_start_s)
            stop_server(restarted)
        record["figures"]["cold"] = [{"value": c} for c in cold]
    return record


async def measure_figures(spec: ServerSpec, args: argparse.Namespace, record: dict,
                          first_rep: int = 0) -> None:
    bench = Bench(spec.url, await model_of(spec.url, {}), args, spec.name)
    checked(await bench.chat(prompt(f"{spec.name}-warmup", 16), 8), "warm-up")  # not timed
    for figure in (f for f in args.figures if f != "cold"):
        runs = record["figures"][figure] = []
        for rep in range(first_rep, first_rep + args.repeats):
            try:
                runs.append(await getattr(bench, figure)(rep))
            except RuntimeError as exc:
                runs.append({"value": float("nan"), "error": str(exc)})
            print(f"   {figure} #{rep}: " + peer_report.brief(runs[-1]), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="hearth,vllm,vllm-bf16,llamacpp",
                   help="built-ins: hearth, hearth-bf16, vllm, vllm-bf16, llamacpp; or names given by --server")
    p.add_argument("--server", action="append", default=[], metavar="NAME=CMD",
                   help="define a server: a command line holding {port}; NAME starting with 'hearth' "
                        "counts as hearth in the ratio table (repeatable)")
    p.add_argument("--port", type=int, default=8110, help="port of --server definitions")
    p.add_argument("--figures", default=",".join(FIGURES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every server this many times in turn (order reversed each "
                        "round), --repeats each time, samples pooled: a slow spell of a shared "
                        "machine then hits every server, not just the one measured during it")
    p.add_argument("--hearth-args", default="", help="extra arguments of `hearth serve`")
    add_peer_path_args(p)
    p.add_argument("--vllm-args", default="")
    p.add_argument("--llamacpp-args", default="")
    p.add_argument("--prefill-words", type=int, default=2000, help="~1 token per word")
    p.add_argument("--short-context-words", type=int, default=90)
    p.add_argument("--long-context-words", type=int, default=6000)
    p.add_argument("--turn-words", type=int, default=1000, help="the new user turn of `turn`")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=64, help="output tokens per stream in batch8/32")
    p.add_argument("--traces", default=str(REPO.parent / "shared/traces"))
    p.add_argument("--agent-sessions", type=int, default=8)
    p.add_argument("--agent-requests", type=int, default=8, help="per session")
    p.add_argument("--agent-tokens-per-block", type=int, default=4)
    p.add_argument("--agent-think-scale", type=float, default=0.0)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--no-roofline", action="store_true", help="skip the GEMM/bandwidth probe in the header")
    p.add_argument("--out", default=str(RESULTS / "peers"), help="prefix of the .json and .png")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="measure nothing: merge the servers of earlier runs' JSON into one report")
    args = p.parse_args()
    args.figures = [f for f in args.figures.split(",") if f]
    unknown = set(args.figures) - set(FIGURES)
    if unknown:
        p.error(f"unknown figures {sorted(unknown)}; known: {', '.join(FIGURES)}")
    args.replay = agent_replay.ReplayConfig(
        num_sessions=args.agent_sessions, requests_per_session=args.agent_requests,
        tokens_per_block=args.agent_tokens_per_block, think_time_scale=args.agent_think_scale)
    return args


def write_report(report: dict, out: Path) -> None:
    print(peer_report.format_report(report), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    if peer_report.plot(report, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def main() -> None:
    args = parse_args()
    if args.from_json:
        reports = [json.loads(Path(f).read_text()) for f in args.from_json]
        merged = {"header": reports[0]["header"], "servers": {}, "merged_from": args.from_json}
        for r in reports:
            merged["servers"].update(r["servers"])
        print(peer_report.format_header(merged["header"]) + "\n(merged runs: compare only runs of one machine)")
        write_report(merged, Path(args.out))
        return
    specs = builtin_servers(args)
    for i, definition in enumerate(args.server):
        name, _, command = definition.partition("=")
        specs[name] = ServerSpec(name, tuple(shlex.split(command)), args.port + i)
    names = [n for n in args.servers.split(",") if n]
    missing = [n for n in names if n not in specs]
    if missing:
        sys.exit(f"unknown servers {missing}; known: {', '.join(specs)}")
    header = peer_report.machine_header(probe_roofline=not args.no_roofline)
    header["agent_scaling"] = args.replay.describe()
    print(peer_report.format_header(header), flush=True)
    servers: dict[str, dict] = {}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if args.rounds > 1:
                print(f"\n# round {r + 1}/{args.rounds}", flush=True)
            record = asyncio.run(measure_server(specs[name], args, r * args.repeats))
            if name not in servers:
                servers[name] = record
                continue
            for figure, runs in record["figures"].items():
                servers[name]["figures"].setdefault(figure, []).extend(runs)
            if "error" in record:
                servers[name]["error"] = record["error"]
    report = {"header": header, "args": {k: v for k, v in vars(args).items() if k != "replay"},
              "servers": servers}
    write_report(report, Path(args.out))


if __name__ == "__main__":
    main()
