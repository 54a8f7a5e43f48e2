"""Horovod's elastic API (``hvd.elastic``), at the launcher's fixed size.

A script written for Horovod's elastic mode runs unchanged under pycollrun::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

pycoll's ranks are MPI's, fixed when the job starts: no worker joins or leaves, so
``HostsUpdatedInterrupt`` is never raised and reset callbacks never run. ``run`` brings
every rank to rank 0's state and calls the function once; ``commit`` saves the state in
host memory and ``restore`` returns to it, as in Horovod. A failed collective
(``HorovodInternalError``) ends the call, as in a job that is not elastic: the rank it
lost cannot be replaced, so running again from the last commit would fail again.
"""
import copy
import functools
import math
import random

import torch

from .api import broadcast_object, broadcast_optimizer_state, broadcast_parameters, rank, size


def run(func):
    """Decorate ``func(state, ...)``: each call first syncs ``state`` from rank 0."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper


class State:
    """State kept alike on every rank: ``sync`` from rank 0, ``commit`` (``save``) and
    ``restore``."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions to run after workers join or leave: never, at a fixed size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state (in host memory), to ``restore`` later."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises ``HostsUpdatedInterrupt`` here when workers came or went; the
        ranks of an MPI job are fixed, so there is nothing to check."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        pass


class ObjectState(State):
    """Python objects given as keywords, kept as attributes and synced by pickling."""

    def __init__(self, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class ElasticSampler(torch.utils.data.Sampler):
    """``DistributedSampler``'s partition of ``dataset`` over the ranks that also
    remembers how far an epoch went (``record_batch``), so that a state restored or
    synced resumes with the samples not yet processed. Call ``set_epoch`` at the end of
    each epoch."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch):
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Count ``batch_size`` samples processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def reset(self):
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:                           # the same order on every rank
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        # Padded with the first samples to divide evenly, as DistributedSampler pads.
        padded = self.remaining_indices + self.remaining_indices[
            :self.total_size - len(self.remaining_indices)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


class _Handler:
    """How ``TorchState`` saves, restores and syncs one kind of object: a deep copy of
    its ``state_dict()``, loaded back; ``broadcast`` brings rank 0's to every rank."""

    def __init__(self, value, broadcast):
        self.value, self._broadcast = value, broadcast
        self.save()

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        self._broadcast(self.value)


def _sync_sampler(sampler):
    sampler.load_state_dict(broadcast_object(sampler.state_dict()))


_HANDLERS = [
    (torch.nn.Module, lambda m: broadcast_parameters(m.state_dict(), root_rank=0)),
    (torch.optim.Optimizer, lambda o: broadcast_optimizer_state(o, root_rank=0)),
    (ElasticSampler, _sync_sampler),
]


class TorchState(ObjectState):
    """The state of a torch training loop: models, optimizers and ``ElasticSampler`` s
    (by their ``state_dict``) and any other keyword as a Python object."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        for name, value in list(kwargs.items()):
            broadcast = next((b for kind, b in _HANDLERS if isinstance(value, kind)), None)
            if broadcast is not None:
                handlers[name] = _Handler(kwargs.pop(name), broadcast)
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(**kwargs)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        # A new model or optimizer assigned to the state is the one saved from now on.
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None and handler.value is not value:
            handler.value = value
            handler.save()
        super().__setattr__(name, value)
