"""pycoll.overlap: when gradients and parameters travel, relative to compute.

Three schedules, for the parameter server (``ps.TorchWorker(model, schedule=...)``) and
for allreduce training (``pycoll.torch.DistributedOptimizer(..., model=model,
schedule=...)``):

- ``"default"``: everything after backward; the next forward waits for all of it.
- ``"layerwise"``: each layer's gradients go when backward produces them; a pre-hook on
  each layer waits for that layer's parameters (PS, answered in arrival order) or update
  (allreduce) only.
- ``"ipart"``: iPart (TPDS 2021): partitions of rows, small layers merged and large
  tensors split, sized by a greedy planner from profiled compute and the link's cost
  and issued in an order that lets what the next forward needs first overtake the
  backlog (``plan``), run as layerwise runs layers (``schedule``). On the parameter
  server a partition's pull carries its forward index as its priority, and the servers
  send the most urgent answers first (``pycoll.ps.server``).

``plan`` is the planner (pure Python, its cost model in its docstring), ``schedule`` the
hooks and the partitions in flight, ``transports`` what a partition's transfer is.
"""
from .plan import Plan, Profile, choose
from .schedule import SCHEDULES, Schedule, check_schedule

__all__ = ["SCHEDULES", "Schedule", "Plan", "Profile", "choose", "check_schedule"]
