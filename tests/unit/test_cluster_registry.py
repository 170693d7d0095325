"""The deployment registry's own rules (hearth/cluster/worker_registry.py), without Ray."""

import pytest

from hearth.cluster.cluster_config import ClusterConfig
from hearth.cluster.worker_registry import WorkerRegistry


def test_versions_change_with_every_change_and_only_then():
    r = WorkerRegistry("hearth")
    assert r.version() == 0
    assert r.register("decode-0", "decode", "http://a:1", "n1") == 1
    assert r.set_draining("decode-0") == 2 and r.set_draining("decode-0") == 2
    assert r.records() == (2, [dict(name="decode-0", role="decode", url="http://a:1",
                                    node="n1", draining=True)])
    assert r.deregister("decode-0") == 3 and r.deregister("decode-0") == 3
    r.acknowledge(3, {"http://a:1": 0})
    assert r.router_view()[:2] == (3, {"http://a:1": 0})


def test_scale_wait_returns_only_once_the_router_routes_to_every_running_worker():
    from hearth.cluster.commands import _reached

    r = WorkerRegistry("hearth")
    r.set_targets({"decode": 1})
    r.register("decode-0", "decode", "http://a:1", "n1")
    r.set_status({"workers": [{"name": "decode-0", "role": "decode", "state": "running"}]})
    assert not _reached(r.status())  # running, but the router has not seen it
    r.acknowledge(1, {}, [])
    assert not _reached(r.status())  # seen, not yet healthy there
    r.acknowledge(1, {"http://a:1": 0}, ["decode-0"])
    assert _reached(r.status())
    assert r.status()["router"] == {"applied": 1, "routes_to": ["decode-0"]}
    r.register("decode-1", "decode", "http://b:1", "n2")  # a newer list than it applied
    assert not _reached(r.status())


def test_targets_are_validated_and_merged():
    r = WorkerRegistry("hearth")
    assert r.set_targets({"prefill": 1, "decode": 2}) == {"prefill": 1, "decode": 2, "both": 0}
    assert r.set_targets({"decode": 3})["decode"] == 3
    with pytest.raises(ValueError, match="at least one decode"):
        r.set_targets({"decode": 0})
    with pytest.raises(ValueError, match="unknown role"):
        r.set_targets({"router": 1})
    with pytest.raises(ValueError, match="integer >= 0"):
        r.set_targets({"decode": -1})
    with pytest.raises(ValueError, match="prefill workers need decode"):
        r.set_targets({"decode": 0, "both": 1})
    assert r.targets() == {"prefill": 1, "decode": 3, "both": 0}


def test_secrets_are_only_what_was_set():
    r = WorkerRegistry("hearth")
    assert r.secrets() == {}
    r.set_secrets({"worker_api_key": "k", "kv_secret": "s"})
    assert r.secrets() == {"worker_api_key": "k", "kv_secret": "s"}
    assert "k" not in str(r.status())


def test_cluster_config_checks():
    assert ClusterConfig(name="x").registry_name == "x-registry"
    with pytest.raises(ValueError):
        ClusterConfig(cpus_per_rank=-1)
    with pytest.raises(ValueError, match="tensor parallel size"):
        ClusterConfig(role_tensor_parallel={"router": 2})
