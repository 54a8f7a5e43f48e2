"""Parameter-server jobs the tests in test_ps.py launch: python ps_job.py MODE [args].

Each mode prints what the test checks; any failed check raises (the job exits non-zero).
"""
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import pycoll
import pycoll.ps as ps
from pycoll.ps import wire

DIM = (1 << 18) + 3          # over 1 MiB of float32: the layout splits it over the servers


def grads_at(worker, step, w, b):
    """A gradient that depends on the parameters, so staleness would change the result."""
    rng = np.random.default_rng(1000 * step + worker)
    target = rng.standard_normal(DIM).astype(np.float32)
    return w - target, (b * b - rng.standard_normal(3)).astype(np.float64)


def bsp_equals_sgd(steps=6):
    sgd = ps.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    ps.init(policy="bsp", optimizer=sgd)
    rank, size = pycoll.rank(), pycoll.size()
    w = np.zeros(DIM, np.float32) + rank           # only worker 0's values may count
    b = np.full(3, 0.5 + rank, np.float64)
    ps.init_params({"w": w, "b": b})
    ref_w, ref_b = np.zeros(DIM, np.float32), np.full(3, 0.5)   # one process, torch's SGD
    mom = [None, None]
    for step in range(steps):
        gw, gb = grads_at(rank, step, w, b)
        ps.push_pull(["w", "b"], [gw, gb], outs=[w, b]).wait()
        pairs = [grads_at(r, step, ref_w, ref_b) for r in range(size)]
        for i, (p, g) in enumerate(((ref_w, np.mean([q[0] for q in pairs], 0, dtype=np.float32)),
                                    (ref_b, np.mean([q[1] for q in pairs], 0)))):
            d = g + sgd.weight_decay * p
            mom[i] = d if mom[i] is None else sgd.momentum * mom[i] + d
            p -= sgd.lr * mom[i]
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, ref_b, rtol=1e-10)
    servers = {r.server for r in ps._client().keys["w"].ranges}
    print(f"worker {rank}: BSP matches synchronous SGD after {steps} steps; "
          f"w spans {len(servers)} servers; clock {ps.clock()}", flush=True)


def staleness(policy, steps=30):
    """Each worker adds exactly 1 to its own slot of two counters per push (the servers
    scale a push by 1/N); a pull at clock c must see every slot >= c - s."""
    ps.init(policy=policy)
    rank, size = pycoll.rank(), pycoll.size()
    bound = {"bsp": 0, "asp": None}.get(policy, None if ":" not in policy else int(policy.split(":")[1]))
    counts = {k: np.zeros(size) for k in ("a", "b")}
    ps.init_params(counts)
    one_hot = np.zeros(size)
    one_hot[rank] = size
    worst = 0
    rng = np.random.default_rng(rank)
    for clock in range(1, steps + 1):
        time.sleep((0.01 if rank == 0 else 0.002) * rng.random())   # worker 0 is slow
        ps.push_pull(["a", "b"], [one_hot, one_hot], outs=[counts["a"], counts["b"]]).wait()
        for seen in counts.values():
            assert abs(seen[rank] - clock) < 1e-9, (seen, clock)      # own pushes all in
            worst = max(worst, clock - int(round(seen.min())))
            assert bound is None or clock - seen.min() <= bound + 1e-9, (policy, clock, seen)
    stats = ps.counters()
    delayed = sum(s["delayed_pulls"] for s in stats["servers"])
    print(f"worker {rank}: {policy} max staleness {worst} (bound {bound}) "
          f"reported {stats['worker']['max_staleness']} delayed {delayed}", flush=True)


def dying_server(how):
    """The last rank (a server) is killed or stopped after 1 s; workers keep pulling."""
    world = MPI.COMM_WORLD
    if world.rank == world.size - 1:
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        threading.Timer(1.0, os.kill, (os.getpid(), sig)).start()
    ps.init(policy="bsp")
    x = np.zeros(1000, np.float32)
    ps.init_params({"x": x})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ps.push_pull("x", np.ones_like(x), x).wait()
        time.sleep(0.01)
    print("the job should have failed", flush=True)


