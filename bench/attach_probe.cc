// One engine for the concurrent-attach benchmark: starts, waits until it
// reads a byte on stdin (its parent writes one per engine and then closes
// the pipe, which wakes all of them together: 64 attach at the same moment,
// with process start-up out of the picture), acquires the model through the
// C++ API and prints the seconds the acquire took and where the weights came
// from, then holds the weights until it is sent SIGTERM. Beside the seconds,
// the CPU time this process spent in the acquire (user and system): what the
// engine side of an attach costs the machine.
//
//   attach_probe MODEL SOCKET_DIR
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>

#include "weightd/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: attach_probe MODEL SOCKET_DIR\n");
    return 2;
  }
  char go;
  if (::read(0, &go, 1) != 1) return 1;
  auto cpu_seconds = [] {
    timespec t{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
  };
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  weightd::AcquireOptions options;
  options.socket_dir = argv[2];
  options.log = [](const std::string&) {};
  auto weights = weightd::Acquire({.path = argv[1]}, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu = cpu_seconds() - cpu_start;
  if (!weights.ok()) {
    std::fprintf(stderr, "attach_probe: %s\n", weights.error().message().c_str());
    return 1;
  }
  std::printf("%.9f %.9f %s\n", seconds, cpu, std::string((*weights)->source()).c_str());
  // Stay attached, as an engine does, until the parent ends us (SIGTERM):
  // the others' attaches should not share the cores with 63 process exits.
  // (Reading stdin again would take the start bytes meant for the others.)
  std::fflush(stdout);
  ::close(1);
  while (true) ::pause();
}
