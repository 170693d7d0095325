"""Train a small EAGLE-3 draft head for the default model on its own greedy outputs (CPU).

Three stages, each reading the previous one's file in OUT (default /tmp/eagle3-smollm2):

  data   the target (exact formats: float32 weights, no quantization) answers a few hundred
         generated agent-like prompts greedily (JSON tool arguments and extractions that echo
         the prompt, edits of code given in the prompt, prose); each prompt + answer is then
         computed once more with the engine's own capture (`ModelRunner.capture_aux_hidden`)
         to record the residual stream at the head's three layers and the target's greedy
         prediction at every position -> OUT/data.pt
  train  the head (hearth/models/eagle3_head.py's layout: fc + one decoder layer + norm +
         lm_head over a draft vocabulary of the most frequent predicted tokens, d2t mapping;
         norm and lm_head rows start from the target's) with EAGLE-3's training-time test:
         the head is unrolled on its own pre-norm outputs for `--ttt-steps` steps, each step's
         rows attending to the real rows before them and to their own chain, as when drafting
         -> OUT/config.json + OUT/model.safetensors (vLLM / SpecForge names; load_head reads it)
  eval   acceptance on benchmarks/speculative.py's held-out prompts (edit / extract / tool /
         prose): off vs suffix vs eagle3, in-process, greedy; mean accepted tokens per verify
         step and the CPU seconds of drafting (process CPU time, one torch thread), and that
         eagle3's output equals off's token for token -> printed table + OUT/eval.json

  nice -n 19 .venv/bin/python benchmarks/train_eagle3.py [data|train|eval|all] [--out DIR]
      [--num-prompts 240] [--max-tokens 128] [--minutes 25] [--cpu-minutes 10] [--ttt-steps 3]
      [--draft-vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from hearth.api.chat_prompt import render_chat_prompt  # noqa: E402
from hearth.api.protocol import ChatMessage, Tool  # noqa: E402
from hearth.config import SpeculativeConfig  # noqa: E402
from hearth.engine.llm import LLM  # noqa: E402
from hearth.engine.sampling_params import GuidedSpec, SamplingParams  # noqa: E402
from hearth.models.eagle3_head import ARCHITECTURE, default_aux_layers  # noqa: E402
from train_eagle3_prompts import training_conversations  # noqa: E402

MODEL = "smollm2-135m-instruct"
EXACT = dict(quantization="none", dtype="float32")


def render(tok, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt's token ids as the server renders them (tools in the Hermes format)."""
    text = render_chat_prompt(tok, [ChatMessage(**m) for m in messages],
                              [Tool(**t) for t in tools] if tools else None)
    return tok.encode(text)


