#include "link.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "clock.h"
#include "mpi_calls.h"

namespace pycoll::link {
namespace {

// Nappers wait for the count of releases to move.
std::mutex lock;
std::condition_variable moved;
uint64_t releases_so_far = 0;
double latest_due = -INFINITY;  // a napper woken by a release counts its wait for a core after it

void notify(double due) {
    {
        std::lock_guard<std::mutex> hold(lock);
        ++releases_so_far;
        latest_due = std::max(latest_due, due);
    }
    moved.notify_all();
}

}  // namespace

size_t wait(const std::vector<Release>& releases, const std::vector<int>& fds, double until,
            std::vector<int>& ready, int& error) {
    clock::precise_timers();
    std::vector<pollfd> polls(fds.size());
    for (size_t i = 0; i < fds.size(); ++i) polls[i] = pollfd{fds[i], POLLIN, 0};
    const bool counting = clock::counting_core_waits();
    double before = counting ? clock::run_delay() : 0.0, awake = clock::now();  // as clock::sleep_until's
    size_t done = 0;
    error = 0;
    for (;;) {
        double t = clock::now();
        const size_t first = done;
        while (done < releases.size() && releases[done].due <= t) {
            if ((error = mpi::grequest_complete(releases[done].request)) != 0) break;
            ++done;
        }
        if (done > first) {
            const double due = releases[done - 1].due;
            if (counting) {
                double delay, at;
                clock::woke(due, before, awake, delay, at);
                before = delay, awake = at;
            }
            notify(due);
        }
        if (error || !ready.empty()) return done;
        const double next = done < releases.size() ? releases[done].due : INFINITY;
        if (std::min(next, until) <= t) return done;
        // Asleep to the next release (or to `until`, or to a record). Not spinning to it
        // as clock::sleep_until does: on a machine where ranks outnumber cores that took the
        // core from the rank the waiter waits for (round trips of 1.4-3.7 ms, not 0.2).
        const double sleep = std::min(next, until) - t;
        const timespec timeout = clock::timespec_of(std::isinf(sleep) ? 0.0 : sleep);
        if (ppoll(polls.data(), polls.size(), std::isinf(sleep) ? nullptr : &timeout, nullptr) > 0) {
            for (size_t i = 0; i < polls.size(); ++i)
                if (polls[i].revents) ready.push_back(static_cast<int>(i));
        }
        if (counting) {
            double delay, at;
            clock::woke(next, before, -1.0, delay, at);
            before = delay, awake = at;
        }
    }
}

bool nap(double seconds) {
    clock::precise_timers();
    const bool counting = clock::counting_core_waits();
    const double before = counting ? clock::run_delay() : 0.0;
    // The releases this thread's naps have seen: one since its last nap (while it tested
    // its requests) ends the next at once, as a set event would.
    thread_local uint64_t seen = 0;
    double due;
    {
        std::unique_lock<std::mutex> hold(lock);
        if (!moved.wait_for(hold, std::chrono::duration<double>(std::max(0.0, seconds)),
                            [&] { return releases_so_far != seen; }))
            return false;
        seen = releases_so_far;
        due = latest_due;
    }
    if (counting) {
        double delay, at;
        clock::woke(due, before, -1.0, delay, at);
    }
    return true;
}

void released() { notify(-INFINITY); }

}  // namespace pycoll::link
