"""An EAGLE-3 draft head (Li et al., "EAGLE-3"), in the checkpoint layout vLLM and SpecForge use.

A folder with `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`) and
`model.safetensors`:

    fc.weight                      [H, 3H]   the target's hidden states at three layers -> H
    midlayer.input_layernorm       [H]       on the token embeddings
    midlayer.hidden_norm           [H]       on the hidden states
    midlayer.self_attn.{q,k,v}_proj [.., 2H] attention over concat(normed embeds, normed hidden)
    midlayer.self_attn.o_proj      [H, heads * head_dim]
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight                    [H]
    lm_head.weight                 [draft_vocab_size, H]
    d2t                            [draft_vocab_size] int64: target id = draft id + d2t[draft id]
    t2d                            [vocab_size] bool (which target ids the draft vocabulary has)
    embed_tokens.weight            optional; without it the target's embeddings are shared

One row of the head at position i reads the target's hidden states at i (or, while chaining,
the head's own pre-norm output of the row before) and the embedding of the token at i + 1, and
predicts the token at i + 2. The target's hidden states are taken at
`aux_layer_ids` (the residual stream entering each of those layers; `num_layers` names the
stream after the last layer), by default vLLM's (2, num_layers // 2, num_layers - 3), or the
checkpoint's `eagle_aux_hidden_state_layer_ids`.

The head knows only math; its KV (one layer) is the caller's (hearth/engine/speculative/eagle3.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.layers import RMSNorm, RotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Spec:
    """The head's shape, from its config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool  # residual = hidden_norm(hidden) instead of hidden (some heads)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default capture layers for an EAGLE-3 target."""
    return (2, num_layers // 2, num_layers - 3)


def read_spec(folder: Path, target: ModelArch) -> Eagle3Spec:
    """The head's config, checked against the target (ValueError naming the field)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"speculative_config.model: {folder} has no config.json")
    c = json.loads(path.read_text())
    archs = c.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ValueError(f"speculative_config.model: architectures {archs}, an EAGLE-3 head is "
                         f"{ARCHITECTURE!r}")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    eagle = c.get("eagle_config") or {}
    aux = c.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    spec = Eagle3Spec(
        hidden_size=hidden, intermediate_size=int(c["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads", heads)),
        head_dim=int(c.get("head_dim") or hidden // heads),
        vocab_size=int(c["vocab_size"]),
        draft_vocab_size=int(c.get("draft_vocab_size") or c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", 10000.0)), rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        aux_layer_ids=tuple(int(i) for i in aux) if aux else default_aux_layers(target.num_layers),
        norm_before_residual=bool(c.get("norm_before_residual", False)))
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"speculative_config.model: num_key_value_heads {spec.num_kv_heads} "
                         f"does not divide num_attention_heads {spec.num_heads}")
    if spec.hidden_size != target.hidden_size:
        raise ValueError(f"speculative_config.model: hidden_size {spec.hidden_size}, the target's "
                         f"is {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: vocab_size {spec.vocab_size}, the target's "
                         f"is {target.vocab_size}")
    if not 0 < spec.draft_vocab_size <= spec.vocab_size:
        raise ValueError(f"speculative_config.model: draft_vocab_size {spec.draft_vocab_size} "
                         f"must be in [1, vocab_size {spec.vocab_size}]")
    if len(spec.aux_layer_ids) != 3 or not all(0 <= i <= target.num_layers
                                               for i in spec.aux_layer_ids):
        raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids "
                         f"{list(spec.aux_layer_ids)} must be three layers in [0, "
                         f"{target.num_layers}] of the target")
    return spec


class Eagle3Head(nn.Module):
    """fc + one decoder layer + norm + lm_head over the draft vocabulary (float32)."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        s = self.spec = spec
        h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def linear(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(rows, cols), requires_grad=False)

        self.fc = linear(h, 3 * h)
        self.input_layernorm = RMSNorm(h, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, s.rms_norm_eps)
        self.qkv = linear(q + 2 * kv, 2 * h)
        self.o_proj = linear(h, q)
        self.post_attention_layernorm = RMSNorm(h, s.rms_norm_eps)
        self.gate_up = linear(2 * s.intermediate_size, h)
        self.down_proj = linear(h, s.intermediate_size)
        self.norm = RMSNorm(h, s.rms_norm_eps)
        self.lm_head = linear(s.draft_vocab_size, h)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Module | None = None  # the head's own, or the target's (`load`)
        self.rotary = RotaryEmbedding(s.head_dim, s.max_position_embeddings, s.rope_theta,
                                      s.rope_scaling)
        self.sizes = (q, kv, kv)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3H] target hidden states -> [T, H]."""
        return aux_hidden @ self.fc.T

    def qkv_of(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The decoder layer up to attention: (q [T, heads, D], k, v [T, kv_heads, D], residual)."""
        embeds = self.input_layernorm(self.embed_tokens(input_ids).float())
        normed = self.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        q, k, v = (torch.cat([embeds, normed], dim=-1) @ self.qkv.T).split(self.sizes, dim=-1)
        d = self.spec.head_dim
        q, k = self.rotary(positions, q.reshape(-1, self.spec.num_heads, d),
                           k.reshape(-1, self.spec.num_kv_heads, d))
        return q, k, v.reshape(-1, self.spec.num_kv_heads, d), residual

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor):
        """attn [T, heads * D] -> (normed [T, H] for the logits, pre-norm [T, H] to chain on)."""
        normed, residual = self.post_attention_layernorm.add_forward(attn @ self.o_proj.T,
                                                                     residual)
        gate, up = (normed @ self.gate_up.T).chunk(2, dim=-1)
        out = (nn.functional.silu(gate) * up) @ self.down_proj.T
        prenorm = out + residual
        return self.norm(prenorm), prenorm

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy next tokens, as target ids: [T]."""
        draft = (normed @ self.lm_head.T).argmax(dim=-1)
        return draft + self.d2t[draft]


def load_head(folder: str | Path, target: ModelArch, target_embed: nn.Module) -> Eagle3Head:
    """The head in `folder`, checked against `target` (ValueError naming the field)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    spec = read_spec(folder, target)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model: {folder} has no .safetensors file")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    # SpecForge writes the decoder layer as `midlayer.`, some exports as `layers.0.` (vLLM
    # reads both)
    tensors = {_midlayer(n.removeprefix("model.")): t for n, t in tensors.items()}
    head = Eagle3Head(spec)
    h, s = spec.hidden_size, spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

    def take(name: str, shape: tuple[int, ...], field: str | None = None) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"speculative_config.model: tensor {name} missing")
        if tuple(t.shape) != shape:
            raise ValueError(f"speculative_config.model: {field or name} has shape "
                             f"{list(t.shape)}, expected {list(shape)} for hidden_size {h} and "
                             f"the config's heads")
        return t.float()

    m = "midlayer."
    with torch.no_grad():
        head.fc.copy_(take("fc.weight", (h, 3 * h), "fc.weight (3 x hidden_size inputs)"))
        head.input_layernorm.weight.copy_(take(m + "input_layernorm.weight", (h,)))
        head.hidden_norm.weight.copy_(take(m + "hidden_norm.weight", (h,)))
        head.qkv.copy_(torch.cat([take(m + "self_attn.q_proj.weight", (q, 2 * h)),
                                  take(m + "self_attn.k_proj.weight", (kv, 2 * h)),
                                  take(m + "self_attn.v_proj.weight", (kv, 2 * h))]))
        head.o_proj.copy_(take(m + "self_attn.o_proj.weight", (h, q)))
        head.post_attention_layernorm.weight.copy_(
            take(m + "post_attention_layernorm.weight", (h,)))
        inter = s.intermediate_size
        head.gate_up.copy_(torch.cat([take(m + "mlp.gate_proj.weight", (inter, h)),
                                      take(m + "mlp.up_proj.weight", (inter, h))]))
        head.down_proj.copy_(take(m + "mlp.down_proj.weight", (h, inter)))
        head.norm.weight.copy_(take("norm.weight", (h,)))
        head.lm_head.copy_(take("lm_head.weight", (s.draft_vocab_size, h),
                                "lm_head.weight (draft_vocab_size x hidden_size)"))
        d2t = tensors.get("d2t")
        if d2t is None and s.draft_vocab_size != s.vocab_size:
            raise ValueError("speculative_config.model: tensor d2t missing (draft_vocab_size "
                             "differs from vocab_size)")
        if d2t is not None:
            if tuple(d2t.shape) != (s.draft_vocab_size,):
                raise ValueError(f"speculative_config.model: d2t has shape {list(d2t.shape)}, "
                                 f"expected [draft_vocab_size {s.draft_vocab_size}]")
            d2t = d2t.long()
            targets = torch.arange(s.draft_vocab_size) + d2t
            if int(targets.min()) < 0 or int(targets.max()) >= s.vocab_size:
                raise ValueError(f"speculative_config.model: d2t maps draft ids outside the "
                                 f"target's vocabulary of {s.vocab_size}")
            head.d2t.copy_(d2t)
    if "embed_tokens.weight" in tensors:
        embed = nn.Embedding(s.vocab_size, h)
        with torch.no_grad():
            embed.weight.copy_(take("embed_tokens.weight", (s.vocab_size, h)))
        embed.weight.requires_grad_(False)
        head.embed_tokens = embed
    else:
        head.embed_tokens = target_embed
    return head.eval()


