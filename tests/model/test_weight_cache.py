"""The packed-weight cache file (hearth/models/weight_cache.py, `--weight-cache DIR`).

On tiny random GGUF files (hearth/models/random_gguf.py): a dense Llama of llama.cpp's Q4_K_M
mix (Q4_K beside Q6_K, some requantized to Q8_0), a Qwen3-MoE of the same mix (the expert
stacks), gpt-oss (MXFP4 experts). The first load with a cache packs and writes the file, the
second packs nothing; both hold every packed weight as views of the file's map, and both compute
bit for bit what a load without a cache computes. Two processes started together write one
file; a truncated or mismatched file is rebuilt with a warning; a directory that cannot be
written leaves the load as without a cache.
"""

import json
import logging
import multiprocessing
import os
import resource
import signal

import pytest
import torch

from hearth.engine.executor import make_executor
from hearth.engine.llm import make_engine_config
from hearth.models import weight_cache
from hearth.models.layers import QuantizedWeight
from hearth.models.loader import load_checkpoint, resolve_builtin
from hearth.models.moe import SparseMoeBlock
from hearth.models.random_gguf import write_random_gguf
from hearth.ops.cpu_kernels import available_variants
from tests.model.test_blocks_only import PROMPT_LEN, TINY, TINY_MOE, tokens
from tests.model.test_formats import teacher_forced_logits
from tests.model.test_random_gguf_families import GPT_OSS

pytestmark = pytest.mark.skipif(not available_variants(), reason="CPU kernels not built")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wcache")
    tokenizer = resolve_builtin("smollm2-135m-instruct")
    return {name: write_random_gguf(folder / f"{name}.gguf", shape, tokenizer, mix, seed=4,
                                    context_length=4096)
            for name, shape, mix in (("llama", TINY, "q4_k_m"), ("moe", TINY_MOE, "q4_k_m"),
                                     ("gpt-oss", GPT_OSS, None))}


def runner_for(path, cache_dir=None, quantization: str = "gguf"):
    config = make_engine_config(str(path), dtype="float32", prefill_dtype="float32",
                                kv_cache_dtype="model", quantization=quantization,
                                num_blocks=16, weight_cache=str(cache_dir or ""))
    return make_executor(config, load_checkpoint(str(path)))


def logits(runner) -> torch.Tensor:
    return teacher_forced_logits(runner, tokens(), PROMPT_LEN)


def packed_weights(model) -> list:
    """Every PackedWeight the model's layers hold (linears, the embedding table, experts)."""
    out = [m.qweight for m in model.modules() if isinstance(m, QuantizedWeight)]
    out.append(model.embed_tokens.packed)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            out += [layer.mlp.experts.qw13, layer.mlp.experts.qw2]
    return out


def assert_views_of_the_map(model) -> None:
    load = model.weight_cache
    start = load.mapped.data_ptr()
    end = start + load.num_bytes
    weights = packed_weights(model)
    assert weights and all(w is not None for w in weights)
    for w in weights:
        for t in (w.qs, w.d, w.m):
            if t.numel():
                assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end


@pytest.mark.parametrize("name", ["llama", "moe", "gpt-oss"])
def test_miss_then_hit_are_the_uncached_model_bit_for_bit(files, name, tmp_path):
    want = logits(runner_for(files[name]))
    miss = runner_for(files[name], tmp_path)
    load = miss.model.weight_cache
    assert not load.hit and load.num_packed > 0
    assert_views_of_the_map(miss.model)
    assert torch.equal(logits(miss), want)

    hit = runner_for(files[name], tmp_path)
    load = hit.model.weight_cache
    assert load.hit and load.num_packed == 0  # nothing packed: every weight read from the file
    assert_views_of_the_map(hit.model)
    assert torch.equal(logits(hit), want)
    if name != "llama":
        assert all(layer.mlp.experts.blocks_only for layer in hit.model.layers)
    assert len(list(tmp_path.glob("*.bin"))) == 1


