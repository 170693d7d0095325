"""What every weight loader hands the model: an architecture, named tensors, and a tokenizer source.

Invariant: `tensor_names()` are Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...)
and `get()` returns tensors in HF layout (Q/K rows in rotate-half RoPE order) whatever the file
format. Shapes follow `torch.nn.Linear`: `[out_features, in_features]`.

`shard=(dim, rank, world_size)` asks for the contiguous `1/world_size` slice along `dim` (tensor
parallelism). A loader reads only that slice where the format allows it (safetensors slices,
whole rows or whole blocks of a GGUF tensor) and otherwise slices after reading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hearth.models.arch import ModelArch

if TYPE_CHECKING:
    import torch

Shard = tuple[int, int, int]  # (dim, rank, world_size)


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizer of a checkpoint lives; `hearth.engine.text.tokenizer.Tokenizer` builds it.

    Exactly one field is set. (The tokenizer is an engine-layer object; models/ only says where
    its data is, so the import graph keeps pointing down.)
    """

    folder: Path | None = None  # holds tokenizer.json (+ tokenizer_config.json, chat template)
    gguf_metadata: dict[str, Any] | None = field(default=None, repr=False)  # tokenizer.* keys


class Checkpoint(ABC):
    arch: ModelArch
    name: str  # default served model name: built-in name, folder name or file stem
    tokenizer_source: TokenizerSource

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """HF names of every tensor the model needs, in file order."""

    @abstractmethod
    def get(self, name: str, shard: Shard | None = None) -> torch.Tensor:
        """One tensor (float32, or its stored float dtype for safetensors), optionally one shard."""

    def read_into(self, out: torch.Tensor, name: str, shard: Shard | None = None) -> None:
        """Write `get(name, shard)` into `out` (a parameter or rows of one: same shape, its own
        dtype). A loader that can decode straight into `out` overrides this: no temporary and
        no second pass over the weights (each pass is ~0.15 s of a cold start in page faults)."""
        value = self.get(name) if shard is None else self.get(name, shard=shard)
        if tuple(out.shape) != tuple(value.shape):
            raise ValueError(f"shape mismatch loading {name}: checkpoint {tuple(value.shape)}, "
                             f"model expects {tuple(out.shape)}")
        out.copy_(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, arch={self.arch})"


def shard_bounds(size: int, shard: Shard, name: str) -> tuple[int, int]:
    """[start, stop) of `shard` over a dimension of `size`; it must divide evenly."""
    dim, rank, world_size = shard
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid shard {shard} for {name}")
    if size % world_size:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split into {world_size} equal shards")
    step = size // world_size
    return rank * step, (rank + 1) * step


def take_shard(tensor: torch.Tensor, shard: Shard | None, name: str) -> torch.Tensor:
    """Slice an already-read tensor (the fallback when the format cannot read a slice directly)."""
    if shard is None:
        return tensor
    dim = shard[0]
    start, stop = shard_bounds(tensor.shape[dim], shard, name)
    return tensor.narrow(dim, start, stop - start).contiguous()
