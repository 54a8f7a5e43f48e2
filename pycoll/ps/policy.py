"""Consistency policies: when a server applies updates and when it answers a pull.

A policy sees one server's ``SyncState`` only (the clocks of its own shard), so every
server decides alone. A worker's clock at a server counts the push requests the server
has received from it. ``wait_for`` is asked once, when a pull arrives, and names the
minimum worker clock the pull must wait for; the pull is answered when
``SyncState.min_clock`` reaches it. If the policy ``buffers`` pulls, a pull that must
wait is kept at the server and answered the moment its condition holds; otherwise the
server refuses it and the worker sends it again after a back-off. With ``rounds``, the
pushes of one clock are summed and applied together when every worker has sent its
push for that clock (BSP); otherwise every push is applied on arrival.

New schemes plug in here: R²SP as a policy whose workers push in turn (``wait_for``
gates pulls by turn), SaPS as one whose ``wait_for`` bounds the straggler's version gap.
"""
import math
from dataclasses import dataclass
from typing import List


DONE_CLOCK = 2**62          # the min clock once every worker is done: nothing waits


@dataclass
class SyncState:
    """One server's view of its workers' progress. A worker that is done (``active``
    False) holds nobody back."""
    clocks: List[int]
    active: List[bool]

    @property
    def min_clock(self) -> int:
        return min((c for c, a in zip(self.clocks, self.active) if a), default=DONE_CLOCK)

    def slowest(self) -> List[int]:
        low = self.min_clock
        return [w for w, c in enumerate(self.clocks) if c == low and self.active[w]]


class Policy:
    """Base: every worker reads whatever the server holds (ASP)."""
    name = "asp"
    staleness = math.inf         # a pull by a worker at clock c waits for min clock >= c - s
    buffers = True
    rounds = False

    def wait_for(self, sync: SyncState, worker: int) -> int:
        """Minimum worker clock this worker's pull must wait for (decided on arrival)."""
        if math.isinf(self.staleness):
            return 0
        return sync.clocks[worker] - int(self.staleness)

    def __repr__(self) -> str:
        return self.name


class ASP(Policy):
    """Asynchronous: pulls are never delayed, pushes apply on arrival."""


class BSP(Policy):
    """Bulk synchronous: one update per clock from all workers' pushes; a pull at clock
    c waits until every worker has pushed c times, so all workers read the same model."""
    name, staleness, rounds = "bsp", 0, True


class SSP(Policy):
    """Stale synchronous parallel, as a parameter server without request buffering runs
    it (the baseline FluentPS measures against): a pull at clock c needs every worker
    at c - s; a pull that does not is refused and the worker polls again."""
    buffers = False

    def __init__(self, staleness: int = 3):
        if int(staleness) != staleness or staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
        self.staleness = int(staleness)
        self.name = f"ssp({self.staleness})"


class FluentPS(SSP):
    """FluentPS (Yao et al. 2019) on SSP(s). A pull that must wait is buffered at the
    server and answered lazily, the moment its condition holds (no polling, no resend).
    A worker is paused only when it would pass the SSP bound (lead over the slowest
    > s), and then released with one clock of room (slowest within s - 1) rather than
    at the bound, so a fast worker stops about half as often as under SSP and never
    reads beyond the bound.

    Measured (bench/ps_training.py, one worker 3x slow): pausing below the bound at
    random, with a probability growing with the lead as the paper suggests, throttled
    the fast workers' progress more than it saved (1.3-1.7x later to 90% accuracy than
    SSP for (L / (s + 1))^2 with release at s // 2 or s - 1), so pauses are kept to the
    bound."""
    buffers = True

    def __init__(self, staleness: int = 3):
        super().__init__(staleness)
        self.name = f"fluentps({self.staleness})"

    def wait_for(self, sync: SyncState, worker: int) -> int:
        clock = sync.clocks[worker]
        if clock - sync.min_clock > self.staleness and self.staleness > 0:
            return clock - self.staleness + 1
        return clock - self.staleness


def make(policy) -> Policy:
    """A Policy from itself or its name: "bsp", "asp", "ssp", "ssp:3", "fluentps:3"."""
    if isinstance(policy, Policy):
        return policy
    name, _, arg = str(policy).strip().lower().partition(":")
    kinds = {"bsp": BSP, "asp": ASP, "ssp": SSP, "fluentps": FluentPS}
    if name not in kinds or (arg and name in ("bsp", "asp")):
        raise ValueError(f"unknown PS policy {policy!r}; use 'bsp', 'asp', 'ssp:S', "
                         "'fluentps:S' or a pycoll.ps.Policy")
    if not arg:
        return kinds[name]()
    try:
        return kinds[name](int(arg))
    except ValueError:
        raise ValueError(f"policy {policy!r}: staleness must be an integer, e.g. ssp:3") from None
