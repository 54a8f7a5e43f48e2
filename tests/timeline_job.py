"""A job for tests/test_timeline.py: steps of compute (inside pycoll.slowdown()) and
collectives, each named after its step; ``timeline.step()`` ends each step."""
import sys
import time

import numpy as np

import pycoll
from pycoll import timeline

pycoll.init()
for k in range(int(sys.argv[1])):
    with pycoll.slowdown():
        time.sleep(0.01)
    works = [pycoll.allreduce_async(np.ones(4, np.float32), name=f"grad{i}.step{k}")
             for i in range(3)]
    for work in works:
        work.wait()
    pycoll.allreduce(np.ones(2), name=f"loss.step{k}")
    pycoll.broadcast(np.zeros(3), root=0, name=f"bcast.step{k}")
    timeline.step()
