"""``SyncBatchNorm``: batch normalization over the batch of every rank, as Horovod's.

Horovod's (and torch's) run in training on GPUs only, through CUDA kernels; this one is
written in torch's own tensor operations, so it trains on CPU tensors too. Forward
gathers each rank's count, mean and sum of squared deviations (one allgather), which
combine exactly however the batch is split, an empty rank included; backward sums the
two per-channel terms of the input's gradient (one allreduce). The gradients of
``weight`` and ``bias`` stay this rank's, as in Horovod: ``DistributedOptimizer`` (or
DDP) averages them as it averages every gradient.
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .api import Sum, allgather_async, allreduce_async, global_process_set, synchronize


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose statistics in training are those of the
    batches of every rank of ``process_set`` together (``hvd.SyncBatchNorm``).
    Every member must call it (forward and backward) in the same order; in evaluation
    with running statistics it is the local ``BatchNorm``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dims (N, C, ...), "
                             f"got {input.dim()}")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:           # a cumulative average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or self.process_set.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, batch_stats, factor, self.eps)
        running = (self.running_mean, self.running_var) if self.training else (None, None)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, *running, self.eps,
                                    factor, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """``module`` with every ``BatchNorm*d`` in it replaced by a ``SyncBatchNorm``
        holding its parameters and running statistics (torch's classmethod of that name)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return converted


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    """``t`` (N, C, ...) summed over every dim but the channels'."""
    return t.sum([0, *range(2, t.dim())])


def _channels(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (N, C, ...)."""
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, process_set):
        # Statistics in float32 at least (as torch's kernels keep them for half inputs);
        # the ranks' rows combine in float64, so that counts stay exact.
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        channels, count = x.size(1), x.numel() // x.size(1)
        mean = _per_channel(x) / count if count else x.new_zeros(channels)
        m2 = _per_channel((x - _channels(mean, x)) ** 2)
        row = torch.cat([mean.new_tensor([count], dtype=torch.float64), mean.double(),
                         m2.double()]).unsqueeze(0)
        rows = synchronize(allgather_async(row, name="sync_batch_norm.stats",
                                           process_set=process_set))
        counts, means, m2s = rows[:, :1], rows[:, 1:channels + 1], rows[:, channels + 1:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel in training, "
                             f"got {int(total)} over the {rows.size(0)} ranks")
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(global_mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((global_m2 / (total - 1)).to(running_var.dtype),
                                              alpha=factor)
        invstd = torch.rsqrt(global_m2 / total + eps).to(x.dtype)
        normalized = (x - _channels(global_mean.to(x.dtype), x)) * _channels(invstd, x)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.total, ctx.process_set = float(total), process_set
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = normalized
        if weight is not None:
            out = out * _channels(weight.to(x.dtype), x)
        if bias is not None:
            out = out + _channels(bias.to(x.dtype), x)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        normalized, invstd, weight = ctx.saved_tensors
        dy = grad_output.to(normalized.dtype)
        sum_dy, sum_dy_normalized = _per_channel(dy), _per_channel(dy * normalized)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            both = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_normalized]), op=Sum,
                                               name="sync_batch_norm.grads",
                                               process_set=ctx.process_set))
            total_dy, total_dy_normalized = both.split(normalized.size(1))
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = ((dy - _channels(total_dy / ctx.total, dy)
                           - normalized * _channels(total_dy_normalized / ctx.total, dy))
                          * _channels(scale, dy)).to(grad_output.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_normalized.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
