"""Engine benchmark: hearth vs HF transformers `generate`, same machine, same run, same weights.

    .venv/bin/python benchmarks/engine.py [--quick] [--dtype float32|bfloat16]

Measures cold start (process start to ready), prefill tokens/s on a ~2k-token prompt, and decode
tokens/s at batch 1, 8 and 32; prints a table of both and the ratio, and writes
benchmarks/results/engine.png. Decode throughput is measured as (tokens after the first) / (time
after the prefill), so prompt processing does not pollute it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
COLD_HEARTH = (
    "import time; t=time.monotonic(); from hearth.engine.llm import LLM; "
    "LLM('{m}', dtype='{d}'); print(time.monotonic()-t)"
)
COLD_HF = (
    "import time; t=time.monotonic(); import torch; from transformers import AutoModelForCausalLM;"
    "from hearth.models.loader import resolve_builtin; p=resolve_builtin('{m}');"
    "AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32);"
    "print(time.monotonic()-t)"
)


def cold_start(code: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.monotonic() - t0  # wall time from process start, interpreter start included


def make_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
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
    eng = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}-{time.monotonic_ns()}", p, params)
    t_first = None
    produced = 0
    while eng.has_unfinished():
        outs = eng.step()
        if t_first is None and all(r.num_output_tokens >= 1 for r in eng.scheduler.running) \
                and not eng.scheduler.waiting:
            t_first, produced = time.perf_counter(), 0
        produced += sum(len(o.new_token_ids) for o in outs)
    return produced / (time.perf_counter() - t_first)


def hf_model():
    from transformers import AutoModelForCausalLM

    from hearth.models.loader import resolve_builtin
    p = resolve_builtin(MODEL)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=torch.float32).eval()


@torch.inference_mode()
def hf_prefill(model, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    model(torch.tensor([prompt]))
    return len(prompt) / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    t2 = time.perf_counter()
    # the second call redoes the prefill; subtract the first call's (prefill + 1 token) time
    return len(prompts) * (new - 1) / max(1e-9, (t2 - t1) - (t1 - t0))


def plot(rows: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r[0] for r in rows if "tok/s" in r[0]]
    hv = [r[1] for r in rows if "tok/s" in r[0]]
    fv = [r[2] for r in rows if "tok/s" in r[0]]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], hv, 0.4, label="hearth")
    ax.bar([i + 0.2 for i in x], fv, 0.4, label="transformers")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("hearth vs transformers, SmolLM2-135M, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter runs (smoke test)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    from hearth.engine.llm import LLM

    new = 16 if a.quick else a.new_tokens
    prefill_len = 512 if a.quick else 2048
    rows: list[tuple[str, float, float]] = []
    rows.append(("cold start (s)", cold_start(COLD_HEARTH.format(m=MODEL, d=a.dtype)),
                 cold_start(COLD_HF.format(m=MODEL))))
    llm = LLM(MODEL, dtype=a.dtype, max_num_batched_tokens=4096, max_num_seqs=64)
    hf = hf_model()
    prompt = make_prompts(llm.tokenizer, 1, prefill_len)[0]
    hearth_prefill(llm, prompt[:64])  # warm-up
    rows.append((f"prefill {prefill_len} tok/s", hearth_prefill(llm, prompt), hf_prefill(hf, prompt)))
    for batch in (1, 8, 32):
        prompts = make_prompts(llm.tokenizer, batch, 32)
        rows.append((f"decode b={batch} tok/s", hearth_decode(llm, prompts, new),
                     hf_decode(hf, prompts, new)))
    print(f"\n{'metric':<24}{'hearth':>12}{'transformers':>14}{'ratio':>9}")
    for name, h, f in rows:
        ratio = f / h if name.startswith("cold") else h / f
        print(f"{name:<24}{h:>12.2f}{f:>14.2f}{ratio:>8.2f}x")
    print("(ratio: how many times better hearth is; cold start: transformers time / hearth time)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(rows, indent=1))
    plot(rows, RESULTS / "engine.png")


if __name__ == "__main__":
    main()
