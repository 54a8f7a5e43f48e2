"""Torch wrappers that keep replicas of any ``nn.Module`` in step, three ways.

    sync = Ripples(model, GroupGenerator(group_size=3))     # or ADPSGD(model), AllReduce(model)
    for batch in data:
        loss_fn(model(x), y).backward()
        sync.step(optimizer)            # optimizer.step() plus this scheme's communication
        optimizer.zero_grad()
    sync.close()                        # collective: everyone leaves together

- ``AllReduce``: synchronous data parallel; gradients are averaged before the update.
- ``Ripples``: local update, then the model is averaged with this step's group through
  ``pycoll.partial_allreduce_`` (Luo et al., 2019).
- ``ADPSGD``: the model is averaged with one random neighbour, atomically, then the local
  gradient is applied (Lian et al., 2018). Workers split into active (even ranks) and
  passive (odd ranks) sets; only actives start an averaging, with a random passive, whose
  service thread grants its model's lock, exchanges models and unlocks on the active's
  release, so two workers never wait for each other in a cycle.

Models are averaged as one flat float vector (``parameters_to_vector``); optimizer state
such as momentum stays local, as in both papers.
"""
import contextlib
import random
import sys
import threading
import time

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .. import collectives, config, emulation, runtime
from ..partial import partial_allreduce_
from ..work import CollectiveTimeout, poll


def _write(flat: torch.Tensor, params) -> None:
    """``flat`` (``parameters_to_vector``'s layout) into ``params``' memory, from any
    thread (AD-PSGD's averages; Ripples, in the caller's thread, lets its parameters
    become views of the averaged vector instead, saving the copy). Not torch's
    ``vector_to_parameters``: its ``param.data =`` takes the parameter's autograd lock
    holding the GIL, where the training thread's first op on a parameter in a step takes
    that lock and then the GIL (to make its gradient accumulator), so AD-PSGD's service
    thread writing the model that way deadlocked a passive within seconds. Through
    ``.data``, as that did, so that a backward pass under way on the old values does not
    fail autograd's check for tensors modified in place."""
    offset = 0
    for param in params:
        param.data.copy_(flat[offset:offset + param.numel()].view_as(param))
        offset += param.numel()


