"""Regenerate the HF transformers greedy reference for the default model.

    .venv/bin/python tests/model/make_golden.py

The reference is the plainest greedy loop there is: the argmax of a full fp32 forward pass over
the whole sequence at every step (no KV cache), with transformers' own GGUF loader and tokenizer.
For every generated token we also store the margin between the top-2 logits, so a test can tell
a real divergence from an fp32 near-tie.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.models.loader import resolve_builtin

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of copper, one per line.",
    "Translate to German: The weather is lovely today and we are going for a walk.",
    "Explain in two sentences why the sky is blue.",
    "Résumé en français: les chats dorment beaucoup. 🐱 Combien d'heures?",
    "Count from 1 to 20, separated by commas.",
    "You are a helpful agent. The user wants the JSON object {\"a\": 1, \"b\": [2, 3]} pretty-printed.",
]
NUM_NEW = 40
OUT = Path(__file__).parent / "golden" / "smollm2_greedy.json"


def main() -> None:
    path = resolve_builtin("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seq, out, margins = list(ids), [], []
        with torch.no_grad():
            for _ in range(NUM_NEW):
                logits = model(torch.tensor([seq])).logits[0, -1]
                top2 = logits.topk(2).values
                nxt = int(logits.argmax())
                out.append(nxt)
                margins.append(float(top2[0] - top2[1]))
                seq.append(nxt)
        cases.append({"prompt": prompt, "chat_text": text, "prompt_ids": ids,
                      "output_ids": out, "top2_margins": margins})
        print(prompt[:40], "->", tok.decode(out)[:60].replace("\n", " "), file=sys.stderr)
    OUT.write_text(json.dumps({"model": "smollm2-135m-instruct", "num_new": NUM_NEW,
                               "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
