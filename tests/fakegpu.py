"""Fake GPU arrays: host memory behind ``__cuda_array_interface__`` only.

They drive pycoll's CUDA code paths on machines without a GPU; the tests swap
``pycoll.tensors.stager`` for one whose copies are host memmoves that it counts.
"""
import ctypes
import types

import numpy as np


class FakeCudaArray:
    def __init__(self, host: np.ndarray, device: int = 0):
        self.host = np.ascontiguousarray(host)
        self.shape, self.dtype = self.host.shape, self.host.dtype
        self.device = types.SimpleNamespace(id=device)      # as cupy's arrays say it

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.host.ctypes.data, not self.host.flags.writeable), "strides": None}

    def copy(self):
        return FakeCudaArray(self.host.copy(), self.device.id)

    def get(self) -> np.ndarray:
        return self.host


def empty(shape, dtype):
    """What ``cupy.empty`` would be: pycoll allocates outputs through the array's module."""
    return FakeCudaArray(np.empty(shape, dtype))


class CountingStager:
    """Stands in for ``pycoll.tensors.stager(device)``: copies and scales at once,
    counting the copies and the bytes scaled. ``scales = False`` plays a stager with no
    GPU scale (the cupy one)."""

    scales = True

    def __init__(self):
        self.calls = 0
        self.scaled_bytes = 0
        self.devices = set()            # the devices it was asked for

    def __call__(self, device: int) -> "CountingStager":
        self.devices.add(device)
        return self

    def copy(self, dst: int, src: int, nbytes: int, after=None) -> None:
        self.calls += 1
        ctypes.memmove(dst, src, nbytes)

    def scale(self, ptrs, sizes, dtype, factor) -> None:
        from pycoll import _C
        itemsize = np.dtype(dtype).itemsize
        for ptr, nbytes in zip(ptrs, sizes):
            _C.scale(ptr, nbytes // itemsize, dtype, factor)
            self.scaled_bytes += nbytes

    def mark(self):
        return None

    def wait(self, mark=None) -> None:
        pass
