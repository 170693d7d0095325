"""Decode workers that can pull KV from every prefill worker's node, as nodes join.

A decode worker connects for KV only to the hosts on its allow-list (`--kv-peers`,
hearth/kv_transfer/peers.py), fixed when its process starts: the cluster's node addresses then
(`Worker.peers`). A node that joins later is not on it, so a prefill worker placed there hands
that decode worker descriptors it refuses (it recomputes the prompt instead: correct, slower).

Invariant kept, one worker at a time (at most one extra decode worker exists): every running decode worker trusts the host of every
running prefill worker, or is being replaced. A stale decode worker gets a successor (a new
decode worker, whose peers are the nodes alive now) placed beside it; while the successor is
on its way the stale one keeps serving and the controller counts the successor in its place
(`replaced_by`), so the decode count never drops below its target. Once the successor serves,
the stale one drains (hearth/cluster/controller.py: no request lost). A successor that cannot
be placed or started is given up without counting as a worker failure, and that refresh is
retried later (`refresh_after`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hearth.cluster.controller import Worker

log = logging.getLogger("hearth.cluster")


def refresh_peers(workers: dict[str, Worker], add: Callable[[str], Worker],
                  drain: Callable[[Worker], None], now: float) -> None:
    """One step: finish the refresh under way (drain the stale worker once its successor
    serves), or start the next one."""
    prefill_hosts = {w.host for w in workers.values()
                     if w.role == "prefill" and w.state == "running"}
    under_way = False
    for worker in list(workers.values()):
        if worker.refresh_of not in workers:  # its predecessor is gone anyway
            worker.refresh_of = None
        if worker.replaced_by is None:
            continue
        successor = workers.get(worker.replaced_by)
        if successor is None:  # could not be placed or started: retried later
            worker.replaced_by = None
        elif successor.state == "running" and worker.state == "running":
            log.info("KV peers: worker %s serves; draining %s", successor.name, worker.name)
            successor.refresh_of = None  # a worker like any other from now on
            drain(worker)
            under_way = True  # the next one starts once this one is gone
        else:
            under_way = True
    if under_way:
        return
    for worker in list(workers.values()):
        missing = prefill_hosts - worker.peers
        if (worker.role == "decode" and worker.state == "running" and missing
                and worker.replaced_by is None and now >= worker.refresh_after):
            successor = add("decode")
            successor.refresh_of, worker.replaced_by = worker.name, successor.name
            log.info("KV peers: worker %s does not trust %s (joined later); starting %s to "
                     "take its place", worker.name, ", ".join(sorted(missing)), successor.name)
            return


def give_up_refresh(workers: dict[str, Worker], successor: Worker, retry_at: float) -> None:
    """`successor` (already removed) will not take its predecessor's place: that one serves on,
    and is refreshed again from `retry_at`."""
    stale = workers.get(successor.refresh_of)
    if stale is not None:
        stale.replaced_by = None
        stale.refresh_after = retry_at

