"""Horovod's ``DistributedOptimizer``: gradients are allreduced while backward runs.

A hook on every parameter (``register_post_accumulate_grad_hook``) submits the allreduce
of its gradient, named after the parameter, the moment autograd has accumulated it.
Negotiation matches the names across ranks (``pycoll.negotiation``), so ranks whose hooks
fire in other orders, or that compute no gradient for a parameter (it is reduced as
zeros at ``step()``), still agree; the gradients ready everywhere in one cycle go to the
engine together and fuse there up to ``PYCOLL_FUSION_THRESHOLD``, while backward goes on.
``step()`` waits for the rest, then steps.

Overlap needs a core to overlap on: where a CPU rank has none to spare
(``runtime.overlap_pays``), the hooks only note the gradients, and ``step()`` submits them
all at once (one negotiation cycle) while backward is over.

``schedule=`` ("default", "layerwise", "ipart"; needs ``model=``) hands the gradients to
``pycoll.overlap`` instead: partitions of rows allreduced in one order on every rank,
each parameter updated as its reduction completes, by the next forward's pre-hooks.

``op=Adasum`` is Horovod's delta optimizer: each parameter's local step is taken at once,
and the step's delta is what Adasum combines.
"""
import contextlib
import warnings
from typing import Dict, List

import torch

from .. import timeline
from . import api
from .compression import Compression


def _zero_grad(self, set_to_none: bool = True):
    """Both distributed optimizers' zero_grad: refused while gradients are being reduced."""
    if self._handles:
        raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                             "but before optimizer.step() or optimizer.synchronize(). "
                             "This is prohibited as it can cause a race condition.")
    return super(self.__class__, self).zero_grad(set_to_none)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (see ``DistributedOptimizer``)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 schedule=None, model=None):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op, self.process_set = op, process_set
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._prescale = 1.0 / gradient_predivide_factor if op is api.Average else 1.0
        self._postscale = gradient_predivide_factor if op is api.Average else 1.0
        self._parameter_names = _parameter_names(self.param_groups, named_parameters)
        self._delay: Dict[torch.Tensor, int] = {}
        self._handles: Dict[torch.Tensor, tuple] = {}       # param -> (handle, context)
        self._ready: Dict[int, List[torch.Tensor]] = {}      # group index -> params ready
        self._deferred: List[torch.Tensor] = []              # ready, to submit at synchronize
        self._synchronized = False
        self._should_synchronize = True
        self._params = [p for group in self.param_groups for p in group["params"]
                        if p.requires_grad]
        self._groups = _parameter_groups(self._params, groups, self._parameter_names,
                                         process_set)
        self._hooks = []
        self._schedule = None
        if schedule is not None:
            self._schedule = _overlap(self, model, schedule)
        elif process_set.included() and api.size() > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                           for p in self._params]
        self.set_backward_passes_per_step(backward_passes_per_step)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._delay = {p: passes for p in self._params}

    def load_state_dict(self, *args, **kwargs):
        self._handles, self._ready, self._deferred = {}, {}, []
        self._synchronized, self._should_synchronize = False, True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        return super(self.__class__, self).load_state_dict(*args, **kwargs)

    # ------------------------------------------------------------ hooks
    def _gradient_ready(self, p: torch.Tensor) -> None:
        if p in self._handles and self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            self._handles[p] = None             # counted; reduced at step() if it comes to that
            return
        if api.overlap_pays(p.grad):
            self._submit(p)
        else:
            self._handles[p] = None             # counted as submitted; synchronize() submits
            self._deferred.append(p)

    def _submit(self, p: torch.Tensor) -> None:
        if p.grad is None:
            # Not computed here (an unused parameter), perhaps elsewhere: reduce zeros.
            p.grad = torch.zeros_like(p)
        group = self._groups.get(p)
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        index, members = group
        ready = self._ready.setdefault(index, [])
        if not any(q is p for q in ready):       # tensors' == is elementwise
            ready.append(p)
        self._handles[p] = None                  # counted as submitted; the group's handle follows
        if len(ready) < len(members):
            return
        for q in members:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        compressed = [self._compression.compress(q.grad) for q in members]
        handle = api.grouped_allreduce_async_([c for c, _ in compressed],
                                              name=self._parameter_names[members[0]],
                                              op=self.op, prescale_factor=self._prescale,
                                              postscale_factor=self._postscale,
                                              process_set=self.process_set)
        for q, (c, context) in zip(members, compressed):
            self._handles[q] = (handle, context, c)
        del self._ready[index]

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple:
        name, tensor = self._parameter_names[p], p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return (api.sparse_allreduce_async(tensor, name, self.op, self.process_set),
                        None, None)
            tensor = tensor.to_dense()
        compressed, context = self._compression.compress(tensor)
        handle = api.allreduce_async_(compressed, name=name, op=self.op,
                                      prescale_factor=self._prescale,
                                      postscale_factor=self._postscale,
                                      process_set=self.process_set)
        return handle, context, compressed

    # ------------------------------------------------------------ synchronization
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce. Gradients this rank did not compute
        (unused parameters) are reduced as zeros: other ranks may have computed them.
        With a ``schedule``: apply every update still in flight (e.g. before evaluating)."""
        if self._schedule is not None:
            self._schedule.finish()
            return
        if not self.process_set.included():
            self._synchronized = True
            return
        deferred, self._deferred = self._deferred, []
        for p in deferred:
            del self._handles[p]
            self._submit(p)
        if self._hooks:
            for p in self._params:
                if self._handles.get(p) is None:
                    self._submit(p)
        outputs = {}
        for p, (handle, context, compressed) in list(self._handles.items()):
            if handle not in outputs:
                outputs[handle] = handle() if callable(handle) else api.synchronize(handle)
            # A sparse allreduce gives a new tensor; the others reduced ``compressed``.
            out = outputs[handle] if compressed is None else \
                self._compression.decompress(compressed, context)
            if out is not p.grad:
                _set_grad(p, out)
        self._handles.clear()
        self._ready.clear()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
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
        if self._schedule is not None:       # updates happen as partitions complete
            loss = closure() if closure is not None else None
            self._schedule.step()
            timeline.step()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        loss = super(self.__class__, self).step(closure)
        timeline.step()
        return loss

    def _wrapped_step(self, closure=None):
        """The wrapped optimizer's own step, without reducing (broadcast_optimizer_state)."""
        return super(self.__class__, self).step(closure)

    def _step_only(self, params, grads) -> None:
        """The wrapped optimizer's step of ``params`` alone, with gradients ``grads``
        (a schedule's reduced ones); the others and their gradients are left alone."""
        chosen = {id(p) for p in params}
        stashed = [group["params"] for group in self.param_groups]
        kept = [p.grad for p in params]
        for group in self.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in chosen]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            super(self.__class__, self).step()
        finally:
            for group, members in zip(self.param_groups, stashed):
                group["params"] = members
            for p, g in zip(params, kept):
                p.grad = g

    zero_grad = _zero_grad


