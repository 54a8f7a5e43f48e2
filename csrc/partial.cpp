// The partial all-reduce's two algorithms (partial.h).
//
// Ring, for large messages: k-1 reduce-scatter steps then k-1 allgather steps; a step's
// block is cut into chunks of chunk_bytes, all its receives are posted at once, and each
// chunk is reduced and forwarded in order as soon as it has landed, so reducing one chunk
// overlaps the transfer of the next. Each block is reduced once and then copied: every member ends
// with the same bits.
// Direct exchange, for small messages: every member sends its buffer to every other and
// reduces the k buffers in member order (one latency instead of 2(k-1); the same bits
// everywhere because every member combines in the same order).
//
// Recursive doubling, for small messages in groups of Round::doubling_from or more: log2(k)
// exchanges with one partner each instead of k-1 messages to and from every member; the
// members past the largest power of two m first hand their buffer to member p-m and get
// the result back from it. A pair combines its lower member's value with its higher's,
// in that order on both, so every member gets the same bits.
//
// Waiting: MPI_Testany in a loop that never sleeps while messages flow. It spins for
// 50 us after the last progress (a peer on another core answers within it: yielding at
// once costs tens of us on a machine shared with other jobs), then yields the core between
// tries; only a wait that has made no progress for 50 ms (a late peer, a straggler)
// backs off to short sleeps, so ranks that outnumber cores are not starved. Where ranks
// share cores MPI's own progress already yields while it has nothing to do (Open MPI's
// mpi_yield_when_idle, on when oversubscribed, as in its blocking waits): yielding here
// at once as well, as this loop did, sent every wait through the scheduler twice: at 4
// and 8 ranks on 2 cores, 4 B rounds took a median 1.72x MPI's Allreduce against 1.36x
// spinning first (docs/benchmarks.md).
// Progress is a completed message, and one chunk of a large ring takes milliseconds to
// arrive, while its transfer needs both ends to keep calling MPI (rendezvous fragments):
// at 2 ms, waits fell into sleeping mid-transfer and 1-4 MiB rounds at 2 ranks took 4-7x
// MPI's Allreduce; at 50 ms, 1.02-1.10x.
#include "partial.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "clock.h"
#include "kernels.h"
#include "mpi_calls.h"

namespace pycoll::partial {
namespace {

constexpr size_t NONE = SIZE_MAX;

// A failure that ends the round: Late (peer) or Failed (MPI's code).
struct Stop {
    Outcome::Status status;
    int peer, error;
};

void check(int code) {
    if (code) throw Stop{Outcome::Failed, -1, code};
}

// Where received data lands before it is reduced, kept from round to round: a fresh,
// zero-filled allocation of a large block each round cost a page fault per 4 KiB and a
// pass over the block before any byte arrived. Rounds of a process run one at a time (the engine's
// order); the lock makes that a rule here too. Receives of a failed round are cancelled
// before it returns, so no late message lands in it.
class Scratch {
  public:
    char* take(size_t nbytes) {
        lock_ = std::unique_lock<std::mutex>(mutex);
        if (nbytes > size) {
            data.reset();
            data.reset(new char[nbytes]);  // uninitialized: every byte is received before it is read
            size = nbytes;
        }
        return data.get();
    }

  private:
    static inline std::mutex mutex;
    static inline std::unique_ptr<char[]> data;
    static inline size_t size = 0;
    std::unique_lock<std::mutex> lock_;
};

class Exchange {
  public:
    explicit Exchange(const Round& r)
        : r_(r), item_(itemsize(r.dt)), patience_(r.timeout), sends_(r.request_null), recvs_(r.request_null) {}

    Outcome run() {
        Outcome out;
        try {
            if (r_.count * item_ > r_.direct_bytes) ring();
            else if (r_.members.size() < r_.doubling_from) direct();
            else doubling();
        } catch (const Stop& stop) {
            out.status = stop.status, out.peer = stop.peer, out.error = stop.error;
            for (size_t i = 0; i < recvs_.size(); ++i)  // no late message may land in freed scratch
                if (recvs_.active(i) && mpi::cancel(recvs_.at(i)) == 0) mpi::wait(recvs_.at(i));
            for (size_t i = 0; i < sends_.size(); ++i)
                if (sends_.active(i)) out.sends.push_back(sends_.get(i));
        }
        return out;
    }

  private:
    char* at(size_t element) const { return static_cast<char*>(r_.data) + element * item_; }
    int peer(size_t j) const { return r_.members[j]; }

