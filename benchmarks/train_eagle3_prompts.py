"""Generated agent-like training conversations for benchmarks/train_eagle3.py.

Four kinds in equal shares, each built from random parts so no two are alike, and none is one
of benchmarks/speculative.py's held-out prompts: a tool call whose arguments echo an earlier
tool result or the request; a JSON extraction from a generated document; an edit of generated
code given in the prompt; free prose. Returns (messages, tools or None) pairs.
"""

from __future__ import annotations

import json
import random

NOUNS = ["order", "invoice", "ticket", "user", "device", "shipment", "report", "session", "job",
         "account", "payment", "sensor", "booking", "article", "task", "message", "record"]
VERBS = ["load", "save", "update", "delete", "validate", "render", "parse", "merge", "sync",
         "fetch", "archive", "retry", "compute", "format", "publish", "resolve"]
NAMES = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Maria Garcia", "Chen Wei", "Olu Ade",
         "Priya Nair", "John Smith", "Lena Novak", "Tomas Berg", "Aiko Sato", "Omar Haddad"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Austin", "Kyoto", "Leeds", "Porto", "Lyon", "Quito",
          "Perth", "Gdansk", "Bergen"]
TOPICS = ["a storm over a fishing village", "the first day at a new school",
          "how bread rises", "a robot learning to paint", "a train journey through mountains",
          "why cats purr", "a lost key found years later", "the history of the bicycle",
          "a city garden on a rooftop", "how bees find flowers", "a chess match in a park",
          "a letter to a future self", "the life of a river", "how a compass works",
          "a night at an observatory", "a bakery before sunrise"]
PROSE_ASKS = ["Write a short story about {t}.", "Describe {t} in a few paragraphs.",
              "Explain {t} simply.", "Write a poem about {t}.", "Tell me about {t}."]


def _ident(r: random.Random) -> str:
    return f"{r.choice(VERBS)}_{r.choice(NOUNS)}"


def _path(r: random.Random) -> str:
    return f"src/{r.choice(NOUNS)}s/{r.choice(VERBS)}_{r.choice(NOUNS)}.{r.choice(['py', 'ts', 'go'])}"


def _tool(r: random.Random):
    name = r.choice(["read_file", "open_ticket", "send_email", "get_weather", "search_docs",
                     "create_event", "lookup_user"])
    props = {"read_file": ["path"], "open_ticket": ["title", "priority"],
             "send_email": ["to", "subject", "body"], "get_weather": ["city", "unit"],
             "search_docs": ["query"], "create_event": ["title", "date", "city"],
             "lookup_user": ["name", "email"]}[name]
    tool = {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()}.",
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in props},
                       "required": props}}}
    person = r.choice(NAMES)
    values = {"path": _path(r), "title": f"{r.choice(VERBS).capitalize()} the {r.choice(NOUNS)}",
              "priority": r.choice(["low", "high", "urgent"]),
              "to": person.lower().replace(" ", ".") + "@example.com",
              "subject": f"About {r.choice(NOUNS)} {r.randint(100, 999)}",
              "body": f"Please check {r.choice(NOUNS)} {r.randint(1000, 9999)}.",
              "city": r.choice(CITIES), "unit": r.choice(["celsius", "fahrenheit"]),
              "query": f"how to {r.choice(VERBS)} a {r.choice(NOUNS)}",
              "date": f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
              "name": person, "email": person.lower().replace(" ", "_") + "@corp.example"}
    args = {p: values[p] for p in props}
    if r.random() < 0.5:  # the arguments come from an earlier tool result
        result = json.dumps({"items": [args, {p: values[p] + "x" for p in props[:1]}]})
        messages = [{"role": "user", "content": f"Use {name} on the first item you find."},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "c1", "type": "function", "function": {
                            "name": "list_items", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": result}]
    else:
        spelled = ", ".join(f"{p} {v!r}" for p, v in args.items())
        messages = [{"role": "user", "content": f"Call {name} with {spelled}."}]
    return messages, [tool]


def _extract(r: random.Random):
    person, city = r.choice(NAMES), r.choice(CITIES)
    n = r.randint(1000, 99999)
    kind = r.choice(["Invoice", "Order", "Booking", "Shipment", "Ticket"])
    date = f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    amount = f"{r.randint(5, 5000)}.{r.randint(0, 99):02d}"
    email = person.lower().replace(" ", ".") + f"@{r.choice(NOUNS)}.example"
    doc = (f"{kind.upper()} {kind[0]}-{n}\nDate: {date}\nCustomer: {person}, {r.randint(1, 99)} "
           f"{r.choice(['High', 'Mill', 'Park', 'Station'])} Street, {city}\nEmail: {email}\n"
           f"Amount: {amount} {r.choice(['EUR', 'USD', 'GBP'])}\nStatus: "
           f"{r.choice(['paid', 'open', 'overdue', 'cancelled'])}\n")
    fields = r.sample(["number", "date", "customer", "email", "amount", "status", "city"], 4)
    ask = r.choice(["Extract {f} as JSON.", "Return a JSON object with {f}.",
                    "Give me {f} from this document as JSON."]).format(f=", ".join(fields))
    return [{"role": "user", "content": f"{doc}\n{ask}"}], None


def _code(r: random.Random) -> str:
    cls = r.choice(NOUNS).capitalize() + r.choice(["Store", "Service", "Queue", "Cache"])
    methods = []
    for _ in range(r.randint(2, 4)):
        m = _ident(r)
        arg = r.choice(NOUNS)
        methods.append(f"    def {m}(self, {arg}_id: int) -> None:\n"
                       f"        if {arg}_id < 0:\n"
                       f"            raise ValueError(\"{arg}_id must not be negative\")\n"
                       f"        self.items[{arg}_id] = self.items.get({arg}_id, 0) + 1\n")
    return (f"class {cls}:\n    \"\"\"Keeps {r.choice(NOUNS)}s in memory.\"\"\"\n\n"
            f"    def __init__(self) -> None:\n        self.items: dict[int, int] = {{}}\n\n"
            + "\n".join(methods)), cls


def _edit(r: random.Random):
    code, cls = _code(r)
    ask = r.choice([f"Rename the class {cls} to {cls}V2 and reply with the whole code.",
                    "Add a docstring to every method. Reply with the complete code only.",
                    "Replace ValueError with KeyError everywhere and show the full code.",
                    "Rewrite this code with type hints kept and comments added.",
                    "Explain what this code does, then repeat it unchanged."])
    return [{"role": "user", "content": f"```python\n{code}```\n{ask}"}], None


def _prose(r: random.Random):
    return [{"role": "user", "content": r.choice(PROSE_ASKS).format(t=r.choice(TOPICS))}], None


def training_conversations(n: int, seed: int = 0) -> list[tuple[list[dict], list | None]]:
    r = random.Random(seed)
    kinds = [_tool, _extract, _edit, _prose]
    return [kinds[i % 4](r) for i in range(n)]
