// Time for the compiled paths: the clock, the one wait with a deadline, and the
// emulation's precise sleep with its count of waits for a core (clock.cpp). No Python here.
#pragma once

#include <cmath>
#include <ctime>

namespace pycoll::clock {

// time.monotonic()'s clock, to the nanosecond.
double now();

// Waiting on peers with a deadline: spins for spin_s after the last progress, then yields the
// core until stall_s, then sleeps growing to 1 ms (ranks may outnumber cores: a spinning
// waiter would starve those it waits for).
class Patience {
   public:
    explicit Patience(double timeout, double spin_s = 50e-6, double stall_s = 50e-3);
    void progressed();
    bool idle();  // one wait between tries; false past the deadline

   private:
    double deadline_, last_, spin_s_, stall_s_, delay_ = 0;
};

// Under --link (pycoll.emulation): return at `deadline` (now()'s clock), asleep until its
// last SPIN_S, then yielding the core. Call without the GIL.
constexpr double SPIN_S = 120e-6;
void sleep_until(double deadline);

// `seconds` (>= 0: a span, or a time on now()'s clock) as the timespec the sleeps take.
inline timespec timespec_of(double seconds) {
    return timespec{static_cast<time_t>(seconds), static_cast<long>((seconds - std::floor(seconds)) * 1e9)};
}

// Linux's timer slack of 1 ns for the calling thread, not 50 us: sleeps end on time.
void precise_timers();

// How often a counting spin reads its run delay (a read is a procfs call): a wait for a
// core in the last READ_EVERY_S before the deadline may be left out; a shared core's waits
// are its time slices, milliseconds.
constexpr double READ_EVERY_S = 20e-6;

// Seconds the calling thread has been runnable without a core (schedstat's run delay; 0
// where there is none).
double run_delay();

// How long this process's threads waited for a core after modelled deadlines (the time
// this machine's oversubscription adds that a cluster would not: see pycoll.emulation's
// count_core_waits). Off until count_core_waits(true).
void count_core_waits(bool on);
bool counting_core_waits();
// A thread whose run delay was `before` when it went to sleep (or, given awake >= 0, when it
// was on a core at `awake`) is back on a core at `at` with run delay `delay`: count its wait
// after `deadline`.
void count_wait(double deadline, double before, double awake, double at, double delay);
// count_wait at now(), run_delay(); sets `delay` and `at` to them, where a next span starts.
void woke(double deadline, double before, double awake, double& delay, double& at);
// The wait after the latest deadline since `since`, up to `at` (this thread's run delay then
// `delay`, read here if negative); forgets it.
double wait_after(double since, double at, double delay = -1.0);

}  // namespace pycoll::clock