    size_t send(const void* buf, size_t nbytes, size_t j) {
        const size_t i = sends_.add();
        check(mpi::isend(buf, static_cast<int>(nbytes), r_.byte_type, peer(j), r_.tags[j], r_.comm, sends_.at(i)));
        return i;
    }

    size_t post_recv(void* buf, size_t nbytes, size_t j) {
        const size_t i = recvs_.add();
        check(mpi::irecv(buf, static_cast<int>(nbytes), r_.byte_type, peer(j), r_.tags[j], r_.comm, recvs_.at(i)));
        return i;
    }

    // The index among the receives posted since `first` of one that completed (waiting on `j`).
    size_t next_recv(size_t first, size_t j) {
        while (true) {
            int index, flag;
            check(mpi::testany(static_cast<int>(recvs_.size() - first), recvs_.at(first), &index, &flag));
            if (flag && index != r_.undefined) {
                patience_.progressed();
                return static_cast<size_t>(index);
            }
            idle(peer(j));
        }
    }

    // Until request i of `reqs` completes (waiting on member j).
    void wait(mpi::Requests& reqs, size_t i, size_t j) {
        while (true) {
            int flag;
            check(mpi::test(reqs.at(i), &flag));
            if (flag) return patience_.progressed();
            idle(peer(j));
        }
    }

    // One wait between tries on member j; Late past the round's deadline.
    void idle(int peer) {
        if (!patience_.idle()) throw Stop{Outcome::Late, peer, 0};
    }

    void finish(size_t j) {
        for (size_t i = 0; i < sends_.size(); ++i) wait(sends_, i, j);
    }

    void direct() {
        const size_t k = r_.members.size(), p = r_.me, nbytes = r_.count * item_;
        if (!nbytes) return;
        char* scratch = scratch_.take(nbytes * (k - 1));  // the others' buffers, in member order
        auto of = [&](size_t j) { return j == p ? static_cast<char*>(r_.data) : scratch + (j - (j > p)) * nbytes; };
        for (size_t j = 0; j < k; ++j)
            if (j != p) post_recv(of(j), nbytes, j);
        for (size_t j = 0; j < k; ++j)
            if (j != p) send(r_.data, nbytes, j);
        for (size_t left = recvs_.size(); left; --left) {
            size_t waiting = 0;  // the first member not heard from, named if it never comes
            for (size_t i = 0, j = 0; i < recvs_.size(); ++i, ++j) {
                if (j == p) ++j;
                if (recvs_.active(i)) {
                    waiting = j;
                    break;
                }
            }
            next_recv(0, waiting);
        }
        for (size_t i = 0, j = 0; i < sends_.size(); ++i, ++j) {  // our buffer is read until they are done
            if (j == p) ++j;
            wait(sends_, i, j);
        }
        char* acc = of(0);  // x0 op x1 op ... in member order on every member
        for (size_t j = 1; j < k; ++j) cpu::reduce(acc, of(j), r_.count, r_.dt, r_.op);
        if (acc != r_.data) std::memcpy(r_.data, acc, nbytes);
        if (r_.scale != 1.0) cpu::scale(r_.data, r_.count, r_.dt, r_.scale);
    }

    // data = (lower member's) op (higher member's), with `scratch` holding member j's: the
    // same operands in the same order on both members of a pair (min and max of a NaN
    // depend on it).
    void combine(char* scratch, size_t j) {
        char* data = static_cast<char*>(r_.data);
        if (r_.me < j) return cpu::reduce(data, scratch, r_.count, r_.dt, r_.op);
        cpu::reduce(scratch, data, r_.count, r_.dt, r_.op);
        std::memcpy(data, scratch, r_.count * item_);
    }

    void doubling() {
        const size_t k = r_.members.size(), p = r_.me, nbytes = r_.count * item_;
        size_t m = 1;  // the largest power of two <= k
        while (2 * m <= k) m *= 2;
        char* scratch = scratch_.take(nbytes);
        if (p >= m) {  // past the power of two: member p - m reduces for it
            wait(sends_, send(r_.data, nbytes, p - m), p - m);
            wait(recvs_, post_recv(r_.data, nbytes, p - m), p - m);
        } else {
            if (p + m < k) {
                wait(recvs_, post_recv(scratch, nbytes, p + m), p + m);
                combine(scratch, p + m);
            }
            for (size_t d = 1; d < m; d *= 2) {
                const size_t q = p ^ d, got = post_recv(scratch, nbytes, q), sent = send(r_.data, nbytes, q);
                wait(recvs_, got, q);
                wait(sends_, sent, q);  // before data changes
                combine(scratch, q);
            }
            if (p + m < k) wait(sends_, send(r_.data, nbytes, p + m), p + m);
        }
        if (r_.scale != 1.0) cpu::scale(r_.data, r_.count, r_.dt, r_.scale);
    }

