"""Tool calls, hearth vs llama.cpp's llama-server vs vLLM-CPU on the same model, in one run.

Agents wait on tool calls, so this measures one call the way an agent makes it: a coding-agent
system prompt, four tools shaped like a real agent's (read_file(path), edit(path, old, new),
search(query, max_results), run_shell(cmd, timeout)), a user turn that calls for one of them,
`tool_choice` naming that function or "required", greedy, non-streaming, one request at a time.
Per call:

  tokens   usage.completion_tokens (what the server generated, forced tokens included)
  steps    decode steps: model forward passes that sampled a token for the call. hearth: tokens
           minus the tokens jump-forward appended (the worker's /load num_forced_tokens before and
           after the call); the peers as started here (no speculative decoding, no jump-forward)
           sample every token they generate, so steps = tokens
  wall     request sent -> response received (ms)
  valid    the call names the expected function and its arguments validate against its schema

Servers are started one at a time (hearth/bench/server_process.py), warmed with one call, then
measured with --repeats calls per case; tables give medians per case and overall, JSON goes to
benchmarks/results/tool_calls.json. hearth-nojf is hearth with --no-jump-forward (same output,
one decode step per token): what jump-forward alone buys.

Peers, as an agent framework would meet them: SmolLM2's own chat template has no tools, so
llama-server gets benchmarks/chatml_tools.jinja (ChatML with the Hermes tools section hearth
writes itself; llama.cpp then parses Hermes <tool_call>s and constrains "required" with a
grammar) and a named tool_choice as "required" over that one tool (it accepts only strings).
vLLM gets the same template, --enable-auto-tool-choice --tool-call-parser hermes (without a
parser it refuses named and "required" tool_choice), and serves those through its own guided
decoding (the output is the arguments JSON, or a JSON list of calls, with no wrapper).

usage (peers installed per ../shared/peers/README.md; run under the heavy lock):
  flock /tmp/hearth-heavy.lock .venv/bin/python benchmarks/tool_calls.py \
      [--servers hearth,hearth-nojf,llamacpp,vllm] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hearth.bench.peer_report import machine_header  # noqa: E402
from hearth.bench.peer_servers import add_peer_path_args, hearth_argv, llama_argv, vllm_argv, vllm_env  # noqa: E402
from hearth.bench.server_process import ServerSpec, ServerStartError, start_server, stop_server  # noqa: E402

RESULTS = Path(__file__).parent / "results"

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to inspect and "
          "change files and to run commands. Call exactly one tool per turn.")


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False}}}


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
TOOLS = [
    tool("read_file", "Read a file of the repository.", {"path": STRING}, ["path"]),
    tool("edit", "Replace the text `old` with `new` in a file.",
         {"path": STRING, "old": STRING, "new": STRING}, ["path", "old", "new"]),
    tool("search", "Search the repository for a text.",
         {"query": STRING, "max_results": INTEGER}, ["query", "max_results"]),
    tool("run_shell", "Run a shell command.", {"cmd": STRING, "timeout": INTEGER},
         ["cmd", "timeout"]),
]
CASES = [  # (name, expected function, tool_choice, user turn)
    ("read_file", "read_file", "named", "Show me the contents of src/app/main.py."),
    ("edit", "edit", "named",
     "In src/app/config.py replace `DEBUG = True` with `DEBUG = False`."),
    ("search", "search", "named", "Find where parse_request is defined; at most 5 results."),
    ("run_shell", "run_shell", "named", "Run the unit tests with pytest, 60 second timeout."),
    ("required", "read_file", "required", "Open README.md so I can read it."),
]


# llama-server takes tool_choice only as a string (a named one is ignored with a warning): a
# named call is asked of it as "required" with only that tool, which constrains the same way.
NAMED_AS_REQUIRED = {"llamacpp"}


def builtin_servers(args: argparse.Namespace) -> dict[str, ServerSpec]:
    template = str(Path(__file__).parent / "chatml_tools.jinja")
    hearth = hearth_argv(extra=shlex.split(args.hearth_args))
    vllm = vllm_argv(args.vllm_python, args.hf_model, extra=[
        "--dtype", args.vllm_dtype, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", template, *shlex.split(args.vllm_args)])
    llama = llama_argv(args.llama_server, args.gguf, 8192, 1, extra=[
        "--jinja", "--chat-template-file", template, *shlex.split(args.llamacpp_args)])
    return {
        "hearth": ServerSpec("hearth", tuple(hearth), 8100),
        "hearth-nojf": ServerSpec("hearth-nojf", (*hearth, "--no-jump-forward"), 8100),
        "llamacpp": ServerSpec("llamacpp", tuple(llama), 8101),
        "vllm": ServerSpec("vllm", tuple(vllm), 8102, vllm_env()),
    }


def forced_tokens(url: str, name: str) -> int:
    if not name.startswith("hearth"):
        return 0
    return int(httpx.get(url + "/load", timeout=30).json().get("num_forced_tokens", 0))


def call(url: str, model: str, name: str, case: tuple, max_tokens: int) -> dict:
    _, expected, choice, ask = case
    tools, tool_choice = TOOLS, "required"
    if choice == "named" and name in NAMED_AS_REQUIRED:  # the same constraint, said another way
        tools = [t for t in TOOLS if t["function"]["name"] == expected]
    elif choice == "named":
        tool_choice = {"type": "function", "function": {"name": expected}}
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": ask}],
            "tools": tools, "tool_choice": tool_choice, "temperature": 0, "max_tokens": max_tokens}
    forced_before = forced_tokens(url, name)
    start = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)  # fresh connection
    wall_ms = (time.perf_counter() - start) * 1000
    if response.status_code != 200:
        return {"error": f"{response.status_code}: {response.text[:300]}", "wall_ms": wall_ms}
    reply = response.json()
    tokens = reply["usage"]["completion_tokens"]
    forced = forced_tokens(url, name) - forced_before
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return {"tokens": tokens, "forced": forced, "steps": tokens - forced, "wall_ms": wall_ms,
            "valid": is_valid(calls[0]["function"] if calls else None, expected), "finish_reason": reply["choices"][0]["finish_reason"],
            "call": calls[0]["function"] if calls else None, "content": message.get("content")}


def is_valid(call: dict | None, expected: str) -> bool:
    """The call names `expected` and its arguments validate against that tool's schema."""
    if not call or call.get("name") != expected:
        return False
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == expected)
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema)
    except (json.JSONDecodeError, TypeError, jsonschema.ValidationError):
        return False
    return True


