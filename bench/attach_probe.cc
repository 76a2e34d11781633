// One engine for the concurrent-attach benchmark: starts, waits until its
// parent writes a byte on stdin (so 64 of them attach at the same moment,
// with process start-up out of the picture), acquires the model through the
// C++ API and prints the seconds the acquire took and where the weights came
// from, then holds the weights until it is sent SIGTERM.
//
//   attach_probe MODEL SOCKET_DIR
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "weightd/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: attach_probe MODEL SOCKET_DIR\n");
    return 2;
  }
  char go;
  if (::read(0, &go, 1) != 1) return 1;
  const auto start = std::chrono::steady_clock::now();
  weightd::AcquireOptions options;
  options.socket_dir = argv[2];
  options.log = [](const std::string&) {};
  auto weights = weightd::Acquire({.path = argv[1]}, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!weights.ok()) {
    std::fprintf(stderr, "attach_probe: %s\n", weights.error().message().c_str());
    return 1;
  }
  std::printf("%.9f %s\n", seconds, std::string((*weights)->source()).c_str());
  // Stay attached, as an engine does, until the parent ends us (SIGTERM):
  // the others' attaches should not share the cores with 63 process exits.
  // (Reading stdin again would take the start bytes meant for the others.)
  std::fflush(stdout);
  ::close(1);
  while (true) ::pause();
}
