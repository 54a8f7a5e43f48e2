// The clock, Patience, and the emulation's sleep and core-wait count (clock.h).
//
// sleep_until sleeps to SPIN_S before its deadline and yields the core from there: a 300 us
// sleep wakes 25 us late with a 1 ns timer slack (80 us with Linux's default 50 us), a
// sched_yield spin 0.3 us (2-core VM; docs/benchmarks.md). Spinning the last 30 us still let
// the sleep before it wake late from an idle core: small collectives under a 10 GbE link took
// 1.14-1.33x their model at 2 ranks against 1.05-1.18x with 120 us.
//
// Core waits: Linux counts, per thread, the time it was runnable without a core (schedstat's
// run delay). A thread asleep to a deadline is not runnable; the run delay it gains from just
// before its sleep until it is back on a core is its wait for one, all at its wake-up, so the
// part after the deadline is min(that, back - deadline). Waits before the deadline are never
// counted (the sleep absorbs them); of those while sleep_until spins, the ones that could have
// come before the deadline are left out.
#include "clock.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace pycoll::clock {

double now() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

Patience::Patience(double timeout, double spin_s, double stall_s)
    : deadline_(now() + timeout), last_(now()), spin_s_(spin_s), stall_s_(stall_s) {}

void Patience::progressed() { last_ = now(), delay_ = 0; }

bool Patience::idle() {
    const double t = now();
    if (t > deadline_) return false;
    if (t - last_ < spin_s_) return true;
    if (t - last_ < stall_s_) {
        sched_yield();
        return true;
    }
    delay_ = std::min(std::max(2 * delay_, 1e-5), 1e-3);
    const timespec ts{0, static_cast<long>(delay_ * 1e9)};
    nanosleep(&ts, nullptr);
    return true;
}

void precise_timers() {
    thread_local bool set = false;
    if (!set) set = true, prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
}

double run_delay() {
    thread_local int fd = -2;  // open for the thread's life: a read is then one pread
    if (fd == -2) fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    char text[96];
    const ssize_t got = fd >= 0 ? pread(fd, text, sizeof text - 1, 0) : -1;
    if (got <= 0) return 0.0;
    text[got] = '\0';
    char* rest;
    std::strtoull(text, &rest, 10);  // time on a core; the run delay comes next
    return 1e-9 * static_cast<double>(std::strtoull(rest, nullptr, 10));
}

namespace {

struct Waits {
    bool on = false;
    std::mutex lock;
    double deadline = -INFINITY, wait = 0.0;  // the latest deadline, the waits after it
} waits;

// This thread's latest deadline it woke past, and its run delay then: waits from there on
// came after that deadline.
thread_local double last_deadline = NAN, last_delay = 0.0;

}  // namespace

void count_core_waits(bool on) { waits.on = on; }

bool counting_core_waits() { return waits.on; }

void count_wait(double deadline, double before, double awake, double at, double delay) {
    const double gained = std::max(0.0, delay - before);
    const double wait = awake < 0 ? std::min(gained, at - deadline)  // asleep, then one wait
                                  : std::min(gained - std::max(0.0, deadline - awake), at - std::max(deadline, awake));
    if (wait > 0) {
        std::lock_guard<std::mutex> hold(waits.lock);
        if (deadline > waits.deadline) waits.deadline = deadline, waits.wait = 0.0;
        if (deadline == waits.deadline) waits.wait += wait;
    }
    if (at >= deadline) last_deadline = deadline, last_delay = delay;
}

void woke(double deadline, double before, double awake, double& delay, double& at) {
    at = now(), delay = run_delay();
    count_wait(deadline, before, awake, at, delay);
}

double wait_after(double since, double at, double delay) {
    double deadline, wait;
    {
        std::lock_guard<std::mutex> hold(waits.lock);
        deadline = waits.deadline, wait = waits.wait;
        waits.deadline = -INFINITY, waits.wait = 0.0;
    }
    if (deadline < since) return 0.0;
    if (last_deadline == deadline) wait += std::max(0.0, (delay < 0 ? run_delay() : delay) - last_delay);
    return std::min(wait, std::max(0.0, at - deadline));
}

void sleep_until(double deadline) {
    double t = now();
    if (t >= deadline) return;
    precise_timers();
    const bool counting = waits.on;
    double before = counting ? run_delay() : 0.0, awake = t;
    if (deadline - t > SPIN_S) {
        const double wake = deadline - SPIN_S;
        const timespec ts = timespec_of(wake);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
        }
        if (counting) woke(deadline, before, -1.0, before, awake);
    }
    for (t = now(); t < deadline; t = now()) {
        // The latest instant on a core before the deadline, the run delay then: a wait for
        // a core since then came after it.
        if (counting && t - awake > READ_EVERY_S) before = run_delay(), awake = t;
        sched_yield();
    }
    if (counting) {
        double delay, at;
        woke(deadline, before, awake, delay, at);
    }
}

}  // namespace pycoll::clock
