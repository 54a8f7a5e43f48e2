"""Server checkpoints as plain data: one raw array file and one JSON manifest per server
and generation, in ``checkpoint_dir``::

    server-<i>.g<generation>.bin     parameters and momentum, back to back
    server-<i>.g<generation>.json    format, version, generation, job shape (servers,
                                     workers, policy), layout (keys, dtypes, ranges) and
                                     its fingerprint, clocks, array offsets, the .bin's
                                     size and SHA-256

Each file is written to a temporary name, fsynced and renamed, the manifest last, then
the directory is fsynced: a generation whose manifest is there and whose checksum holds
is complete. A server keeps its last two complete generations. Loading parses JSON and
reads raw bytes into arrays of the manifest's dtypes: nothing is unpickled or run.
"""
import hashlib
import json
import os
import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .. import tensors

FORMAT, VERSION = "pycoll.ps checkpoint", 1


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the text names the file and what is wrong."""


class State(NamedTuple):
    generation: int
    keys: List[Tuple[str, str, int, int, int]]       # (name, dtype, count, lo, hi)
    params: List[np.ndarray]
    momentum: List[Optional[np.ndarray]]
    clocks: List[int]
    applied_round: int
    manifest: str                                     # the manifest's path


def paths(directory: str, server: int, generation: int) -> Tuple[str, str]:
    stem = os.path.join(directory, f"server-{server}.g{generation:08d}")
    return stem + ".bin", stem + ".json"


def fingerprint(keys) -> str:
    """SHA-256 of the layout: names, dtypes, counts and ranges, in name order."""
    text = json.dumps(sorted([list(k) for k in keys]))
    return hashlib.sha256(text.encode()).hexdigest()


def generations(directory: str, server: int) -> List[int]:
    """The generations this server has any file of, newest first."""
    pattern = re.compile(rf"server-{server}\.g(\d+)\.(bin|json)$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted({int(m.group(1)) for m in map(pattern.match, names) if m}, reverse=True)


def _durable(path: str, chunks) -> None:
    """Write ``chunks`` to ``path`` so that a crash leaves the old file or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str, server: int, generation: int, job: dict, keys, params, momentum,
         clocks, applied_round: int) -> str:
    """Write one generation of one server; its manifest's path. ``job``: servers,
    workers, policy (what a resume must match)."""
    os.makedirs(directory, exist_ok=True)
    bin_path, json_path = paths(directory, server, generation)
    arrays, offset, table = [], 0, []
    for key, p, m in zip(keys, params, momentum):
        entry = dict(key=list(key), params=offset, momentum=None)
        arrays.append(p)
        offset += p.nbytes
        if m is not None:
            entry["momentum"] = offset
            arrays.append(m)
            offset += m.nbytes
        table.append(entry)
    digest = hashlib.sha256()
    views = [np.ascontiguousarray(a).view(np.uint8) for a in arrays]
    for v in views:
        digest.update(v)
    _durable(bin_path, [v.data for v in views])
    manifest = dict(format=FORMAT, version=VERSION, generation=generation, server=server,
                    **job, layout=fingerprint(keys), keys=table, clocks=list(map(int, clocks)),
                    applied_round=int(applied_round),
                    files={os.path.basename(bin_path):
                           dict(bytes=offset, sha256=digest.hexdigest())})
    _durable(json_path, [json.dumps(manifest, indent=1).encode()])
    _sync_dir(directory)
    return json_path


def load(directory: str, server: int, generation: int, job: dict) -> State:
    """Read and check one generation. ``CheckpointError`` names the file and what is
    wrong: missing, truncated, corrupted, or written by another job (``job`` differs)."""
    bin_path, json_path = paths(directory, server, generation)
    try:
        with open(json_path, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{json_path} is missing (the write did not finish)") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{json_path} is not valid JSON (truncated or corrupted): "
                              f"{err}") from None
    try:
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise CheckpointError(f"{json_path} is not a {FORMAT} of version {VERSION} "
                                  f"(format {manifest.get('format')!r}, version "
                                  f"{manifest.get('version')!r})")
        for field in ("servers", "workers", "policy"):
            if manifest[field] != job[field]:
                raise CheckpointError(
                    f"{json_path} was written by a job with {field} = {manifest[field]!r}; "
                    f"this one has {job[field]!r} (resume with the same servers, workers and "
                    "policy, or use another checkpoint_dir)")
        if manifest["server"] != server or manifest["generation"] != generation:
            raise CheckpointError(f"{json_path} says it is server {manifest['server']}'s "
                                  f"generation {manifest['generation']}")
        expect = manifest["files"][os.path.basename(bin_path)]
        try:
            raw = np.fromfile(bin_path, np.uint8)
        except FileNotFoundError:
            raise CheckpointError(f"{bin_path} is missing") from None
        if raw.nbytes != expect["bytes"]:
            raise CheckpointError(f"{bin_path} has {raw.nbytes} bytes, its manifest "
                                  f"{expect['bytes']} (truncated)")
        if hashlib.sha256(raw).hexdigest() != expect["sha256"]:
            raise CheckpointError(f"{bin_path}'s SHA-256 differs from its manifest's "
                                  "(corrupted)")
        keys = [tuple(entry["key"]) for entry in manifest["keys"]]
        if fingerprint(keys) != manifest["layout"]:
            raise CheckpointError(f"{json_path}: its keys do not match its layout fingerprint")
        params, momentum = [], []
        for entry, (name, dtype, count, lo, hi) in zip(manifest["keys"], keys):
            dtype = tensors.numpy_dtype(dtype)
            nbytes = (hi - lo) * dtype.itemsize
            arrays = []
            for offset in (entry["params"], entry["momentum"]):
                if offset is not None and not 0 <= offset <= raw.nbytes - nbytes:
                    raise CheckpointError(f"{json_path}: key {name!r} lies outside {bin_path}")
                arrays.append(None if offset is None else
                              raw[offset:offset + nbytes].view(dtype).copy())
            params.append(arrays[0])
            momentum.append(arrays[1])
        return State(generation, keys, params, momentum, [int(c) for c in manifest["clocks"]],
                     int(manifest["applied_round"]), json_path)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as err:        # a manifest of the wrong shape
        raise CheckpointError(f"{json_path} is malformed: {type(err).__name__}: {err}") from None


def scan(directory: str, server: int, job: dict) -> Tuple[Dict[int, State], Dict[int, str]]:
    """Every generation of this server: ``({generation: State}, {generation: problem})``."""
    good, bad = {}, {}
    for generation in generations(directory, server):
        try:
            good[generation] = load(directory, server, generation, job)
        except CheckpointError as err:
            bad[generation] = str(err)
    return good, bad


def prune(directory: str, server: int, keep) -> None:
    """Remove this server's generations other than ``keep``."""
    for generation in generations(directory, server):
        if generation not in keep:
            for path in paths(directory, server, generation):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
