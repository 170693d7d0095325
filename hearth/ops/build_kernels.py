"""Build hearth's CPU kernels (hearth/ops/csrc/cpu_kernels.cpp) for this machine.

    python -m hearth.ops.build_kernels     (run by `make setup`; idempotent)

The source is compiled once per instruction set the CPU lists (AVX-512 + AMX, AVX-512 + VNNI,
AVX-512, AVX2) into `hearth/ops/_build/` under names that carry a hash of the source and the torch
version, so a stale build is never loaded. Each build is then run once in a child process on a
small self-check (its results against plain torch): a CPU that lists an instruction set it cannot
execute kills only the child, and that build is marked unusable in `probe.json`.
`hearth.ops.cpu_kernels` loads the best usable build at run time and falls back to plain torch
when there is none.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
BUILD_DIR = Path(__file__).parent / "_build"
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx2"]
VARIANTS = {  # best first
    # + prefill attention on AMX tiles (bf16); its probe runs them, so a CPU or VM that lists
    # AMX but faults on it (or a kernel that refuses the tile state) marks only this build unusable
    "avx512amx": [*AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512vnni": [*AVX512, "-mavx512vnni"],  # qlinear's int8-activation path on VNNI dot products
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx2"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
# The CPU flags (/proc/cpuinfo) a build needs: a build whose flags the CPU does not list is not
# compiled (it could never run here; it is most of `make setup`'s compile time on an AVX2 CPU).
# A CPU that lists a flag and faults on it is caught by the probe instead.
NEEDS = {
    "avx512amx": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                  "amx_tile", "amx_bf16"),
    "avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c"),
}
ISA = {"avx512amx": 514, "avx512vnni": 513, "avx512": 512, "avx2": 256}  # what each build's isa() returns
PROBE_FILE = BUILD_DIR / "probe.json"


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    for path in sorted(SOURCE.parent.iterdir()):  # cpu_kernels.cpp and the headers it includes
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:12]


def library_path(variant: str) -> Path:
    return BUILD_DIR / f"hearth_cpu_{variant}_{build_key()}.so"


def compile_variant(variant: str) -> Path:
    import torch
    from torch.utils import cpp_extension

    out = library_path(variant)
    if out.exists():
        return out
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd = ["g++", "-O3", "-std=c++20", "-w", "-shared", "-fPIC", "-fopenmp", "-DNDEBUG",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *VARIANTS[variant], *includes, f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-o", str(out) + ".tmp",
           f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    subprocess.run(cmd, check=True)
    Path(str(out) + ".tmp").rename(out)
    return out


SELF_CHECK = r"""
import sys, torch
torch.ops.load_library(sys.argv[1])
h = torch.ops.hearth
assert h.isa() == int(sys.argv[2])
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 64, generator=g)
w = torch.randn(8, 64, generator=g)
d = w.reshape(8, 2, 32).abs().amax(-1, keepdim=True) / 127
d = d.half().float()
q = (w.reshape(8, 2, 32) / d).round().clamp(-127, 127).to(torch.int8)
ref = x @ (q.float() * d.half().float()).reshape(8, 64).T
w13, w2 = torch.randn(3, 64, 64, generator=g), torch.randn(3, 64, 32, generator=g)
ids, tw = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1], [0, 2]]), torch.rand(5, 2, generator=g)
moe = h.moe_experts(x, w13, w2, tw, ids, 0, [], [])
gu = torch.einsum("th,tjih->tji", x, w13[ids])
ref_moe = torch.einsum("tji,tjhi,tj->th", torch.nn.functional.silu(gu[..., :32]) * gu[..., 32:],
                       w2[ids], tw)
assert torch.allclose(moe, ref_moe, atol=1e-3, rtol=1e-4), "moe_experts"
got = h.qlinear(x, q.view(torch.uint8).reshape(8, 64), d.half().reshape(8, 2),
                torch.empty(0, dtype=torch.half), 8, 8, 64)
assert torch.allclose(got, ref, atol=1e-4), "qlinear"
for qtype, qs in ((8, q.view(torch.uint8).reshape(8, 64)),
                  (2, torch.randint(0, 256, (8, 32), generator=g, dtype=torch.uint8))):
    args = (qs, d.half().reshape(8, 2), torch.empty(0, dtype=torch.half), qtype, 8, 64)
    exact = h.qlinear(x, *args)
    a8 = h.qlinear(x, *args, 64, True)  # 8-bit activations (VNNI in that build)
    assert (a8 - exact).abs().max() <= 0.02 * exact.abs().max() + 1e-4, "qlinear int8 activations"
r = torch.randn(5, 64, generator=g)
n = h.add_rms_norm(x, r.clone(), torch.ones(64), 1e-5)
ref_n = (r + x) * torch.rsqrt((r + x).pow(2).mean(-1, keepdim=True) + 1e-5)
assert torch.allclose(n, ref_n, atol=1e-5), "add_rms_norm"
if h.isa() == 514:  # AMX tiles: a prompt of 40 after 8 cached tokens, against a float64 softmax
    qf, kf, vf = (torch.randn(48, h_, 64, generator=g, dtype=torch.float64) for h_ in (6, 2, 2))
    kc, vc = kf.float().reshape(3, 16, 2, 64), vf.float().reshape(3, 16, 2, 64)
    got = h.amx_prefill_attention(qf[8:].bfloat16(), kc, vc, torch.tensor([0, 1, 2]), 48, 0.125, 2)
    s = torch.einsum("qhd,khd->hqk", qf[8:], kf.repeat_interleave(3, 1)) * 0.125
    s = s.masked_fill(torch.arange(48)[None, :] > torch.arange(8, 48)[:, None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vf.repeat_interleave(3, 1))
    assert (got.double() - ref).abs().max() < 0.05, "amx_prefill_attention"
print("ok")
"""


def probe(variant: str, path: Path) -> bool:
    isa = str(ISA[variant])
    proc = subprocess.run([sys.executable, "-c", SELF_CHECK, str(path), isa],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0 and proc.stdout.strip() == "ok"


def cpu_flags() -> set[str] | None:
    """The flags /proc/cpuinfo lists, or None where there is no such file (then every build is
    compiled and the probes decide)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return flags or None


def build_and_probe(variant: str, flags: set[str] | None = None) -> dict:
    if flags is not None and not set(NEEDS[variant]) <= flags:
        return {"usable": False, "path": None, "skipped": "the CPU does not list "
                + ", ".join(sorted(set(NEEDS[variant]) - flags))}
    try:
        path = compile_variant(variant)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"hearth kernels: {variant} build failed: {e}", file=sys.stderr)
        return {"usable": False, "path": None}
    return {"usable": probe(variant, path), "path": path.name}


def main() -> int:
    # The variants compile (and probe, each in its own child) side by side: g++ is one thread.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        flags = cpu_flags()
        results = dict(zip(VARIANTS, pool.map(lambda v: build_and_probe(v, flags), VARIANTS)))
    for variant, result in results.items():
        if "skipped" in result:
            print(f"hearth kernels: {variant}: not built ({result['skipped']})")
        elif result["path"] is not None:
            print(f"hearth kernels: {variant}: "
                  f"{'usable' if result['usable'] else 'NOT usable on this CPU'}")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    PROBE_FILE.write_text(json.dumps({"key": build_key(), "variants": results}, indent=1))
    return 0 if any(v["usable"] for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
