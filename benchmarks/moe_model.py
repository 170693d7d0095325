"""Build the random-weight Qwen3-MoE the MoE benchmarks serve, in the forms every server reads.

    .venv/bin/python benchmarks/moe_model.py OUT_DIR [--tokenizer-from HF_FOLDER]
        [--llama-cpp LLAMA_CPP_SOURCE_DIR] [--outtype q8_0]

Writes OUT_DIR/hf (config.json, model.safetensors in bf16, the tokenizer and chat template of
--tokenizer-from, e.g. the default model's HF form from ../shared/peers/gguf_to_hf.py) and, with
--llama-cpp, OUT_DIR/moe-<outtype>.gguf through llama.cpp's own convert_hf_to_gguf.py (the file
both hearth and llama-server serve). Random weights are fine for speed; the shape is what counts:

    Qwen3MoeForCausalLM, 16 layers, hidden 1024, 16 heads / 4 KV heads of 64, 64 experts of
    width 256, top 8 renormalised, every layer sparse, vocab 49,152 (SmolLM2's tokenizer):
    0.95B parameters, ~0.19B active per token (experts 8/64 of 50M per layer, attention, head)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hearth.models.random_checkpoint import write_random_checkpoint  # noqa: E402

SHAPE = dict(num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64,
             intermediate_size=2816, vocab_size=49152, num_experts=64, num_experts_per_tok=8,
             expert_intermediate_size=256, max_position_embeddings=8192)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def active_parameters(shape: dict) -> dict:
    """Parameters in all, read per token, and the bytes a batch-1 decode step reads with Q8_0
    linears and experts (34 bytes per 32 weights), fp32 router and no KV (short context)."""
    h, d, layers = shape["hidden_size"], shape["head_dim"], shape["num_layers"]
    attn = h * d * (2 * shape["num_heads"] + 2 * shape["num_kv_heads"])
    expert = 3 * h * shape["expert_intermediate_size"]
    embed = shape["vocab_size"] * h
    router = shape["num_experts"] * h
    total = layers * (attn + shape["num_experts"] * expert + router) + 2 * embed
    active = layers * (attn + shape["num_experts_per_tok"] * expert) + embed
    q8 = 34 / 32
    step_bytes = q8 * (layers * (attn + shape["num_experts_per_tok"] * expert) + embed)
    step_bytes += 4 * layers * router
    return {"total": total, "active_per_token": active, "decode_step_bytes_q8_0": int(step_bytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, help="a HF folder whose tokenizer to copy")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source dir (convert_hf_to_gguf.py)")
    ap.add_argument("--outtype", default="q8_0")
    args = ap.parse_args()
    hf = args.out / "hf"
    if not (hf / "model.safetensors").exists():
        write_random_checkpoint(hf, seed=0, dtype=torch.bfloat16, **SHAPE)
        if args.tokenizer_from:
            for name in TOKENIZER_FILES:
                if (args.tokenizer_from / name).exists():
                    shutil.copy(args.tokenizer_from / name, hf / name)
            source = json.loads((args.tokenizer_from / "config.json").read_text())
            config = json.loads((hf / "config.json").read_text())
            for key in ("bos_token_id", "eos_token_id"):
                config[key] = source.get(key, config[key])
            config["torch_dtype"] = "bfloat16"
            (hf / "config.json").write_text(json.dumps(config, indent=1))
    print(json.dumps({"shape": SHAPE, "parameters": active_parameters(SHAPE)}))
    if args.llama_cpp:
        out = args.out / f"moe-{args.outtype}.gguf"
        if not out.exists():
            env = {"PYTHONPATH": str(args.llama_cpp / "gguf-py")}
            subprocess.run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                            "--outtype", args.outtype, "--outfile", str(out)], check=True,
                           env={**__import__("os").environ, **env})
        print(out)


if __name__ == "__main__":
    main()
