"""The model families hearth serves, one line each; every other table of names is derived.

A family is a folder under hearth/models/families/ whose `FAMILY` (a `Family`) says which
config.json `architectures[0]` and GGUF `general.architecture` values it answers to, how their
configs become a ModelArch, and which model class, weight loader and quant hooks run it
(hearth/models/families/__init__.py). Adding one is its folder and a line in `FAMILIES`.

Loaders ask this module which family (and `ModelArch.architecture`) a file is; `ModelArch`
asks it whether an architecture needs MoE / MLA settings; the model builder and the quantizer
ask it for the family's code. Nothing else names architectures. Importing it imports no torch.
"""

from __future__ import annotations

from hearth.models.families import Family, deepseek, gpt_oss, llama, llama4, moe_llama

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    moe_llama.FAMILY,
    deepseek.FAMILY,
    llama4.FAMILY,
    gpt_oss.FAMILY,
)


def check_families(families: tuple[Family, ...]) -> None:
    """Each architecture and each HF name belongs to one family; a GGUF name to at most one
    dense and one MoE family (a file's expert tensors pick between them)."""
    owners: dict[str, str] = {}
    for family in families:
        for name in family.architectures + tuple(family.hf_names):
            if owners.setdefault(name, family.name) != family.name:
                raise ValueError(f"{name!r} is claimed by families {owners[name]} and "
                                 f"{family.name}")
        for gguf_name in family.gguf_names:
            key = f"gguf {gguf_name} ({'MoE' if family.is_moe else 'dense'})"
            if owners.setdefault(key, family.name) != family.name:
                raise ValueError(f"{key} is claimed by families {owners[key]} and {family.name}")


check_families(FAMILIES)

_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
MOE_ARCHITECTURES = tuple(a for f in FAMILIES if f.is_moe for a in f.architectures)
MLA_ARCHITECTURES = tuple(a for f in FAMILIES if f.uses_mla for a in f.architectures)
HF_ARCHITECTURES = {hf: (f, a) for f in FAMILIES for hf, a in f.hf_names.items()}
GGUF_ARCHITECTURES = tuple(dict.fromkeys(g for f in FAMILIES for g in f.gguf_names))


def family_of(architecture: str) -> Family:
    """The family that runs `architecture` (a ModelArch.architecture)."""
    if architecture not in _BY_ARCHITECTURE:
        raise ValueError(f"unsupported architecture {architecture!r}; hearth supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return _BY_ARCHITECTURE[architecture]


def hf_family(hf_name: str | None, folder) -> tuple[Family, str]:
    """(family, ModelArch.architecture) of a config.json's `architectures[0]`."""
    if hf_name not in HF_ARCHITECTURES:
        raise ValueError(f"{folder}: architecture {hf_name!r} is not supported "
                         f"(supported: {', '.join(HF_ARCHITECTURES)})")
    return HF_ARCHITECTURES[hf_name]


def gguf_family(gguf_name: str, has_experts: bool, path) -> tuple[Family, str]:
    """(family, ModelArch.architecture as the file's name says) of a GGUF file: among the
    families answering to `gguf_name`, the MoE one if the file has experts, else the dense one."""
    claims = [f for f in FAMILIES if gguf_name in f.gguf_names]
    if not claims:
        raise ValueError(f"{path}: GGUF architecture {gguf_name!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    family = next((f for f in claims if f.is_moe == has_experts), None)
    if family is None:
        raise ValueError(f"{path}: a {gguf_name} file {'with' if has_experts else 'without'} "
                         f"experts is not supported")
    return family, family.gguf_names[gguf_name]


def model_class(architecture: str) -> type:
    """The nn.Module class that runs `architecture` (a ModelArch.architecture)."""
    return family_of(architecture).model_class()