def _overlap(opt, model, schedule):
    """A ``pycoll.overlap`` schedule for ``opt``'s parameters: its partitions allreduced
    with ``opt``'s op and factors, its updates by ``opt._step_only``."""
    from ..overlap import Schedule, check_schedule
    from ..overlap.transports import Allreduce
    check_schedule(schedule)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"DistributedOptimizer(schedule={schedule!r}) needs model=, the "
                         "torch.nn.Module being trained (its layers get the forward hooks)")
    if opt.backward_passes_per_step != 1 or opt._compression is not Compression.none or \
            opt.sparse_as_dense or opt._groups or opt.process_set is not api.global_process_set:
        raise ValueError("DistributedOptimizer(schedule=...) takes none of "
                         "backward_passes_per_step > 1, compression, sparse_as_dense, groups "
                         "or a process set; leave them at their defaults")
    agreed = [0]

    def agree(text: str) -> str:
        agreed[0] += 1
        return api.broadcast_object(text, root_rank=0, name=f"pycoll.overlap.agree.{agreed[0]}")

    # Grouped, so that the engine sends each partition alone: partitions negotiated in
    # one cycle would otherwise fuse into one batch, and the next forward's first
    # partition would wait for the whole batch (the plan already merged what pays).
    def allreduce(buffer, name):
        return api.grouped_allreduce_async_([buffer], name=name, op=opt.op,
                                            prescale_factor=opt._prescale,
                                            postscale_factor=opt._postscale)
    return Schedule(model, opt._params, schedule,
                    lambda pieces: Allreduce(opt._params, allreduce, api.synchronize, opt._step_only),
                    agree, first=api.rank() == 0)


