"""Every usable kernel build but the best one: tests/unit/test_cpu_kernels.py again in a child
process per build (torch.ops holds one library named `hearth` per process, so a process tests
one build; the unit tier tests the best one).

Here rather than in the unit tier: on a Zen 4 EPYC (avx512vnni best; avx512 and avx2 in
children) the children cost ~27 of the unit tier's ~53 CPU-seconds and kept `make test-unit` at
~38 s; run beside the parent's tests, OpenMP's barriers on the 2 oversubscribed cores took it to
~55 s. `make test` runs them with the model tier.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.ops.cpu_kernels import available_variants

KERNEL_TESTS = Path(__file__).parents[1] / "unit" / "test_cpu_kernels.py"


@pytest.mark.parametrize("variant", available_variants()[1:])
def test_other_builds_in_a_child_process(variant):
    env = {**os.environ, "HEARTH_TEST_KERNEL_VARIANT": variant}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:hypothesispytest", str(KERNEL_TESTS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
