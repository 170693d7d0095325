"""The cluster controller's polling of a placing worker (hearth/cluster/controller.py), against a
stand-in for Ray's async readiness refs (the real cluster: tests/e2e/test_cluster.py)."""

from __future__ import annotations

import time

from hearth.cluster.cluster_config import ClusterConfig
from hearth.cluster.controller import Controller, Worker


class Ref:
    """An async reply: `ray.wait(timeout=0)` sees it only once it has landed, which is after the
    check that first looked at it (as `group.ready()`'s GCS wait is)."""

    def __init__(self) -> None:
        self.looked = False


class Group:
    def __init__(self) -> None:
        self.refs: list[Ref] = []

    def ready(self) -> Ref:  # every call a new wait, as Ray's
        self.refs.append(Ref())
        return self.refs[-1]


class Actor:
    def __init__(self) -> None:
        self.calls: list[str] = []

        class Method:
            def __init__(method, name: str) -> None:
                method.name = name

            def remote(method, *args) -> Ref:
                self.calls.append(method.name)
                return Ref()

        self.start, self.wait = Method("start"), Method("wait")


class FakeRay:
    @staticmethod
    def wait(refs: list[Ref], timeout: float):
        [ref] = refs
        if ref.looked:
            return [ref], []
        ref.looked = True
        return [], [ref]


def test_a_placed_worker_starts_on_a_later_poll():
    """Polled with one readiness ref, a worker whose group is placed starts within two polls;
    with a fresh `group.ready()` per poll (the bug: workers sat 'placing' 4-60 s on an idle
    cluster) no poll ever saw its reply."""
    controller = Controller(ClusterConfig(), engine=None, server=None, worker_args=(),
                            targets={}, serve_argv=None)
    group, actor = Group(), Actor()
    worker = controller.workers["decode-0"] = Worker("decode-0", "decode", actor, group,
                                                                time.monotonic())
    for _ in range(3):
        controller._collect(FakeRay)
        if worker.state != "placing":
            break
    assert worker.state == "starting" and actor.calls == ["start", "wait"]
    assert len(group.refs) == 1  # one wait on the group, however many polls