def checkpoint(directory, phase, steps=5):
    """``first`` saves generations at clocks 3 and 5 (and the values then); ``second``
    resumes from the newest and trains on; ``fallback`` (the newest was corrupted)
    resumes from the one before; ``refused`` (none is intact) must fail init_params."""
    ps.init(policy="bsp", optimizer=ps.SGD(lr=0.5, momentum=0.5), checkpoint_dir=directory)
    rank = pycoll.rank()
    v = np.full(10, 7.0 if phase != "first" else 1.0, np.float32)
    if phase == "refused":
        try:
            ps.init_params({"v": v})
            print(f"worker {rank}: a corrupt checkpoint was accepted", flush=True)
        except RuntimeError as err:
            print(f"worker {rank}: refused: {err}", flush=True)
        return
    ps.init_params({"v": v})
    if phase != "first":
        clock = 3 if phase == "fallback" else steps
        np.testing.assert_array_equal(v, np.load(os.path.join(directory, f"v{clock}.npy")))
        assert ps.clock() == clock, ps.clock()
        print(f"worker {rank}: resumed at clock {ps.clock()}", flush=True)
    if phase != "fallback":
        for step in range(1, steps + 1):
            ps.push_pull("v", v.copy(), v).wait()
            if phase == "first" and step in (3, steps):
                ps.checkpoint()
                if rank == 0:
                    np.save(os.path.join(directory, f"v{step}.npy"), v)
                print(f"worker {rank}: saved at clock {ps.clock()}", flush=True)


def faults(only="all", n=1000):
    """The protocol's fault cases in one job (2 workers, 1 server, BSP): each prints what
    a worker saw; the server must serve on after every one. ``only``: one of them
    (mismatch, duplicates, wrong_size, malformed, thread, mean)."""
    def want(part):
        return only in ("all", part)
    ps.init(policy="bsp")
    rank, client, comm = pycoll.rank(), ps._client(), ps._state.comm
    server = comm.size - 1
    wide = np.zeros(2 * n, np.float32) if rank == 0 else np.zeros(n, np.float64)   # same bytes
    if want("mismatch"):
        try:
            ps.init_params({"w": wide})
            print(f"worker {rank}: mismatched declarations accepted", flush=True)
        except ValueError as err:
            print(f"worker {rank}: mismatch: {err}", flush=True)
    w = np.zeros(n, np.float32)
    ps.init_params({"w": w, "b": np.zeros(3)})
    if want("duplicates"):
        try:
            ps.push(["w", "w"], [w, w]).wait()
            print(f"worker {rank}: duplicate keys accepted", flush=True)
        except ValueError as err:
            print(f"worker {rank}: duplicates: {err}", flush=True)
        if only == "duplicates":
            return
    if rank == 1 and want("wrong_size"):   # its idea of 'w' is one element short of the server's
        good = client.keys["w"]
        client.keys["w"] = good._replace(shape=(n - 1,),
                                         ranges=(good.ranges[0]._replace(hi=n - 1),))
        try:
            ps.push("w", np.ones(n - 1, np.float32)).wait()
            print(f"worker {rank}: wrong-size push accepted", flush=True)
        except ValueError as err:
            print(f"worker {rank}: wrong size: {err}", flush=True)
        client.keys["w"] = good
    pycoll.barrier()
    ps.push_pull("w", np.full(n, rank + 1, np.float32), w).wait()      # one BSP round: 1.5
    assert (w == 1.5).all() and ps.clock() == 1, (w[:3], ps.clock())
    print(f"worker {rank}: in step after the refused push", flush=True)
    if rank == 0 and want("malformed"):
        malformed(comm, server, client, n)
    pycoll.barrier()
    ps.push_pull("w", np.full(n, rank + 1, np.float32), w).wait()      # 1.5 + 1.5
    assert (w == 3.0).all() and ps.clock() == 2, (w[:3], ps.clock())
    print(f"worker {rank}: served after the malformed requests", flush=True)
    if rank == 1 and want("thread"):   # the thread fails: nothing hangs, the next call says so
        def broken(part):
            raise RuntimeError("injected fault")
        client._send = broken
        work = ps.push_pull("w", np.ones(n, np.float32), w)
        try:
            work.wait(timeout=10)
        except RuntimeError as err:
            print(f"worker {rank}: pending work failed: {err!r}", flush=True)
        try:
            ps.pull("w")
        except RuntimeError as err:
            print(f"worker {rank}: next call: {err}", flush=True)
        ps.shutdown()
        return
    if not want("mean"):
        return
    if rank == 1:
        ps.shutdown()
        return
    for _ in range(2):   # BSP with worker 1 gone: the mean over the active worker alone
        ps.push_pull("w", np.full(n, 2, np.float32), w).wait()
    print(f"worker {rank}: after worker 1 left: {w[0]:g}", flush=True)


