// 64 engines attaching at once against one alone, by itself: what
// cache_bench reports, for a machine that runs only this (scripts/gpu-check
// on its many cores). Prints `key: value` lines, times in milliseconds.
//
//   attach_burst PROBE MODEL SOCKET_DIR DAEMON_PID [ROUNDS]
//
// PROBE is bench/attach_probe; MODEL must be resident in the daemon
// listening in SOCKET_DIR, whose pid is DAEMON_PID (for its CPU time).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "attach_rounds.h"

int main(int argc, char** argv) {
  if (argc < 5 || argc > 6) {
    std::fprintf(stderr, "usage: attach_burst PROBE MODEL SOCKET_DIR DAEMON_PID [ROUNDS]\n");
    return 2;
  }
  const std::string probe = argv[1], model = argv[2], socket_dir = argv[3];
  const pid_t daemon = static_cast<pid_t>(std::stol(argv[4]));
  const int rounds_wanted = argc == 6 ? std::stoi(argv[5]) : 10;
  if (rounds_wanted < 1) bench::Die("attach_burst", "ROUNDS must be at least 1");
  constexpr int kEngines = 64;
  std::vector<double> alone;
  std::vector<bench::AttachRound> rounds;
  for (int i = 0; i < rounds_wanted; ++i) {
    alone.push_back(bench::AttachAll(probe, model, socket_dir, 1, daemon).seconds[0]);
    rounds.push_back(bench::AttachAll(probe, model, socket_dir, kEngines, daemon));
  }
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  const bench::AttachSummary s = bench::Summarize(alone, rounds, cores);
  std::printf("cores: %ld\n", cores);
  std::printf("engines: %d\n", kEngines);
  std::printf("rounds: %d\n", rounds_wanted);
  std::printf("attach_alone_ms: %.3f\n", s.alone * 1e3);
  std::printf("attach_p50_ms: %.3f\n", s.p50 * 1e3);
  std::printf("attach_p99_ms: %.3f\n", s.p99 * 1e3);
  std::printf("attach_p99_undisturbed_ms: %.3f\n", s.p99_undisturbed * 1e3);
  std::printf("attach_rounds_disturbed: %d\n", s.disturbed);
  std::printf("attach_round_cpu_ms: %.3f\n", (s.engines_cpu + s.daemon_cpu) * 1e3);
  std::printf("attach_share_ms: %.3f\n", s.share * 1e3);
  std::printf("attach_cores_for_5x: %.0f\n", s.cores_for_5x);
  return 0;
}
