// weightd's own CUDA segment (src/memory/cuda.h) on a real GPU, the way the
// daemon and an engine will use it: this process creates a segment, fills
// it from host memory with many threads, seals and exports it; a child
// process imports the descriptor, maps it read-only, reads it back and
// compares; then this process lets go of its segment and the child reads
// again. Prints `key: value` lines.
//
//   cuda_segment_check [--mib N]
//
// Exit: 0 every check passed; 1 one failed; 3 no GPU here (no driver, or
// one that sees no device).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "memory/cuda.h"

namespace {

using namespace weightd;

std::byte Pattern(uint64_t i) { return static_cast<std::byte>(i * 131 + 7); }

bool HoldsPattern(const memory::CudaMapping& m, uint64_t size) {
  std::vector<std::byte> back(static_cast<size_t>(size));
  if (Status s = m.ReadBack(0, back); !s.ok()) {
    std::printf("error: %s\n", s.error().message().c_str());
    return false;
  }
  for (uint64_t i = 0; i < size; ++i) {
    if (back[i] != Pattern(i)) return false;
  }
  return true;
}

// The child: imports, reads, tells the parent, waits for it to let go,
// reads again.
int Importer(int fd, uint64_t size, const std::string& uuid, int to_parent, int from_parent) {
  auto m = memory::MapCudaSegment(memory::UniqueFd(fd), size, uuid);
  if (!m.ok()) {
    std::printf("error: import: %s\n", m.error().message().c_str());
    return 1;
  }
  std::printf("importer_read_only: %s\n",
              (*m)->read_only() ? "granted" : "refused (mapped read-write)");
  const bool first = HoldsPattern(**m, size);
  std::printf("importer_reads_exporter_bytes: %s\n", first ? "match" : "DIFFER");
  std::fflush(stdout);
  char c = 0;
  if (::write(to_parent, "m", 1) != 1 || ::read(from_parent, &c, 1) != 1) return 1;
  const bool after = HoldsPattern(**m, size);
  std::printf("bytes_after_exporter_let_go: %s\n", after ? "match" : "DIFFER");
  return first && after ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::strcmp(argv[1], "--import") == 0) {
    return Importer(std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10), argv[4],
                    std::atoi(argv[5]), std::atoi(argv[6]));
  }
  uint64_t mib = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--mib") == 0) mib = std::strtoull(argv[i + 1], nullptr, 10);
  }
  // What a fresh process pays before any weights move: the driver loaded,
  // cuInit, and a GPU's context made (with the smallest segment). Engines
  // pay it whether their weights come from the daemon or from disk.
  const auto start = std::chrono::steady_clock::now();
  auto devices = memory::ListCudaDevices();
  if (!devices.ok()) {
    const std::string why = devices.error().message();
    std::printf("gpu: none (%s)\n", why.c_str());
    const bool absent = why.starts_with("no CUDA driver") || why.starts_with("no CUDA device") ||
                        why.starts_with("this weightd was built without");
    return absent ? 3 : 1;
  }
  const memory::CudaDevice& gpu = devices->front();
  if (auto first = memory::CreateCudaSegment(gpu.granularity, gpu.uuid); first.ok()) {
    std::printf("cuda_start_seconds: %.3f\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("gpu: %s %s\ngranularity: %llu\n", gpu.uuid.c_str(), gpu.name.c_str(),
              static_cast<unsigned long long>(gpu.granularity));
  const uint64_t size = mib << 20;
  auto segment = memory::CreateCudaSegment(size, gpu.uuid);
  if (!segment.ok()) {
    std::printf("error: create: %s\n", segment.error().message().c_str());
    return 1;
  }
  // Filled as the loader fills it: 256 KiB writes from several threads.
  std::vector<std::byte> host(static_cast<size_t>(size));
  for (uint64_t i = 0; i < size; ++i) host[i] = Pattern(i);
  constexpr uint64_t kStep = 256 << 10;
  constexpr int kThreads = 8;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> team;
  std::vector<std::string> errors(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    team.emplace_back([&, t] {
      for (uint64_t at = static_cast<uint64_t>(t) * kStep; at < size; at += kThreads * kStep) {
        const uint64_t n = std::min(kStep, size - at);
        if (Status s = (*segment)->Write(at, std::span(host).subspan(at, n)); !s.ok()) {
          errors[t] = s.error().message();
          return;
        }
      }
    });
  }
  for (auto& t : team) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) {
      std::printf("error: write: %s\n", e.c_str());
      return 1;
    }
  }
  if (Status s = (*segment)->Seal(); !s.ok()) {
    std::printf("error: seal: %s\n", s.error().message().c_str());
    return 1;
  }
  const double fill_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fill_gbps: %.2f (%d threads, 256 KiB pageable writes)\n",
              static_cast<double>(size) / 1e9 / fill_s, kThreads);
  auto fd = (*segment)->Export();
  if (!fd.ok()) {
    std::printf("error: export: %s\n", fd.error().message().c_str());
    return 1;
  }
  int up[2], down[2];
  if (::pipe(up) != 0 || ::pipe(down) != 0) return 1;
  // Everything the child needs is made before the fork: between fork and
  // exec it only closes, clears a flag and execs.
  const std::string args[] = {std::to_string(fd->get()), std::to_string(size), gpu.uuid,
                              std::to_string(up[1]), std::to_string(down[0])};
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(up[0]);
    ::close(down[1]);
    ::fcntl(fd->get(), F_SETFD, 0);  // the exported descriptor crosses the exec
    ::execl("/proc/self/exe", argv[0], "--import", args[0].c_str(), args[1].c_str(),
            args[2].c_str(), args[3].c_str(), args[4].c_str(), nullptr);
    ::_exit(127);
  }
  ::close(up[1]);
  ::close(down[0]);
  char c = 0;
  const bool mapped = ::read(up[0], &c, 1) == 1;
  segment->reset();  // unmapped, released, the descriptor closed below
  fd->Reset();
  if (mapped && ::write(down[1], "r", 1) != 1) return 1;
  ::close(down[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  const bool ok = mapped && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::printf("cuda_segment: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
