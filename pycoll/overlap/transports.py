"""What a partition's transfer is: an allreduce of its gradient rows, or a PS push_pull.

Both are given their collectives by the caller (``pycoll.torch`` or ``pycoll.ps``), so
this package depends on neither.
"""
import time
from typing import Callable, Dict, List, Sequence

import torch

from .plan import Partition, Piece, Plan
from .schedule import pack_rows, unpack_rows


def _gradient(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as a dense contiguous tensor (zeros where there is none)."""
    if p.grad is None:
        return torch.zeros_like(p)
    g = p.grad.to_dense() if p.grad.is_sparse else p.grad
    return g if g.is_contiguous() else g.contiguous()


def _by_kind(part: Partition, params: Sequence[torch.Tensor]) -> Dict[tuple, List[Piece]]:
    """``part``'s pieces by (dtype, device): one buffer each."""
    kinds: Dict[tuple, List[Piece]] = {}
    for piece in part:
        p = params[piece.tensor]
        kinds.setdefault((p.dtype, p.device), []).append(piece)
    return kinds


def _packed(params, tensors, pieces, dtype, device) -> torch.Tensor:
    count = sum((q.hi - q.lo) * (params[q.tensor].numel() // max(_rows(params[q.tensor]), 1))
                for q in pieces)
    buffer = torch.empty(count, dtype=dtype, device=device)
    pack_rows(buffer, tensors, pieces)
    return buffer


def _rows(p: torch.Tensor) -> int:
    return p.shape[0] if p.dim() else 1


class Allreduce:
    """Partition k's gradient rows, one buffer per dtype and device, packed (compiled)
    and allreduced under the name ``pycoll.overlap.<plan>.<k>.<dtype>``; ``complete``
    unpacks each into the parameter's reduced gradient, and once all of a parameter's
    rows are in, ``step(params, grads)`` updates those parameters (the user's optimizer
    on them alone), so the result is synchronous training's."""
    stages = 1

    def __init__(self, params: Sequence[torch.Tensor], allreduce_async: Callable,
                 wait: Callable, step: Callable):
        self.params, self.allreduce_async, self.wait, self.step = list(params), allreduce_async, wait, step
        self._reduced: List = [None] * len(self.params)
        self._left = [0] * len(self.params)
        self._probes = 0

    def adopt(self, plan: Plan) -> None:
        self.version = plan.version
        self._pieces = [0] * len(self.params)
        for part in plan.parts:
            for piece in part:
                self._pieces[piece.tensor] += 1

    def issue(self, k: int, part: Partition):
        grads = {q.tensor: _gradient(self.params[q.tensor]) for q in part}
        tensors = [grads.get(i) for i in range(len(self.params))]
        out = []
        for (dtype, device), pieces in _by_kind(part, self.params).items():
            buffer = _packed(self.params, tensors, pieces, dtype, device)
            name = f"pycoll.overlap.{self.version}.{k}.{str(dtype).replace('torch.', '')}"
            out.append((self.allreduce_async(buffer, name), buffer, pieces))
        return out

    def complete(self, k: int, handles) -> None:
        finished = []
        for handle, buffer, pieces in handles:
            self.wait(handle)
            for q in pieces:
                if self._reduced[q.tensor] is None:
                    self._reduced[q.tensor] = torch.empty_like(self.params[q.tensor])
                    self._left[q.tensor] = self._pieces[q.tensor]
            unpack_rows(buffer, self._reduced, pieces)
            for q in pieces:
                self._left[q.tensor] -= 1
                if self._left[q.tensor] == 0:
                    finished.append(q.tensor)
        if finished:
            grads = [self._reduced[i] for i in finished]
            for i in finished:
                self._reduced[i] = None
            self.step([self.params[i] for i in finished], grads)

    def probe(self, nbytes: int) -> float:
        self._probes += 1
        buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        start = time.perf_counter()
        self.wait(self.allreduce_async(buffer, f"pycoll.overlap.probe.{self._probes}"))
        return time.perf_counter() - start


class ParameterServer:
    """One PS key per piece (``<name>`` when the piece is the whole tensor, else
    ``<name>[lo:hi]``), declared once: plans only regroup them. Partition k's gradient
    rows are packed (compiled) into one buffer per dtype, from which its push_pull sends
    them, so the gradients may change once it is issued; the answer lands in the
    parameters' rows in place. ``urgent`` (iPart's): its priority is k (partitions are in
    forward order: a server with answers waiting sends those the next forward needs
    first); else every pull has one priority and is answered in arrival order, as a
    plain PS answers layer-by-layer pulls. Two stages: the push, then the pull (each
    link's two directions, so one partition's pull overlaps the next one's push)."""
    stages = 2

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str],
                 pieces: Sequence[Piece], push_pull: Callable, pull: Callable,
                 urgent: bool = True):
        self.params, self.push_pull, self.pull = list(params), push_pull, pull
        self.urgent = urgent
        self.keys, self.views = {}, {}
        for q in pieces:
            p = self.params[q.tensor].detach()
            whole = q.lo == 0 and q.hi == _rows(p)
            self.keys[q] = names[q.tensor] if whole else f"{names[q.tensor]}[{q.lo}:{q.hi}]"
            self.views[q] = (p.reshape(1) if p.dim() == 0 else p[q.lo:q.hi])

    def declared(self) -> list:
        """(key, tensor) of every piece, for ``ps.init_params``."""
        return [(self.keys[q], self.views[q]) for q in sorted(self.keys)]

    def adopt(self, plan: Plan) -> None:
        pass

    def issue(self, k: int, part: Partition):
        grads = {q.tensor: _gradient(self.params[q.tensor]) for q in part}
        tensors = [grads.get(i) for i in range(len(self.params))]
        names, values, outs = [], [], []
        for (dtype, device), pieces in _by_kind(part, self.params).items():
            buffer = _packed(self.params, tensors, pieces, dtype, device)
            offset = 0
            for q in pieces:
                view = self.views[q]
                names.append(self.keys[q])
                values.append(buffer[offset:offset + view.numel()].view(view.shape))
                outs.append(view)
                offset += view.numel()
        return self.push_pull(names, values, outs, priority=k if self.urgent else 0)

    def complete(self, k: int, work) -> None:
        work.wait()

    def probe(self, nbytes: int) -> float:
        """A pull of keys holding about ``nbytes`` (into scratch): one stage's cost."""
        chosen, total = [], 0
        for q in sorted(self.keys, key=lambda q: self.views[q].numel() * self.views[q].element_size()):
            if chosen and total >= nbytes:
                break
            chosen.append(self.keys[q])
            total += self.views[q].numel() * self.views[q].element_size()
        start = time.perf_counter()
        self.pull(chosen).wait()
        return time.perf_counter() - start
