// 64 engines attaching at once against one alone, by itself: what
// cache_bench reports, for a machine that runs only this (scripts/gpu-check
// on its many cores). Prints `key: value` lines, times in milliseconds.
//
//   attach_burst PROBE MODEL SOCKET_DIR DAEMON_PID [ROUNDS]
//
// PROBE is bench/attach_probe; MODEL must be resident in the daemon
// listening in SOCKET_DIR, whose pid is DAEMON_PID (for its CPU time).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attach_rounds.h"

namespace {

constexpr int kEngines = 64;

// A whole decimal number in [1, max], or 0.
long Positive(const char* text, long max) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < 1 || v > max) return 0;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage = "usage: attach_burst PROBE MODEL SOCKET_DIR DAEMON_PID [ROUNDS]\n";
  if (argc < 5 || argc > 6) {
    std::fputs(usage, stderr);
    return 2;
  }
  const std::string probe = argv[1], model = argv[2], socket_dir = argv[3];
  const auto daemon = static_cast<pid_t>(Positive(argv[4], 1 << 30));
  const int rounds_wanted = argc == 6 ? static_cast<int>(Positive(argv[5], 1000)) : 10;
  if (daemon == 0 || rounds_wanted == 0) {
    std::fprintf(stderr, "attach_burst: DAEMON_PID and ROUNDS must be whole numbers above 0\n%s",
                 usage);
    return 2;
  }
  if (::kill(daemon, 0) != 0) {
    std::fprintf(stderr, "attach_burst: no process %d to be the daemon\n", daemon);
    return 2;
  }
  std::vector<double> alone;
  std::vector<bench::AttachRound> rounds;
  for (int i = 0; i < rounds_wanted; ++i) {
    alone.push_back(bench::AttachAll(probe, model, socket_dir, 1, daemon).seconds[0]);
    rounds.push_back(bench::AttachAll(probe, model, socket_dir, kEngines, daemon));
  }
  const long cores = bench::UsableCores();
  const bench::AttachSummary s = bench::Summarize(alone, rounds, cores);
  std::printf("attach_cores: %ld\n", cores);
  std::printf("attach_engines: %d\n", kEngines);
  std::printf("attach_rounds: %d\n", rounds_wanted);
  std::printf("attach_alone_ms: %.3f\n", s.alone * 1e3);
  std::printf("attach_p50_ms: %.3f\n", s.p50 * 1e3);
  std::printf("attach_p99_ms: %.3f\n", s.p99 * 1e3);
  std::printf("attach_p99_since_release_ms: %.3f\n", s.p99_since_release * 1e3);
  std::printf("attach_rounds_with_cpu_stolen: %d\n", s.disturbed);
  if (s.p99_undisturbed > 0) {
    std::printf("attach_p99_without_stolen_rounds_ms: %.3f\n", s.p99_undisturbed * 1e3);
  }
  std::printf("attach_round_cpu_ms: %.3f\n", (s.engines_cpu + s.daemon_cpu) * 1e3);
  std::printf("attach_round_engines_cpu_ms: %.3f\n", s.engines_cpu * 1e3);
  std::printf("attach_round_daemon_cpu_ms: %.3f\n", s.daemon_cpu * 1e3);
  std::printf("attach_share_ms: %.3f\n", s.share * 1e3);
  std::printf("attach_cores_for_5x: %.0f\n", s.cores_for_5x);
  return 0;
}
