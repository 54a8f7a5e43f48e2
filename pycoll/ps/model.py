"""Training a torch.nn.Module through the parameter server."""
import time
from typing import Optional

import torch

from .. import timeline
from . import _exchange, _state, init_params, pull, push_pull
from .r2sp import Pacer


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

    Under R²SP (``policy="r2sp"``) give ``batch_size``: ``pull()`` asks for this
    worker's turn as the computing starts, so the gate's messages overlap the compute;
    ``push()`` hands the push over to go at the turn (sent by the communication thread:
    the loop does not wake up for it) and returns; ``batch_size`` says how many samples
    the next batch should hold (``pycoll.ps.AdaptiveBatchSampler`` draws batches by it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 schedule: str = "default", batch_size: Optional[int] = None):
        self.model, self.optimizer = model, optimizer
        self._batch_size = batch_size
        self.pacer = Pacer(batch_size) if _state.policy is not None and _state.policy.turns \
            else None
        self.named = [(name, p) for name, p in model.named_parameters()]
        if not self.named:
            raise ValueError("pycoll.ps.TorchWorker: the model has no parameters")
        self.names = [name for name, _ in self.named]
        self.params = [p.detach() for _, p in self.named]
        self.schedule, self._pending, self.pull_wait_s = None, None, 0.0
        if schedule != "default":
            if self.pacer is not None:
                raise ValueError(f"pycoll.ps.TorchWorker(schedule={schedule!r}) pushes "
                                 "partitions during backward, which R²SP's turns cannot pace: "
                                 "use schedule='default' with policy 'r2sp'")
            self.schedule = _overlap(self, schedule)
            return
        init_params(list(zip(self.names, self.params)))

    @property
    def batch_size(self) -> Optional[int]:
        """The size the next batch should have (R²SP adapts it; else as given)."""
        return self.pacer.batch_size if self.pacer is not None else self._batch_size

    def pull(self) -> None:
        """Wait until the parameters asked for by the last ``push`` are in the model."""
        self._wait()
        if self.pacer is not None:
            self.pacer.start()                    # computing starts: ask for the turn

    def _wait(self) -> None:
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
        self._wait()
        pull(self.names, self.params).wait()

    def push(self, samples: Optional[int] = None) -> None:
        """Send this step's gradients (or local step) and start fetching the new parameters.
        Under R²SP they go at this worker's turn; ``samples``: in this step's batch
        (default ``batch_size``), which weighs the push."""
        if self.schedule is not None:
            self.schedule.step()
            timeline.step()
            return
        self._wait()
        if self.optimizer is None:
            values = [p.grad.detach().contiguous() if p.grad is not None else torch.zeros_like(p)
                      for _, p in self.named]
        else:
            before = [p.clone() for p in self.params]
            self.optimizer.step()
            values = [after - old for after, old in zip(self.params, before)]
        turn, weight = (None, 1.0) if self.pacer is None else self.pacer.turn(samples)
        self._pending = push_pull(self.names, values, outs=self.params, weight=weight,
                                  turn=turn)
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
        transport = ParameterServer(params, worker.names, pieces, push_pull, pull,
                                    urgent=schedule == "ipart")
        init_params(transport.declared())
        return transport
    return Schedule(worker.model, params, schedule, build, agree, first=runtime.rank() == 0)
