"""iPart's planner: which parameter rows travel together, from measured compute and a
link cost (pure Python; the schedules in ``schedule`` run the plans).

Pieces. Each parameter tensor is rows (its first dimension; a scalar is one row) of
``row_bytes`` bytes; a piece is a run of at most ``grain`` bytes of rows of one tensor
(at least one row), so large tensors are split at row boundaries. Pieces are ordered by
the forward order of the layers that own their tensors. A partition is a run of
consecutive pieces: small layers merge, large ones split. A plan covers every piece once.

Cost model, one worker, one iteration (layers l = 1..L in forward order, forward time
F_l, backward time B_l, measured):
- A partition P costs c(P) = alpha + bytes(P) / beta in each of its stages: one for
  allreduce (its gradients' allreduce), two for the parameter server (its push, then
  its pull: the two directions of the links, so the pull of one partition overlaps the
  push of the next); alpha and beta are fitted to transfers timed when planning (under
  ``--link``, the emulated link's times).
- A partition also costs the compute ``cpu`` (packing it, handing it over, and the CPU
  its transfer takes from compute on a host with few cores): compute cannot hide it,
  so it goes on the compute's own time line, when backward issues the partition.
- Backward runs L..1. Partition k is ready once every layer it holds pieces of is done
  backward, and issued ``cpu`` later. Partitions are issued in the plan's issue order
  (every rank the same order; a partition is issued once it is ready and the one before
  it in the order is issued) and go one at a time through the first stage in that
  order: a partition enters it at max(its issue, the end of the partition before it
  there) and leaves it c(P) later. The PS's second stage, the pulls, serves by priority
  (the server sends waiting answers most urgent first, ``ps.server``): whenever it
  frees it takes, of the partitions whose push has ended, the one with the lowest index
  (the first to end its push if none has).
- The next forward runs 1..L; layer l starts when layer l-1 is done and every partition
  holding its pieces has arrived. Step time T = the end of the last forward, counted from
  the start of backward. K = 1 is the default schedule, T = B + cpu + stages * c(all) +
  F; the overlap bound is max(B + F, c(all)); what T exceeds B + F by is exposed
  communication.

Greedy (after the iPart paper, TPDS 2021): P_1 is the first layer's pieces (small: it
goes last and is needed first, so its transfer is the exposed tail). Each next
partition takes pieces in forward order while its cost stays within lambda times the
compute of the previous partition (a piece's share of F_l + B_l is its share of the
layer's bytes): its transfer (and its ``cpu``) hides behind that compute on the way back
and again on the way forward. It always takes at least one piece. lambda trades messages
(alpha and cpu each) against exposed time: the planner builds plans for lambda in
``LAMBDAS``, adds one partition per layer and one for everything, and keeps the plan
whose modelled T is least.
The greedy cuts by compute alone, so it can merge a large layer with small ones that
finish backward later, whose transfer then waits for them; ``refine`` (local search:
split a partition where a layer ends, or merge two neighbours, best move first, while T
falls) starts from the best greedy plan and is one more candidate.

Issue order (ByteScheduler's priorities, made static so that every rank issues alike):
backward makes the partitions ready in the order K..1, but the next forward needs P_1
first, so K..1 puts all of the link's backlog at the end of backward in front of it.
``by_priority`` instead lets the first stage, whenever it frees, take the ready
partition with the lowest index (the earliest ready if none is); partitions ready late
then overtake the backlog, and the next forward overlaps what is left. Each plan is
scored in both orders, K..1 and by priority, and keeps the better.

Measured plans: the plans profiled (one partition, layerwise) ran, so their measured
step times compete with the best modelled T, and one of them is kept if it measured
faster: a model fitted on a busy host can be wrong, a measurement less so.

Damping: a re-plan keeps the running partitions and order unless the new plan's
modelled T is at least ``KEEP`` (relative) below theirs under the same new profile, so
that noise in the profile does not change the plan from one re-plan to the next.

Calibration (``schedule`` profiles one partition, then one per layer): F_l and B_l are
the one partition's (nothing travels while it computes), and so is beta: the next
forward waited for all of the bytes' stages with nothing overlapped, so beta = bytes /
(that wait / stages - alpha), alpha a timed small transfer's (large transfers timed on
one rank saw a fraction of a stage where a PS server answers the workers in turn).
``cpu`` is the larger of the time issuing a partition took and what the layerwise
steps' compute exceeds the one partition's by, per extra partition (charged to alpha
instead, the model hid it behind compute, and planned partitions that each slowed the
compute they were to hide behind). A partition still costs more than that (a BSP round
waits for every worker's push; each message has software costs), so alpha is then
raised until the model gives the step time measured under layerwise (``calibrate``); a
link that hides nothing then plans few partitions.
"""
import json
from dataclasses import dataclass, replace
from typing import List, NamedTuple, Optional, Sequence, Tuple