def _set_grad(p: torch.Tensor, reduced: torch.Tensor) -> None:
    """A sparse result into a sparse gradient (``set_`` does not take sparse tensors)."""
    if p.grad.is_sparse:
        p.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
    else:
        p.grad.copy_(reduced.to_dense() if reduced.is_sparse else reduced)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Horovod's delta optimizer for ``op=Adasum``: when a gradient is ready, the wrapped
    optimizer steps that parameter alone from zero, giving its update; ``step()``
    combines the updates by Adasum and adds them to the parameters."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._parameter_names = _parameter_names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._params = [p for group in self.param_groups for p in group["params"]
                        if p.requires_grad]
        self._delay = {p: backward_passes_per_step for p in self._params}
        self._handles: Dict[torch.Tensor, tuple] = {}
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False)
                                 for p in self._params}
        for p in self._params:
            p.grad = torch.zeros_like(p)
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for p in self._params]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._delay = {p: passes for p in self._params}

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if p in self._handles and self._handles[p][0] is not None and self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase "
                                 "backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        self._handles[p] = self._allreduce_delta_async(p) if self._delay[p] == 0 else (None, None)

    def _allreduce_delta_async(self, p: torch.Tensor) -> tuple:
        # delta = (start - lr f(g)) - start: step p alone from where it is, keep the change.
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            start.data.copy_(p)
            super(self.__class__, self).step()
            p.data.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, context = self._compression.compress(p.data)
        return api.allreduce_async_(compressed, name=self._parameter_names[p],
                                    op=api.Adasum), context

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self._params:
            if self._handles.get(p, (None,))[0] is None:
                self._handles[p] = self._allreduce_delta_async(p)
        for p, (handle, context) in self._handles.items():
            delta = self._compression.decompress(api.synchronize(handle), context)
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def _wrapped_step(self, closure=None):
        return super(self.__class__, self).step(closure)

    zero_grad = _zero_grad


def _parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    """param -> the name its allreduce goes by: Horovod's (``named_parameters``' names, or
    ``allreduce.noname.<group>.<index>``)."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(duplicates)}")
    by_param = {p: name for name, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} of the "
                         "optimizer's parameters are not in it; pass the model's "
                         "named_parameters()")
    return {p: by_param[p] for group in param_groups for p in group["params"]}


def _parameter_groups(params, groups, names, process_set) -> Dict[torch.Tensor, tuple]:
    """param -> (group index, the group's params in order); ungrouped params are absent.
    ``groups``: None, a number of groups (params split evenly in rank 0's order, as
    Horovod does), or lists of parameters (the others each a group of one)."""
    if groups is None or groups == 0:
        return {}
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "torch.Tensor.")
        if process_set.included() and api.size() > 1:
            order = api.broadcast_object([names[p] for p in params], root_rank=process_set.ranks[0],
                                         name="DistributedOptimizer.groups",
                                         process_set=process_set)
            rank_of = {name: i for i, name in enumerate(order)}
            params = sorted(params, key=lambda p: rank_of.get(names[p], len(order)))
        size, extra = divmod(len(params), groups)
        lists, begin = [], 0
        for i in range(groups):
            end = begin + size + (i < extra)
            lists.append(params[begin:end])
            begin = end
        lists = [g for g in lists if g]
    else:
        lists = [list(g) for g in groups]
        if any(not isinstance(p, torch.Tensor) for g in lists for p in g):
            raise ValueError("groups must consist of torch.Tensor.")
        known = set(params)
        lists = [[p for p in g if p in known] for g in lists]
    out = {}
    for index, members in enumerate(lists):
        for p in members:
            if p in out:
                raise ValueError("A parameter can only appear once in groups.")
            out[p] = (index, members)
    return out


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=api.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=api.global_process_set, schedule=None, model=None):
    """Wrap ``optimizer`` so that its gradients are averaged (``op``) over the ranks.

    Returns an optimizer of the same class. ``backward_passes_per_step``: local
    accumulation before each allreduce. ``groups``: an int, or lists of parameters whose
    gradients are reduced together once all of them are ready. ``sparse_as_dense``:
    reduce sparse gradients as dense tensors (else by allgathers). ``op=Adasum``: Horovod's
    delta optimizer, combining each step's updates by Adasum. ``schedule``: "default",
    "layerwise" or "ipart" (``pycoll.overlap``), with ``model=`` the module trained; then
    ``step()`` returns at once and each parameter is updated when its reduction completes,
    at the latest in the next forward (``synchronize()`` applies all of them now).
    """
    if gradient_predivide_factor != 1.0 and op is not api.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if schedule is not None and op == api.Adasum:
        raise ValueError("DistributedOptimizer: schedule= does not combine with op=Adasum")
    if op == api.Adasum and api.size() > 1:
        if process_set is not api.global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedAdasumOptimizer.__dict__))
        return cls(optimizer.param_groups, named_parameters, compression,
                   backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
               schedule, model)
