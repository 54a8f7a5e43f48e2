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

A policy whose workers take ``turns`` (R²SP, ``r2sp.py``) gives server 0 a
``coordinator``: the server hands it the workers' turn requests (``wire.TURN``) and
answers each when the coordinator releases it. SaPS (``saps``) plugs in through
``server_side``, what a server runs of a policy beyond ``wait_for``: the weight of each
push by its staleness, and talk between the servers.
"""
import math
import random
from dataclasses import dataclass, field
from typing import List


DONE_CLOCK = 2**62          # the min clock once every worker is done: nothing waits


@dataclass
class SyncState:
    """One server's view of its workers' progress. A worker that is done (``active``
    False) holds nobody back."""
    clocks: List[int]
    active: List[bool]
    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False,
                               compare=False)   # a server seeds its own (its index)

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
    turns = False                # workers ask server 0 for their turn before pushing

    def coordinator(self, server: int, workers: int, timeout: float):
        """What serves turn requests on server ``server`` (None: no turns there)."""
        return None

    def wait_for(self, sync: SyncState, worker: int) -> int:
        """Minimum worker clock this worker's pull must wait for (decided on arrival)."""
        if math.isinf(self.staleness):
            return 0
        return sync.clocks[worker] - int(self.staleness)

    def why_wait(self, sync: SyncState, worker: int, need: int) -> str:
        """Why a pull that needs min clock ``need`` waits (the timeline's label):
        "staleness" (the bound), else "policy" (the policy's own rule)."""
        return "staleness" if need <= sync.clocks[worker] - self.staleness else "policy"

    def server_side(self, comm, index: int, workers: int):
        """None, or what server ``index`` (of ``comm``, the servers) runs of the policy:
        ``observe(worker, staleness) -> weight`` on each push (0 drops it), ``poll()``
        between requests, ``close(timeout)`` at the end, ``stats() -> dict``."""
        return None

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
    A worker leading the slowest by L clocks is paused with probability
    (L / (s + 1)) ** sharpness (default 8: 0.004 at L = 2, 0.10 at L = 3 for s = 3) and
    always past the bound (L > s); a paused pull is released when the slowest has come
    one clock closer, and from past the bound when it is within s - 1 (one clock of
    room), so nothing is ever read more than s clocks stale. Each server draws from its
    own generator, seeded with its index: it decides alone, and its draws are
    reproducible (which pulls they fall on still depends on arrival order).

    Measured (bench/ps_training.py: 2 servers, 4 workers, worker 3 slowed 3x; medians
    of interleaved runs; per-run spread 0.19-0.42 s). Default, 6 runs: SSP(3) 0.303 s to
    90% accuracy and 245 delayed pulls, FluentPS(3) 0.303 s (0.4 ms later) and 84. In earlier 4-5 run
    sets, every variant releasing at s - 1 had about a third of SSP(3)'s delayed pulls
    (80-110 against 250-275) but a median 0.03-0.07 s later to 90% than SSP(3)
    (0.26-0.27 s there), the deterministic rule (pause only past the bound) included
    (0.30 s): sharpness 4 (0.32 at L = 3) 0.29-0.33 s, 8 0.31 s, 16 0.30 s. Steeper
    than 8 measured the same within that noise while leaving chance next to no part in
    the rule; 2, with release at s // 2, was 0.38 s."""
    buffers = True

    def __init__(self, staleness: int = 3, sharpness: float = 8):
        super().__init__(staleness)
        if not sharpness > 0:
            raise ValueError(f"sharpness must be > 0, got {sharpness!r}")
        self.sharpness = float(sharpness)
        self.name = f"fluentps({self.staleness})"

    def pause_probability(self, lead: int) -> float:
        """The chance that a pull by a worker ``lead`` clocks ahead of the slowest waits."""
        if lead <= 0:
            return 0.0
        if lead > self.staleness:
            return 1.0
        return (lead / (self.staleness + 1)) ** self.sharpness

    def wait_for(self, sync: SyncState, worker: int) -> int:
        clock, low = sync.clocks[worker], sync.min_clock
        lead = clock - low
        if self.staleness == 0 or lead <= 0:                 # s = 0: a BSP-like wait
            return clock - self.staleness
        if lead > self.staleness:                            # past the bound: always
            return clock - self.staleness + 1
        if sync.rng.random() < self.pause_probability(lead):
            return max(low + 1, clock - self.staleness + 1)
        return clock - self.staleness


def make(policy) -> Policy:
    """A Policy from itself or its name: "bsp", "asp", "ssp", "ssp:3", "fluentps:3",
    "r2sp", "r2sp:patience=2", "saps", "saps:bound=12,window=8"."""
    if isinstance(policy, Policy):
        return policy
    name, _, arg = str(policy).strip().lower().partition(":")
    if name == "r2sp":
        from .r2sp import R2SP
        return R2SP.parse(arg)
    if name == "saps":
        from .saps import SaPS
        return SaPS.parse(arg)
    kinds = {"bsp": BSP, "asp": ASP, "ssp": SSP, "fluentps": FluentPS}
    if name not in kinds or (arg and name in ("bsp", "asp")):
        raise ValueError(f"unknown PS policy {policy!r}; use 'bsp', 'asp', 'ssp:S', "
                         "'fluentps:S', 'r2sp[:knob=value,...]', 'saps[:KNOB=V,...]' or a "
                         "pycoll.ps.Policy")
    if not arg:
        return kinds[name]()
    try:
        return kinds[name](int(arg))
    except ValueError:
        raise ValueError(f"policy {policy!r}: staleness must be an integer, e.g. ssp:3") from None
