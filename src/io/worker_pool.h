// A process-wide set of threads for blocking I/O, kept between calls. On a
// latency-bound file system weightd keeps hundreds of reads in flight, each
// a blocking call on its own thread; creating those threads anew for every
// batch cost 0.1-0.9 ms each on a 2-core VM (50-100 ms per batch of a few
// hundred), on the critical path. The pool keeps them between batches, and
// can grow in the background while the caller still waits on the network;
// threads beyond kKeptThreads end once idle for a while (a minute), so a
// burst leaves no hundreds behind for good.
//
// Thread safety: all members may be called from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>

namespace weightd::io {

class WorkerPool {
 public:
  // The process's pool; never destroyed (its kept threads live as long as
  // the process and sleep when there is no work). A child of fork() gets a
  // new one, with threads of its own.
  static WorkerPool& Shared();

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Starts growing the pool to `threads` (at most kMaxThreads) on a
  // background thread, and returns at once.
  void Reserve(int threads);

  // Runs body(slot) for slot = 0 .. workers-1, at most `workers` at once:
  // slot 0 on the calling thread, the others on pool threads (created here
  // when too few are idle). Returns when every slot has run. A slot that
  // throws (an allocation refused) ends there; the others run on, and once
  // all have ended the first exception is rethrown here, on the caller's
  // thread. So a body whose slots wait for each other must not throw while
  // another may be waiting on it.
  void RunTeam(int workers, const std::function<void(int slot)>& body);

  int threads() const;
  // Threads waiting for work now.
  int idle_threads() const;

  // How long a thread beyond kKeptThreads waits for work before it ends
  // (60 s): a burst of reads in flight (hundreds, on a network file
  // system) leaves no hundreds of threads behind for good.
  void set_idle_exit(std::chrono::milliseconds after);

  static constexpr int kMaxThreads = 2048;
  static constexpr int kKeptThreads = 64;

 private:
  WorkerPool() = default;

  struct Team {
    const std::function<void(int)>* body = nullptr;
    int slots = 0;
    int next_slot = 1;  // slot 0 is the caller's
    int running = 0;
    std::exception_ptr thrown;  // the first slot's that threw; guarded by mu_
  };

  // Runs one slot; what it threw, or null.
  static std::exception_ptr RunSlot(const Team& team, int slot);

  // Creates up to n threads; returns how many it created (fewer when the
  // system refuses or kMaxThreads is reached). REQUIRES: mu_ not held.
  int Spawn(int n);
  void WorkerLoop();
  // Claims an unclaimed slot of any team; REQUIRES: mu_ held.
  bool Claim(Team** team, int* slot);

  pid_t owner_ = 0;  // the process whose threads these are
  mutable std::mutex mu_;
  std::condition_variable work_;
  std::condition_variable done_;
  std::deque<Team*> teams_;
  int threads_ = 0;
  int idle_ = 0;
  int unclaimed_ = 0;  // slots queued for pool threads and not yet claimed
  int reserve_target_ = 0;
  std::chrono::milliseconds idle_exit_{60'000};
  uint64_t idle_exit_changes_ = 0;                      // set_idle_exit calls
  std::chrono::steady_clock::time_point last_reserve_;  // the latest Reserve call
  bool reserving_ = false;
};

}  // namespace weightd::io
