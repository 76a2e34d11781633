// Many engines attaching at once, against one alone: the rounds that
// cache_bench reports and attach_burst runs on another machine (the GPU
// machine's many cores, by scripts/gpu-check). Each engine is
// bench/attach_probe: started first, waiting on a pipe, then woken with the
// others, so what is timed is the attach and not a process start-up.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"

namespace bench {

// CPU time (user and system) a process has used so far, every thread of it,
// ended ones too: its CPU clock, or /proc's count in clock ticks (10 ms)
// where the clock cannot be read; nullopt when neither can (it is gone).
inline std::optional<double> TryProcessCpuSeconds(pid_t pid) {
  clockid_t clock;
  timespec t{};
  if (::clock_getcpuclockid(pid, &clock) == 0 && ::clock_gettime(clock, &t) == 0) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
  }
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return std::nullopt;
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  // After the command name's closing parenthesis: state is field 3,
  // utime and stime are fields 14 and 15.
  const char* at = std::strrchr(buf, ')');
  unsigned long long utime = 0, stime = 0;
  if (n == 0 || at == nullptr ||
      std::sscanf(at + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
                  &stime) != 2) {
    return std::nullopt;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

inline double ProcessCpuSeconds(pid_t pid) {
  const std::optional<double> seconds = TryProcessCpuSeconds(pid);
  if (!seconds) Die("bench", "cannot read the CPU time of process " + std::to_string(pid));
  return *seconds;
}

// CPU time the hypervisor has taken from this machine's CPUs so far (steal,
// /proc/stat's eighth figure of the `cpu` line; 0 on bare metal).
inline double StolenSeconds() {
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return 0;
  unsigned long long v[8] = {};
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
                            &v[3], &v[4], &v[5], &v[6], &v[7]);
  std::fclose(f);
  if (n != 8) return 0;
  return static_cast<double>(v[7]) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// The cores this process may run on (its affinity: a container's cpuset,
// not the machine's count).
inline long UsableCores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(CPU_COUNT(&set), 1);
  return std::max(::sysconf(_SC_NPROCESSORS_ONLN), 1L);
}

// Seconds on the monotonic clock, which every process on the machine shares
// (steady_clock is CLOCK_MONOTONIC on Linux).
inline double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct AttachRound {
  // Each engine's attach as it timed it, from its own wake-up (its read
  // returning) to its weights; and from the release to its weights, the
  // wait for a first turn on a core included.
  std::vector<double> seconds;
  std::vector<double> since_release;
  double wall = 0;         // from the release to the last engine's answer
  double engines_cpu = 0;  // the engines' own, in their attaches
  double daemon_cpu = 0;   // the daemon's meanwhile
  double stolen = 0;       // by the hypervisor meanwhile
};

// Starts `n` engines (`probe` MODEL SOCKET_DIR), lets them settle, wakes
// them all at once, and collects what each says; every one must have been
// served by the daemon (pid `daemon`). On any failure every engine is
// ended before the error.
inline AttachRound AttachAll(const std::string& probe, const std::string& model,
                             const std::string& socket_dir, int n, pid_t daemon) {
  int go[2];
  if (::pipe2(go, O_CLOEXEC) != 0) Die("bench", "pipe");
  std::vector<Child> engines;
  for (int i = 0; i < n; ++i) {
    engines.push_back(SpawnWithStdin({probe, model, socket_dir}, go[0], /*keep_stderr=*/true));
  }
  ::close(go[0]);
  ::usleep(500'000);  // every engine started and waiting
  AttachRound round;
  const std::string bytes(static_cast<size_t>(n), 'x');
  const double stolen_before = StolenSeconds();
  const std::optional<double> daemon_before = TryProcessCpuSeconds(daemon);
  const double released = MonotonicSeconds();
  // A byte each, then the pipe closed. Linux's pipe readers wait in turn
  // (since 5.5): a write wakes one, which wakes the next only once it has
  // read, so the engines would start one after another. The last write end
  // closing (ours: the engines' copies are closed on exec) wakes them all.
  const bool written = ::write(go[1], bytes.data(), bytes.size()) == n;
  ::close(go[1]);
  std::string failure = written ? "" : "cannot release the engines";
  for (Child& e : engines) {
    // "SECONDS CPU_SECONDS END_MONOTONIC_SECONDS SOURCE"
    const std::string out = ReadOutput(e);
    std::istringstream fields(out);
    double seconds = 0, cpu = 0, end = 0;
    std::string source;
    if (!(fields >> seconds >> cpu >> end >> source) || source != "daemon") {
      if (failure.empty()) failure = "an engine did not attach from the daemon: `" + out + "`";
      continue;
    }
    round.seconds.push_back(seconds);
    round.since_release.push_back(end - released);
    round.engines_cpu += cpu;
  }
  round.wall = MonotonicSeconds() - released;
  round.stolen = StolenSeconds() - stolen_before;
  const std::optional<double> daemon_after = TryProcessCpuSeconds(daemon);
  if (daemon_before && daemon_after) {
    round.daemon_cpu = *daemon_after - *daemon_before;
  } else if (failure.empty()) {
    failure = "cannot read the daemon's CPU time (process " + std::to_string(daemon) + ")";
  }
  // All attached and holding their weights (or failed); now let them go.
  for (const Child& e : engines) {
    if (e.pid <= 0) continue;
    ::kill(e.pid, SIGTERM);
    ::waitpid(e.pid, nullptr, 0);
  }
  if (!failure.empty()) Die("bench", failure);
  return round;
}

// What rounds of one engine alone and of many at once come to.
struct AttachSummary {
  double alone = 0;  // median
  double p50 = 0, p99 = 0;
  // The same p99 without the rounds the hypervisor took CPU time in; 0 when
  // every round or none lost some.
  double p99_undisturbed = 0;
  int disturbed = 0;
  double stolen = 0;
  // From the release: p99 of when each engine had its weights.
  double p99_since_release = 0;
  // A round's CPU time, engines' and daemon's (means), and that spread
  // over the cores: a lower bound on the time the round's work took, and
  // about what an engine sharing the cores fairly with all the others,
  // from the release to its end, would take.
  double engines_cpu = 0, daemon_cpu = 0, share = 0;
  // Cores from which that share would be within 5x one alone, if an attach
  // cost there what it cost here.
  double cores_for_5x = 0;
};

inline AttachSummary Summarize(const std::vector<double>& alone,
                               const std::vector<AttachRound>& rounds, long cores) {
  AttachSummary s;
  s.alone = Median(alone);
  if (rounds.empty()) return s;
  std::vector<double> all, undisturbed, since_release;
  for (const AttachRound& r : rounds) {
    all.insert(all.end(), r.seconds.begin(), r.seconds.end());
    since_release.insert(since_release.end(), r.since_release.begin(), r.since_release.end());
    s.stolen += r.stolen;
    s.engines_cpu += r.engines_cpu / static_cast<double>(rounds.size());
    s.daemon_cpu += r.daemon_cpu / static_cast<double>(rounds.size());
    if (r.stolen > 0) {
      ++s.disturbed;
    } else {
      undisturbed.insert(undisturbed.end(), r.seconds.begin(), r.seconds.end());
    }
  }
  s.p50 = Percentile(all, 50);
  s.p99 = Percentile(all, 99);
  s.p99_since_release = Percentile(since_release, 99);
  if (s.disturbed > 0 && !undisturbed.empty()) s.p99_undisturbed = Percentile(undisturbed, 99);
  const double round_cpu = s.engines_cpu + s.daemon_cpu;
  s.share = round_cpu / static_cast<double>(std::max(cores, 1L));
  if (s.alone > 0) s.cores_for_5x = std::ceil(round_cpu / (5 * s.alone));
  return s;
}

}  // namespace bench