def malformed(comm, server, client, n):
    """Hand-made requests, sent and answered with raw mpi4py; each answer is printed."""
    H, slot = wire.HEADER, wire.slots(client.tag_ub) - 1       # a slot the client never uses

    def next_id():
        client._next_id += 1
        return client._next_id

    def ask(what, raw, payload=None, on_slot=True):
        comm.Send([np.frombuffer(raw, np.uint8), MPI.BYTE], server, wire.REQUEST)
        if payload is not None:
            comm.Send([payload, MPI.BYTE], server, wire.tags(slot)[3])
        if on_slot:
            meta = np.zeros(wire.META_LEN, np.int64)
            comm.Recv([meta, MPI.INT64_T], server, wire.tags(slot)[0])
            assert meta[wire.STATUS] == wire.ERROR, meta
            text = bytearray(int(meta[wire.NBYTES]))
            comm.Recv([text, MPI.BYTE], server, wire.tags(slot)[2])
        else:
            status = MPI.Status()
            comm.Probe(server, wire.BAD, status)
            text = bytearray(status.Get_count(MPI.BYTE))
            comm.Recv([text, MPI.BYTE], server, wire.BAD)
        print(f"malformed {what}: {text.decode()}", flush=True)

    w = wire.encode_table([wire.Entry("w", "float32", n, 0, n)])
    ask("garbage", b"hello, server", on_slot=False)
    ask("version", H.pack(wire.MAGIC, 99, wire.PULL, slot, next_id(), 0, 0.0, 0, 0, 0, 1.0, 0.0,
                          0.0), on_slot=False)
    ask("truncated", H.pack(wire.MAGIC, wire.VERSION, wire.PULL, slot, next_id(), 0, 0.0, 1, 0, 0,
                            1.0, 0.0, 0.0))
    ask("op", H.pack(wire.MAGIC, wire.VERSION, 99, slot, next_id(), 0, 0.0, 0, 0, 0, 1.0, 0.0,
                     0.0))
    ask("payload", H.pack(wire.MAGIC, wire.VERSION, wire.PUSH, slot, next_id(), 0, 0.0, 1, 1,
                          4 * n, 1.0, 0.0, 0.0) + w, payload=np.zeros(2, np.float32))
    ask("dtype", H.pack(wire.MAGIC, wire.VERSION, wire.PULL, slot, next_id(), 0, 0.0, 1, 0, 0,
                        1.0, 0.0, 0.0)
        + wire.encode_table([wire.Entry("w", "float64", n, 0, n)]))
    ask("key", H.pack(wire.MAGIC, wire.VERSION, wire.PULL, slot, next_id(), 0, 0.0, 1, 0, 0,
                      1.0, 0.0, 0.0)
        + wire.encode_table([wire.Entry("nope", "float32", n, 0, n)]))
    ask("order", H.pack(wire.MAGIC, wire.VERSION, wire.PULL, slot, 1, 0, 0.0, 1, 0, 0, 1.0, 0.0,
                        0.0) + w)