def revalidate(report: dict) -> None:
    """Recompute `valid` from the stored calls (runs saved before the check was this strict)."""
    expected = {c[0]: c[1] for c in CASES}
    for server in report["servers"].values():
        for case, runs in server.get("cases", {}).items():
            for run in runs:
                if "error" not in run:
                    run["valid"] = is_valid(run.get("call"), expected[case])


def measure(spec: ServerSpec, args: argparse.Namespace) -> dict:
    log = RESULTS / f"tool_calls-{spec.name}.log"
    record = {"command": shlex.join(spec.command()), "env": spec.env, "cases": {}}
    print(f"\n## {spec.name}: {record['command']}", flush=True)
    try:
        server = start_server(spec, log, args.start_timeout)
    except ServerStartError as exc:
        print(f"   not measured: {exc}", flush=True)
        return {**record, "error": str(exc)}
    record["cold_start_s"] = server.cold_start_s
    try:
        model = httpx.get(spec.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        call(spec.url, model, spec.name, CASES[0], args.max_tokens)  # warm-up, not recorded
        for case in CASES:
            runs = record["cases"][case[0]] = []
            for _ in range(args.repeats):
                runs.append(call(spec.url, model, spec.name, case, args.max_tokens))
            last = runs[-1]
            print(f"   {case[0]:<10} " + (last.get("error") or
                  f"tokens {last['tokens']:>3}  steps {last['steps']:>3}  "
                  f"{last['wall_ms']:7.0f} ms  valid {last['valid']}  {json.dumps(last['call'])}"),
                  flush=True)
    except httpx.HTTPError as exc:
        record["error"] = str(exc)
        print(f"   stopped: {exc}", flush=True)
    finally:
        stop_server(server)
    return record


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r and "error" not in r]
    return statistics.median(values) if values else float("nan")


def format_table(report: dict) -> str:
    names = list(report["servers"])
    lines = ["median per call: generated tokens / decode steps / wall ms (valid calls of all)", ""]
    head = f"{'case':<11}" + "".join(f"{n:>26}" for n in names)
    lines += [head, "-" * len(head)]
    for case in [c[0] for c in CASES] + ["all"]:
        cells = []
        for name in names:
            server = report["servers"][name]
            runs = (sum(server["cases"].values(), []) if case == "all"
                    else server["cases"].get(case, []))
            if not runs:
                cells.append(f"{'—':>26}")
                continue
            num_valid = sum(bool(r.get("valid")) for r in runs)
            cells.append(f"{median(runs, 'tokens'):>6.0f} /{median(runs, 'steps'):>4.0f} /"
                         f"{median(runs, 'wall_ms'):>6.0f} ({num_valid}/{len(runs)})")
        lines.append(f"{case:<11}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="hearth,hearth-nojf,llamacpp,vllm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--hearth-args", default="")
    add_peer_path_args(p)
    p.add_argument("--vllm-dtype", default="float32",
                   help="float32 (its fastest here); bfloat16 where the CPU has AVX512-BF16")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--llamacpp-args", default="")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", default=str(RESULTS / "tool_calls.json"))
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="measure nothing: merge the servers of earlier runs into one table")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.from_json:
        reports = [json.loads(Path(f).read_text()) for f in args.from_json]
        report = {"header": reports[0]["header"], "servers": {}, "merged_from": args.from_json}
        for r in reports:
            report["servers"].update(r["servers"])
    else:
        specs = builtin_servers(args)
        header = machine_header(probe_roofline=False)
        print(json.dumps(header), flush=True)
        report = {"header": header, "args": vars(args), "servers": {}}
        for name in [n for n in args.servers.split(",") if n]:
            report["servers"][name] = measure(specs[name], args)
    revalidate(report)
    print("\n" + format_table(report), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