# ---- data ------------------------------------------------------------------------------------
def make_data(out: Path, num_prompts: int, max_tokens: int) -> None:
    llm = LLM(MODEL, **EXACT, num_blocks=2048, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    tok = llm.tokenizer
    prompts = [render(tok, m, tools) for m, tools in training_conversations(num_prompts, seed=0)]
    runner = llm.engine.executor
    model = runner.model
    arch = model.arch
    h, layers = arch.hidden_size, default_aux_layers(arch.num_layers)
    # the three aux layers, and the stream after the last layer for the target's predictions;
    # captured while the target generates (each token is computed once)
    runner.capture_aux_hidden((*layers, arch.num_layers))
    slots: dict[int, dict[int, tuple]] = {}  # slot -> position -> (token, aux row, prediction)
    done: list[dict[int, tuple]] = []
    execute = runner.execute

    def capturing_execute(cmd):
        result = execute(cmd)
        rows = runner.aux_hidden
        with torch.inference_mode():
            pred = model.compute_logits(model.norm(rows[:, 3 * h :].contiguous())).argmax(-1)
        aux = rows[:, : 3 * h].to(torch.bfloat16)
        offset = 0
        for slot, q, end in zip(cmd.slots, cmd.query_lens, cmd.context_lens):
            if end - q == 0 and slots.get(slot):
                done.append(slots.pop(slot))  # a new request in a finished one's slot
            seq = slots.setdefault(slot, {})
            for j in range(q):
                seq[end - q + j] = (cmd.input_ids[offset + j], aux[offset + j],
                                    int(pred[offset + j]))
            offset += q
        return result
    runner.execute = capturing_execute
    t0 = time.time()
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i in range(0, len(prompts), 40):
        llm.generate(prompts[i : i + 40], greedy)
        print(f"  generated {min(i + 40, len(prompts))}/{len(prompts)} "
              f"({time.time() - t0:.0f} s)", flush=True)
    done += [s for s in slots.values() if s]
    records = []
    for seq in done:
        n = max(seq) + 1
        if len(seq) != n:
            continue  # a gap (should not happen without prefix caching)
        rows = [seq[p] for p in range(n)]
        records.append({"tokens": torch.tensor([r[0] for r in rows], dtype=torch.int32),
                        "aux": torch.stack([r[1] for r in rows]),
                        "pred": torch.tensor([r[2] for r in rows], dtype=torch.int32)})
    runner.capture_aux_hidden(())
    embed = model.embed_tokens.weight.detach().float().clone()
    torch.save({"records": records, "aux_layers": layers, "arch": _arch_dict(arch),
                "embed": embed, "lm_head": model.lm_head.weight.detach().float().clone(),
                "norm": model.norm.weight.detach().float().clone()}, out / "data.pt")
    llm.engine.close()
    n = sum(len(r["tokens"]) for r in records)
    print(f"wrote {out / 'data.pt'}: {len(records)} sequences, {n} positions "
          f"({time.time() - t0:.0f} s)")


def _arch_dict(arch) -> dict:
    return {k: getattr(arch, k) for k in (
        "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "num_layers",
        "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")}



# ---- train -----------------------------------------------------------------------------------
class TrainHead(torch.nn.Module):
    """The head's math (hearth/models/eagle3_head.py) in differentiable torch, over a whole
    sequence, unrolled EAGLE-3 style.

    Step t, row i sits at position i + t: it reads the target's rows (t = 0, through fc) or
    the step before's pre-norm output of the same row (t > 0), and the embedding of token
    i + 1 + t, and predicts the target's token after that. It attends to step 0's keys at
    positions 0..i (the committed rows a draft sees) and to its own chain, the keys of row i
    at steps 1..t (the drafts before it), as the proposer does when it drafts."""

    def __init__(self, a: dict, embed, lm_head, norm, aux_layers, draft_ids) -> None:
        super().__init__()
        h, inter = a["hidden_size"], a["intermediate_size"]
        self.heads, self.kv_heads = a["num_heads"], a["num_kv_heads"]
        self.dim = h // self.heads
        self.eps = a["rms_norm_eps"]
        self.a, self.aux_layers = a, aux_layers
        g = torch.Generator().manual_seed(0)

        def w(rows: int, cols: int, scale: float = 1.0) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(rows, cols, generator=g) * scale / cols ** 0.5)

        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        self.fc = w(h, 3 * h)
        self.wq, self.wk, self.wv = w(q, 2 * h), w(kv, 2 * h), w(kv, 2 * h)
        self.wo = w(h, q, 0.1)
        self.wg, self.wu, self.wd = w(inter, h), w(inter, h), w(h, inter, 0.1)
        self.in_norm, self.hid_norm, self.post_norm = (
            torch.nn.Parameter(torch.ones(h)) for _ in range(3))
        self.norm = torch.nn.Parameter(norm.clone())
        self.lm_head = torch.nn.Parameter(lm_head[draft_ids].clone())
        self.register_buffer("embed", embed)
        self.register_buffer("draft_ids", draft_ids)
        inv = 1.0 / a["rope_theta"] ** (torch.arange(0, self.dim, 2, dtype=torch.float64)
                                        / self.dim)
        freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
        self.register_buffer("cos", freqs.cos().float())
        self.register_buffer("sin", freqs.sin().float())

    def rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, positions):  # x [L, heads, D]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens, aux, num_steps: int):
        """tokens [N], aux [N, 3H] -> per step t: (logits [N - 1 - t, Vd]). Rows i of step t
        predict the target's token after position i + 1 + t."""
        n = tokens.shape[0]
        rep = self.heads // self.kv_heads
        hidden = aux[: n - 1] @ self.fc.T
        keys0 = values0 = None
        chain_k, chain_v, out = [], [], []
        for t in range(num_steps):
            rows = n - 1 - t
            if rows <= 0:
                break
            hidden = hidden[:rows]
            positions = torch.arange(rows) + t
            e = self.rms(self.embed[tokens[1 + t : 1 + t + rows]], self.in_norm)
            x = torch.cat([e, self.rms(hidden, self.hid_norm)], dim=-1)
            q = self.rope((x @ self.wq.T).view(rows, self.heads, self.dim), positions)
            k = self.rope((x @ self.wk.T).view(rows, self.kv_heads, self.dim), positions)
            v = (x @ self.wv.T).view(rows, self.kv_heads, self.dim)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if t == 0:
                keys0, values0 = k, v
            else:
                chain_k, chain_v = [c[:rows] for c in chain_k], [c[:rows] for c in chain_v]
                chain_k.append(k)
                chain_v.append(v)
            scale = self.dim ** -0.5
            s0 = torch.einsum("ihd,jhd->hij", q, keys0[:rows]) * scale  # [heads, rows, rows]
            s0 = s0.masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
            diag = [torch.einsum("ihd,ihd->hi", q, ck).unsqueeze(-1) * scale for ck in chain_k]
            p = torch.cat([s0, *diag], dim=-1).softmax(dim=-1)
            attn = torch.einsum("hij,jhd->ihd", p[..., :rows], values0[:rows])
            for s, cv in enumerate(chain_v):
                attn = attn + p[..., rows + s].T.unsqueeze(-1) * cv
            residual = hidden + attn.reshape(rows, -1) @ self.wo.T
            m = self.rms(residual, self.post_norm)
            prenorm = residual + (F.silu(m @ self.wg.T) * (m @ self.wu.T)) @ self.wd.T
            out.append(self.rms(prenorm, self.norm) @ self.lm_head.T)
            hidden = prenorm
        return out

    def save(self, folder: Path) -> None:
        """config.json + model.safetensors in vLLM's / SpecForge's names (load_head reads it)."""
        from safetensors.torch import save_file

        a, h = self.a, self.a["hidden_size"]
        vocab, draft = a["vocab_size"], self.draft_ids.shape[0]
        config = {"architectures": [ARCHITECTURE], "hidden_size": h,
                  "intermediate_size": a["intermediate_size"],
                  "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                  "head_dim": self.dim, "num_hidden_layers": 1, "vocab_size": vocab,
                  "draft_vocab_size": draft, "rms_norm_eps": self.eps,
                  "rope_theta": a["rope_theta"],
                  "max_position_embeddings": a["max_position_embeddings"],
                  "tie_word_embeddings": False, "torch_dtype": "float32",
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}}
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[self.draft_ids] = True
        m = "midlayer."
        tensors = {"fc.weight": self.fc, m + "input_layernorm.weight": self.in_norm,
                   m + "hidden_norm.weight": self.hid_norm,
                   m + "self_attn.q_proj.weight": self.wq, m + "self_attn.k_proj.weight": self.wk,
                   m + "self_attn.v_proj.weight": self.wv, m + "self_attn.o_proj.weight": self.wo,
                   m + "post_attention_layernorm.weight": self.post_norm,
                   m + "mlp.gate_proj.weight": self.wg, m + "mlp.up_proj.weight": self.wu,
                   m + "mlp.down_proj.weight": self.wd, "norm.weight": self.norm,
                   "lm_head.weight": self.lm_head}
        tensors = {n: t.detach().float().contiguous() for n, t in tensors.items()}
        tensors["d2t"] = self.draft_ids - torch.arange(draft)
        tensors["t2d"] = t2d
        save_file(tensors, str(folder / "model.safetensors"))


