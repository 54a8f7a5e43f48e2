"""Training a torch.nn.Module through the parameter server."""
import time
from typing import Optional

import torch

from .. import timeline
from . import _exchange, init_params, pull, push_pull


class TorchWorker:
    """Keeps ``model``'s parameters on the servers: ``pull()`` before forward, ``push()``
    after backward.

    ``push`` sends the gradients (for a server-side ``pycoll.ps.SGD``) or, given a local
    ``optimizer``, takes its step and sends the change, then asks for the new parameters
    at once; ``pull`` waits for them, so the transfer overlaps whatever runs in between.
    Creating it declares the parameters (every worker, same model) and loads the servers'
    values: worker 0's initial ones, or a checkpoint's.

    ``schedule`` (``pycoll.overlap``): "default" is the above; "layerwise" and "ipart"
    (server-side optimizer only) push partitions of gradient rows during backward and
    wait in each layer's forward pre-hook for its own rows only: ``pull`` returns at once,
    and each piece of a parameter is its own key (``<name>[lo:hi]`` when split). Exposed
    communication: ``schedule.counters()`` per step, or ``pull_wait_s`` (all the time
    "default" spent waiting in ``pull``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 schedule: str = "default"):
        self.model, self.optimizer = model, optimizer
        self.named = [(name, p) for name, p in model.named_parameters()]
        if not self.named:
            raise ValueError("pycoll.ps.TorchWorker: the model has no parameters")
        self.names = [name for name, _ in self.named]
        self.params = [p.detach() for _, p in self.named]
        self.schedule, self._pending, self.pull_wait_s = None, None, 0.0
        if schedule != "default":
            self.schedule = _overlap(self, schedule)
            return
        init_params(list(zip(self.names, self.params)))

    def pull(self) -> None:
        """Wait until the parameters asked for by the last ``push`` are in the model."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            start = time.perf_counter()
            pending.wait()
            self.pull_wait_s += time.perf_counter() - start

    def fetch(self) -> None:
        """Load the servers' current parameters now (e.g. to evaluate after training)."""
        if self.schedule is not None:
            self.schedule.finish()
            keys, tensors = zip(*self.schedule.transport.declared())
            pull(list(keys), list(tensors)).wait()
            return
        self.pull()
        pull(self.names, self.params).wait()

    def push(self) -> None:
        """Send this step's gradients (or local step) and start fetching the new parameters."""
        if self.schedule is not None:
            self.schedule.step()
            timeline.step()
            return
        self.pull()
        if self.optimizer is None:
            values = [p.grad.detach().contiguous() if p.grad is not None else torch.zeros_like(p)
                      for _, p in self.named]
        else:
            before = [p.clone() for p in self.params]
            self.optimizer.step()
            values = [after - old for after, old in zip(self.params, before)]
        self._pending = push_pull(self.names, values, outs=self.params)
        timeline.step()


def _overlap(worker: TorchWorker, schedule: str):
    """A ``pycoll.overlap`` schedule whose partitions are push_pulls of one key per piece."""
    from .. import runtime
    from ..overlap import Schedule, check_schedule
    from ..overlap.transports import ParameterServer
    check_schedule(schedule)
    if worker.optimizer is not None:
        raise ValueError(f"pycoll.ps.TorchWorker(schedule={schedule!r}) pushes gradients as "
                         "backward makes them: use a server-side optimizer "
                         "(pycoll.ps.init(optimizer=pycoll.ps.SGD(...))), not a local one")
    params = [p for _, p in worker.named]

    def agree(text: str) -> str:
        return _exchange(text.encode(), "pycoll.overlap plan")[0].decode()

    def build(pieces):
        transport = ParameterServer(params, worker.names, pieces, push_pull, pull)
        init_params(transport.declared())
        return transport
    return Schedule(worker.model, params, schedule, build, agree, first=runtime.rank() == 0)
