"""How pushes reach one server: how many are in flight at once, how evenly they arrive.

A push is in flight from the moment its worker sent the request until the server has
taken the last byte of its payload. The start is read on the worker's clock (the
header's ``sent``) and moved onto the server's by the smallest delay seen in that
worker's requests so far (the clocks' offset plus the least latency: on one machine
about one latency). The server takes pushes in arrival order, so the pushes still in
flight when one started are those finished before it whose end is after its start; a
push's count is those plus itself. Every policy is measured the same way, so BSP's
incast and R²SP's round robin compare.

Why from the sending: a server's link takes one message at a time (on a real network
as under ``--link``'s FIFO model), so pushes never share it byte for byte; contention is
a push that is sent while another is still coming in and waits behind it. Its worker's
own NIC is not in the way: a training loop has one push out at a time, and its other
requests (a turn, a pull) are small.
"""
import collections
import math
import statistics


class Traffic:
    RECENT = 256         # pushes kept: more than ever overlap one push

    def __init__(self):
        self.offset = {}                                     # worker -> min(received - sent)
        self.ends = collections.deque(maxlen=self.RECENT)
        self.pushes = self.total = self.most = 0
        self.last_end = None
        self.gaps = collections.deque(maxlen=4096)           # between push arrivals (s)

    def heard(self, worker: int, sent: float, now: float) -> None:
        """A request from ``worker`` sent at ``sent`` (its clock) arrived ``now``."""
        if sent > 0:
            self.offset[worker] = min(self.offset.get(worker, math.inf), now - sent)

    def start(self, worker: int, sent: float, now: float) -> float:
        """When a request of ``worker`` sent at ``sent`` (its clock) set out, on this
        server's clock (``now`` if the header has no time)."""
        return min(now, sent + self.offset.get(worker, 0.0)) if sent > 0 else now

    def pushed(self, worker: int, sent: float, now: float) -> None:
        """A push's payload is all in, ``now``."""
        start = self.start(worker, sent, now)
        count = 1 + sum(1 for end in self.ends if end > start)
        self.pushes += 1
        self.total += count
        self.most = max(self.most, count)
        if self.last_end is not None:
            self.gaps.append(now - self.last_end)
        self.ends.append(now)
        self.last_end = now

    def stats(self) -> dict:
        gaps = sorted(self.gaps)
        out = dict(pushes_in_flight_mean=self.total / self.pushes if self.pushes else 0.0,
                   pushes_in_flight_max=self.most)
        if len(gaps) >= 2:
            mean = statistics.fmean(gaps)
            out.update(push_gap_mean_s=mean, push_gap_cv=statistics.pstdev(gaps) / mean
                       if mean > 0 else 0.0,
                       push_gap_p10_s=gaps[len(gaps) // 10],
                       push_gap_p50_s=gaps[len(gaps) // 2],
                       push_gap_p90_s=gaps[len(gaps) * 9 // 10])
        return out