LAMBDAS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
KEEP = 0.05             # a re-plan must model this much (relative) faster to replace
REFINE_ROUNDS = 16      # local-search moves on the best greedy plan


class Tensor(NamedTuple):
    rows: int
    row_bytes: int
    layer: int           # the owning layer's index (into the forward order's layers)


class Piece(NamedTuple):
    tensor: int
    lo: int              # rows [lo, hi)
    hi: int


Partition = Tuple[Piece, ...]


@dataclass
class Profile:
    forward: List[float]       # F_l per layer (seconds), indexed like Tensor.layer
    backward: List[float]      # B_l
    alpha: float               # seconds per partition and stage
    beta: float                # bytes per second
    stages: int = 1            # 1: allreduce; 2: the PS's push, then pull
    cpu: float = 0.0           # seconds of compute each partition costs (at its issue)


def pieces(tensors: Sequence[Tensor], order: Sequence[int], grain: int) -> List[Piece]:
    """Every tensor's rows in runs of at most ``grain`` bytes (one row at least), in the
    forward ``order`` of layers, tensors of a layer in index order. Empty tensors carry
    no bytes and get no piece."""
    if grain < 1:
        raise ValueError(f"pycoll.overlap: grain must be >= 1 byte, got {grain}")
    position = {layer: i for i, layer in enumerate(order)}
    missing = {t.layer for t in tensors} - set(position)
    if missing:
        raise ValueError(f"pycoll.overlap: layers {sorted(missing)} are not in the order given")
    out = []
    for index in sorted(range(len(tensors)), key=lambda i: (position[tensors[i].layer], i)):
        t = tensors[index]
        if t.rows == 0 or t.row_bytes == 0:
            continue
        step = max(1, grain // t.row_bytes)
        out += [Piece(index, lo, min(lo + step, t.rows)) for lo in range(0, t.rows, step)]
    return out


def nbytes(part: Partition, tensors: Sequence[Tensor]) -> int:
    return sum((p.hi - p.lo) * tensors[p.tensor].row_bytes for p in part)


def check_cover(parts: Sequence[Partition], tensors: Sequence[Tensor]) -> None:
    """Raise ValueError unless ``parts`` hold every row of every tensor exactly once."""
    seen = [[] for _ in tensors]
    for part in parts:
        for p in part:
            if not 0 <= p.tensor < len(tensors) or not 0 <= p.lo < p.hi <= tensors[p.tensor].rows:
                raise ValueError(f"pycoll.overlap: piece {tuple(p)} is outside the tensors")
            seen[p.tensor].append((p.lo, p.hi))
    for index, (ranges, t) in enumerate(zip(seen, tensors)):
        edge = 0
        for lo, hi in sorted(ranges):
            if lo != edge:
                raise ValueError(f"pycoll.overlap: tensor {index}'s rows {min(lo, edge)}.."
                                 f"{max(lo, edge)} are {'missing' if lo > edge else 'twice'}")
            edge = hi
        if edge != (t.rows if t.row_bytes else 0):
            raise ValueError(f"pycoll.overlap: tensor {index}'s rows {edge}..{t.rows} are missing")


def ready_times(parts: Sequence[Partition], tensors: Sequence[Tensor], order: Sequence[int],
                profile: Profile) -> Tuple[List[float], float]:
    """When backward has made each partition ready and issued it (``cpu`` each, in the
    order they become ready), and when backward ends."""
    backward_at = {layer: i for i, layer in enumerate(reversed(order))}
    readies: List[List[int]] = [[] for _ in order]   # by backward position: what it readies
    for k, part in enumerate(parts):
        readies[max(backward_at[tensors[p.tensor].layer] for p in part)].append(k)
    ready, t = [0.0] * len(parts), 0.0
    for at, layer in enumerate(reversed(order)):
        t += profile.backward[layer]
        for k in readies[at]:
            t += profile.cpu
            ready[k] = t
    return ready, t


def reverse(parts: Sequence[Partition]) -> List[int]:
    """The issue order K..1: as backward makes them ready."""
    return list(reversed(range(len(parts))))


def urgent_first(arrive: Sequence[float], cost: Sequence[float]) -> List[Tuple[int, float]]:
    """A stage that, whenever it frees, serves the partition with the lowest index of
    those that have arrived (the first to arrive if none has): (partition, its end) in
    the order served."""
    left, t, out = set(range(len(arrive))), 0.0, []
    while left:
        now = [k for k in left if arrive[k] <= t]
        k = min(now) if now else min(left, key=lambda k: (arrive[k], k))
        t = max(t, arrive[k]) + cost[k]
        out.append((k, t))
        left.remove(k)
    return out


def _costs(parts: Sequence[Partition], tensors: Sequence[Tensor], profile: Profile) -> List[float]:
    return [profile.alpha + nbytes(part, tensors) / profile.beta for part in parts]


def by_priority(parts: Sequence[Partition], tensors: Sequence[Tensor], order: Sequence[int],
                profile: Profile) -> List[int]:
    """The issue order of the first stage taking, whenever it frees, the ready partition
    the next forward needs first (see the module's docstring)."""
    ready, _ = ready_times(parts, tensors, order, profile)
    return [k for k, _ in urgent_first(ready, _costs(parts, tensors, profile))]


def simulate(parts: Sequence[Partition], tensors: Sequence[Tensor], order: Sequence[int],
             profile: Profile, issue: Optional[Sequence[int]] = None) -> float:
    """The modelled step time T of ``parts`` issued in the order ``issue`` (default
    K..1; see the module's docstring)."""
    ready, backward_end = ready_times(parts, tensors, order, profile)
    cost = _costs(parts, tensors, profile)
    end, free, issued = [0.0] * len(parts), 0.0, 0.0
    for k in (reverse(parts) if issue is None else issue):      # the first stage: in order
        issued = max(issued, ready[k])
        end[k] = free = max(issued, free) + cost[k]
    for _ in range(1, profile.stages):                           # the pulls: by priority
        for k, at in urgent_first(list(end), cost):
            end[k] = at
    arrived = {layer: 0.0 for layer in order}
    for k, part in enumerate(parts):
        for p in part:
            layer = tensors[p.tensor].layer
            arrived[layer] = max(arrived[layer], end[k])
    t = backward_end
    for layer in order:
        t = max(t, arrived[layer]) + profile.forward[layer]
    return t


def calibrate(parts: Sequence[Partition], tensors: Sequence[Tensor], order: Sequence[int],
              profile: Profile, measured: float, issue: Optional[Sequence[int]] = None) -> Profile:
    """``profile`` with the least alpha (not below its own) for which the modelled step
    time of ``parts`` issued in the order ``issue`` reaches ``measured``, a step time
    measured running them."""
    def modelled(alpha: float) -> float:
        return simulate(parts, tensors, order, replace(profile, alpha=alpha), issue)
    low, high = profile.alpha, max(profile.alpha, measured)
    if modelled(low) >= measured:
        return profile
    for _ in range(50):              # modelled() grows with alpha: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if modelled(middle) < measured else (low, middle)
    return replace(profile, alpha=high)


def greedy(items: Sequence[Piece], tensors: Sequence[Tensor], order: Sequence[int],
           profile: Profile, lam: float) -> List[Partition]:
    """The greedy partitions for one lambda (see the module's docstring)."""
    layer_bytes = {}
    for p in items:
        t = tensors[p.tensor]
        layer_bytes[t.layer] = layer_bytes.get(t.layer, 0) + (p.hi - p.lo) * t.row_bytes

    def compute(p: Piece) -> float:
        t = tensors[p.tensor]
        return ((profile.forward[t.layer] + profile.backward[t.layer])
                * (p.hi - p.lo) * t.row_bytes / layer_bytes[t.layer])

    first = order[0] if order else None
    parts, current, budget, cost = [], [], 0.0, 0.0
    for p in items:
        size = (p.hi - p.lo) * tensors[p.tensor].row_bytes
        grow = tensors[p.tensor].layer == first if not parts else \
            cost + size / profile.beta <= budget
        if current and not grow:
            parts.append(tuple(current))
            budget = lam * sum(compute(q) for q in current)
            current, cost = [], profile.alpha + profile.cpu
        current.append(p)
        cost = (cost or profile.alpha + profile.cpu) + size / profile.beta
    if current:
        parts.append(tuple(current))
    return parts


def refine(parts: List[Partition], tensors: Sequence[Tensor], order: Sequence[int],
           profile: Profile, rounds: int = REFINE_ROUNDS) -> List[Partition]:
    """``parts`` improved by local search: the best of splitting one partition where a
    layer ends, or merging two neighbours, while that lowers the modelled T (in the
    better issue order) and for at most ``rounds`` moves."""
    def score(candidate):
        return min(simulate(candidate, tensors, order, profile, issue) for issue in
                   (reverse(candidate), by_priority(candidate, tensors, order, profile)))

    best = score(parts)
    for _ in range(rounds):
        moves = [parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
                 for i in range(len(parts) - 1)]
        for i, part in enumerate(parts):
            for j in range(1, len(part)):
                if tensors[part[j].tensor].layer != tensors[part[j - 1].tensor].layer:
                    moves.append(parts[:i] + [part[:j], part[j:]] + parts[i + 1:])
        if not moves:
            break
        value, move = min(((score(m), m) for m in moves), key=lambda vm: vm[0])
        if value >= best * (1 - 1e-6):
            break
        best, parts = value, move
    return parts


def by_layer(items: Sequence[Piece], tensors: Sequence[Tensor]) -> List[Partition]:
    """One partition per layer (the layerwise schedule)."""
    parts: List[List[Piece]] = []
    for p in items:
        if parts and tensors[parts[-1][-1].tensor].layer == tensors[p.tensor].layer:
            parts[-1].append(p)
        else:
            parts.append([p])
    return [tuple(part) for part in parts]


@dataclass
class Plan:
    parts: List[Partition]
    order: List[int]           # layers in forward order
    predicted_s: float = 0.0   # modelled step time (0: not planned from a profile)
    version: int = 0           # how many plans came before (names the partitions' messages)
    issue: Optional[List[int]] = None    # the order partitions are issued in (default K..1)

    def __post_init__(self):
        if self.issue is None:
            self.issue = reverse(self.parts)
        if sorted(self.issue) != list(range(len(self.parts))):
            raise ValueError(f"pycoll.overlap: issue order {self.issue} is not an order of "
                             f"the {len(self.parts)} partitions")

    def to_json(self) -> str:
        return json.dumps(dict(parts=[[list(p) for p in part] for part in self.parts],
                               order=self.order, predicted_s=self.predicted_s,
                               version=self.version, issue=self.issue))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        return cls([tuple(Piece(*p) for p in part) for part in d["parts"]], d["order"],
                   d["predicted_s"], d["version"], d["issue"])


def choose(tensors: Sequence[Tensor], order: Sequence[int], profile: Profile, grain: int,
           version: int = 0, current: Optional[Plan] = None,
           measured: Sequence[Tuple[Plan, float]] = ()) -> Plan:
    """The best of the greedy plans (and layerwise, one partition, and the best greedy
    plan refined), each in both issue orders, by modelled T, or of the ``measured``
    plans (plan, its measured step time) if one measured faster; ``current`` (the
    running plan) unless the best is ``KEEP`` faster than it."""
    items = pieces(tensors, order, grain)
    if not items:
        raise ValueError("pycoll.overlap: the parameters hold no bytes; nothing to plan")
    candidates = [greedy(items, tensors, order, profile, lam) for lam in LAMBDAS]
    candidates += [by_layer(items, tensors), [tuple(items)]]
    first = min(candidates, key=lambda parts: simulate(parts, tensors, order, profile))
    candidates.append(refine(list(first), tensors, order, profile))
    scored = []
    for i, parts in enumerate(candidates):
        for issue in (reverse(parts), by_priority(parts, tensors, order, profile)):
            scored.append((simulate(parts, tensors, order, profile, issue), len(parts), i, issue))
    best, _, index, issue = min(scored)
    chosen = Plan(candidates[index], list(order), best, version, issue)
    for ran, step in measured:
        if step < chosen.predicted_s:
            chosen = Plan(ran.parts, list(order), step, version, ran.issue)
    if current is not None and current.order == list(order):
        kept = simulate(current.parts, tensors, order, profile, current.issue)
        if chosen.predicted_s > (1 - KEEP) * kept:
            return Plan(current.parts, list(order), kept, version, current.issue)
    return chosen
