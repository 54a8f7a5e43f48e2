"""Horovod's ``DistributedOptimizer``: gradients are allreduced while backward runs.

A hook on every parameter (``register_post_accumulate_grad_hook``) starts the
allreduce of its gradient the moment autograd has accumulated it. Consecutive
allreduces fuse in pycoll's engine, which sends a batch as soon as it holds
``PYCOLL_FUSION_THRESHOLD`` bytes, so the first batches travel while backward still
computes the rest, and a gradient of that size or more travels alone, without a copy
(hooks fire in the same order on every rank, so every rank makes the same batches).
``step()`` waits for the rest, then steps.

Overlap needs a core to overlap on: where a CPU rank has none to spare
(``api.overlap_pays``), the hooks only note the gradients, and ``step()`` issues their
allreduces, in the same order and so in the same batches, while backward is over.
"""
import contextlib
from typing import Dict, List, Optional

import torch

from . import api
from .compression import Compression


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (see ``DistributedOptimizer``)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, process_set):
        super(self.__class__, self).__init__(params)
        if op is not api.Average and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor needs op=Average (it splits the "
                             "averaging between before and after the sum)")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._compression = compression
        self._passes = backward_passes_per_step
        self._op, self._process_set = op, process_set
        self._prescale = 1.0 / gradient_predivide_factor if op is api.Average else 1.0
        self._postscale = gradient_predivide_factor if op is api.Average else 1.0
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._names = _parameter_names(params, named_parameters)
        self._groups = _parameter_groups(params, groups)
        self._delay: Dict[torch.Tensor, int] = {p: self._passes for p in params}
        self._handles: Dict[torch.Tensor, tuple] = {}       # param -> (handle, context)
        self._ready: Dict[int, List[torch.Tensor]] = {}      # group index -> params ready
        self._deferred: List[torch.Tensor] = []              # ready, to submit at synchronize
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in params]
        self._params = params

    # ------------------------------------------------------------ hooks
    def _gradient_ready(self, p: torch.Tensor) -> None:
        if p in self._handles:
            raise AssertionError(
                "a gradient was computed more than backward_passes_per_step times before "
                "step() or synchronize(); raise backward_passes_per_step to accumulate "
                "gradients locally over several backward passes")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            if api.overlap_pays(p.grad):
                self._submit(p)
            else:
                self._handles[p] = None          # counted as submitted; synchronize() submits
                self._deferred.append(p)

    def _submit(self, p: torch.Tensor) -> None:
        group = self._groups.get(p)
        if group is None:
            compressed, context = self._compression.compress(p.grad)
            handle = api.allreduce_async_(compressed, name=self._names[p], op=self._op,
                                          prescale_factor=self._prescale,
                                          postscale_factor=self._postscale,
                                          process_set=self._process_set)
            self._handles[p] = (handle, context, compressed)
            return
        index, members = group
        ready = self._ready.setdefault(index, [])
        ready.append(p)
        self._handles[p] = None                  # counted as submitted; the group's handle follows
        if len(ready) < len(members):
            return
        compressed = [self._compression.compress(q.grad) for q in members]
        handle = api.grouped_allreduce_async_([c for c, _ in compressed],
                                              name=f"allreduce.group.{index}", op=self._op,
                                              prescale_factor=self._prescale,
                                              postscale_factor=self._postscale,
                                              process_set=self._process_set)
        for q, (c, context) in zip(members, compressed):
            self._handles[q] = (handle, context, c)
        del self._ready[index]

    # ------------------------------------------------------------ synchronization
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; gradients that were never computed (unused
        parameters) are reduced as zeros, in parameter order, so all ranks agree."""
        deferred, self._deferred = self._deferred, []
        for p in deferred:
            del self._handles[p]
            self._submit(p)
        for p in self._params:
            if p not in self._handles or self._handles[p] is None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if p not in self._handles:
                    self._delay[p] = 1
                    self._gradient_ready(p)
        outputs = {}
        for p in self._params:
            handle, context, compressed = self._handles[p]
            if handle not in outputs:
                outputs[handle] = api.synchronize(handle)
            if compressed is not p.grad:
                p.grad.copy_(self._compression.decompress(compressed, context))
        self._handles.clear()
        for p in self._params:
            self._delay[p] = self._passes
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For ``step()`` after an explicit ``synchronize()`` (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("zero_grad() was called after backward() but before step() "
                                 "or synchronize(); the gradients' allreduces are pending")
        return super(self.__class__, self).zero_grad(set_to_none)


def _parameter_names(params, named_parameters) -> Dict[torch.Tensor, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if named and not all(isinstance(item, tuple) and len(item) == 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; repeated: {duplicates}")
    by_param = {p: name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} of the optimizer's "
                         "parameters are not in it; pass the model's named_parameters()")
    return {p: "allreduce." + by_param[p] for p in params}


def _parameter_groups(params, groups) -> Dict[torch.Tensor, tuple]:
    """param -> (group index, the group's params in order); ungrouped params are absent.
    ``groups``: None, a number of groups (params split evenly, in order), or lists of
    parameters."""
    if groups is None or groups == 0:
        return {}
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be >= 0, got {groups}")
        size = -(-len(params) // groups)
        lists = [params[i:i + size] for i in range(0, len(params), size)]
    else:
        lists = [list(g) for g in groups]
        known = set(params)
        if any(p not in known for g in lists for p in g):
            raise ValueError("every parameter in groups must be one the optimizer trains "
                             "(and requires grad)")
    out = {}
    for index, members in enumerate(lists):
        for p in members:
            if p in out:
                raise ValueError("a parameter appears in more than one of groups")
            out[p] = (index, members)
    return out


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=api.Average,
                         gradient_predivide_factor: float = 1.0, groups=None,
                         process_set=api.global_process_set):
    """Wrap ``optimizer`` so that its gradients are averaged (``op``) over the ranks.

    Returns an optimizer of the same class. ``backward_passes_per_step``: local
    accumulation before each allreduce. ``groups``: an int, or lists of parameters whose
    gradients are reduced together once all of them are ready.
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, process_set)
