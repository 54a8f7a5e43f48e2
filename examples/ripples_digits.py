"""Decentralized training of the digits MLP: Ripples, AD-PSGD and synchronous AllReduce.

    pycollrun -np 8 --slowdown 3:4 python examples/ripples_digits.py --scheme all --seconds 8

Every worker draws its own batches and runs one emulated compute step of --step-time
seconds (the real forward/backward, then a sleep, inside ``pycoll.slowdown()`` so a
slowed rank's step takes FACTOR times longer and ranks may outnumber cores), then
``sync.step(optimizer)`` communicates as its scheme says. Every --eval-every steps a
worker keeps a copy of its model; the copies are scored after the run (scoring a large
model would take the cores the run is timed on), which gives each worker's test accuracy
against wall-clock time; at the end the models are averaged and the average is scored.
Each worker also reports its wall and CPU seconds and its time in compute (real and in
all) and in ``sync.step``: how much of the run was real CPU. Schemes: allreduce, adpsgd,
ripples-static, ripples-random, ripples-generator (group policies of pycoll.decentral).
"""
import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import pycoll
from digits import accuracy, load, mlp
from pycoll import decentral

SCHEMES = ("allreduce", "adpsgd", "ripples-static", "ripples-random", "ripples-generator")
# Lockstep schemes need every worker to run the same number of steps.
LOCKSTEP = ("allreduce", "ripples-static", "ripples-random")


def make_sync(scheme: str, model, group_size: int, seed: int):
    if scheme == "allreduce":
        return decentral.AllReduce(model)
    if scheme == "adpsgd":
        return decentral.ADPSGD(model, seed=seed)
    policy = {"ripples-static": lambda: decentral.StaticGroups(group_size, seed),
              "ripples-random": lambda: decentral.RandomGroups(group_size, seed),
              "ripples-generator": lambda: decentral.GroupGenerator(group_size, seed)}[scheme]
    return decentral.Ripples(model, policy())


class Deadline:
    """When to stop. Asynchronous schemes stop on their own clock. Lockstep ones stop at
    one step count, which every worker learns at step ``calibrate`` in one broadcast from
    rank 0 (its first steps' pace turns the time budget into steps): a worker that
    learnt it later than the others could be past it already, in a group whose partners
    have stopped."""

    def __init__(self, seconds: float, steps: int, lockstep: bool, comm, calibrate: int = 10):
        self.seconds, self.comm, self.calibrate = seconds, comm, calibrate
        self.start = time.perf_counter()
        self.steps = steps or None                  # the step count, once known
        self.by_clock = not steps and not lockstep

    def done(self, step: int) -> bool:
        elapsed = time.perf_counter() - self.start
        if self.by_clock:
            return elapsed >= self.seconds
        if self.steps is None and step == self.calibrate:
            pace = max(step + 1, int(self.seconds / (elapsed / step)))
            self.steps = self.comm.bcast(pace if self.comm.rank == 0 else None, root=0)
        return self.steps is not None and step >= self.steps


def train(scheme: str, args, data) -> dict:
    """One scheme on every rank; rank 0 gets the merged log."""
    comm = MPI.COMM_WORLD
    rank = comm.rank
    # The same start everywhere; args built by hand (tests) may leave the width out.
    model = mlp(args.seed, getattr(args, "hidden", 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    sync = make_sync(scheme, model, args.group_size, args.seed)
    batches = torch.Generator().manual_seed(args.seed * 1000 + rank)
    params = list(model.parameters())
    pycoll.barrier()
    deadline = Deadline(args.seconds, args.steps, scheme in LOCKSTEP, comm)
    start, step, copies = deadline.start, 0, []
    phases = dict.fromkeys(("compute", "real compute", "sync"), 0.0)
    cpu = time.process_time()                   # every thread's: emulation and services too
    while not deadline.done(step):
        begin = time.perf_counter()
        with pycoll.slowdown():
            mine = torch.randint(len(data.x_train), (args.batch_size,), generator=batches)
            loss_fn(model(data.x_train[mine]), data.y_train[mine]).backward()
            real = time.perf_counter() - begin
            time.sleep(max(0.0, args.step_time - real))
        synced = time.perf_counter()
        sync.step(optimizer)
        optimizer.zero_grad()
        phases["sync"] += time.perf_counter() - synced
        phases["compute"] += synced - begin
        phases["real compute"] += real
        step += 1
        if step % args.eval_every == 0:
            copies.append((time.perf_counter() - start, parameters_to_vector(params).detach()))
    sync.close()
    seconds = time.perf_counter() - start
    phases.update(wall=seconds, cpu=time.process_time() - cpu,
                  counters=sync.counters() if hasattr(sync, "counters") else {})
    own = parameters_to_vector(params).detach()
    log = [(t, score(model, flat, data)) for t, flat in copies]
    vector_to_parameters(pycoll.allreduce(own), params)
    final = accuracy(model, data)
    logs = comm.gather((log, step, phases), root=0)
    if rank:
        return {}
    return {"scheme": scheme, "final_accuracy": final, "seconds": seconds,
            "steps": [s for _, s, _ in logs], "curve": merge([l for l, _, _ in logs]),
            "phases": [p for _, _, p in logs]}


def score(model, flat: torch.Tensor, data) -> float:
    """Test accuracy of ``model`` with the parameters ``flat`` (the model keeps them)."""
    vector_to_parameters(flat, model.parameters())
    return accuracy(model, data)


def merge(logs, points: int = 200):
    """Mean over workers of each one's latest accuracy, on a common time grid."""
    end = max((t for log in logs for t, _ in log), default=0.0)
    curve = []
    for t in np.linspace(0, end, points):
        latest = [next((a for s, a in reversed(log) if s <= t), 0.0) for log in logs]
        curve.append((float(t), float(np.mean(latest))))
    return curve


def time_to(curve, target: float):
    return next((t for t, a in curve if a >= target), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scheme", default="all", choices=SCHEMES + ("all",))
    parser.add_argument("--seconds", type=float, default=8.0, help="wall-clock budget per scheme")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps per worker instead of a time budget (0: use --seconds)")
    parser.add_argument("--step-time", type=float, default=0.02,
                        help="emulated compute seconds per step (before any --slowdown)")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units (75 x HIDDEN float32 parameters: 65536 is 18.75 MiB)")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=5,
                        help="steps between copies of the model, scored after the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()

    pycoll.init()
    torch.set_num_threads(1)          # ranks share the cores
    data = load()
    results = [train(s, args, data) for s in (SCHEMES if args.scheme == "all" else [args.scheme])]
    if pycoll.rank():
        return
    print(f"{pycoll.size()} workers, slowdown {pycoll.config.get('slowdown') or 'none'}")
    print(f"{'scheme':<18} {'to 90% (s)':>10} {'final acc':>9} {'steps/worker':>14}")
    for r in results:
        t90 = time_to(r["curve"], 0.9)
        print(f"{r['scheme']:<18} {t90 if t90 is None else round(t90, 2)!s:>10} "
              f"{100 * r['final_accuracy']:8.2f}% {min(r['steps']):>6}-{max(r['steps']):<6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "size": pycoll.size(),
                       "slowdown": pycoll.config.get("slowdown"), "results": results}, f)


if __name__ == "__main__":
    main()
