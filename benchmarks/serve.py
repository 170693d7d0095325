"""Streaming load generator against any OpenAI-compatible server (hearth, vLLM, llama-server).

Two workloads, each measured per target and printed as one table:

  steady   fixed-size prompts at concurrency 1, 8, 32 (default): TTFT, inter-token latency
           (ITL, between streamed content chunks) p50/p90/p99, output tokens/s, requests/s
  agent    S concurrent sessions sharing a ~1,500-token system prompt that lists tools; each
           session's history grows over T turns (user turn, assistant answer, tool-result turn):
           TTFT per turn, ITL, output tokens/s, and the prefix-cache hit ratio where the server
           reports usage.prompt_tokens_details.cached_tokens

Every request streams with stream_options.include_usage and opens a fresh connection (some
servers were seen failing on reused keep-alive sockets). Output length is pinned with
max_tokens + ignore_eos so servers are compared on equal work.

usage:
  python benchmarks/serve.py --target hearth=http://127.0.0.1:8000 \\
      [--target vllm=http://127.0.0.1:8102 --target llamacpp=http://127.0.0.1:8101] \\
      [--workload steady,agent] [--concurrency 1,8,32] [--prompt-tokens 512] [--max-tokens 64] \\
      [--sessions 8 --turns 4] [--json-out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact table river stone light music garden window paper "
         "market letter road engine system model token cache server agent answer question").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first content chunk
    itls: list[float] = field(default_factory=list)  # seconds between content chunks
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""


@dataclass
class Row:
    target: str
    workload: str
    concurrency: int
    num_ok: int
    num_failed: int
    wall_seconds: float
    ttft_ms: tuple[float, float, float]
    itl_ms: tuple[float, float, float]
    output_tok_s: float
    requests_s: float
    cache_hit: float | None


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def pcts(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return (statistics.median(ordered) * 1000, pick(0.90) * 1000, pick(0.99) * 1000)


async def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int,
                      headers: dict) -> RequestResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    result, start, last = RequestResult(ok=False), time.perf_counter(), None
    limits = httpx.Limits(max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            result.text += content
                            if last is None:
                                result.ttft = now - start
                            else:
                                result.itls.append(now - last)
                            last = now
                    usage = chunk.get("usage")
                    if usage:
                        result.prompt_tokens = usage.get("prompt_tokens", 0)
                        result.output_tokens = usage.get("completion_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    if not result.output_tokens:
        result.output_tokens = len(result.itls) + (1 if result.ok else 0)
    return result


def summarize(target: str, workload: str, concurrency: int, results: list[RequestResult],
              wall: float) -> Row:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{target} {workload} c={concurrency}: {len(failed)} failed, e.g. {failed[0].error}")
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return Row(
        target=target, workload=workload, concurrency=concurrency, num_ok=len(ok),
        num_failed=len(results) - len(ok), wall_seconds=wall,
        ttft_ms=pcts([r.ttft for r in ok]), itl_ms=pcts([x for r in ok for x in r.itls]),
        output_tok_s=sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        requests_s=len(ok) / wall if wall else 0.0,
        cache_hit=(cached / prompt) if prompt and any(r.cached_tokens for r in ok) else None,
    )


async def run_steady(target: str, url: str, model: str, headers: dict, concurrency: int,
                     num_requests: int, prompt_tokens: int, max_tokens: int, seed: int) -> Row:
    rng = random.Random(seed)
    # Distinct prompts (a unique head) so the prefix cache does not turn this into a cache test.
    prompts = [f"Request {i} {rng.random():.6f}: " + words(rng, prompt_tokens) for i in range(num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            messages = [{"role": "user", "content": prompt}]
            results.append(await stream_chat(url, model, messages, max_tokens, headers))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(target, f"steady p{prompt_tokens}", concurrency, results, time.perf_counter() - start)


def agent_system_prompt(rng: random.Random, target_tokens: int = 1500) -> str:
    tools = [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')}: " + words(rng, 20),
        "parameters": {"type": "object", "properties": {
            arg: {"type": "string", "description": words(rng, 8)} for arg in ("path", "query", "limit")},
            "required": ["path"]}}} for name in
        ("read_file", "write_file", "search_code", "run_tests", "list_directory", "git_diff")]
    tool_text = "\n".join(json.dumps(t) for t in tools)
    filler = words(rng, max(0, target_tokens - len(tool_text) // 3 - 60))
    return ("You are a coding agent. Use the tools below to inspect and change the repository. "
            "Answer concisely.\n# Tools\n<tools>\n" + tool_text + "\n</tools>\n# Guidelines\n" + filler)


async def run_agent(target: str, url: str, model: str, headers: dict, num_sessions: int,
                    num_turns: int, max_tokens: int, seed: int) -> tuple[Row, list[float]]:
    rng = random.Random(seed)
    system = agent_system_prompt(rng)
    results_by_turn: list[list[RequestResult]] = [[] for _ in range(num_turns)]

    async def session(index: int) -> None:
        local = random.Random(seed * 1000 + index)
        messages = [{"role": "system", "content": system}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": f"Session {index} task {turn}: " + words(local, 120)})
            result = await stream_chat(url, model, messages, max_tokens, headers)
            results_by_turn[turn].append(result)
            messages.append({"role": "assistant", "content": result.text or "ok"})
            messages.append({"role": "user", "content": "Tool result: " + words(local, 150)})

    start = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(num_sessions)))
    wall = time.perf_counter() - start
    flat = [r for turn in results_by_turn for r in turn]
    ttft_by_turn = [pcts([r.ttft for r in turn if r.ok])[0] for turn in results_by_turn]
    row = summarize(target, f"agent {num_sessions}x{num_turns}", num_sessions, flat, wall)
    return row, ttft_by_turn


async def model_of(url: str, headers: dict) -> str:
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        response = await client.get(url + "/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def print_table(rows: list[Row]) -> None:
    header = (f"{'target':<10}{'workload':<15}{'conc':>5}{'ok':>5}{'fail':>5}"
              f"{'TTFT p50/p90/p99 ms':>24}{'ITL p50/p90/p99 ms':>24}{'out tok/s':>11}{'req/s':>8}{'cache':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ttft = "/".join(f"{v:.0f}" for v in r.ttft_ms)
        itl = "/".join(f"{v:.0f}" for v in r.itl_ms)
        cache = f"{r.cache_hit:.0%}" if r.cache_hit is not None else "-"
        print(f"{r.target:<10}{r.workload:<15}{r.concurrency:>5}{r.num_ok:>5}{r.num_failed:>5}"
              f"{ttft:>24}{itl:>24}{r.output_tok_s:>11.1f}{r.requests_s:>8.2f}{cache:>7}")


async def main(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: list[Row] = []
    turn_ttfts: dict[str, list[float]] = {}
    for spec in args.target:
        name, _, url = spec.partition("=")
        url = url.rstrip("/")
        model = args.model or await model_of(url, headers)
        workloads = args.workload.split(",")
        if "steady" in workloads:
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                num_requests = max(args.min_requests, concurrency * args.requests_per_slot)
                # A seed per level: levels must not hit each other's cached prompts.
                rows.append(await run_steady(name, url, model, headers, concurrency, num_requests,
                                             args.prompt_tokens, args.max_tokens,
                                             args.seed * 1000 + concurrency))
                if args.verbose:
                    print_table(rows[-1:])
        if "agent" in workloads:
            row, ttfts = await run_agent(name, url, model, headers, args.sessions, args.turns,
                                         args.max_tokens, args.seed)
            rows.append(row)
            turn_ttfts[name] = ttfts
    print_table(rows)
    for name, ttfts in turn_ttfts.items():
        print(f"{name}: agent TTFT p50 by turn (ms): " + ", ".join(f"{t:.0f}" for t in ttfts))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"rows": [asdict(r) for r in rows], "agent_ttft_by_turn_ms": turn_ttfts}, out, indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", required=True, help="NAME=URL (repeatable)")
    parser.add_argument("--model", default=None, help="model name to send (default: from /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--workload", default="steady,agent")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--verbose", action="store_true")
    asyncio.run(main(parser.parse_args()))
