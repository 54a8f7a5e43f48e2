"""Running a plan on a torch model: hooks, partitions in flight, profile and counters.

``Schedule`` is shared by the parameter server (``ps.TorchWorker``) and allreduce
training (``pycoll.torch.DistributedOptimizer``); a transport (``transports``, made by
``make_transport(pieces)`` from the fixed pieces) gives it the operations that differ:
``issue(k, rows)`` starts partition k's transfer of its gradient rows and returns a
handle; ``complete(k, handle)`` waits for it and puts the result in place (the PS pulled
parameters, allreduce's per-parameter update once all its rows are in).
``probe(nbytes)`` times one blocking transfer of that many bytes (every rank calls it
together), so the planner can fit alpha; ``stages`` is how many such transfers a
partition makes one after the other (``plan``'s cost model).

- Backward: a hook on every parameter notes its gradient; a partition is issued once
  every tensor it holds rows of has its gradient and the partitions before it in the
  plan's issue order are issued, so every rank issues them in the same order (for
  "default", all at ``step``).
- Forward: a pre-hook on every layer (module with parameters of its own) completes the
  partitions holding that layer's rows, and only those, before the layer runs; the
  other partitions stay in flight. "default" completes everything at ``step``.
- Plans: "default" is one partition, "layerwise" one per layer (in the modules' order).
  "ipart" profiles ``PYCOLL_IPART_PROFILE_STEPS`` steps (after one to settle) under one
  partition, then as many under layerwise (per-layer forward and backward times,
  measured between the hooks; step times; the forward's waits; the time issuing takes),
  times a small transfer (alpha; under ``--link``, the emulated link's), fits the cost
  model to them (``plan``'s calibration) and plans (``plan.choose``: the partitions and
  their issue order; one of the two profiled plans if it measured faster than the best
  modelled; a re-plan keeps the running plan unless the new one is clearly faster) on
  the first rank, whose plan every rank adopts (``agree``).
  Every ``PYCOLL_IPART_REPLAN_EVERY`` steps the first rank compares the mean step time
  with the one after planning; past ``PYCOLL_IPART_DRIFT`` (relative) every rank
  profiles and plans again. A plan changes only with nothing in flight.
- Counters (``counters()``): per step, the step time and the exposed communication time
  (spent waiting for partitions in forward and at ``step``); the fitted alpha and cpu
  per partition of the last plan (on the first rank). On the timeline
  (``--timeline``): each partition from issue to arrival, and each forward's wait.
"""
import atexit
import collections
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _C, config, timeline
from . import plan as planner
from .plan import Piece, Plan, Profile, Tensor

SCHEDULES = ("default", "layerwise", "ipart")
HISTORY = 1000          # steps the counters keep


def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"pycoll.overlap: schedule {schedule!r} is not one of "
                         f"{', '.join(map(repr, SCHEDULES))}")
    return schedule


def layers_of(model: torch.nn.Module, params: Sequence[torch.Tensor]):
    """(modules that own some of ``params`` directly, in registration order; per module
    the indices of the params it uses; per param the first module using it)."""
    index = {id(p): i for i, p in enumerate(params)}
    modules, uses, owner = [], [], {}
    for module in model.modules():
        mine = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
        if mine:
            for i in mine:
                owner.setdefault(i, len(modules))
            modules.append(module)
            uses.append(sorted(set(mine)))
    strays = [i for i in range(len(params)) if i not in owner]
    if strays:
        raise ValueError(f"pycoll.overlap: {len(strays)} parameter(s) (e.g. index {strays[0]}, "
                         f"shape {list(params[strays[0]].shape)}) are not in the model given; "
                         "pass the model whose parameters are trained")
    return modules, uses, [owner[i] for i in range(len(params))]