def silent_payload(n=1000):
    """Worker 0 sends (by hand) a push header whose payload never comes: the server gives
    up at PYCOLL_TIMEOUT, answers naming the worker, and serves on."""
    ps.init(policy="asp")
    rank, client, comm = pycoll.rank(), ps._client(), ps._state.comm
    w = np.zeros(n, np.float32)
    ps.init_params({"w": w})
    if rank == 0:
        slot = wire.slots(client.tag_ub) - 1
        client._next_id += 1
        header = wire.encode(wire.PUSH, slot, client._next_id,
                             wire.encode_table([wire.Entry("w", "float32", n, 0, n)]), 1,
                             npieces=1, nbytes=4 * n)
        comm.Send([np.frombuffer(header, np.uint8), MPI.BYTE], comm.size - 1, wire.REQUEST)
        meta = np.zeros(wire.META_LEN, np.int64)
        comm.Recv([meta, MPI.INT64_T], comm.size - 1, wire.tags(slot)[0])
        text = bytearray(int(meta[wire.NBYTES]))
        comm.Recv([text, MPI.BYTE], comm.size - 1, wire.tags(slot)[2])
        print(f"worker 0: {text.decode()}", flush=True)
    ps.push_pull("w", np.ones(n, np.float32), w).wait()
    print(f"worker {rank}: served on", flush=True)


def tag_wrap(tag_ub, rounds=40):
    """Many requests in flight through a tag space of a few slots: the tags wrap around
    (slots are reused), never pass ``tag_ub``, and every answer lands where it belongs."""
    ps.init(policy="asp", tag_ub=int(tag_ub))
    rank, size, client = pycoll.rank(), pycoll.size(), ps._client()
    names = ["a", "b", "c", "d", "e"]
    values = {k: np.zeros(100 + i, np.float64) for i, k in enumerate(names)}
    ps.init_params(values)
    for _ in range(rounds):
        works = [ps.push(k, np.full(len(v), rank + 1.0)) for k, v in values.items()]
        works += [ps.pull(k) for k in names]
        for work in works:
            work.wait()
    pycoll.barrier()
    got = ps.pull(names).wait()
    expect = rounds * sum(r + 1 for r in range(size)) / size     # each push counts 1/N
    assert all(np.allclose(g, expect) for g in got), ([g[0] for g in got], expect)
    slots = wire.slots(int(tag_ub))
    print(f"worker {rank}: {client.counters['requests']} requests through {slots} slots, "
          f"max tag {client.counters['max_tag']} <= {tag_ub}; values right", flush=True)


def grads(worker, step, w):
    rng = np.random.default_rng(100 * step + worker)
    return w - rng.standard_normal(len(w)).astype(np.float32)


def resume(directory, phase, steps=8, n=DIM):
    """BSP with server SGD, ``w`` split over the servers: ``whole`` trains ``steps`` steps;
    ``killed`` saves every 0.2 s and has its first server killed after step 6;
    ``resumed`` goes on from the checkpoint. Worker 0 writes the final parameters."""
    world, servers = MPI.COMM_WORLD, pycoll.config.get("servers")
    if world.rank == world.size - servers:
        with open(os.path.join(directory, "server.pid"), "w") as f:
            f.write(str(os.getpid()))
    killed = phase == "killed"
    ps.init(policy="bsp", optimizer=ps.SGD(lr=0.1, momentum=0.9),
            checkpoint_dir=None if phase == "whole" else os.path.join(directory, "ckpt"),
            checkpoint_every=0.2 if killed else 0.0)
    rank = pycoll.rank()
    w = np.linspace(-1, 1, n).astype(np.float32)
    ps.init_params({"w": w})
    start = ps.clock()
    print(f"worker {rank}: {phase} from clock {start}", flush=True)
    for step in range(start, steps):
        ps.push_pull("w", grads(rank, step, w), w).wait()
        if killed:
            time.sleep(0.1 if rank == 0 else 0.15)
            if step == 5 and rank == 0:
                with open(os.path.join(directory, "server.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
    if rank == 0:
        np.save(os.path.join(directory, f"{phase}.npy"), w)
    print(f"worker {rank}: {phase} done at clock {ps.clock()}", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"bsp": bsp_equals_sgd, "staleness": staleness, "dying_server": dying_server,
     "checkpoint": checkpoint, "faults": faults, "tag_wrap": tag_wrap,
     "silent_payload": silent_payload,
     "resume": resume}[mode](*args)
