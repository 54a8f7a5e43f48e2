"""The parameter-server job test_overlap.py launches: python overlap_job.py.

Trains one model under BSP with each schedule (servers serve three jobs in a row, sending
their answers one at a time, the others by priority) and checks: every schedule ends
with bit-identical parameters, every layer's forward read the same values under each
(so none read rows before they arrived, which the layers also assert), and iPart's
plans are the same on every worker and cover every byte once.
"""
import torch
from mpi4py import MPI

import pycoll
import pycoll.ps as ps
from pycoll.overlap import SCHEDULES, plan as planner

STEPS = 10             # iPart: profiled at 1 and 3, plans 1 after 3 and 2 after 9
SCHEDULE = [None]        # the running schedule, for the layers' checks


class Checked(torch.nn.Linear):
    """A Linear that asserts its rows have arrived and records what it reads."""
    reads: list = []

    def forward(self, x):
        schedule = SCHEDULE[0]
        if schedule is not None:
            assert all(schedule.arrived(p) for p in self.parameters(recurse=False)), \
                "a layer's forward ran before its parameters arrived"
        Checked.reads.append((self.weight.detach().sum().item(), self.bias.detach().sum().item()))
        return super().forward(x)


def model():
    torch.manual_seed(3)
    # Small layers to merge, one of 128 KiB to split (grain 16 KiB).
    return torch.nn.Sequential(Checked(8, 16), torch.nn.ReLU(), Checked(16, 16), torch.nn.ReLU(),
                               Checked(16, 2048), torch.nn.ReLU(), Checked(2048, 4))


def train(schedule):
    ps.init(policy="bsp", optimizer=ps.SGD(lr=0.05, momentum=0.9), exit_servers=False)
    m = model()
    worker = ps.TorchWorker(m, schedule=schedule)
    SCHEDULE[0] = worker.schedule
    g = torch.Generator().manual_seed(7)      # the same batches on every worker: BSP's sums
    for _ in range(STEPS):                    # then do not depend on the order pushes come
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        worker.pull()
        m.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        worker.push()
    worker.fetch()
    if schedule == "ipart":
        s = worker.schedule
        assert s.plan.version >= 2, f"iPart planned and re-planned: plan {s.plan.version}"
        mine = s.plan.to_json()
        everyone = ps._exchange(mine.encode(), "plans")
        assert all(p.decode() == mine for p in everyone), "workers hold different plans"
        planner.check_cover(s.plan.parts, s.tensors)
        assert any(len(part) > 1 for part in s.plan.parts) or len(s.plan.parts) == 1
        print(f"ipart plan {s.plan.version}: {len(s.plan.parts)} partitions of "
              f"{len(s.pieces)} pieces; counters {len(s.counters()['exposed_s'])} steps", flush=True)
    SCHEDULE[0] = None
    ps.shutdown()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def main():
    # A credit of one byte: the servers send one answer at a time, the others by priority.
    pycoll.configure(ipart_grain=16 << 10, ipart_profile_steps=1, ipart_replan_every=1,
                     ipart_drift=1e-9, ps_reply_credit=1)
    servers = pycoll.config.get("servers")
    if MPI.COMM_WORLD.rank >= MPI.COMM_WORLD.size - servers:
        for _ in SCHEDULES:
            ps.init(policy="bsp", optimizer=ps.SGD(lr=0.05, momentum=0.9), exit_servers=False)
        return
    results, reads = {}, {}
    for schedule in SCHEDULES:
        Checked.reads = []
        results[schedule] = train(schedule)
        reads[schedule] = Checked.reads
    for schedule in SCHEDULES[1:]:
        assert torch.equal(results[schedule], results["default"]), \
            f"{schedule} ended with other parameters than default"
        assert reads[schedule] == reads["default"], f"{schedule}'s forwards read other values"
    print(f"worker {MPI.COMM_WORLD.rank}: schedules bit-identical", flush=True)


if __name__ == "__main__":
    main()