def tensor_of(p: torch.Tensor, layer: int) -> Tensor:
    rows = p.shape[0] if p.dim() else 1
    return Tensor(rows, (p.numel() // rows if rows else 0) * p.element_size(), layer)


def _rows_args(tensors: Sequence[torch.Tensor], rows: Sequence[Piece]):
    bases, widths, strides, lo, hi = [], [], [], [], []
    for piece in rows:
        t = tensors[piece.tensor]
        rows_total = t.shape[0] if t.dim() else 1
        width = t.numel() // rows_total * t.element_size() if rows_total else 0
        if t.dim() > 1 and not t[0].is_contiguous():
            raise ValueError(f"pycoll.overlap: a tensor of shape {list(t.shape)} has rows that "
                             "are not contiguous; make it contiguous")
        bases.append(t.data_ptr())
        widths.append(width)
        strides.append(t.stride(0) * t.element_size() if t.dim() else width)
        lo.append(piece.lo)
        hi.append(piece.hi)
    return bases, widths, strides, lo, hi


def pack_rows(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], rows: Sequence[Piece]) -> None:
    """Rows ``rows`` of ``tensors`` back to back into ``buffer`` (compiled; CUDA tensors
    on the current stream)."""
    if buffer.is_cuda:
        _C.cuda_pack_rows(buffer.data_ptr(), *_rows_args(tensors, rows),
                          torch.cuda.current_stream(buffer.device).cuda_stream)
    else:
        _C.pack_rows(buffer.data_ptr(), *_rows_args(tensors, rows))


def unpack_rows(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], rows: Sequence[Piece]) -> None:
    """The inverse of ``pack_rows``."""
    if buffer.is_cuda:
        _C.cuda_unpack_rows(buffer.data_ptr(), *_rows_args(tensors, rows),
                            torch.cuda.current_stream(buffer.device).cuda_stream)
    else:
        _C.unpack_rows(buffer.data_ptr(), *_rows_args(tensors, rows))


class Phase(NamedTuple):
    """What profiling one plan measured: per layer and step, means; per step, medians."""
    forward: List[float]
    backward: List[float]
    step: float
    exposed: float
    issue: float            # seconds issuing a partition took (packing, handing over)

    @property
    def compute(self) -> float:
        return sum(self.forward) + sum(self.backward)


