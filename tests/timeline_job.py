"""A job for tests/test_timeline.py: steps of compute (inside pycoll.slowdown()) and
communication, each operation named after its step; ``timeline.step()`` ends a step.

    timeline_job.py collectives STEPS     async allreduces (fused), allreduce, broadcast
    timeline_job.py ps STEPS              push_pull to the parameter server (BSP)
"""
import sys
import time

import numpy as np

import pycoll
from pycoll import timeline

mode, steps = sys.argv[1], int(sys.argv[2])
if mode == "ps":
    import pycoll.ps as ps
    ps.init(policy="bsp")                  # servers serve here, then exit
    weights = np.zeros(16, np.float32)
    ps.init_params({"w": weights})
else:
    pycoll.init()
for k in range(steps):
    with pycoll.slowdown():
        time.sleep(0.01)
    if mode == "ps":
        ps.push_pull(["w"], [np.ones(16, np.float32)], outs=[weights]).wait()
    else:
        works = [pycoll.allreduce_async(np.ones(4, np.float32), name=f"grad{i}.step{k}")
                 for i in range(3)]
        for work in works:
            work.wait()
        pycoll.allreduce(np.ones(2), name=f"loss.step{k}")
        pycoll.broadcast(np.zeros(3), root=0, name=f"bcast.step{k}")
    timeline.step()