def test_the_key_separates_formats_and_kernels(files, tmp_path):
    """gguf and gguf-a8 pack differently: two files, each a hit on its second load."""
    for quantization in ("gguf", "gguf-a8", "gguf", "gguf-a8"):
        runner_for(files["llama"], tmp_path, quantization)
    assert len(list(tmp_path.glob("*.bin"))) == 2
    assert runner_for(files["llama"], tmp_path, "gguf-a8").model.weight_cache.hit


def test_a_changed_gguf_is_a_miss(files, tmp_path):
    runner_for(files["llama"], tmp_path)
    stat = os.stat(files["llama"])
    os.utime(files["llama"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert not runner_for(files["llama"], tmp_path).model.weight_cache.hit
    finally:
        os.utime(files["llama"], ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncate", "index", "version", "offset"])
def test_a_damaged_cache_is_rebuilt_with_a_warning(files, tmp_path, caplog, damage):
    want = logits(runner_for(files["llama"]))
    runner_for(files["llama"], tmp_path)
    (bin_path,) = tmp_path.glob("*.bin")
    index_path = bin_path.with_suffix(".json")
    index = json.loads(index_path.read_text())
    if damage == "truncate":
        os.truncate(bin_path, bin_path.stat().st_size // 2)
    elif damage == "index":
        index_path.write_text("{not json")
    elif damage == "version":
        index_path.write_text(json.dumps({**index, "format_version": -1}))
    else:  # an index naming bytes past the end of the file
        index["entries"][0]["weights"][0]["tensors"][0]["offset"] = index["size"]
        index_path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="hearth.models"):
        rebuilt = runner_for(files["llama"], tmp_path)
    assert "rebuilding it" in caplog.text
    assert not rebuilt.model.weight_cache.hit and rebuilt.model.weight_cache.num_packed > 0
    assert torch.equal(logits(rebuilt), want)
    assert runner_for(files["llama"], tmp_path).model.weight_cache.hit
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".bin", ".json", ".lock"]


def test_an_unusable_directory_is_a_warning_and_no_cache(files, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="hearth.models"):
        runner = runner_for(files["llama"], blocker / "weights")  # under a file: no directory
    assert "not usable" in caplog.text
    assert getattr(runner.model, "weight_cache", None) is None
    assert torch.equal(logits(runner), logits(runner_for(files["llama"])))


def _load_in_child(path: str, cache_dir: str, queue) -> None:
    runner = runner_for(path, cache_dir)
    queue.put((runner.model.weight_cache.hit, logits(runner).numpy()))  # pickled whole


def test_two_processes_started_together_write_one_file(files, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_load_in_child, args=(str(files["moe"]), str(tmp_path), queue))
                for _ in range(2)]
    for child in children:
        child.start()
    results = [queue.get(timeout=600) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(hit for hit, _ in results) == [False, True]  # one packed, one waited and mapped
    want = logits(runner_for(files["moe"]))
    assert all(torch.equal(torch.from_numpy(got), want) for _, got in results)
    assert len(list(tmp_path.glob("*.bin"))) == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_format_version_is_in_the_key(files):
    model = runner_for(files["llama"]).model
    key = weight_cache.cache_key(load_checkpoint(str(files["llama"])), model, False, None)
    assert key["format_version"] == weight_cache.FORMAT_VERSION
    assert key["gguf"] == os.path.realpath(files["llama"])


def test_a_write_that_fails_leaves_no_cache_and_the_same_model(files, tmp_path, caplog):
    """The file cannot grow past 1 MB (as a full disk): a warning, the temporary file removed,
    every weight packed as without a cache. A temporary file a dead builder left is removed."""
    runner_for(files["llama"], tmp_path)  # names the sha
    (bin_path,) = tmp_path.glob("*.bin")
    stale = bin_path.with_name(bin_path.name + ".999999.tmp")
    stale.write_bytes(b"left by a builder that died")
    bin_path.unlink()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="hearth.models"):
            runner = runner_for(files["llama"], tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert "packing without a cache" in caplog.text
    assert getattr(runner.model, "weight_cache", None) is None
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.bin"))
    assert torch.equal(logits(runner), logits(runner_for(files["llama"])))
