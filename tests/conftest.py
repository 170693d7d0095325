"""Suite-wide: the time each tier took (unit, model, e2e, gpu), printed at the end of a run.

`make test` must stay within its budget (issue 28: the whole suite from a fresh clone, and the
unit tier alone); this summary says where the time goes. Wall time per tier is the sum of its
tests' setup, call and teardown phases (module fixtures included), as pytest measures them; under
pytest-xdist (`make test` runs two workers) that sum is over both workers, so it exceeds the wall.

`HEARTH_TEST_TIMES=FILE` appends one line per phase as it ends (`seconds phase outcome nodeid
rss_mb`: the resident memory of the process that ran it, after the phase), so even an interrupted
run says where its time and memory went (`sort -rn FILE | head`).
"""

from __future__ import annotations

import os
from collections import defaultdict

_TIER_SECONDS: dict[str, float] = defaultdict(float)
_TIER_TESTS: dict[str, int] = defaultdict(int)


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


_TIMES_FILE = os.environ.get("HEARTH_TEST_TIMES")
_IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ  # the controller writes each report once


def _rss_mb() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except OSError:
        return -1


if _TIMES_FILE:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        outcome.get_result().user_properties.append(("rss_mb", _rss_mb()))


def pytest_runtest_logreport(report) -> None:
    if _TIMES_FILE and not _IN_WORKER:
        rss = dict(report.user_properties).get("rss_mb", -1)
        with open(_TIMES_FILE, "a") as f:
            f.write(f"{report.duration:9.3f} {report.when:8} {report.outcome:7} {report.nodeid} "
                    f"{rss}\n")
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
