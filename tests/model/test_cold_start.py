"""What a cold start skips must not change what is loaded.

Exact: weights decoded straight into the parameters (`Checkpoint.read_into`) equal the ones
`get()` returns, element for element, for every stored format and the un-permuted Q/K rows; the
tokenizer source read without torch equals the checkpoint's; a worker's HTTP side builds its
tokenizer without importing torch (the engine-core process beside it needs those CPU seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from hearth.models.gguf_loader import GGUFCheckpoint
from hearth.models.loader import load_checkpoint, load_tokenizer_source
from hearth.models.weights import build_model
from tests.model.test_loader import make_gguf, make_tiny_weights

MODEL = "smollm2-135m-instruct"
QT = gguf.GGMLQuantizationType


def reference_model(checkpoint, dtype=torch.float32):
    """The model as `get()` gives its tensors (the path read_into replaces), for comparison."""
    class ViaGet:  # a checkpoint without read_into's fast path: base-class copy of get()
        def __init__(self, inner):
            self.inner, self.arch, self.name = inner, inner.arch, inner.name

        def tensor_names(self):
            return self.inner.tensor_names()

        def get(self, name, shard=None):
            return self.inner.get(name) if shard is None else self.inner.get(name, shard=shard)

        def read_into(self, out, name, shard=None):
            value = self.get(name, shard)
            assert tuple(out.shape) == tuple(value.shape), name
            out.copy_(value)

    return build_model(ViaGet(checkpoint), dtype)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# (gguf cannot write K-quants; their `out=` path is tests/unit/test_dequant.py's)
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("tied", [False, True])
def test_read_into_loads_what_get_returns(tmp_path: Path, qtype: QT, tied: bool) -> None:
    weights = make_tiny_weights(tied=tied, bias=True)
    checkpoint = GGUFCheckpoint(make_gguf(tmp_path / "m.gguf", weights, qtype=qtype))
    loaded = build_model(checkpoint, torch.float32)
    assert_same_weights(loaded, reference_model(checkpoint))
    if tied:  # a copy of the embedding, not the same storage
        assert torch.equal(loaded.lm_head.weight, loaded.embed_tokens.weight)
        assert loaded.lm_head.weight.data_ptr() != loaded.embed_tokens.weight.data_ptr()


def test_default_model_loads_what_get_returns() -> None:
    checkpoint = load_checkpoint(MODEL)
    assert_same_weights(build_model(checkpoint, torch.float32), reference_model(checkpoint))


def test_read_into_refuses_a_wrong_shape(tmp_path: Path) -> None:
    checkpoint = GGUFCheckpoint(make_gguf(tmp_path / "m.gguf", make_tiny_weights(), qtype=QT.Q8_0))
    out = torch.empty(3, 64)
    with pytest.raises(ValueError, match="shape mismatch loading model.layers.0.mlp.up_proj"):
        checkpoint.read_into(out, "model.layers.0.mlp.up_proj.weight")


def test_tokenizer_source_without_torch_equals_the_checkpoints(tmp_path: Path) -> None:
    assert (load_tokenizer_source(MODEL).gguf_metadata
            == load_checkpoint(MODEL).tokenizer_source.gguf_metadata)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert load_tokenizer_source(str(folder)).folder == folder
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        load_tokenizer_source(str(tmp_path / "missing"))


def test_worker_http_side_builds_its_tokenizer_without_torch() -> None:
    script = (
        "import json, sys\n"
        "from hearth.cli import build_parser, engine_config\n"
        "from hearth.server import worker_launch\n"
        "from hearth.server.worker_app import load_tokenizer\n"
        "tok = load_tokenizer(engine_config(build_parser().parse_args(['serve'])))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'eos': list(tok.eos_token_ids),\n"
        "                  'ids': tok.encode('hello world')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from hearth.engine.text.tokenizer import Tokenizer

    reference = Tokenizer.from_checkpoint(load_checkpoint(MODEL))
    assert got == {"torch": False, "eos": list(reference.eos_token_ids),
                   "ids": reference.encode("hello world")}
