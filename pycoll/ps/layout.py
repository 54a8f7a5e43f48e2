"""Which server holds which part of which key.

Every worker computes the same layout from the same (name, shape, dtype) list, so no
message is needed to agree on it. A key of at least ``split_bytes`` is cut into one
near-equal element range per server (a big layer spans every server); smaller keys go
whole to the server holding the fewest bytes so far. Each server holds at most one
range of a key, so messages name keys, never ranges.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

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


def _declared(spec) -> str:
    return "nothing" if spec is None else f"{spec[1]} {list(spec[0])}"


def mismatch(declarations: Sequence[Sequence]) -> Optional[str]:
    """What differs between the workers' declarations (``[[name, shape, dtype], ...]``
    per worker, as each passed them to init_params), or None if nothing does."""
    for worker, declared in enumerate(declarations):
        names = [name for name, _, _ in declared]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            return (f"worker {worker} declares key(s) {twice} more than once; key names must "
                    "be unique")
    first = {name: (tuple(shape), dtype) for name, shape, dtype in declarations[0]}
    order = [name for name, _, _ in declarations[0]]
    for worker, declared in enumerate(declarations[1:], 1):
        mine = {name: (tuple(shape), dtype) for name, shape, dtype in declared}
        for name in order + [n for n in mine if n not in first]:
            if first.get(name) != mine.get(name):
                return (f"workers declare key {name!r} differently: worker 0 declares "
                        f"{_declared(first.get(name))}, worker {worker} "
                        f"{_declared(mine.get(name))}; every worker must declare the same "
                        "names, shapes and dtypes")
        if [name for name, _, _ in declared] != order:
            return (f"worker {worker} declares the keys in another order than worker 0 "
                    "(the layout follows the order); declare them in the same order")
    return None
