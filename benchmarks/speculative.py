"""Speculative decoding, side by side: hearth off / ngram / suffix / eagle3 against llama-server's n-gram modes.

One server at a time, same GGUF, greedy. Each request's prompt is sent once with max_tokens=1 first
(both servers cache prompts), so the timed run is almost all decode: decode tok/s = output tokens /
wall time. Workloads:
  agent  — answers that draw on the context: rewrite a function from a file in the prompt, extract a
           document's fields as JSON (json_schema on hearth; json_object-free prompt on llama), a tool
           call whose arguments come from an earlier tool result
  prose  — free writing (speculation should neither help nor hurt)
Streams: 1 (each agent prompt alone), 4 (the agent prompts at once), 32 (prose at once).
Also printed: how much of each reference output repeats itself (a looping small model inflates
acceptance) vs copies the prompt, and hearth's acceptance counters from /metrics.

hearth-eagle3 (not in the default set) drafts with the EAGLE-3 head in --eagle3-head (k = 4;
benchmarks/train_eagle3.py trains one for the default model).

  .venv/bin/python benchmarks/speculative.py [--servers hearth-off,hearth-ngram,hearth-suffix,llama-off,llama-ngram] [--repeats 2]
      [--eagle3-head /tmp/eagle3-smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from hearth.bench.peer_servers import LLAMA_SERVER, default_gguf, hearth_argv, llama_argv  # noqa: E402
from hearth.bench.server_process import ServerSpec, start_server, stop_server  # noqa: E402

RESULTS = Path(__file__).parent / "results"

SOURCE = '''import json
from pathlib import Path


class Inventory:
    """Items in a warehouse, persisted as JSON."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.items: dict[str, int] = {}

    def load(self) -> None:
        if self.path.exists():
            self.items = json.loads(self.path.read_text())

    def save(self) -> None:
        self.path.write_text(json.dumps(self.items, indent=2))

    def add(self, name: str, count: int) -> None:
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name: str, count: int) -> None:
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} left")
        self.items[name] = have - count
