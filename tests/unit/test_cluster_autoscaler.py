"""The autoscaler's decisions (hearth/cluster/autoscaler.py), the registry's atomic target moves
and the cluster package's import promise, without Ray."""

import subprocess
import sys

import pytest

from hearth.cluster.autoscaler import Autoscaler
from hearth.cluster.cluster_config import AutoscaleConfig
from hearth.cluster.worker_registry import WorkerRegistry


def make_autoscaler(low=1, high=4, target=2.0, up=10.0, down=60.0) -> Autoscaler:
    return Autoscaler(AutoscaleConfig(ranges={"decode": (low, high)}, target_requests=target,
                                      upscale_delay_seconds=up, downscale_delay_seconds=down))


def test_wanted_is_open_requests_over_target_within_the_range():
    a = make_autoscaler(low=1, high=4, target=2.0)
    assert [a.wanted("decode", n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100)] == \
        [1, 1, 1, 2, 2, 3, 4, 4, 4]


def test_upscale_waits_for_the_delay_and_a_break_restarts_the_clock():
    a = make_autoscaler(up=10.0)
    assert a.decide("decode", 1, 6, now=100.0) == 1  # wants 3 from now on
    assert a.decide("decode", 1, 6, now=109.9) == 1
    assert a.decide("decode", 1, 2, now=110.0) == 1  # a lull: the clock starts over
    assert a.decide("decode", 1, 6, now=111.0) == 1
    assert a.decide("decode", 1, 6, now=120.9) == 1
    assert a.decide("decode", 1, 8, now=121.0) == 4  # held 10 s: straight to what it wants now
    assert a.decide("decode", 4, 8, now=121.0) == 4


def test_downscale_waits_longer_and_stops_at_min():
    a = make_autoscaler(up=0.0, down=60.0)
    assert a.decide("decode", 1, 7, now=0.0) == 4  # no upscale delay
    assert a.decide("decode", 4, 0, now=1.0) == 4
    assert a.decide("decode", 4, 0, now=60.9) == 4
    assert a.decide("decode", 4, 0, now=61.0) == 1
    assert a.decide("decode", 1, 0, now=1000.0) == 1


def test_direction_change_restarts_the_clock_and_forget_clears_it():
    a = make_autoscaler(up=10.0, down=10.0)
    assert a.decide("decode", 2, 0, now=0.0) == 2  # down wanted
    assert a.decide("decode", 2, 8, now=5.0) == 2  # up wanted: its own clock from 5
    assert a.decide("decode", 2, 8, now=14.9) == 2
    a.forget("decode")
    assert a.decide("decode", 2, 8, now=15.0) == 2
    assert a.decide("decode", 2, 8, now=25.0) == 4


def test_a_target_outside_the_range_comes_back_at_once():
    a = make_autoscaler(low=2, high=3, up=100.0, down=100.0)
    assert a.decide("decode", 1, 0, now=0.0) == 2
    assert a.decide("decode", 7, 100, now=0.0) == 3


def test_config_checks_and_clamp():
    c = AutoscaleConfig(ranges={"decode": (1, 3), "prefill": (0, 2)})
    assert c.clamp({"prefill": 5, "decode": 0, "both": 7}) == {"prefill": 2, "decode": 1,
                                                               "both": 7}
    with pytest.raises(ValueError, match="unknown role"):
        AutoscaleConfig(ranges={"router": (1, 2)})
    with pytest.raises(ValueError, match="MIN <= MAX"):
        AutoscaleConfig(ranges={"decode": (3, 1)})
    with pytest.raises(ValueError, match="MAX >= 1"):
        AutoscaleConfig(ranges={"decode": (0, 0)})
    with pytest.raises(ValueError, match="> 0"):
        AutoscaleConfig(target_requests=0)


def test_registry_moves_a_target_only_from_the_value_read():
    r = WorkerRegistry("hearth")
    r.set_targets({"prefill": 1, "decode": 2})
    assert r.set_target_if("decode", 2, 3) is True
    assert r.set_target_if("decode", 2, 1) is False  # a `hearth scale` came in between
    assert r.targets()["decode"] == 3
    with pytest.raises(ValueError, match="at least one decode"):
        r.set_target_if("decode", 3, 0)
    assert r.targets()["decode"] == 3


def test_registry_decrement_is_one_call_and_stops_at_zero():
    r = WorkerRegistry("hearth")
    r.set_targets({"prefill": 1, "decode": 1})
    assert r.decrement_target("prefill") == {"prefill": 0, "decode": 1, "both": 0}
    assert r.decrement_target("prefill")["prefill"] == 0
    assert r.decrement_target("decode")["decode"] == 0  # the last one died: not replaced


def test_importing_hearth_cluster_does_not_import_ray():
    code = ("import sys, hearth, hearth.cluster, hearth.cluster.deployment;"
            "import hearth.cluster.controller, hearth.cluster.commands;"
            "assert callable(hearth.deploy);"
            "print('ray' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
