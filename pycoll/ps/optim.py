"""What a server does with a push: the optimizer and one key's shard."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import tensors

FLOATS = ("float16", "float32", "float64")


@dataclass(frozen=True)
class SGD:
    """Server-side SGD, as torch.optim.SGD (dampening 0): d = g + wd p; b = m b + d;
    p -= lr b. Without it the server adds what workers push (their own optimizer's steps)."""
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.lr <= 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"SGD needs lr > 0, momentum >= 0, weight_decay >= 0; got {self}")


class Shard:
    """This server's range of one key."""

    def __init__(self, dtype: str, count: int, lo: int, hi: int):
        self.dtype, self.count, self.lo, self.hi = dtype, count, lo, hi
        self.params = np.zeros(hi - lo, tensors.numpy_dtype(dtype))
        self.momentum: Optional[np.ndarray] = None

    def apply(self, update: np.ndarray, sgd: Optional[SGD], start: int = 0) -> None:
        """``update`` is the mean gradient (or step) of the workers' pushes for elements
        ``start:start + len(update)`` of the shard (updates are elementwise, so a push
        can be applied piece by piece); ``update`` may be clobbered."""
        params = self.params[start:start + len(update)]
        if sgd is None:
            params += update
            return
        if sgd.weight_decay:
            update += sgd.weight_decay * params
        if sgd.momentum:
            if self.momentum is None:      # zeros: the first step's buffer is the update
                self.momentum = np.zeros_like(self.params)
            momentum = self.momentum[start:start + len(update)]
            momentum *= sgd.momentum
            momentum += update
            np.multiply(momentum, sgd.lr, out=update)
        else:
            update *= sgd.lr
        params -= update