class Schedule:
    """See the module's docstring. ``agree(text)`` returns the first rank's ``text`` on
    every rank (a collective)."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor], kind: str,
                 make_transport: Callable, agree: Callable[[str], str], first: bool = True):
        self.kind, self.agree, self.first = check_schedule(kind), agree, first
        self.params = list(params)
        self.modules, self.uses, owner = layers_of(model, self.params)
        self.tensors = [tensor_of(p, layer) for p, layer in zip(self.params, owner)]
        self.grain = int(config.get("ipart_grain"))
        registration = list(range(len(self.modules)))
        items = planner.pieces(self.tensors, registration, self.grain)
        # The pieces are fixed (a PS declares one key per piece); plans only regroup them.
        self.pieces = sorted(items)
        self.transport = make_transport(self.pieces)
        self._one = Plan([tuple(items)], registration)
        self._layerwise = Plan(planner.by_layer(items, self.tensors), registration)
        self._install(self._layerwise if kind == "layerwise" else self._one)
        self._ready = [False] * len(self.params)
        self._in_flight: Dict[int, tuple] = {}         # partition -> (handle, issued at)
        self._next = 0                                  # the next to issue: plan.issue[_next]
        self._step, self._last_step_at = 0, None
        self._exposed = 0.0
        self._issuing = 0.0                             # seconds issuing (profiled)
        self.history = collections.deque(maxlen=HISTORY)   # (step_s, exposed_s)
        self._profiling = False
        self._profile_steps = int(config.get("ipart_profile_steps"))
        self._replan_every = int(config.get("ipart_replan_every"))
        self._drift = float(config.get("ipart_drift"))
        self._baseline: Optional[float] = None
        self._started: Dict[int, float] = {}
        self.profile: Optional[Profile] = None         # the last plan's (first rank only)
        if kind == "ipart":
            self._start_profile()
        self._hooks = [m.register_forward_pre_hook(self._make_pre_forward(i))
                       for i, m in enumerate(self.modules)]
        self._hooks += [m.register_forward_hook(self._make_post_forward(i))
                        for i, m in enumerate(self.modules)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._make_grad_ready(i))
                        for i, p in enumerate(self.params)]
        # Before the collectives' own exit handlers (registered earlier, so run later):
        # the last step's partitions complete, and the parameters hold their updates.
        atexit.register(self.finish)

    # ------------------------------------------------------------ plans
    def _install(self, new: Plan) -> None:
        planner.check_cover(new.parts, self.tensors)
        self.plan = new
        self._holding = [set() for _ in self.params]          # tensor -> its partitions
        for k, part in enumerate(new.parts):
            for piece in part:
                self._holding[piece.tensor].add(k)
        self._needs = [sorted(set().union(*(self._holding[i] for i in use)))
                       for use in self.uses]                  # layer -> its partitions
        self._tensors_of = [sorted({p.tensor for p in part}) for part in new.parts]
        self.transport.adopt(new)

    # ------------------------------------------------------------ profiling
    def _start_profile(self) -> None:
        """Profile under one partition, then under layerwise (see the module's docstring);
        ``_running`` is what a re-plan keeps unless the new plan is clearly faster."""
        self._running = self.plan
        self._phases = [self._one, self._layerwise]
        self._measured: List[Phase] = []
        self._forward_order: List[int] = []
        self._next_phase()

    def _next_phase(self) -> None:
        """Run the next profiling plan, with nothing in flight."""
        self.finish()
        phase = self._phases.pop(0)
        self._install(Plan(phase.parts, phase.order, version=self._running.version))
        self._next = 0
        self._profiling = True
        self._fwd = [0.0] * len(self.modules)
        self._bwd = [0.0] * len(self.modules)
        self._done: Dict[int, float] = {}
        self._phase_steps = 0                      # the first is not profiled: it settles
        self._profiled_steps: List[Tuple[float, float]] = []     # (step, exposed) times
        self._issuing = 0.0                        # seconds spent issuing partitions
        self._forward_end = 0.0

    def _profiled(self) -> bool:
        return self._profiling and self._phase_steps > 0

    def _planned(self) -> Plan:
        """The first rank's plan from the profiles (every rank calls it together)."""
        alpha = min(self.transport.probe(8) for _ in range(3))     # noise only adds
        text = ""
        if self.first:
            one, layerwise = self._measured
            order = self._forward_order + [l for l in range(len(self.modules))
                                           if l not in self._forward_order]
            # One partition: the next forward waits for all of the bytes' stages, nothing
            # overlapped. Their share at least a quarter of it: on a busy host the wait can
            # be near alpha by noise alone, and beta would be unbounded.
            stage = one.exposed / self.transport.stages
            beta = sum(t.rows * t.row_bytes for t in self.tensors) / max(stage - alpha, stage / 4,
                                                                         1e-9)
            extra = max(len(self._layerwise.parts) - 1, 1)
            cpu = max(layerwise.issue, (layerwise.compute - one.compute) / extra)
            profile = Profile(one.forward, one.backward, alpha, beta, self.transport.stages, cpu)
            profile = self.profile = planner.calibrate(
                self._layerwise.parts, self.tensors, self._layerwise.order, profile,
                layerwise.step, self._layerwise.issue)
            text = planner.choose(self.tensors, order, profile, self.grain,
                                  self._running.version + 1, self._running,
                                  [(self._one, one.step), (self._layerwise, layerwise.step)]
                                  ).to_json()
        return Plan.from_json(self.agree(text))

    # ------------------------------------------------------------ backward
    def _make_grad_ready(self, i: int):
        def ready(p):
            self._ready[i] = True
            if self._profiled():
                layer = self.tensors[i].layer
                self._done[layer] = time.perf_counter()
            if self.kind != "default":
                self._issue(lambda k: all(self._ready[t] for t in self._tensors_of[k]))
        return ready

    def _issue(self, may: Callable[[int], bool]) -> None:
        issue = self.plan.issue
        while self._next < len(issue) and may(issue[self._next]):
            k = issue[self._next]
            start = time.perf_counter()
            self._in_flight[k] = (self.transport.issue(k, self.plan.parts[k]),
                                  timeline.now() if timeline.on else 0.0)
            self._issuing += time.perf_counter() - start
            self._next += 1

    def step(self) -> None:
        """The end of backward: issue what is left (unused parameters' rows as zeros);
        "default" waits for everything here. Then the step's counters, and profiling,
        planning and re-planning."""
        self._issue(lambda k: True)
        if self._profiled():
            self._profile_backward()
        if self.kind == "default":
            self.finish()
        self._ready = [False] * len(self.params)
        self._next = 0
        if self._last_step_at is not None:
            self.history.append((time.perf_counter() - self._last_step_at, self._exposed))
            if self._profiled():
                self._profiled_steps.append(self.history[-1])
        self._exposed = 0.0
        self._last_step_at = time.perf_counter()
        self._step += 1
        if self._profiling:
            self._phase_steps += 1
        if self.kind == "ipart":
            self._maybe_replan()

    def _profile_backward(self) -> None:
        """B_l: the time from the previous layer's gradients (or the forward's end) to
        this layer's, in the order backward produced them."""
        last = self._forward_end
        for layer, at in sorted(self._done.items(), key=lambda item: item[1]):
            self._bwd[layer] += max(at - last, 0.0)
            last = at
        self._done.clear()

    def _maybe_replan(self) -> None:
        if self._profiling:
            n = len(self._profiled_steps)
            if n >= self._profile_steps:
                steps, exposed = zip(*self._profiled_steps)
                self._measured.append(Phase(
                    [f / n for f in self._fwd], [b / n for b in self._bwd],
                    statistics.median(steps), statistics.median(exposed),
                    self._issuing / ((n + 1) * len(self.plan.parts))))
                if self._phases:
                    self._next_phase()
                    return
                self.finish()
                self._install(self._planned())
                self._next = 0
                self._profiling, self._baseline = False, None
                self._since_plan = 0
            return
        self._since_plan += 1
        if self._replan_every <= 0 or self._since_plan % self._replan_every:
            return
        recent = statistics.mean(s for s, _ in list(self.history)[-self._replan_every:])
        verdict = ""
        if self.first:
            if self._baseline is None:
                self._baseline = recent
            elif abs(recent - self._baseline) > self._drift * self._baseline:
                verdict = "replan"
        if self.agree(verdict) == "replan":
            self._start_profile()

    # ------------------------------------------------------------ forward
    def _make_pre_forward(self, layer: int):
        def pre_forward(module, inputs):
            waiting = [k for k in self._needs[layer] if k in self._in_flight]
            if waiting:
                start, began = time.perf_counter(), timeline.now() if timeline.on else 0.0
                for k in waiting:
                    self._complete(k)
                self._exposed += time.perf_counter() - start
                if timeline.on:      # exposed communication: this layer's forward waited
                    timeline.interval(f"layer {layer} waits", "ipart", began, partitions=waiting)
            if self._profiled():
                if layer not in self._forward_order:
                    self._forward_order.append(layer)
                self._started[layer] = time.perf_counter()
        return pre_forward

    def _make_post_forward(self, layer: int):
        def post_forward(module, inputs, output):
            if self._profiled() and layer in self._started:
                now = time.perf_counter()
                self._fwd[layer] += now - self._started.pop(layer)
                self._forward_end = now
        return post_forward

    def _complete(self, k: int) -> None:
        handle, issued = self._in_flight.pop(k)
        self.transport.complete(k, handle)
        if timeline.on:      # issue to arrival, as this rank saw it
            timeline.interval(f"partition {k}", "ipart", issued, rows=len(self.plan.parts[k]))

    def arrived(self, p: torch.Tensor) -> bool:
        """Whether every partition holding rows of parameter ``p`` has completed (what a
        layer's forward needs first)."""
        i = next(j for j, q in enumerate(self.params) if q is p)
        return not any(k in self._in_flight for k in self._holding[i])

    def finish(self) -> None:
        """Complete everything in flight, in issue order (e.g. before evaluating)."""
        start = time.perf_counter()
        for k in [k for k in self.plan.issue if k in self._in_flight]:
            self._complete(k)
        self._exposed += time.perf_counter() - start

    def counters(self) -> dict:
        steps = list(self.history)
        fitted = self.profile
        return dict(schedule=self.kind, steps=self._step, partitions=len(self.plan.parts),
                    plan_version=self.plan.version, predicted_step_s=self.plan.predicted_s,
                    alpha_s=fitted.alpha if fitted else 0.0, cpu_s=fitted.cpu if fitted else 0.0,
                    step_s=[s for s, _ in steps], exposed_s=[e for _, e in steps])

    def remove(self) -> None:
        atexit.unregister(self.finish)
        self.finish()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
