"""Which server holds which part of which key.

Every worker computes the same layout from the same (name, shape, dtype) list, so no
message is needed to agree on it. A key of at least ``split_bytes`` is cut into one
near-equal element range per server (a big layer spans every server); smaller keys go
whole to the server holding the fewest bytes so far. Each server holds at most one
range of a key, so messages name keys, never ranges.
"""
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from ..tensors import ITEMSIZE

SPLIT_BYTES = 1 << 20


class Range(NamedTuple):
    server: int
    lo: int            # element offsets into the key's flattened tensor
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class Key(NamedTuple):
    name: str
    shape: Tuple[int, ...]
    dtype: str
    ranges: Tuple[Range, ...]

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


def plan(specs: Sequence[Tuple[str, tuple, str]], servers: int,
         split_bytes: int = SPLIT_BYTES) -> Dict[str, Key]:
    """``{name: Key}`` for ``[(name, shape, dtype), ...]`` spread over ``servers``."""
    load = [0] * servers
    keys: Dict[str, Key] = {}
    for name, shape, dtype in specs:
        if name in keys:
            raise ValueError(f"pycoll.ps: key {name!r} is declared twice; key names must be unique")
        if dtype not in ITEMSIZE:
            raise TypeError(f"pycoll.ps: key {name!r} has unsupported dtype {dtype}; "
                            f"use one of {', '.join(ITEMSIZE)}")
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * ITEMSIZE[dtype]
        if nbytes >= split_bytes and count >= servers > 1:
            bounds = [count * s // servers for s in range(servers + 1)]
            ranges = tuple(Range(s, bounds[s], bounds[s + 1]) for s in range(servers))
            for s, r in enumerate(ranges):
                load[s] += r.count * ITEMSIZE[dtype]
        else:
            s = min(range(servers), key=lambda i: load[i])
            ranges = (Range(s, 0, count),)
            load[s] += nbytes
        keys[name] = Key(name, tuple(int(d) for d in shape), dtype, ranges)
    return keys


def by_server(keys: Sequence[Key]) -> Dict[int, List[Tuple[Key, Range]]]:
    """``{server: [(key, range), ...]}`` in key order: the order payloads are packed in."""
    out: Dict[int, List[Tuple[Key, Range]]] = {}
    for key in keys:
        for r in key.ranges:
            out.setdefault(r.server, []).append((key, r))
    return out