    void ring() {
        const size_t k = r_.members.size(), p = r_.me;
        const size_t left = (p + k - 1) % k, right = (p + 1) % k;
        const size_t step = std::max<size_t>(1, r_.chunk_bytes / item_);
        std::vector<size_t> bounds(k + 1);
        for (size_t b = 0; b <= k; ++b) bounds[b] = r_.count * b / k;
        size_t largest = 0;
        for (size_t b = 0; b < k; ++b) largest = std::max(largest, bounds[b + 1] - bounds[b]);
        char* scratch = scratch_.take(largest * item_);  // a reduce-scatter step's chunks
        auto chunks = [&](size_t b) { return (bounds[b + 1] - bounds[b] + step - 1) / step; };
        auto lo = [&](size_t b, size_t c) { return bounds[b] + c * step; };
        auto hi = [&](size_t b, size_t c) { return std::min(lo(b, c) + step, bounds[b + 1]); };
        // The latest send of each chunk: a receive into that chunk waits for it first.
        std::vector<std::vector<size_t>> sent(k);
        for (size_t b = 0; b < k; ++b) sent[b].assign(chunks(b), NONE);
        auto forward = [&](size_t b, size_t c) { sent[b][c] = send(at(lo(b, c)), (hi(b, c) - lo(b, c)) * item_, right); };

        for (size_t c = 0; c < chunks(p); ++c) forward(p, c);
        // Steps 0..k-2 reduce-scatter (receive block p-s-1 and reduce it in), then k-1
        // allgather steps (receive block p-t into place). What a step receives is what the
        // next step sends, so each chunk goes on the moment it is ready.
        for (size_t s = 0; s < 2 * (k - 1); ++s) {
            const bool reduce = s < k - 1;
            const size_t b = reduce ? (2 * k + p - s - 1) % k : (2 * k + p - (s - (k - 1))) % k;
            const size_t first = recvs_.size(), n = chunks(b);
            for (size_t c = 0; c < n; ++c) {
                const size_t nbytes = (hi(b, c) - lo(b, c)) * item_;
                if (reduce) {
                    post_recv(scratch + (lo(b, c) - bounds[b]) * item_, nbytes, left);
                } else {
                    if (sent[b][c] != NONE) wait(sends_, sent[b][c], right);
                    post_recv(at(lo(b, c)), nbytes, left);
                }
            }
            // In chunk order, not as they land: the right neighbour matches this step's
            // sends to its receives, all of one tag, in the order it posted them.
            for (size_t c = 0; c < n; ++c) {
                wait(recvs_, first + c, left);
                if (reduce) {
                    const size_t m = hi(b, c) - lo(b, c);
                    cpu::reduce(at(lo(b, c)), scratch + (lo(b, c) - bounds[b]) * item_, m, r_.dt, r_.op);
                    if (s == k - 2 && r_.scale != 1.0) cpu::scale(at(lo(b, c)), m, r_.dt, r_.scale);  // complete here
                }
                if (s + 1 < 2 * (k - 1)) forward(b, c);
            }
        }
        finish(right);
    }

    const Round& r_;
    const size_t item_;
    clock::Patience patience_;  // spins 50 us, yields to 50 ms (the top)
    Scratch scratch_;  // declared before the requests: released after they are cancelled
    mpi::Requests sends_, recvs_;
};

}  // namespace

Outcome allreduce(const Round& round) {
    const size_t k = round.members.size();
    if (round.me >= k || round.tags.size() != k)
        throw std::invalid_argument("partial allreduce: one tag per member, and this rank among them");
    if (round.chunk_bytes == 0 || round.chunk_bytes > INT32_MAX || round.direct_bytes > INT32_MAX)
        throw std::invalid_argument("partial allreduce: chunk_bytes in [1, 2^31) and direct_bytes below 2^31");
    if (k < 2 || round.count == 0) {
        if (round.scale != 1.0) cpu::scale(round.data, round.count, round.dt, round.scale);
        return {};
    }
    return Exchange(round).run();
}

}  // namespace pycoll::partial
