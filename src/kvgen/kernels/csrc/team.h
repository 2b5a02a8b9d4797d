// A thread team kept for the length of one multi-op kernel call (kvgen.decoder_layers): the OpenMP threads are forked
// once for the call, and inside it kvgen::parallel_for hands each range to the team's waiting threads through two
// atomics instead of forking an OpenMP region per op. A batch-1 decode step runs ~150 parallel ops; on a 2-core VM
// (AMD EPYC) an empty OpenMP region of 2 threads cost 0.7-1.0 us and a round trip between two threads through atomics
// 0.05-0.12 us, both in a loop of 20,000 in plain C++.
// parallel_for splits a range as at::parallel_for does (parallel only past `grain` items, at most one contiguous
// chunk per thread), and every op computes each output in one fixed order, so the numbers do not change.
#pragma once

#include <immintrin.h>
#include <omp.h>
#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#include "aten_lite.h"

namespace kvgen {

class Team {
 public:
  // Runs body() on the calling thread while the other threads of one OpenMP region wait for parallel_for work; plain
  // body() (each op forking its own OpenMP region) with one thread, inside a parallel region or a team, with more
  // threads than the CPUs this process may use, or while another thread of the process runs a team: waiting threads
  // spin, and spinning next to more threads than cores made a decode 6-8x slower (libgomp throttles its own spinning
  // there). Rethrows body's exception.
  template <class Body>
  static void run(const Body& body) {
    if (at::get_num_threads() <= 1 || at::get_num_threads() > usable_cpus() || at::in_parallel_region() ||
        lead() != nullptr)
      return body();
    static std::atomic<int> num_running{0};  // teams running in this process
    struct Claim {
      bool is_first = num_running.fetch_add(1) == 0;
      ~Claim() { num_running.fetch_sub(1); }
    } claim;
    if (!claim.is_first) return body();
    Team team;
    std::exception_ptr error;
#pragma omp parallel
    {
      if (omp_get_thread_num() == 0) {
        team.size_ = std::min(omp_get_num_threads(), kMaxThreads);
        lead() = &team;
        try {
          body();
        } catch (...) {
          error = std::current_exception();
        }
        lead() = nullptr;
        team.exit_ = true;
        team.epoch_.fetch_add(1, std::memory_order_release);
      } else if (omp_get_thread_num() < kMaxThreads) {
        team.work(omp_get_thread_num());
      }
    }
    if (error) std::rethrow_exception(error);
  }

  // The team whose body this thread runs; null elsewhere (and on the team's other threads).
  static Team*& lead() {
    static thread_local Team* team = nullptr;
    return team;
  }

  int size() const { return size_; }
  bool busy() const { return busy_; }

  // f(b, e) over contiguous chunks of [begin, end), one per thread, as at::parallel_for splits them.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t range = end - begin;
    if (range <= 0) return;
    const int64_t n = std::min<int64_t>(size_, grain > 0 ? (range + grain - 1) / grain : size_);
    if (range <= grain || n <= 1) return f(begin, end);
    call_ = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    fn_ = &f;
    begin_ = begin, end_ = end, chunk_ = (range + n - 1) / n, num_chunks_ = n;
    const uint64_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
    epoch_.store(epoch, std::memory_order_release);
    std::exception_ptr error;
    busy_ = true;  // a parallel_for inside f runs inline, as inside an OpenMP region
    try {
      f(begin, std::min(end, begin + chunk_));
    } catch (...) {
      error = std::current_exception();
    }
    busy_ = false;
    for (int t = 1; t < size_; ++t) {  // every thread acknowledges every job before the next overwrites it
      for (uint32_t spins = 0; slots_[t].done.load(std::memory_order_acquire) != epoch;) pause(spins);
      if (slots_[t].error && !error) error = slots_[t].error;
      slots_[t].error = nullptr;
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  static constexpr int kMaxThreads = 64;
  // A wait spins (the other thread is a few microseconds away), and past 2^10 pauses (tens of microseconds) also
  // yields the core: with more runnable threads than cores (a server's event loop, a client beside it) the thread
  // waited for may be the one descheduled. Decode measured the same as with 2^14 (249 vs 248 tok/s, 4 pairs).
  static void pause(uint32_t& spins) {
    _mm_pause();
    if (++spins >= (1u << 10)) std::this_thread::yield();
  }

  // CPUs this process may run on (its affinity mask on Linux).
  static int usable_cpus() {
    static const int count = [] {
#ifdef __linux__
      cpu_set_t set;
      if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
      return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }();
    return count;
  }

  struct alignas(64) Slot {
    std::atomic<uint64_t> done{0};
    std::exception_ptr error;
  };

  // A waiting thread: runs its chunk of each posted job (if the job has one) and acknowledges it, until exit.
  void work(int tid) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t epoch;
      for (uint32_t spins = 0; (epoch = epoch_.load(std::memory_order_acquire)) == seen;) pause(spins);
      seen = epoch;
      if (exit_) return;
      const int64_t b = begin_ + tid * chunk_;
      if (tid < num_chunks_ && b < end_) {
        try {
          at::internal::ThreadIdGuard guard(tid);
          call_(fn_, b, std::min(end_, b + chunk_));
        } catch (...) {
          slots_[tid].error = std::current_exception();
        }
      }
      slots_[tid].done.store(epoch, std::memory_order_release);
    }
  }

  alignas(64) std::atomic<uint64_t> epoch_{0};
  void (*call_)(const void*, int64_t, int64_t) = nullptr;  // the posted job: call_(fn_, b, e) on chunk [b, e)
  const void* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0, num_chunks_ = 0;
  bool exit_ = false;
  int size_ = 1;
  bool busy_ = false;
  Slot slots_[kMaxThreads];
};

// Whether a parallel_for here goes to a team's threads (a split then costs ~0.1 us, not an OpenMP fork).
inline bool in_team() {
  const Team* team = Team::lead();
  return team != nullptr && !team->busy();
}

// at::parallel_for, through the running team's threads when this thread leads one.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (in_team()) return Team::lead()->parallel_for(begin, end, grain, f);
  at::parallel_for(begin, end, grain, f);
}

// Threads a parallel_for here may use: the team's, or at::get_num_threads().
inline int64_t num_threads() {
  const Team* team = Team::lead();
  return team != nullptr ? team->size() : at::get_num_threads();
}

}  // namespace kvgen
