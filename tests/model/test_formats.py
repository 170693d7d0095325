"""Accuracy of every fast format against the float32 reference, on the real default model.

* `gguf` decode weights are the file's own blocks: the numbers fp32 dequantizes, so greedy output
  must equal the transformers golden file exactly as the fp32 path does (ties aside); so must
  the float32 path through the fused kernels.
* `q8_0` weights and a `bfloat16`, `int8` or `fp8` KV cache change numbers: each is held to top-1 agreement with
  fp32 and a bound on the mean KL divergence, teacher-forced over held-out prompts (every position
  is scored on the same token history, so one early flip cannot cascade).
"""

import pytest
import torch

from hearth.config import CacheConfig, EngineConfig, ModelConfig
from hearth.ops.attention import build_attention_metadata
from hearth.ops.cpu_kernels import available_variants
from tests.model.test_greedy_parity import CASES, GREEDY, assert_matches

pytestmark = pytest.mark.skipif(not available_variants(), reason="CPU kernels not built")
# fp8 e4m3 KV: 3 mantissa bits per value, where int8's step is 1/127 of the row's largest;
# measured 0.98 / 8.7e-3 (kernels), 0.98 / 9.5e-3 (torch path): ~7x int8's KL
FP8_MAX_KL = 2e-2

HELD_OUT = [
    "Write a Python function that parses an ISO 8601 date and returns the weekday.",
    "Explain what a KV cache is in a transformer, in two sentences.",
    '{"tool": "read_file", "arguments": {"path": "src/main.rs"}} returned an error. What next?',
    "List three differences between TCP and UDP.",
]
NUM_NEW = 24
BLOCK = 16


@pytest.mark.parametrize("fmt", [
    {"cpu_kernels": "off"},  # the float32 reference, plain torch (the parity tests run auto)
    {"quantization": "none", "kv_cache_dtype": "float32"},  # kernels, float32 throughout
    {"quantization": "gguf", "kv_cache_dtype": "float32"},
])
def test_exact_formats_match_the_reference_greedy(models, fmt):
    llm = models.llm(max_num_batched_tokens=32, enable_prefix_caching=False, **fmt)
    outs = llm.generate([c["prompt_ids"] for c in CASES], GREEDY)
    for case, out in zip(CASES, outs):
        assert_matches(case, out.token_ids)
    assert llm.engine.kv_pool_is_whole()


def teacher_forced_logits(runner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits after the prompt and after each later token, decoding one token per step (the
    path decode-only formats change). [len(tokens) - prompt_len + 1, vocab]"""
    return teacher_forced_batch(runner, [(tokens, prompt_len)])[0]


def teacher_forced_batch(runner, seqs: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """`teacher_forced_logits` of several (tokens, prompt_len) sequences at once: each prompt in
    its own chunk, then one decode row per unfinished sequence per step (a batched decode step,
    as a server runs them), each sequence in its own blocks. A step of B rows reads the weights
    once, as one row does: B sequences cost about what one did."""
    model = runner.model
    tables, first = [], 0
    for tokens, _ in seqs:
        num = -(-len(tokens) // BLOCK)
        tables.append(list(range(first, first + num)))
        first += num
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        for i, (tokens, prompt_len) in enumerate(seqs):
            meta = build_attention_metadata([prompt_len], [prompt_len], [tables[i]], BLOCK)
            hidden, _ = model(torch.tensor(tokens[:prompt_len]), torch.arange(prompt_len), meta,
                              runner.kv_cache)
            out[i].append(model.compute_logits(hidden[-1:])[0])
        pos = [prompt_len for _, prompt_len in seqs]
        while rows := [i for i, (tokens, _) in enumerate(seqs) if pos[i] < len(tokens)]:
            meta = build_attention_metadata([1] * len(rows), [pos[i] + 1 for i in rows],
                                            [tables[i] for i in rows], BLOCK)
            hidden, _ = model(torch.tensor([seqs[i][0][pos[i]] for i in rows]),
                              torch.tensor([pos[i] for i in rows]), meta, runner.kv_cache)
            logits = model.compute_logits(hidden)
            for row, i in enumerate(rows):
                out[i].append(logits[row])
                pos[i] += 1
    return [torch.stack(logits) for logits in out]


def one_and_batched(runner):
    """Teacher-forced logits of reference sequences: the first decoded alone (the one-row
    kernels), the rest as one batch (the multi-row ones), so each format is scored on both."""
    return lambda seqs: teacher_forced_batch(runner, seqs[:1]) + teacher_forced_batch(runner,
                                                                                      seqs[1:])


def make_runner(models, **model_kw):
    cache = CacheConfig(num_blocks=64, kv_cache_dtype=model_kw.pop("kv_cache_dtype", "model"))
    config = EngineConfig(model=ModelConfig(**model_kw), cache=cache)
    return models.executor(config)


@pytest.fixture(scope="module")
def reference(models):
    """Per held-out prompt: (tokens = prompt + fp32 greedy continuation, prompt length, logits)."""
    llm = models.llm(cpu_kernels="off")
    runner = make_runner(models, cpu_kernels="off")  # float32 weights and KV, plain torch
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True)) for text in HELD_OUT]
    gens = llm.generate(prompts, GREEDY.__class__(temperature=0.0, max_tokens=NUM_NEW,
                                                  ignore_eos=True))
    seqs = [(prompt + gen.token_ids, len(prompt)) for prompt, gen in zip(prompts, gens)]
    return [(tokens, n, logits)
            for (tokens, n), logits in zip(seqs, teacher_forced_batch(runner, seqs))]


@pytest.mark.parametrize("fmt, min_top1, max_kl", [
    # measured here: 1.0 / 1e-8, 0.99 / 1.8e-3, 1.0 / 4e-5, 1.0 / 4e-5
    ({"quantization": "gguf", "kv_cache_dtype": "float32"}, 1.0, 1e-6),
    ({"quantization": "q8_0", "kv_cache_dtype": "float32"}, 0.95, 0.01),
    ({"quantization": "none", "kv_cache_dtype": "bfloat16"}, 0.98, 1e-3),
    ({"kv_cache_dtype": "bfloat16"}, 0.98, 1e-3),  # with auto (gguf) weights
    # int8 KV (a float32 scale per token and head): the kernels, and the plain-torch path
    ({"quantization": "none", "kv_cache_dtype": "int8"}, 0.95, 3e-3),
    ({"cpu_kernels": "off", "kv_cache_dtype": "int8"}, 0.95, 3e-3),
    # fp8 e4m3 KV, the same rows: 3 mantissa bits per value against int8's fixed 1/127 steps
    ({"quantization": "none", "kv_cache_dtype": "fp8"}, 0.95, FP8_MAX_KL),
    ({"cpu_kernels": "off", "kv_cache_dtype": "fp8"}, 0.95, FP8_MAX_KL),
    # 8-bit activations on the decode path (int8 / VNNI dot products)
    ({"quantization": "gguf-a8", "kv_cache_dtype": "float32"}, 0.95, 0.01),
    ({"quantization": "q8_0-a8", "kv_cache_dtype": "float32"}, 0.95, 0.01),
])
def test_format_agrees_with_fp32(models, reference, fmt, min_top1, max_kl):
    runner = make_runner(models, **fmt)
    top1, kl = agreement(reference, one_and_batched(runner))
    print(f"{fmt}: top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= min_top1 and kl <= max_kl, (fmt, top1, kl)


def agreement(reference, logits_of) -> tuple[float, float]:
    """(top-1 agreement, mean KL(fp32 || format)) over the reference positions; `logits_of(seqs)`
    gives the format's logits at the same positions of each (tokens, prompt_len) sequence."""
    agree, kls = [], []
    all_logits = logits_of([(tokens, prompt_len) for tokens, prompt_len, _ in reference])
    for (_, _, ref_logits), logits in zip(reference, all_logits):
        agree.append((logits.argmax(-1) == ref_logits.argmax(-1)).float())
        ref_logp, logp = ref_logits.log_softmax(-1), logits.log_softmax(-1)
        kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
    return torch.cat(agree).mean().item(), torch.cat(kls).mean().item()


def one_chunk_logits(runner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """The same positions' logits as `teacher_forced_logits`, from one prefill chunk over every
    token (the path --prefill-dtype changes). [len(tokens) - prompt_len + 1, vocab]"""
    table = list(range(-(-len(tokens) // BLOCK)))
    meta = build_attention_metadata([len(tokens)], [len(tokens)], [table], BLOCK)
    with torch.inference_mode():
        hidden, _ = runner.model(torch.tensor(tokens), torch.arange(len(tokens)), meta,
                                 runner.kv_cache)
        return runner.model.compute_logits(hidden[prompt_len - 1:])


@pytest.mark.parametrize("fmt, min_top1, max_kl", [
    # measured here (2026-12-02, AMX): 1.0 / 3.6e-9 (float32), 1.0 / 2.5e-4 (bfloat16)
    ({"prefill_dtype": "float32"}, 1.0, 1e-6),
    ({"prefill_dtype": "bfloat16"}, 0.97, 5e-3),
])
def test_prefill_dtype_agrees_with_fp32(models, reference, fmt, min_top1, max_kl):
    runner = make_runner(models, **fmt)
    assert runner.model.lowp_dtype == (
        torch.bfloat16 if fmt["prefill_dtype"] == "bfloat16" else None)
    assert all(len(tokens) > 32 for tokens, _, _ in reference)  # many-row: bf16 GEMMs, attention
    top1, kl = agreement(reference, lambda seqs: [one_chunk_logits(runner, tokens, n)
                                                  for tokens, n in seqs])
    print(f"{fmt}: top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= min_top1 and kl <= max_kl, (fmt, top1, kl)


def test_auto_prefill_takes_bf16_gemms_where_they_pay_without_amx(models, reference):
    """`--prefill-dtype auto` on a CPU without AMX whose bf16 GEMMs run well ahead of fp32
    (AVX512-BF16 on a Zen 4 EPYC: ~2x): a prompt step's linears multiply in bf16 (input
    rounded, output widened back), norms and attention stay float32; agreement with fp32 as
    --prefill-dtype bfloat16's bounds. Elsewhere `auto` is AMX's bf16 prefill or float32."""
    from hearth.engine.executor import BF16_EXPERTS_SPEEDUP, amx_usable, bf16_gemm_speedup
    from hearth.models.layers import QLINEAR_MAX_ROWS

    if amx_usable() or bf16_gemm_speedup() < BF16_EXPERTS_SPEEDUP:
        pytest.skip(f"auto keeps float32 GEMMs here (AMX {amx_usable()}, "
                    f"bf16 GEMM {bf16_gemm_speedup():.2f}x fp32)")
    runner = make_runner(models, prefill_dtype="auto")
    model = runner.model
    assert model.lowp_dtype is None  # activations stay float32 between the GEMMs
    proj = model.layers[3].mlp.down_proj
    assert proj.lowp_min_rows == QLINEAR_MAX_ROWS
    assert proj.tile_dtype == torch.bfloat16 or proj.weight_lowp is not None
    seen = []
    hook = proj.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    try:
        top1, kl = agreement(reference, lambda seqs: [one_chunk_logits(runner, tokens, n)
                                                      for tokens, n in seqs])
    finally:
        hook.remove()
    print(f"auto (bf16 GEMMs): top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert set(seen) == {(torch.float32, torch.float32)}
    assert top1 >= 0.97 and kl <= 5e-3, (top1, kl)


def test_prefill_dtype_takes_decode_batches_above_lowp_min_rows_off_the_fused_kernel(models):
    """--prefill-dtype bfloat16: a step of 20 decodes runs the bf16 GEMMs (they beat the fused
    qlinear kernel above LOWP_MIN_ROWS rows), a step of 8 the fused fp32 kernel; both give the
    same next tokens as far as bf16 allows (all 20, or all but a near-tie or two)."""
    runner = make_runner(models, prefill_dtype="bfloat16")
    model = runner.model
    if model._fused_all is None:
        pytest.skip("no fused decode kernel here (no CPU kernels or no packed weights)")
    seen = []
    model.layers[3].mlp.down_proj.register_forward_hook(
        lambda m, args, out: seen.append(args[0].dtype))
    n, prompt = 20, [1, 504, 3057, 28, 260, 3946, 30, 2]
    tables = [[i] for i in range(n)]
    with torch.inference_mode():
        for i in range(n):  # each request's own prompt (8 rows: the exact path) in its block
            ids = prompt[:-1] + [100 + i]
            meta = build_attention_metadata([8], [8], [tables[i]], BLOCK)
            model(torch.tensor(ids), torch.arange(8), meta, runner.kv_cache)
        seen.clear()

        def decode(rows):
            meta = build_attention_metadata([1] * len(rows), [9] * len(rows),
                                            [tables[i] for i in rows], BLOCK)
            hidden, _ = model(torch.tensor([42] * len(rows)), torch.full((len(rows),), 8), meta,
                              runner.kv_cache)
            return model.compute_logits(hidden)

        wide = decode(range(n))
        assert seen == [torch.bfloat16]
        seen.clear()
        narrow = torch.cat([decode(range(lo, lo + 8)) for lo in (0, 8)] + [decode(range(16, 20))])
        assert seen == []  # the fused kernel: no module forward ran
    # all 20 on AVX-512 machines; 19 on an AVX2 EPYC (2026-12-07: torch's bf16 GEMM without
    # AVX512-BF16 rounds otherwise, and one near-tie flips; max |diff| 0.26)
    assert (wide.argmax(-1) == narrow.argmax(-1)).sum() >= n - 2
    assert (wide - narrow).abs().max() < 1.0
