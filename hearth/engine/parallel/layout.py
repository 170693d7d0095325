"""How a model and a step are cut up across ranks: checks, stage layer ranges, micro-batches.

Pure functions of shapes and counts, so they are unit-tested without processes.
"""

from __future__ import annotations

from hearth.models.arch import ModelArch


def check_parallel_shape(arch: ModelArch, tp_size: int, pp_size: int,
                         expert_parallel: bool = False) -> None:
    """Raise ValueError naming the constraint when the model cannot be split T x P ways (a MoE
    model's experts: cut along their width, or with `expert_parallel` split whole)."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor={tp_size} pipeline={pp_size}")
    if pp_size > arch.num_layers:
        raise ValueError(f"pipeline parallel size {pp_size} is larger than the model's "
                         f"{arch.num_layers} layers (each stage needs at least one layer)")
    problems = []
    if arch.num_heads % tp_size:
        problems.append(f"num_heads={arch.num_heads}")
    kv = arch.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        # Fewer KV heads than ranks: each KV head is replicated on tp_size / kv ranks, which
        # only lines up with the query heads when kv divides tp_size.
        problems.append(f"num_kv_heads={kv}")
    if arch.intermediate_size % tp_size and _has_dense_mlp(arch):
        problems.append(f"intermediate_size={arch.intermediate_size}")
    if arch.moe is not None and expert_parallel and arch.moe.num_experts % tp_size:
        problems.append(f"num_experts={arch.moe.num_experts} (--enable-expert-parallel)")
    if (arch.moe is not None and not expert_parallel
            and arch.moe.expert_intermediate_size % tp_size):
        problems.append(f"the experts' intermediate size={arch.moe.expert_intermediate_size}")
    if arch.moe is not None and arch.moe.num_shared_experts:
        shared = arch.moe.num_shared_experts * arch.moe.expert_intermediate_size
        if shared % tp_size:
            problems.append(f"the shared experts' intermediate size={shared}")
    if problems:
        valid = [t for t in range(1, arch.num_heads + 1) if _tp_fits(arch, t)]
        raise ValueError(f"tensor parallel size {tp_size} does not divide the model's "
                         f"{', '.join(problems)}; valid sizes: {', '.join(map(str, valid))}")


def _has_dense_mlp(arch: ModelArch) -> bool:
    return arch.moe is None or any(not arch.is_moe_layer(i) for i in range(arch.num_layers))


def _tp_fits(arch: ModelArch, t: int) -> bool:
    kv = arch.num_kv_heads
    return (arch.num_heads % t == 0
            and (arch.intermediate_size % t == 0 or not _has_dense_mlp(arch))
            and (kv % t == 0 if kv >= t else t % kv == 0))


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) per stage, sizes differing by at most one. Earlier stages take
    the extra layers because the last stage also runs the LM head."""
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage in range(pp_size):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def kv_bytes_per_block_per_rank(arch: ModelArch, tp_size: int, pp_size: int, block_size: int,
                                itemsize: int, row_extra_bytes: int = 0) -> int:
    """KV bytes one block takes on the busiest rank (the stage with the most layers).
    `row_extra_bytes`: bytes each (token, head) row carries beside its values (the int8 KV
    format's float32 scale, hearth/ops/kv_quant.py)."""
    max_layers = max(end - start for start, end in split_layers(arch.num_layers, pp_size))
    planes, heads, dim = arch.kv_cache_layout(tp_size)
    return planes * max_layers * block_size * heads * (dim * itemsize + row_extra_bytes)
