"""Write a random-weight EAGLE-3 draft head of the right shapes for a target model.

The head is vLLM's / SpecForge's layout (hearth/models/eagle3_head.py): a folder with
config.json (`LlamaForCausalLMEagle3`) and model.safetensors, which
`hearth serve --speculative-config '{"method": "eagle3", "model": OUT}'` loads. Its drafts are
random, so nearly none is accepted: it checks the plumbing and measures the head's cost, not
its speed-up.

  .venv/bin/python benchmarks/eagle3_head.py [--model smollm2-135m-instruct] --out DIR
      [--draft-vocab-size 8192] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from hearth.models.eagle3_head import write_random_head  # noqa: E402
from hearth.models.loader import load_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the target: HF folder, .gguf file or built-in name")
    p.add_argument("--out", required=True, help="the head's folder (created)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocabulary (default: the target's whole vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    arch = load_checkpoint(a.model).arch
    folder = write_random_head(a.out, arch, a.draft_vocab_size, a.seed)
    print(f"wrote {folder}: hidden {arch.hidden_size}, vocabulary {arch.vocab_size}, "
          f"draft vocabulary {a.draft_vocab_size or arch.vocab_size}")


if __name__ == "__main__":
    main()