def train(out: Path, minutes: float, num_steps: int, draft_vocab_size: int,
          cpu_minutes: float) -> None:
    """Until `minutes` of wall time or `cpu_minutes` of this process's CPU time have passed
    (on a shared box the CPU time is what the result depends on)."""
    data = torch.load(out / "data.pt")
    records = data["records"]
    counts = torch.bincount(torch.cat([r["pred"].long() for r in records]),
                            minlength=data["arch"]["vocab_size"])
    draft_ids = counts.argsort(descending=True)[:draft_vocab_size].sort().values
    coverage = counts[draft_ids].sum() / counts.sum()
    to_draft = torch.full((data["arch"]["vocab_size"],), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(draft_vocab_size)
    head = TrainHead(data["arch"], data["embed"], data["lm_head"], data["norm"],
                     data["aux_layers"], draft_ids)
    r = random.Random(0)
    order = list(range(len(records)))
    r.shuffle(order)
    held = order[: max(1, len(order) // 20)]
    train_ids = order[len(held):]
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    print(f"training on {len(train_ids)} sequences ({len(held)} held out), draft vocabulary "
          f"{draft_vocab_size} covers {coverage:.1%} of the target's predictions, "
          f"{num_steps} unrolled steps, {minutes:.0f} min", flush=True)
    t0, c0, step, epoch, batch = time.time(), time.process_time(), 0, 0, 4
    stats = [[0.0, 0.0, 0] for _ in range(num_steps)]

    def progress() -> float:
        return max((time.time() - t0) / (minutes * 60),
                   (time.process_time() - c0) / (cpu_minutes * 60))
    while progress() < 1:
        r.shuffle(train_ids)
        for b in range(0, len(train_ids), batch):
            done = progress()
            if done >= 1:
                break
            lr = 1e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
            for grp in opt.param_groups:
                grp["lr"] = lr
            opt.zero_grad()
            for i in train_ids[b : b + batch]:
                loss = _sequence_loss(head, records[i], to_draft, num_steps, stats)
                (loss / batch).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            step += 1
            if step % 25 == 0:
                accs = " ".join(f"{s[1] / max(1, s[2]):.2f}" for s in stats)
                losses = " ".join(f"{s[0] / max(1, s[2]):.2f}" for s in stats)
                print(f"  step {step} epoch {epoch} {time.time() - t0:.0f}s wall "
                      f"{time.process_time() - c0:.0f}s CPU lr {lr:.1e} "
                      f"loss {losses} acc {accs}", flush=True)
                stats = [[0.0, 0.0, 0] for _ in range(num_steps)]
        epoch += 1
    head.save(out)
    with torch.no_grad():
        held_stats = [[0.0, 0.0, 0] for _ in range(num_steps)]
        for i in held:
            _sequence_loss(head, records[i], to_draft, num_steps, held_stats)
    accs = " ".join(f"{s[1] / max(1, s[2]):.2f}" for s in held_stats)
    print(f"wrote {out}/config.json, model.safetensors after {step} steps of {batch} "
          f"sequences, {time.process_time() - c0:.0f} CPU s, {time.time() - t0:.0f} s wall "
          f"({epoch} epochs "
          f"started); held-out accuracy per unrolled step (target's token, on rows whose token "
          f"is in the draft vocabulary): {accs}", flush=True)
    check_parity(head, records[held[0]], out)


def _sequence_loss(head, rec, to_draft, num_steps, stats):
    tokens, pred = rec["tokens"].long(), rec["pred"].long()
    total = 0.0
    for t, logits in enumerate(head(tokens, rec["aux"].float(), num_steps)):
        labels = to_draft[pred[1 + t : 1 + t + logits.shape[0]]]
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        total = total + 0.8 ** t * loss
        keep = labels >= 0
        stats[t][0] += loss.item()
        stats[t][1] += float((logits.argmax(-1)[keep] == labels[keep]).float().mean())
        stats[t][2] += 1
    return total


def check_parity(head: TrainHead, rec: dict, out: Path) -> None:
    """The saved head, loaded as the engine loads it, must give step 0's logits."""
    from hearth.models.eagle3_head import load_head
    from hearth.models.loader import load_checkpoint

    arch = load_checkpoint(MODEL).arch
    embed = torch.nn.Embedding.from_pretrained(head.embed)
    loaded = load_head(out, arch, embed)
    tokens, aux = rec["tokens"].long()[:200], rec["aux"].float()[:200]
    with torch.no_grad():
        want = head(tokens, aux, 1)[0]
        n = tokens.shape[0] - 1
        q, k, v, residual = loaded.qkv_of(tokens[1:], loaded.combine(aux[:n]), torch.arange(n))
        rep = loaded.spec.num_heads // loaded.spec.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), is_causal=True)
        normed, _ = loaded.after_attention(attn.transpose(0, 1).reshape(n, -1), residual)
        got = normed @ loaded.lm_head.T
    diff = float((got - want).abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"parity: the loaded head's logits differ from training's by at most {diff:.2e}; "
          f"argmax agrees on {agree:.1%} of {n} rows", flush=True)
    assert agree > 0.99, "the saved head does not compute what was trained"



# ---- eval ------------------------------------------------------------------------------------
def workloads(tok) -> dict[str, tuple[list[int], SamplingParams]]:
    """benchmarks/speculative.py's held-out requests, in-process: the tool call is not forced
    (no tool_choice grammar here), the extraction keeps its json_schema."""
    from speculative import AGENT, PROSE

    out = {}
    for name, req in AGENT.items():
        guided = (GuidedSpec("json_schema", json.dumps(req["schema"])) if "schema" in req
                  else None)
        out[name] = (render(tok, req["messages"], req.get("tools")),
                     SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                    guided=guided))
    for i, text in enumerate(PROSE[:2]):
        out[f"prose{i}"] = (render(tok, [{"role": "user", "content": text}], None),
                            SamplingParams(temperature=0.0, max_tokens=128))
    return out


def measure(method: str, head: Path, k: int, names: tuple[str, ...] | None = None) -> dict:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k,
                             draft_model=str(head) if method == "eagle3" else None)
    llm = LLM(MODEL, **EXACT, num_blocks=1024, speculative=spec)
    engine = llm.engine
    cpu = {"draft": 0.0, "steps": 0}
    if engine.speculator is not None:  # the drafting's own CPU time, around the proposer
        proposer = engine.speculator.proposer
        propose_many = proposer.propose_many

        def timed_propose(wants):
            t = time.process_time()
            try:
                return propose_many(wants)
            finally:
                cpu["draft"] += time.process_time() - t
        proposer.propose_many = timed_propose
    engine_step = engine.step

    def counted_step():
        cpu["steps"] += 1
        return engine_step()
    engine.step = counted_step
    res = {}
    try:
        for name, (prompt, params) in workloads(llm.tokenizer).items():
            if names is not None and name not in names:
                continue
            c0 = _counters(engine)
            cpu["draft"], cpu["steps"] = 0.0, 0
            t = time.process_time()
            out = llm.generate([prompt], params)[0]
            total = time.process_time() - t
            c1 = _counters(engine)
            d = {key: c1[key] - c0[key] for key in c0}
            res[name] = {"tokens": out.token_ids, "steps": cpu["steps"], "cpu_s": total,
                         "draft_cpu_s": cpu["draft"], **d}
    finally:
        engine.close()
    return res


def _counters(engine) -> dict:
    c = engine.speculator.counters if engine.speculator is not None else None
    return {"drafts": c.num_drafts if c else 0, "draft_tokens": c.num_draft_tokens if c else 0,
            "accepted": c.num_accepted_tokens if c else 0}


def evaluate(out: Path, k: int = 4) -> None:
    torch.set_num_threads(1)  # process CPU time is then the work itself
    results = {m: measure(m, out, k) for m in ("off", "suffix", "eagle3")}
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    print(f"\nheld-out prompts (benchmarks/speculative.py), batch 1, greedy, k = {k}; CPU s = "
          f"process CPU time (one torch thread)")
    print(f"{'method':8}{'workload':10}{'tokens':>7}{'steps':>6}{'acc/verify':>11}"
          f"{'accepted':>10}{'CPU s':>7}{'draft CPU ms/step':>19}{'same as off':>12}")
    for m, res in results.items():
        for name, r in res.items():
            n = len(r["tokens"])
            per = r["accepted"] / r["drafts"] if r["drafts"] else 0.0
            rate = f"{r['accepted']}/{r['draft_tokens']}"
            same = r["tokens"] == results["off"][name]["tokens"]
            print(f"{m:8}{name:10}{n:7}{r['steps']:6}{per:11.2f}{rate:>10}{r['cpu_s']:7.1f}"
                  f"{1000 * r['draft_cpu_s'] / max(1, r['steps']):19.1f}{str(same):>12}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", nargs="?", default="all", choices=["data", "train", "eval", "all"])
    p.add_argument("--out", default="/tmp/eagle3-smollm2")
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--minutes", type=float, default=25.0, help="training wall limit")
    p.add_argument("--cpu-minutes", type=float, default=10.0, help="training CPU-time limit")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (on a loaded 2-core box, two wait at every barrier)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.stage in ("data", "all"):
        make_data(out, a.num_prompts, a.max_tokens)
    if a.stage in ("train", "all"):
        train(out, a.minutes, a.ttt_steps, a.draft_vocab_size, a.cpu_minutes)
    if a.stage in ("eval", "all"):
        evaluate(out)


if __name__ == "__main__":
    main()
