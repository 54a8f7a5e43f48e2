"""The digits task every example and training benchmark shares: data, model, accuracy.

scikit-learn's bundled 8x8 digits (1,797 images, no download), a fixed 80/20 split,
and a small MLP. Import it beside the examples: ``from digits import load, mlp, accuracy``
(bench/ scripts add examples/ to sys.path).
"""
from typing import NamedTuple

import numpy as np
import torch


class Digits(NamedTuple):
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load() -> Digits:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x_train, x_test, y_train, y_test = (torch.from_numpy(part) for part in train_test_split(
        (data.data / 16.0).astype(np.float32), data.target, test_size=0.2, random_state=0))
    return Digits(x_train, y_train, x_test, y_test)


def mlp(seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Digits) -> float:
    """Test-set accuracy in [0, 1]."""
    return (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