class AllReduce:
    """Synchronous data parallel: average gradients, then step."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, optimizer) -> None:
        collectives.grouped_allreduce_([p.grad for p in self.params], name="gradients")
        optimizer.step()

    def close(self) -> None:
        pass


class Ripples:
    """Local step, then average the model within this step's group (``policy``).

    What Luo et al. prescribe: after its local update a worker gets a group (from the Group
    Generator, or a static schedule in homogeneous clusters) and averages its model with
    the group's members in one Partial All-Reduce among them; the generator hands groups
    out in one global order and keeps them from conflicting (Group Buffer, Group
    Division), so a worker waits for its own group's members only, and no lock is taken.

    What we do: the same, with ``policy.next_group()`` (the generator's requests are
    messages to its rank, paced under ``--link``) and ``partial_allreduce_`` of the flat
    model, paced under ``--link`` as the exchange it runs (a direct exchange up to
    PYCOLL_PARTIAL_DIRECT_BYTES, the ring beyond).
    """

    def __init__(self, model: torch.nn.Module, policy):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.policy = policy
        self.groups_joined = 0

    def _average(self, group) -> None:
        if len(group) > 1:
            with torch.no_grad():
                flat = parameters_to_vector(self.params)
                partial_allreduce_(flat, group, name="ripples model average")
                vector_to_parameters(flat, self.params)     # the caller's thread: no copy
            self.groups_joined += 1

    def step(self, optimizer) -> None:
        optimizer.step()
        self._average(self.policy.next_group())

    def counters(self) -> dict:
        """Averagings this worker took part in (groups of more than one)."""
        return {"averages": self.groups_joined}

    def close(self) -> None:
        for group in self.policy.leave():       # groups others count on this worker for
            self._average(group)
        self.policy.close()


_LOCK, _GRANT, _MODEL, _RELEASE, _BYE = 1, 2, 3, 4, 5


class ADPSGD:
    """Pairwise gossip: actives (even ranks) average with a random passive (odd rank).

    What Lian et al. prescribe (Algorithm 2, each worker in a loop): compute a gradient g on
    the model as read (x^); atomically average with one random neighbour, x_i, x_j <-
    (x_i + x_j) / 2; then x_i <- x_i - lr * g. The graph is bipartite: actives start
    averagings, passives only answer, so no cycle of workers waits on itself. Atomic: an
    averaging and the passive's own update never interleave, and a passive averages with
    one active at a time (actives that pick the same passive queue: the conflicts and the
    serialization at passives that Ripples argues against).

    What we do: every active neighbours every passive; an averaging takes the passive's
    lock over the network, as a lock-based implementation on a cluster must:

    1. the active sends a lock request; the passive's service thread grants it once its
       model is free (not in its own ``optimizer.step()``, not locked by another active;
       requests are served one at a time, as MPI matches them): one round trip plus any
       queueing;
    2. both send their model at once (both directions of the exchange) and each computes
       (x_i + x_j) / 2 (the same bits on both: float addition commutes);
    3. the active sends a release, on whose arrival the passive unlocks its model; until
       then its own update waits.

    Then the active applies its gradient with ``optimizer.step()`` (with the optimizer's
    momentum and the like, where the paper has plain SGD). A passive's gradient may have
    been computed on a model an averaging has since replaced, the paper's x^. Under
    ``--link`` every message is paced (``emulation.p2p``): a model is sent only once
    granted, so an averaging pays two latencies for the lock, the transfer, one for the
    release, and the wait behind other averagings and the passive's update. ``counters()``
    says how often and how long it waited.

    Collective to construct and to close (it duplicates pycoll's world communicator).
    """

    def __init__(self, model: torch.nn.Module, seed: int = 0):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = emulation.p2p(runtime.world().comm.Dup())     # --link paces the gossip
        self.rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self.actives, self.passives = list(range(0, size, 2)), list(range(1, size, 2))
        self.rng = random.Random(f"{seed}:{self.rank}")
        self.lock = threading.Lock()             # the model, between averagings and updates
        # What averaging cost this worker (``counters``): an active's seconds from lock
        # request to grant (a round trip plus queueing); a passive's lock requests that
        # found another averaging under way ("queued"), its service's waits for its own
        # update ("busy") and its update's waits for an averaging ("update").
        self.counts = dict.fromkeys(("averages", "lock wait s", "queued", "busy waits",
                                     "busy wait s", "update waits", "update wait s"), 0)
        self.server = None
        self.failure = None                      # what ended the passive's service early
        if self.rank in self.passives:
            self.server = threading.Thread(target=self._serve, name="pycoll-adpsgd", daemon=True)
            self.server.start()

    def _flat(self) -> np.ndarray:
        return parameters_to_vector(self.params).detach().numpy().astype(np.float32)

    def _wait(self, request, peer: int):
        timeout = config.get("timeout")
        poll(lambda: True if request.Test() else None, time.monotonic() + timeout,
             lambda: f"pycoll: AD-PSGD rank {self.rank} waited more than PYCOLL_TIMEOUT "
                     f"({timeout:g} s) for rank {peer}")

    @contextlib.contextmanager
    def _locked(self, waits: str):
        """Hold the model's lock, counting the waits for it as ``waits``."""
        if not self.lock.acquire(blocking=False):
            begin = time.monotonic()
            self.lock.acquire()
            self.counts[f"{waits} waits"] += 1
            self.counts[f"{waits} wait s"] += time.monotonic() - begin
        try:
            yield
        finally:
            self.lock.release()

    def step(self, optimizer) -> None:
        """Average (an active, with a random passive), then apply this worker's gradient."""
        if self.rank in self.actives and self.passives:
            self._average(self.rng.choice(self.passives))
        with self._locked("update"):
            optimizer.step()

    def _exchange(self, mine: np.ndarray, peer: int) -> np.ndarray:
        """Both models at once: (mine + theirs) / 2."""
        theirs = np.empty_like(mine)
        recv = self.comm.Irecv(theirs, source=peer, tag=_MODEL)
        send = self.comm.Isend(mine, dest=peer, tag=_MODEL)
        self._wait(recv, peer)
        self._wait(send, peer)
        theirs += mine
        theirs *= np.float32(0.5)
        return theirs

    def _average(self, peer: int) -> None:
        begin = time.monotonic()
        grant = self.comm.Irecv(bytearray(0), source=peer, tag=_GRANT)
        self._wait(self.comm.Isend(bytearray(0), dest=peer, tag=_LOCK), peer)
        self._wait(grant, peer)
        self.counts["lock wait s"] += time.monotonic() - begin
        average = self._exchange(self._flat(), peer)
        with torch.no_grad():
            _write(torch.from_numpy(average), self.params)
        self._wait(self.comm.Isend(bytearray(0), dest=peer, tag=_RELEASE), peer)
        self.counts["averages"] += 1

    def _serve(self) -> None:
        from mpi4py import MPI
        status, staying = MPI.Status(), set(self.actives)
        try:
            while staying:
                timeout = config.get("timeout")
                poll(lambda: True if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) else None,
                     time.monotonic() + timeout, lambda: self._silent(staying, timeout))
                peer, tag = status.Get_source(), status.Get_tag()
                self.comm.Recv(bytearray(0), source=peer, tag=tag)
                if tag == _BYE:
                    staying.discard(peer)
                    continue
                with self._locked("busy"), torch.no_grad():
                    self._wait(self.comm.Isend(bytearray(0), dest=peer, tag=_GRANT), peer)
                    average = self._exchange(self._flat(), peer)
                    _write(torch.from_numpy(average), self.params)
                    self.comm.Recv(bytearray(0), source=peer, tag=_RELEASE)
                self.counts["averages"] += 1
                # Another active's request already here waited behind this averaging.
                self.counts["queued"] += bool(self.comm.Iprobe(MPI.ANY_SOURCE, _LOCK))
        except BaseException as error:      # raised by close(), on the thread that called it
            self.failure = error
            # Said at once too: until close(), the actives only see a passive gone silent.
            print(f"pycoll: AD-PSGD passive rank {self.rank} stopped serving: "
                  f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)

    def counters(self) -> dict:
        """Averagings and the waits they cost this worker (``counts`` in ``__init__``)."""
        return dict(self.counts)

    def _silent(self, staying, timeout: float) -> str:
        return (f"pycoll: AD-PSGD passive rank {self.rank} heard from no active rank within "
                f"PYCOLL_TIMEOUT ({timeout:g} s); ranks {sorted(staying)} have not left: they "
                "died, hang, or stopped without close()")

    def close(self) -> None:
        if self.rank in self.actives:
            for peer in self.passives:
                self._wait(self.comm.Isend(bytearray(0), dest=peer, tag=_BYE), peer)
        if self.server is not None:
            # A passive serves until every active has left, or PYCOLL_TIMEOUT after the last
            # message from one.
            self.server.join(config.get("timeout") + 1.0)
            if self.server.is_alive() or self.failure is not None:
                raise self.failure or CollectiveTimeout(f"pycoll: AD-PSGD passive rank "
                                                        f"{self.rank} did not finish serving")
        self.comm.Free()
