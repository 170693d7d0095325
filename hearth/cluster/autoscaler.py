"""The autoscaler: a role's worker target follows the requests the router has open on it.

The router already reports, with every registry acknowledgement, the requests it has open per
worker (decodes and prefill hops; hearth/router/discovery.py). Per autoscaled role:

    wanted = clamp(ceil(open requests on the role's workers / target_requests), MIN, MAX)

(Ray Serve's rule with `target_ongoing_requests`). A move is made only once the same direction
has been wanted without a break for the upscale delay (more workers) or the downscale delay
(fewer), so a burst or a lull shorter than that changes nothing; any reading that does not
want that direction restarts its clock. A target outside the range (set by `hearth scale`) is
brought back into it at once. Scaling down goes through the controller's drain: no request is
lost.

`Autoscaler.decide` is pure but for those clocks: the controller reads the load and applies
the target it returns (hearth/cluster/controller.py).
"""

from __future__ import annotations

import math
from collections import Counter

from hearth.cluster.cluster_config import AutoscaleConfig


class Autoscaler:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._since: dict[str, tuple[int, float]] = {}  # role: (direction wanted, since when)

    def wanted(self, role: str, num_open_requests: int) -> int:
        low, high = self.config.ranges[role]
        return min(max(math.ceil(num_open_requests / self.config.target_requests), low), high)

    def decide(self, role: str, target: int, num_open_requests: int, now: float) -> int:
        """The role's new target (`target` when nothing should change yet)."""
        low, high = self.config.ranges[role]
        if not low <= target <= high:
            self._since.pop(role, None)
            return min(max(target, low), high)
        wanted = self.wanted(role, num_open_requests)
        direction = (wanted > target) - (wanted < target)
        if direction == 0:
            self._since.pop(role, None)
            return target
        held, since = self._since.get(role, (0, now))
        if held != direction:
            since = now
        self._since[role] = (direction, since)
        delay = (self.config.upscale_delay_seconds if direction > 0
                 else self.config.downscale_delay_seconds)
        if now - since < delay:
            return target
        self._since.pop(role, None)
        return wanted

    def forget(self, role: str) -> None:
        """No reading this round (the router's view is stale): clocks start over."""
        self._since.pop(role, None)


def open_requests_by_role(in_flight: dict[str, int], role_of_url: dict[str, str]) -> Counter:
    """The router's open requests per worker URL, summed per role (unknown URLs: workers
    already gone, left out)."""
    num_open: Counter = Counter()
    for url, count in in_flight.items():
        if url in role_of_url:
            num_open[role_of_url[url]] += count
    return num_open