def _midlayer(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def write_random_head(folder: str | Path, target: ModelArch, draft_vocab_size: int | None = None,
                      seed: int = 0, aux_layer_ids: tuple[int, ...] | None = None,
                      num_heads: int | None = None, num_kv_heads: int | None = None,
                      intermediate_size: int | None = None) -> Path:
    """A random-weight EAGLE-3 head of the right shapes for `target` (tests, benchmarks).
    Its draft vocabulary is the first `draft_vocab_size` target ids scattered by a fixed
    permutation, so `d2t` is non-trivial. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h = target.hidden_size
    heads = num_heads or target.num_heads
    kv_heads = num_kv_heads or target.num_kv_heads
    d = h // heads
    inter = intermediate_size or target.intermediate_size
    draft_vocab = draft_vocab_size or target.vocab_size
    config = {"architectures": [ARCHITECTURE], "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": d, "num_hidden_layers": 1,
              "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab,
              "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
              "max_position_embeddings": target.max_position_embeddings,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    m = "midlayer."
    kept = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": w(h, 3 * h), m + "input_layernorm.weight": torch.ones(h),
        m + "hidden_norm.weight": torch.ones(h),
        m + "self_attn.q_proj.weight": w(heads * d, 2 * h),
        m + "self_attn.k_proj.weight": w(kv_heads * d, 2 * h),
        m + "self_attn.v_proj.weight": w(kv_heads * d, 2 * h),
        m + "self_attn.o_proj.weight": w(h, heads * d),
        m + "post_attention_layernorm.weight": torch.ones(h),
        m + "mlp.gate_proj.weight": w(inter, h), m + "mlp.up_proj.weight": w(inter, h),
        m + "mlp.down_proj.weight": w(h, inter), "norm.weight": torch.ones(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab), "t2d": t2d}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder
