"""EAGLE-3 draft heads on a tiny random target: greedy output unchanged, the head reads the
right hidden states (an "echo" head built to repeat the target's own prediction), heads that do
not fit the target refused at start naming the field, and a drafter that raises mid-serve
leaves its request undrafted without ending it. The default model's exactness tests (batched,
guided) are in test_speculative.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.config import SpeculativeConfig
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.models.eagle3_head import write_random_head
from hearth.models.loader import load_checkpoint
from hearth.models.random_checkpoint import write_random_checkpoint

PROMPTS = [[(5 * i + j % 7) % 250 + 3 for j in range(n)] for i, n in enumerate([9, 20, 33])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=6,
                                     hidden_size=64, num_heads=4, num_kv_heads=2,
                                     intermediate_size=128, vocab_size=256)
    return str(folder), load_checkpoint(str(folder)).arch


def make_llm(target: str, head=None, **kw) -> LLM:
    spec = (SpeculativeConfig() if head is None else
            SpeculativeConfig(method="eagle3", draft_model=str(head), num_speculative_tokens=4))
    return LLM(target, num_blocks=64, quantization="none", speculative=spec, **kw)


def generate(target: str, head=None, prompts=PROMPTS):
    llm = make_llm(target, head)
    try:
        out = llm.generate(prompts, GREEDY)
        assert llm.engine.kv_pool_is_whole()
        spec = llm.engine.speculator
        if spec is not None:
            assert not spec.proposer.states  # every request's head KV dropped
        return [c.token_ids for c in out], spec
    finally:
        llm.engine.close()


def test_random_head_leaves_greedy_output_unchanged(tiny, tmp_path):
    target, arch = tiny
    head = write_random_head(tmp_path / "head", arch, draft_vocab_size=100)
    want, _ = generate(target)
    got, spec = generate(target, head)
    assert got == want
    assert spec.counters.num_draft_tokens > 0  # drafts were proposed and verified


def write_echo_head(folder, target: str, arch):
    """A head whose every draft is the target's greedy prediction at the position the head
    reads: fc passes the stream after the last layer through, attention and MLP add zero,
    and norm and lm_head are the target's. Fed the right rows, its drafts for a request are
    all that request's newest token."""
    layers = (1, 2, arch.num_layers)
    write_random_head(folder, arch, aux_layer_ids=layers)
    weights = load_file(f"{target}/model.safetensors")
    head = load_file(f"{folder}/model.safetensors")
    h = arch.hidden_size
    head["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)
    head["midlayer.self_attn.o_proj.weight"].zero_()
    head["midlayer.mlp.down_proj.weight"].zero_()
    head["norm.weight"] = weights["model.norm.weight"].clone()
    head["lm_head.weight"] = weights["lm_head.weight"].clone()
    head["d2t"] = torch.zeros(arch.vocab_size, dtype=torch.long)
    save_file(head, f"{folder}/model.safetensors")
    return folder


def test_the_head_reads_the_hidden_states_of_the_requests_last_position(tiny, tmp_path):
    target, arch = tiny
    head = write_echo_head(tmp_path / "echo", target, arch)
    llm = make_llm(target, head, max_num_batched_tokens=16)  # chunked prefill too
    engine = llm.engine
    proposer = engine.speculator.proposer
    try:
        checked, cached = 0, 0
        for round_ in range(2):  # the second round hits the prefix cache: the head starts late
            for i, ids in enumerate(PROMPTS):
                engine.add_request(f"r{round_}-{i}", ids, GREEDY)
            while engine.has_unfinished():
                engine.step()
                for req in engine.scheduler.running:
                    if req.num_tokens - req.num_computed_tokens == 1 and req.num_output_tokens:
                        assert proposer.propose(req, 3) == [req.all_token_ids[-1]] * 3
                        checked += 1
                        cached = max(cached, req.num_cached_tokens)
        assert checked > 40 and cached > 0
        assert engine.kv_pool_is_whole() and not proposer.states
    finally:
        engine.close()


def _rewrite_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("break_it, match", [
    (lambda d, a: _rewrite_config(d, hidden_size=a.hidden_size * 2), "hidden_size"),
    (lambda d, a: _rewrite_config(d, vocab_size=a.vocab_size + 1), "vocab_size"),
    (lambda d, a: _rewrite_config(d, architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda d, a: _rewrite_config(d, eagle_aux_hidden_state_layer_ids=[1, 2, 99]),
     "eagle_aux_hidden_state_layer_ids"),
    (lambda d, a: _rewrite_config(d, draft_vocab_size=a.vocab_size + 5), "draft_vocab_size"),
    (lambda d, a: _rewrite_config(d, intermediate_size=7), "mlp"),
    (lambda d, a: _retensor(d, "d2t", torch.full((100,), a.vocab_size)), "d2t"),
    (lambda d, a: _retensor(d, "lm_head.weight", torch.zeros(99, a.hidden_size)), "lm_head"),
])
def test_heads_that_do_not_fit_the_target_are_refused_at_start(tiny, tmp_path, break_it, match):
    target, arch = tiny
    head = write_random_head(tmp_path / "head", arch, draft_vocab_size=100)
    break_it(head, arch)
    with pytest.raises(ValueError, match=match):
        make_llm(target, head)


def _retensor(folder, name: str, value: torch.Tensor) -> None:
    tensors = load_file(f"{folder}/model.safetensors")
    tensors[name] = value
    save_file(tensors, f"{folder}/model.safetensors")


@pytest.mark.parametrize("where", ["propose_many", "file_rows"])
def test_a_drafter_that_raises_leaves_the_request_undrafted(tiny, tmp_path, where):
    """Fault injection: the head raises for one request (drafting, or filing its hidden
    states); that request goes on without drafts to the same tokens, the others keep
    drafting, and every resource is released."""
    target, arch = tiny
    head = write_random_head(tmp_path / "head", arch, draft_vocab_size=100)
    want, _ = generate(target)
    llm = make_llm(target, head)
    engine = llm.engine
    proposer = engine.speculator.proposer
    calls = {"victim": 0}
    real = getattr(proposer, where)

    def flaky(first, *args):  # propose_many(wants) or file_rows(req, rows, start)
        reqs = [r for r, _ in first] if where == "propose_many" else [first]
        if any(r.request_id == "victim" for r in reqs):
            calls["victim"] += 1
            raise RuntimeError("injected")
        return real(first, *args)

    setattr(proposer, where, flaky)
    try:
        ids = ["victim", "b", "c"]
        for rid, prompt in zip(ids, PROMPTS):
            engine.add_request(rid, prompt, GREEDY)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finished = {}
        drafted = {rid: 0 for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            for req in engine.scheduler.running:
                drafted[req.request_id] += len(req.spec_token_ids)
        assert [tokens[rid] for rid in ids] == want
        assert finished == {rid: "length" for rid in ids}
        assert 1 <= calls["victim"] <= 2  # once in the batch, maybe once alone; never again
        assert drafted["victim"] == 0 and drafted["b"] + drafted["c"] > 0
        assert engine.kv_pool_is_whole() and not proposer.states
    finally:
        engine.close()


def test_a_target_split_over_ranks_is_refused():
    """The head reads the target's hidden states in the engine's process: a rank set's
    executor (no `capture_aux_hidden`) is refused before anything loads."""
    from hearth.engine.parallel.parallel_executor import ParallelExecutor
    from hearth.engine.speculative.eagle3 import Eagle3Proposer

    assert not hasattr(ParallelExecutor, "capture_aux_hidden")
    config = SpeculativeConfig(method="eagle3", draft_model="/nowhere")
    with pytest.raises(ValueError, match="tensor and pipeline parallel size 1"):
        Eagle3Proposer(config, ParallelExecutor.__new__(ParallelExecutor))


def reference_logits(model, head, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """vLLM's EAGLE-3 drafting, recomputed from scratch: the target's hidden states from
    transformers (`model`; `hidden_states[i]`: the stream entering layer i), then the head over
    every position with full causal attention, once per draft, each time one row longer. Each
    step's row is the given draft (teacher forcing), so a near-tie that float order breaks the
    other way on another CPU does not send the rest of the chain elsewhere. Returns each step's
    logits over the target vocabulary (-inf where the draft vocabulary has no entry)."""
    config = json.loads((head / "config.json").read_text())
    layers = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    w = load_file(f"{head}/model.safetensors")
    embed = model.model.embed_tokens.weight.detach()
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    d = config["head_dim"]
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2).float() / d))

    def rms(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, positions):  # [T, n, d], HF rotate-half
        angles = positions[:, None].float() * inv_freq[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def layer(ids, hidden):
        m, n = "midlayer.", len(ids)
        x = torch.cat([rms(embed[ids], m + "input_layernorm.weight"),
                       rms(hidden, m + "hidden_norm.weight")], -1)
        positions = torch.arange(n)
        q = rope((x @ w[m + "self_attn.q_proj.weight"].T).view(n, heads, d), positions)
        key = rope((x @ w[m + "self_attn.k_proj.weight"].T).view(n, kv_heads, d), positions)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
        key, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (key, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), key.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        r = hidden + o.transpose(0, 1).reshape(n, -1) @ w[m + "self_attn.o_proj.weight"].T
        h = rms(r, m + "post_attention_layernorm.weight")
        mlp = (torch.nn.functional.silu(h @ w[m + "mlp.gate_proj.weight"].T)
               * (h @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
        return rms(mlp + r, "norm.weight"), mlp + r

    hidden = torch.cat([states[i][0] for i in layers], -1) @ w["fc.weight"].T
    ids, out = list(tokens[1:]), []
    draft_ids = torch.arange(len(w["d2t"])) + w["d2t"]
    for draft in drafts:
        normed, prenorm = layer(torch.tensor(ids), hidden)
        logits = torch.full((model.config.vocab_size,), float("-inf"))
        logits[draft_ids] = normed[-1] @ w["lm_head.weight"].T
        out.append(logits)
        ids.append(draft)
        hidden = torch.cat([hidden, prenorm[-1:]])
    return out


def assert_greedy_up_to_ties(drafts: list[int], logits: list[torch.Tensor]) -> int:
    """Each draft is the reference's argmax, or within float noise of it (a near-tie that
    another summation order breaks the other way). Returns how many were exact argmaxes."""
    exact = 0
    for step, (draft, row) in enumerate(zip(drafts, logits)):
        top = float(row.max())
        assert float(row[draft]) >= top - 1e-4 * max(1.0, abs(top)), \
            f"draft {step}: token {draft} scores {float(row[draft]):.6f}, the best {top:.6f}"
        exact += int(draft == int(row.argmax()))
    return exact


def sharp_head(folder, target: str, arch):
    """A random head (aux layers 1, 3, 4) with sharp attention that outweighs the residual,
    so a wrong key or position shows; and the target in transformers, for `reference_logits`."""
    import transformers

    head = write_random_head(folder, arch, draft_vocab_size=100, aux_layer_ids=(1, 3, 4))
    _retensor(head, "midlayer.self_attn.q_proj.weight",
              4 * load_file(f"{head}/model.safetensors")["midlayer.self_attn.q_proj.weight"])
    _retensor(head, "midlayer.self_attn.o_proj.weight",
              8 * load_file(f"{head}/model.safetensors")["midlayer.self_attn.o_proj.weight"])
    return head, transformers.LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)


def test_drafts_match_a_from_scratch_reference(tiny, tmp_path):
    """The head's own KV, filed step by step (chunked prefill, verify steps with rejected
    drafts), gives the drafts a from-scratch recomputation over the whole sequence gives.
    (Which steps draft and how long follows measured step costs, so the schedule varies from
    run to run; a never-written head KV row is NaN, so a read of one fails every time it
    happens. The growth case has its own fixed-schedule test below.)"""
    target, arch = tiny
    head, model = sharp_head(tmp_path / "head", target, arch)
    llm = make_llm(target, head, max_num_batched_tokens=16, kv_cache_dtype="model")
    engine = llm.engine
    proposer = engine.speculator.proposer
    try:
        for i, ids in enumerate(PROMPTS[1:]):
            engine.add_request(f"r{i}", ids, GREEDY)
        checked, exact, step = 0, 0, 0
        while engine.has_unfinished():
            engine.step()
            running = [r for r in engine.scheduler.running
                       if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens]
            for req in running if step % 2 else []:  # the engine drafts on the other steps
                drafts = proposer.propose(req, 4)
                assert len(drafts) == 4
                exact += assert_greedy_up_to_ties(
                    drafts, reference_logits(model, head, list(req.all_token_ids), drafts))
                checked += 4
            step += 1
        assert checked >= 80 and engine.speculator.counters.num_draft_tokens > 0
        assert exact >= checked - 4  # ties are rare: the comparison is not vacuous
        assert engine.kv_pool_is_whole() and not proposer.states
    finally:
        engine.close()


def test_a_head_exported_with_layers_0_names_loads_the_same(tiny, tmp_path):
    """`model.layers.0.*` (some exports) and `midlayer.*` (SpecForge) name the same layer."""
    from hearth.models.eagle3_head import load_head

    _, arch = tiny
    head = write_random_head(tmp_path / "a", arch, draft_vocab_size=100)
    other = write_random_head(tmp_path / "b", arch, draft_vocab_size=100)
    tensors = load_file(f"{head}/model.safetensors")
    save_file({("model.layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
               for n, t in tensors.items()}, f"{other}/model.safetensors")
    embed = torch.nn.Embedding(arch.vocab_size, arch.hidden_size)
    a, b = load_head(head, arch, embed).state_dict(), load_head(other, arch, embed).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_chain_of_drafts_that_grows_the_head_kv_keeps_its_earlier_drafts(tiny, tmp_path):
    """Regression (issue 44): a request's head KV starts with room for HEAD_KV_ROWS positions;
    a chain of drafts that crossed it grew the KV mid-chain keeping only the committed rows,
    so the later drafts attended over lost (uninitialized) K/V of the earlier ones: drafts off
    the reference now and then, depending on what memory held. Here the first drafts of
    requests with HEAD_KV_ROWS - 2 and - 1 computed tokens cross it at draft 3 and 2."""
    from hearth.engine.speculative.eagle3 import HEAD_KV_ROWS

    target, arch = tiny
    head, model = sharp_head(tmp_path / "head", target, arch)
    llm = make_llm(target, head, max_num_batched_tokens=16, kv_cache_dtype="model")
    engine = llm.engine
    proposer = engine.speculator.proposer
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for n in (HEAD_KV_ROWS - 2, HEAD_KV_ROWS - 1):
            engine.add_request(f"r{n}", [(7 * j + n) % 250 + 3 for j in range(n)], params)
        checked = set()
        while engine.has_unfinished():
            engine.step()
            for req in engine.scheduler.running:
                if req.num_output_tokens == 1 and req.request_id not in checked:
                    # first drafts, before the engine's own: the head KV has the prompt only
                    m = req.num_computed_tokens
                    assert m == req.num_prompt_tokens
                    drafts = proposer.propose(req, 4)
                    state = proposer.states[req.request_id]
                    assert state.start == 0 and state.n == m and state.k.shape[0] > HEAD_KV_ROWS
                    assert torch.isfinite(state.k[: m + 3]).all()  # kept rows and the chain's
                    assert torch.isfinite(state.v[: m + 3]).all()
                    assert_greedy_up_to_ties(
                        drafts, reference_logits(model, head, list(req.all_token_ids), drafts))
                    checked.add(req.request_id)
        assert len(checked) == 2
        assert engine.kv_pool_is_whole() and not proposer.states
    finally:
        engine.close()


def test_growing_the_head_kv_keeps_every_row_and_marks_new_ones_unwritten():
    """`_HeadState.reserve` mid-chain: rows past the committed ones (an unfinished chain's
    drafts) survive the growth; rows never written read NaN, never stale memory."""
    from hearth.engine.speculative.eagle3 import _HeadState

    k, v = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    state = _HeadState(10, k, v, rows=[], num_rows=0)
    state.append_kv(torch.full((3, 2, 8), 1.5), torch.full((3, 2, 8), -1.5))  # committed
    state.k[3], state.v[3] = 12345.5, -12345.5  # draft 1 of a chain under way
    state.reserve(5)  # draft 2's row
    assert state.n == 3 and state.k.shape[0] >= 5
    assert (state.k[:3] == 1.5).all() and (state.v[:3] == -1.5).all()
    assert (state.k[3] == 12345.5).all() and (state.v[3] == -12345.5).all()
    assert state.k[4:].isnan().all() and state.v[4:].isnan().all()
