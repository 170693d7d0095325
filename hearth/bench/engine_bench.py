"""The engine benchmark behind `hearth bench` (and `benchmarks/engine.py`): one process, no HTTP.

Measures, for hearth's offline engine (`hearth.engine.llm.LLM`) on one model:
    cold start   process start -> engine ready (a fresh interpreter, imports included)
    prefill      tokens/s of one long prompt, prefix cache emptied first
    decode b=N   output tokens/s of N streams, counted from the step after every stream has
                 its first token (so prompt processing does not pollute it)
    MoE load     for a Mixture-of-Experts model, the busiest expert's share of its layer's
                 routed tokens against an even split (max / mean, worst layer; 1.0 = balanced)
and, when transformers is installed and asked for, the same figures for transformers'
`generate` on the same weights in the same run, with the ratio. Returns rows; `format_table`
prints them. Numbers differ by CPU and by what else runs: re-measure, never assert on them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import torch

COLD_HEARTH = (
    "import time; t=time.monotonic(); from hearth.engine.llm import LLM; "
    "LLM({model!r}, dtype={dtype!r}); print(time.monotonic()-t)"
)
COLD_TRANSFORMERS = (
    "import time; t=time.monotonic(); import torch; from transformers import AutoModelForCausalLM;"
    "from hearth.models.loader import resolve_builtin; p=resolve_builtin({model!r});"
    "AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32);"
    "print(time.monotonic()-t)"
)


@dataclass(frozen=True)
class BenchRow:
    metric: str  # "cold start (s)", "prefill 2048 tok/s", "decode b=8 tok/s"
    hearth: float
    transformers: float | None = None  # None: not measured

    @property
    def ratio(self) -> float | None:
        """How many times better hearth is (time: theirs / ours; rate: ours / theirs)."""
        if self.transformers is None:
            return None
        if self.metric.startswith("cold"):
            return self.transformers / self.hearth
        return self.hearth / self.transformers


def cold_start(code: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.monotonic() - t0  # wall time from process start, interpreter start included


def make_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens; all but the first are shifted so none shares a prefix."""
    base = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * (length // 8 + 1))
    return [[(t + i) % 1000 + 100 for t in base[:length]] if i else base[:length]
            for i in range(batch)]


def hearth_prefill(llm, prompt: list[int]) -> float:
    from hearth.engine.sampling_params import SamplingParams

    llm.engine.pool.reset_cache()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return len(prompt) / (time.perf_counter() - t0)


def hearth_decode(llm, prompts: list[list[int]], new: int) -> float:
    from hearth.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench{i}-{time.monotonic_ns()}", prompt, params)
    t_first, produced = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if t_first is None and not engine.scheduler.waiting and all(
                r.num_output_tokens >= 1 for r in engine.scheduler.running):
            t_first, produced = time.perf_counter(), 0
            continue
        produced += sum(len(o.new_token_ids) for o in outputs)
    return produced / max(1e-9, time.perf_counter() - t_first)


def transformers_model(model: str):
    from transformers import AutoModelForCausalLM

    from hearth.models.loader import resolve_builtin

    path = resolve_builtin(model)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@torch.inference_mode()
def transformers_prefill(model, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    model(torch.tensor([prompt]))
    return len(prompt) / (time.perf_counter() - t0)


@torch.inference_mode()
def transformers_decode(model, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    t2 = time.perf_counter()
    # the second call redoes the prefill; subtract the first call's (prefill + 1 token) time
    return len(prompts) * (new - 1) / max(1e-9, (t2 - t1) - (t1 - t0))


def run_engine_bench(model: str, dtype: str = "float32", prefill_len: int = 2048,
                     new_tokens: int = 64, batches: tuple[int, ...] = (1, 8, 32),
                     compare_transformers: bool = True, log=print) -> list[BenchRow]:
    """Measure every figure; `compare_transformers` needs transformers and a built-in model
    (its weights are read from the same GGUF)."""
    from hearth.engine.llm import LLM
    from hearth.models.loader import BUILTIN_MODELS

    if compare_transformers and model not in BUILTIN_MODELS:
        raise ValueError(f"--compare transformers needs a built-in model ({', '.join(BUILTIN_MODELS)})")
    log("cold start ...")
    cold = cold_start(COLD_HEARTH.format(model=model, dtype=dtype))
    cold_theirs = (cold_start(COLD_TRANSFORMERS.format(model=model)) if compare_transformers
                   else None)
    rows = [BenchRow("cold start (s)", cold, cold_theirs)]
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=max(4096, prefill_len),
              max_num_seqs=max(64, *batches))
    theirs = transformers_model(model) if compare_transformers else None
    try:
        prompt = make_prompts(llm.tokenizer, 1, prefill_len)[0]
        hearth_prefill(llm, prompt[:64])  # warm-up
        log(f"prefill {prefill_len} tokens ...")
        rows.append(BenchRow(f"prefill {prefill_len} tok/s", hearth_prefill(llm, prompt),
                             transformers_prefill(theirs, prompt) if theirs else None))
        for batch in batches:
            log(f"decode, {batch} streams x {new_tokens} tokens ...")
            prompts = make_prompts(llm.tokenizer, batch, 32)
            rows.append(BenchRow(f"decode b={batch} tok/s", hearth_decode(llm, prompts, new_tokens),
                                 transformers_decode(theirs, prompts, new_tokens) if theirs else None))
        load = getattr(llm.engine.executor, "expert_load", dict)()
        if load:
            rows.append(BenchRow("MoE load max/mean", expert_imbalance(load)))
    finally:
        llm.engine.close()
    return rows


def expert_imbalance(load: dict[int, list[int]]) -> float:
    """Worst layer's busiest expert over its mean tokens per expert (1.0: perfectly even; with
    E experts at most E). `load`: layer -> tokens routed to each expert (runner.expert_load)."""
    worst = 1.0
    for counts in load.values():
        mean = sum(counts) / len(counts)
        if mean > 0:
            worst = max(worst, max(counts) / mean)
    return worst


def format_table(rows: list[BenchRow]) -> str:
    compared = any(r.transformers is not None for r in rows)
    header = f"{'metric':<24}{'hearth':>12}" + (f"{'transformers':>14}{'ratio':>9}" if compared else "")
    lines = [header]
    for r in rows:
        line = f"{r.metric:<24}{r.hearth:>12.2f}"
        if compared:
            line += (f"{r.transformers:>14.2f}{r.ratio:>8.2f}x" if r.transformers is not None
                     else f"{'-':>14}{'-':>9}")
        lines.append(line)
    if compared:
        lines.append("(ratio: how many times better hearth is; cold start: transformers time / "
                     "hearth time)")
    return "\n".join(lines)


def plot(rows: list[BenchRow], path, title: str) -> None:
    """Bar chart of the tokens/s rows (log scale), hearth beside transformers when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in rows if "tok/s" in r.metric]
    x = range(len(rates))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r.hearth for r in rates], 0.4, label="hearth")
    if any(r.transformers for r in rates):
        ax.bar([i + 0.2 for i in x], [r.transformers or 0 for r in rates], 0.4, label="transformers")
    ax.set_xticks(list(x), [r.metric for r in rates], rotation=15)
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
