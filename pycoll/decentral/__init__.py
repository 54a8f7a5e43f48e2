"""Decentralized training: Ripples' Partial All-Reduce groups and AD-PSGD's gossip.

Built on pycoll's public primitives (``pycoll.partial_allreduce``, collectives, the
world communicator); nothing below pycoll.decentral imports it.
"""
from .groups import (GroupBook, GroupGenerator, RandomGroups, StaticGroups, random_partition,
                     schedule_conflicts, static_schedule)
from .training import ADPSGD, AllReduce, Ripples

__all__ = ["GroupBook", "GroupGenerator", "RandomGroups", "StaticGroups", "random_partition",
           "schedule_conflicts", "static_schedule", "ADPSGD", "AllReduce", "Ripples"]
