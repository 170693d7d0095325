"""Suite-wide: the time each tier took (unit, model, e2e, gpu), printed at the end of a run.

`make test` must stay within its budget (issue 28: the whole suite from a fresh clone, and the
unit tier alone); this summary says where the time goes. Wall time per tier is the sum of its
tests' setup, call and teardown phases (module fixtures included), as pytest measures them; under
pytest-xdist (`make test` runs two workers) that sum is over both workers, so it exceeds the wall.

`HEARTH_TEST_TIMES=FILE` appends one line per phase as it ends (`seconds phase outcome nodeid
rss_mb cpu_s`: the resident memory of the process that ran it, after the phase, and the CPU
seconds the phase cost: user+sys of the pytest process and of the child processes it waited for
in that phase, such as servers a fixture stopped; not a server still running, nor Ray's
processes), so even an interrupted run says where its time,
memory and CPU went (`awk '{print $NF, $0}' FILE | sort -rn | head`: on the 2-core box the CPU is
what a test costs, since the wall of a test beside another worker is noisy).
"""

from __future__ import annotations

import os
import resource
import sys
from collections import defaultdict

import pytest

_TIER_SECONDS: dict[str, float] = defaultdict(float)
_TIER_TESTS: dict[str, int] = defaultdict(int)


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, the cores each worker may keep busy (None: one process, all of them)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


# `make test` runs one worker per core. Each worker's torch (and every server it starts, which
# inherits the environment) would otherwise run a thread per core too: twice as many busy threads
# as cores, and a parallel region ends at a barrier that waits for a preempted thread (a step
# beside a busy neighbour took ~60x longer on two threads than on one: thread_tuner.py). So a
# worker and its children get their share of the cores. Results do not depend on the count;
# tests of the threaded paths themselves ask for every core with `all_threads`. An explicit
# OMP_NUM_THREADS wins.
WORKER_THREADS = _threads_per_worker()
if WORKER_THREADS is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(WORKER_THREADS)
    if "torch" in sys.modules:  # imported before this file (a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(WORKER_THREADS)

_TIMES_FILE = os.environ.get("HEARTH_TEST_TIMES")
_IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ  # the controller writes each report once


def _rss_mb() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except OSError:
        return -1


def _cpu_seconds() -> float:
    """User+sys seconds of this process and of its children that have been waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _TIMES_FILE:
    _PHASE_START_CPU = "_hearth_phase_start_cpu"

    def _mark_phase_start(item) -> None:
        setattr(item, _PHASE_START_CPU, _cpu_seconds())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item):
        _mark_phase_start(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(item):
        _mark_phase_start(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(item, nextitem):
        _mark_phase_start(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        cpu = _cpu_seconds() - getattr(item, _PHASE_START_CPU, _cpu_seconds())
        outcome.get_result().user_properties += [("rss_mb", _rss_mb()), ("cpu_s", round(cpu, 3))]


def pytest_runtest_logreport(report) -> None:
    if _TIMES_FILE and not _IN_WORKER:
        props = dict(report.user_properties)
        with open(_TIMES_FILE, "a") as f:
            f.write(f"{report.duration:9.3f} {report.when:8} {report.outcome:7} {report.nodeid} "
                    f"{props.get('rss_mb', -1)} {props.get('cpu_s', -1):.3f}\n")
    tier = _tier(report.nodeid)
    _TIER_SECONDS[tier] += report.duration
    if report.when == "call":
        _TIER_TESTS[tier] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TIER_SECONDS:
        return
    terminalreporter.section("time per tier")
    for tier in sorted(_TIER_SECONDS, key=_TIER_SECONDS.get, reverse=True):
        terminalreporter.write_line(f"{tier:>8}: {_TIER_SECONDS[tier]:7.1f} s over "
                                    f"{_TIER_TESTS[tier]} tests")


@pytest.fixture
def all_threads():
    """Torch threads for every core of the machine for the test (restored after): for tests of
    the kernels' and the thread tuner's multi-threaded paths, whatever the worker's share."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    yield torch.get_num_threads()
    torch.set_num_threads(saved)
