#include "io/worker_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <optional>
#include <system_error>
#include <thread>

namespace weightd::io {

WorkerPool& WorkerPool::Shared() {
  // Never destroyed: its threads outlive statics. A child of fork() has
  // none of them, while its copy of the pool counts them (and its lock may
  // have been held by one of them): the child makes a pool of its own.
  static std::atomic<WorkerPool*> current{nullptr};
  const pid_t pid = ::getpid();
  WorkerPool* pool = current.load(std::memory_order_acquire);
  while (pool == nullptr || pool->owner_ != pid) {
    auto* fresh = new WorkerPool();
    fresh->owner_ = pid;
    if (current.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread of this process made one first
  }
  return *pool;
}

int WorkerPool::threads() const {
  std::lock_guard lock(mu_);
  return threads_;
}

int WorkerPool::idle_threads() const {
  std::lock_guard lock(mu_);
  return idle_;
}

void WorkerPool::set_idle_exit(std::chrono::milliseconds after) {
  {
    std::lock_guard lock(mu_);
    idle_exit_ = after;
    ++idle_exit_changes_;
  }
  work_.notify_all();  // waits begun under the old setting start over
}

int WorkerPool::Spawn(int n) {
  for (int i = 0; i < n; ++i) {
    {
      std::lock_guard lock(mu_);
      if (threads_ >= kMaxThreads) return i;
      ++threads_;
    }
    try {
      std::thread([this] { WorkerLoop(); }).detach();
    } catch (...) {
      // Out of threads (a pid limit, say) or of memory: work with the ones
      // there are.
      std::lock_guard lock(mu_);
      --threads_;
      return i;
    }
  }
  return n;
}

void WorkerPool::Reserve(int threads) {
  std::lock_guard lock(mu_);
  last_reserve_ = std::chrono::steady_clock::now();
  reserve_target_ = std::max(reserve_target_, std::min(threads, kMaxThreads));
  if (reserving_ || threads_ >= reserve_target_) return;
  reserving_ = true;
  try {
    std::thread([this] {
      while (true) {
        {
          std::lock_guard inner(mu_);
          if (threads_ >= reserve_target_) {
            reserving_ = false;
            return;
          }
        }
        if (Spawn(1) == 0) {
          // The system will not give us more: stop trying, keep what we have.
          std::lock_guard inner(mu_);
          reserve_target_ = threads_;
          reserving_ = false;
          return;
        }
      }
    }).detach();
  } catch (...) {
    reserving_ = false;
  }
}

bool WorkerPool::Claim(Team** team, int* slot) {
  for (Team* t : teams_) {
    if (t->next_slot < t->slots) {
      *team = t;
      *slot = t->next_slot++;
      ++t->running;
      --unclaimed_;
      return true;
    }
  }
  return false;
}

void WorkerPool::WorkerLoop() {
  ::pthread_setname_np(::pthread_self(), "weightd-io");
  std::unique_lock lock(mu_);
  // When this thread may end if it has had no work since: set when it goes
  // idle, kept across wake-ups that bring it none (a slot another thread took),
  // set anew when set_idle_exit changes the while.
  std::optional<std::chrono::steady_clock::time_point> idle_until;
  uint64_t idle_setting = 0;
  while (true) {
    Team* team;
    int slot;
    if (!Claim(&team, &slot)) {
      const auto now = std::chrono::steady_clock::now();
      if (!idle_until || idle_setting != idle_exit_changes_) {
        idle_until = now + idle_exit_;
        idle_setting = idle_exit_changes_;
      }
      // Idle that long, with no growth asked for lately (a Reserve's
      // threads wait for a team on its way), one of more than are kept, and
      // no work queued: this one ends.
      const bool due = now >= *idle_until && now >= last_reserve_ + idle_exit_;
      if (due && threads_ > kKeptThreads && unclaimed_ == 0 && !reserving_) {
        --threads_;
        reserve_target_ = std::min(reserve_target_, threads_);
        return;
      }
      if (due) idle_until = now + idle_exit_;  // kept for now: another while
      ++idle_;
      work_.wait_until(lock, std::max(*idle_until, last_reserve_ + idle_exit_));
      --idle_;
      continue;
    }
    idle_until.reset();
    lock.unlock();
    std::exception_ptr thrown = RunSlot(*team, slot);
    lock.lock();
    if (thrown && !team->thrown) team->thrown = std::move(thrown);
    --team->running;
    done_.notify_all();
  }
}

std::exception_ptr WorkerPool::RunSlot(const Team& team, int slot) {
  try {
    (*team.body)(slot);
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

void WorkerPool::RunTeam(int workers, const std::function<void(int)>& body) {
  if (workers <= 1) {
    body(0);
    return;
  }
  Team team;
  team.body = &body;
  team.slots = workers;
  int missing, wake;
  {
    std::lock_guard lock(mu_);
    teams_.push_back(&team);
    // Idle threads may already be promised to other teams' slots.
    unclaimed_ += workers - 1;
    missing = unclaimed_ - idle_;
    wake = std::min(workers - 1, idle_);
  }
  // One idle thread per slot, not all of them: after a Reserve hundreds are
  // idle, and a fingerprint on a slow mount starts a small team per shard.
  // Waking every idle thread for each (66 teams, 512 threads, all to contend
  // for mu_) cost a third more CPU on a 2-core VM, and 20-40 ms of its time.
  for (int i = 0; i < wake; ++i) work_.notify_one();
  if (missing > 0) Spawn(std::min(missing, workers - 1));

  // The team stays listed, and `team` alive, until every claimed slot has
  // ended: a slot that throws here must not unwind past the others.
  std::exception_ptr thrown = RunSlot(team, 0);
  std::unique_lock lock(mu_);
  if (thrown && !team.thrown) team.thrown = std::move(thrown);
  // Slots no thread has claimed yet run here, so a short pool never stalls.
  while (team.next_slot < team.slots) {
    const int slot = team.next_slot++;
    --unclaimed_;
    lock.unlock();
    thrown = RunSlot(team, slot);
    lock.lock();
    if (thrown && !team.thrown) team.thrown = std::move(thrown);
  }
  done_.wait(lock, [&] { return team.running == 0; });
  teams_.erase(std::find(teams_.begin(), teams_.end(), &team));
  if (team.thrown) std::rethrow_exception(team.thrown);
}

}  // namespace weightd::io
