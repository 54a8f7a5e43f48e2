"""Training a torch.nn.Module through the parameter server."""
from typing import Optional

import torch

from .. import timeline
from . import init_params, pull, push_pull


class TorchWorker:
    """Keeps ``model``'s parameters on the servers: ``pull()`` before forward, ``push()``
    after backward.

    ``push`` sends the gradients (for a server-side ``pycoll.ps.SGD``) or, given a local
    ``optimizer``, takes its step and sends the change, then asks for the new parameters
    at once; ``pull`` waits for them, so the transfer overlaps whatever runs in between.
    Creating it declares the parameters (every worker, same model) and loads the servers'
    values: worker 0's initial ones, or a checkpoint's.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        self.model, self.optimizer = model, optimizer
        self.named = [(name, p) for name, p in model.named_parameters()]
        if not self.named:
            raise ValueError("pycoll.ps.TorchWorker: the model has no parameters")
        self.names = [name for name, _ in self.named]
        self.params = [p.detach() for _, p in self.named]
        init_params(list(zip(self.names, self.params)))
        self._pending = None

    def pull(self) -> None:
        """Wait until the parameters asked for by the last ``push`` are in the model."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()

    def fetch(self) -> None:
        """Load the servers' current parameters now (e.g. to evaluate after training)."""
        self.pull()
        pull(self.names, self.params).wait()

    def push(self) -> None:
        """Send this step's gradients (or local step) and start fetching the new parameters."""
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
