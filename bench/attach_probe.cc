// One engine for the concurrent-attach benchmark: starts, waits until it
// reads a byte on stdin (its parent writes one per engine and then closes
// the pipe, which wakes all of them together: 64 become runnable at the
// same moment, with process start-up out of the picture), acquires the
// model through the C++ API, and prints one line:
//
//   SECONDS CPU_SECONDS END SOURCE
//
// the seconds the acquire took from its read returning, the CPU time this
// process spent in it (user and system: the engine side of an attach), the
// monotonic clock when it ended (every process shares that clock, so the
// parent can time it from the release), and where the weights came from.
// Then it holds the weights until it is sent SIGTERM.
//
//   attach_probe MODEL SOCKET_DIR
#include <unistd.h>

#include <cstdio>

#include "attach_rounds.h"
#include "weightd/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: attach_probe MODEL SOCKET_DIR\n");
    return 2;
  }
  char go;
  if (::read(0, &go, 1) != 1) return 1;
  // The parent's clock, so that it can time this attach from its release.
  const double start = bench::MonotonicSeconds();
  const double cpu_start = bench::ProcessCpuSeconds(::getpid());
  weightd::AcquireOptions options;
  options.socket_dir = argv[2];
  options.log = [](const std::string&) {};
  // A miss is a failed round, not a disk load held by 64 engines.
  options.fallback = false;
  auto weights = weightd::Acquire({.path = argv[1]}, options);
  const double end = bench::MonotonicSeconds();
  const double cpu = bench::ProcessCpuSeconds(::getpid()) - cpu_start;
  if (!weights.ok()) {
    std::fprintf(stderr, "attach_probe: %s\n", weights.error().message().c_str());
    return 1;
  }
  std::printf("%.9f %.9f %.9f %s\n", end - start, cpu, end,
              std::string((*weights)->source()).c_str());
  // Stay attached, as an engine does, until the parent ends us (SIGTERM):
  // the others' attaches should not share the cores with 63 process exits.
  // (Reading stdin again would take the start bytes meant for the others.)
  std::fflush(stdout);
  ::close(1);
  while (true) ::pause();
}
