// The --link emulation thread's releases of held point-to-point requests (pycoll.emulation):
// each generalized request completes at its modelled time, without the GIL, so its waiter
// sees it at once instead of after the thread's next Python. No Python here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pycoll::link {

struct Release {
    double due;        // time.monotonic()'s clock
    intptr_t request;  // an MPI generalized request (its handle's value)
};

// Until `until`, or until one of `fds` is readable (their indices in `ready`): complete each
// of `releases` (sorted by due) at its due, asleep until then (no spin: see link.cpp); the
// nappers wake after each. How many were completed (a prefix); `error` MPI's code if one
// failed (the rest are left).
size_t wait(const std::vector<Release>& releases, const std::vector<int>& fds, double until,
            std::vector<int>& ready, int& error);

// A poller's sleep between tests of its requests: until a release (true) or `seconds`; at
// once after a release this thread's naps have not seen yet (one while it tested).
bool nap(double seconds);

// Wake the nappers: requests were completed elsewhere (cancelled, or released unpaced).
void released();

}  // namespace pycoll::link
