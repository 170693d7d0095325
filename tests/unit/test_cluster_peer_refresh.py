"""The KV-peer refresh of decode workers (hearth/cluster/peer_refresh.py) over the controller's
own Worker records, without Ray: which worker is replaced, when the stale one drains."""

from hearth.cluster.controller import Worker
from hearth.cluster.peer_refresh import give_up_refresh, refresh_peers

OLD_NODES = frozenset({"10.0.0.1", "10.0.0.2"})
ALL_NODES = OLD_NODES | {"10.0.0.3"}


def make_worker(name: str, role: str, host: str, peers=OLD_NODES, state="running") -> Worker:
    return Worker(name, role, actor=None, group=None, started=0.0, state=state, peers=peers,
                  record={"url": f"http://{host}:8000", "node": "n"})


class Deployment:
    """The controller's side of the calls: workers added (placing) and drained, recorded."""

    def __init__(self, *workers: Worker) -> None:
        self.workers = {w.name: w for w in workers}
        self.drained: list[str] = []

    def add(self, role: str) -> Worker:
        worker = make_worker(f"{role}-new{len(self.workers)}", role, "10.0.0.3", ALL_NODES,
                             state="placing")
        self.workers[worker.name] = worker
        return worker

    def drain(self, worker: Worker) -> None:
        self.drained.append(worker.name)
        worker.state = "draining"

    def step(self, now: float = 0.0) -> None:
        refresh_peers(self.workers, self.add, self.drain, now)


def test_nothing_happens_while_every_prefill_host_is_trusted():
    d = Deployment(make_worker("prefill-0", "prefill", "10.0.0.1"),
                   make_worker("decode-0", "decode", "10.0.0.2"))
    d.step()
    assert list(d.workers) == ["prefill-0", "decode-0"] and d.drained == []


def test_stale_decode_workers_are_replaced_one_at_a_time_successor_first():
    d = Deployment(make_worker("prefill-1", "prefill", "10.0.0.3", ALL_NODES),
                   make_worker("decode-0", "decode", "10.0.0.1"),
                   make_worker("decode-1", "decode", "10.0.0.2"),
                   make_worker("both-0", "both", "10.0.0.2"))  # not a KV importer: left alone
    d.step()
    assert d.workers["decode-0"].replaced_by == "decode-new4"
    assert d.workers["decode-new4"].refresh_of == "decode-0"
    d.step()  # the successor is not serving yet: nothing more
    assert len(d.workers) == 5 and d.drained == [] and d.workers["decode-1"].replaced_by is None
    d.workers["decode-new4"].state = "running"
    d.step()
    assert d.drained == ["decode-0"] and d.workers["decode-new4"].refresh_of is None
    d.step()  # decode-0 still draining: the next refresh waits for it to be gone
    assert len(d.workers) == 5
    del d.workers["decode-0"]
    d.step()
    assert d.workers["decode-1"].replaced_by in d.workers
    assert "both-0" not in d.drained and d.workers["both-0"].replaced_by is None


def test_a_successor_given_up_leaves_the_stale_worker_serving_until_retry():
    d = Deployment(make_worker("prefill-1", "prefill", "10.0.0.3", ALL_NODES),
                   make_worker("decode-0", "decode", "10.0.0.1"))
    d.step(now=0.0)
    successor = d.workers.pop(d.workers["decode-0"].replaced_by)
    give_up_refresh(d.workers, successor, retry_at=100.0)
    assert d.workers["decode-0"].replaced_by is None
    d.step(now=50.0)
    assert len(d.workers) == 2  # not before the retry time
    d.step(now=100.0)
    assert d.workers["decode-0"].replaced_by in d.workers