'''
DOCUMENT = ("INVOICE #A-20931\nDate: 2026-03-14\nBill to: Northwind Traders, 42 Harbour Road, "
            "Portsmouth PO1 3AX\nContact: Maria Anders (maria.anders@northwind.example)\n"
            "Items: 12 x steel brackets @ 4.50; 3 x hinge sets @ 17.25; 1 x delivery @ 25.00\n"
            "Total due: 131.75 GBP\nPayment terms: 30 days\n")
TOOL_RESULT = json.dumps({"files": ["src/inventory/store.py", "src/inventory/models.py",
                                    "tests/test_store.py", "docs/inventory.md"]})
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}

AGENT = {
    "edit": dict(messages=[{"role": "user", "content":
        f"Here is inventory.py:\n```python\n{SOURCE}```\nRewrite the whole file with the method "
        "`remove` renamed to `take`. Reply with the complete file only."}], max_tokens=256),
    "extract": dict(messages=[{"role": "user", "content":
        f"{DOCUMENT}\nExtract invoice_number, date, customer, contact_email and total as JSON."}],
        max_tokens=128, schema={"type": "object", "properties": {
            "invoice_number": {"type": "string"}, "date": {"type": "string"},
            "customer": {"type": "string"}, "contact_email": {"type": "string"},
            "total": {"type": "string"}},
            "required": ["invoice_number", "date", "customer", "contact_email", "total"]}),
    "tool": dict(messages=[
        {"role": "user", "content": "Find the inventory store module and read it."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "list_files", "arguments": "{\"dir\": \"src\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": TOOL_RESULT}],
        tools=[READ_FILE], tool_choice={"type": "function", "function": {"name": "read_file"}},
        max_tokens=64),
}
PROSE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Describe a busy market in a mountain town at dawn.",
         "Explain to a child why the sky changes colour at sunset.",
         "Write a letter from a sailor to his sister about his first voyage."]


def servers(names: list[str], eagle3_head: str | None = None) -> dict[str, ServerSpec]:
    hearth = hearth_argv()
    llama = llama_argv(LLAMA_SERVER, default_gguf(), 65536, 32, unified_kv=True)
    table = {
        "hearth-off": ServerSpec("hearth-off", (*hearth, "--speculative-method", "off"), 8110),
        "hearth-ngram": ServerSpec("hearth-ngram", (*hearth, "--speculative-method", "ngram"), 8110),
        "hearth-suffix": ServerSpec("hearth-suffix", (*hearth, "--speculative-method", "suffix"),
                                    8110),
        "hearth-eagle3": ServerSpec("hearth-eagle3", (
            *hearth, "--speculative-config",
            json.dumps({"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 4})),
            8110),
        "llama-off": ServerSpec("llama-off", tuple(llama), 8111),
        "llama-ngram": ServerSpec("llama-ngram", (*llama, "--spec-type", "ngram-simple",
                                                  "--spec-draft-n-max", "8"), 8111),
        "llama-ngram-mod": ServerSpec("llama-ngram-mod", (*llama, "--spec-type", "ngram-mod",
                                                          "--spec-draft-n-max", "8"), 8111),
    }
    return {n: table[n] for n in names}


MODEL = ["default"]  # set to the server's own name (GET /v1/models) before measuring


def body(req: dict, hearth: bool, max_tokens: int | None = None) -> dict:
    b = {"model": MODEL[0], "messages": req["messages"], "temperature": 0.0,
         "max_tokens": max_tokens or req["max_tokens"]}
    if "tools" in req:
        b["tools"], b["tool_choice"] = req["tools"], req["tool_choice"]
    if "schema" in req and hearth:  # llama-server's json_schema support differs; plain prompt there
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "fields", "schema": req["schema"]}}
    return b


async def timed(client: httpx.AsyncClient, url: str, b: dict) -> tuple[int, float, str]:
    await client.post(url, json={**b, "max_tokens": 1})  # the prompt enters the prefix cache
    t0 = time.perf_counter()
    r = await client.post(url, json=b)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    msg = data["choices"][0]["message"]
    text = (msg.get("content") or "") + json.dumps(msg.get("tool_calls") or "")
    return data["usage"]["completion_tokens"], wall, text


async def run_streams(url: str, bodies: list[dict]) -> tuple[float, list[str]]:
    """Aggregate decode tok/s of `bodies` sent at once, and their texts."""
    async with httpx.AsyncClient(timeout=600) as client:
        for b in bodies:  # warm every prompt first, one at a time
            await client.post(url, json={**b, "max_tokens": 1})
        t0 = time.perf_counter()
        got = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in got)
    return tokens / wall, [r.json()["choices"][0]["message"].get("content") or "" for r in got]


def repetition(text: str, prompt: str, n: int = 4) -> tuple[float, float]:
    """(share of the output's word n-grams seen earlier in the output, share seen in the prompt)."""
    words = re.findall(r"\S+", text)
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    pgrams = set(tuple(w) for w in zip(*(re.findall(r"\S+", prompt)[i:] for i in range(n))))
    seen, own, copied = set(), 0, 0
    for g in grams:
        own += g in seen
        copied += g in pgrams
        seen.add(g)
    return (own / len(grams), copied / len(grams)) if grams else (0.0, 0.0)


def spec_counters(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^hearth:spec_decode_{name}_total{{[^}}]*}} (\S+)", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def measure(spec: ServerSpec, repeats: int) -> dict:
    """Each repeat on a freshly started server: every prompt once ("first": nothing like it was
    seen before, bar the other prompts' answers), then the same requests again ("again": what an
    agent repeating a call gets; the suffix store holds the first answer), then 4 and 32 streams
    (the 32 prose prompts are new each repeat)."""
    hearth = spec.name.startswith("hearth")
    res: dict = {"first": {}, "again": {}, "texts": {}, "streams4": [], "streams32": []}
    prose = {f"prose{i}": {"messages": [{"role": "user", "content": p}], "max_tokens": 128}
             for i, p in enumerate(PROSE[:2])}
    for r in range(repeats):
        server = start_server(spec, RESULTS / f"speculative-{spec.name}.log", 300)
        url = spec.url + "/v1/chat/completions"
        MODEL[0] = httpx.get(spec.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        try:
            for key in ("first", "again"):
                for name, req in {**AGENT, **prose}.items():
                    tokens, wall, text = asyncio.run(_one(url, body(req, hearth)))
                    res[key].setdefault(name.rstrip("01"), []).append(tokens / wall)
                    res["texts"][name.rstrip("01")] = text
            res["streams4"].append(asyncio.run(run_streams(url, [body(q, hearth) for q in AGENT.values()]
                                                           + [body(prose["prose0"], hearth)]))[0])
            prose32 = [body({"messages": [{"role": "user", "content":
                                           f"{PROSE[i % 4]} (repeat {r}, #{i})"}],
                             "max_tokens": 64}, hearth) for i in range(32)]
            res["streams32"].append(asyncio.run(run_streams(url, prose32))[0])
            if hearth:
                c = spec_counters(spec.url)
                for k, v in c.items():
                    res.setdefault("counters", {}).setdefault(k, 0.0)
                    res["counters"][k] += v
        finally:
            stop_server(server)
    return res


async def _one(url: str, b: dict):
    async with httpx.AsyncClient(timeout=600) as client:
        return await timed(client, url, b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="hearth-off,hearth-ngram,hearth-suffix,llama-off,llama-ngram")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eagle3-head", default="/tmp/eagle3-smollm2",
                   help="hearth-eagle3's head folder (benchmarks/train_eagle3.py writes one)")
    p.add_argument("--out", default=str(RESULTS / "speculative.json"))
    args = p.parse_args()
    results = {}
    for name, spec in servers(args.servers.split(","), args.eagle3_head).items():
        print(f"--- {name}", flush=True)
        results[name] = measure(spec, args.repeats)
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    cols = ["edit", "extract", "tool", "prose"]
    base = results.get("hearth-off")

    def cell(values, ref) -> str:
        med = statistics.median(values)
        x = f" {med / statistics.median(ref):.2f}x" if ref else ""
        return f"{med:6.1f} ({min(values):5.1f}){x}"

    for key, what in (("first", "first sight (fresh server)"), ("again", "the same request again")):
        print(f"\ndecode tok/s, {what}: median of repeats (min); x = vs hearth-off")
        print(f"{'server':16}" + "".join(f"{c:>20}" for c in cols))
        for name, r in results.items():
            print(f"{name:16}" + "".join(
                f"{cell(r[key][c], base[key][c] if base else None):>20}" for c in cols))
    print("\naggregate output tok/s, median of repeats (min)")
    print(f"{'server':16}{'4 streams':>20}{'32 streams':>20}")
    for name, r in results.items():
        print(f"{name:16}" + "".join(
            f"{cell(r[k], base[k] if base else None):>20}" for k in ("streams4", "streams32")))
    if base:
        print("\nreference (hearth-off) output: share of word 4-grams repeating the output / copying the prompt")
        prompts = {k: json.dumps(v["messages"]) for k, v in AGENT.items()}
        prompts["prose"] = PROSE[1]
        for c in cols:
            own, copied = repetition(base["texts"][c], prompts[c])
            print(f"  {c:8} self-repeat {own:.2f}  copied {copied:.2f}")
    for name, r in results.items():
        c = r.get("counters")
        if c and c.get("num_draft_tokens"):
            print(f"{name}: drafted {c['num_draft_tokens']:.0f} tokens in {c['num_drafts']:.0f} "
                  f"request-steps, accepted {c['num_accepted_tokens']:.0f} "
                  f"({c['num_accepted_tokens'] / c['num_draft_tokens']:.0%}), mean accepted per "
                  f"step {c['num_accepted_tokens'] / c['num_drafts']:.2f}")


if __name__ == "__main__":
    main()
