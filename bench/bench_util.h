// What the benchmark programs share: dying with a message, medians, timing,
// and running other programs (weightd itself, cp, dd) as child processes.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace bench {

[[noreturn]] inline void Die(const std::string& program, const std::string& what) {
  std::cerr << program << ": error: " << what << "\n";
  std::exit(1);
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The p-th percentile (0..100), nearest rank.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  size_t rank = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size()) + 0.999999);
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

template <typename F>
double TimeIt(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A child running argv, its stdout in a pipe; stderr goes to /dev/null
// unless `keep_stderr`.
struct Child {
  pid_t pid = -1;
  int out = -1;
};

inline Child SpawnWithStdin(const std::vector<std::string>& argv, int stdin_fd,
                            bool keep_stderr = false) {
  int pipe_fds[2];
  // Close-on-exec: a later child must not hold this one's pipe open.
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) Die("bench", "pipe");
  Child c;
  c.pid = ::fork();
  if (c.pid < 0) Die("bench", "cannot start " + argv[0] + ": fork failed");
  if (c.pid == 0) {
    if (stdin_fd >= 0) ::dup2(stdin_fd, 0);
    ::dup2(pipe_fds[1], 1);
    ::close(pipe_fds[0]);
    if (!keep_stderr) {
      int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 2);
    }
    std::vector<char*> args;
    std::vector<std::string> copy = argv;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  c.out = pipe_fds[0];
  return c;
}

inline Child Spawn(const std::vector<std::string>& argv, bool keep_stderr = false) {
  return SpawnWithStdin(argv, -1, keep_stderr);
}

// Everything the child writes on stdout until it closes it.
inline std::string ReadOutput(Child& c) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(c.out, buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  ::close(c.out);
  c.out = -1;
  return out;
}

// Waits for the child; its stdout, or death if it failed.
inline std::string Finish(Child c, const std::string& what) {
  std::string out = ReadOutput(c);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("bench", what + " failed");
  return out;
}

// What touching a fresh 4 KiB page of anonymous memory costs here, in
// microseconds (the median of 3 runs of 20,000 pages). Cold loads,
// preloads, cp into /dev/shm and an engine's attach all take fresh pages,
// and on a virtual machine that cost moves with the host's load (1-2 us on
// an idle one, ten times that on a busy one): the tables print it so that a
// run on a slow day can be told from a slower weightd.
inline double FreshPageMicros() {
  constexpr size_t kPages = 20'000, kPage = 4096;
  std::vector<double> runs;
  for (int r = 0; r < 3; ++r) {
    void* m =
        ::mmap(nullptr, kPages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) Die("bench", "cannot map memory to time page faults");
    ::madvise(m, kPages * kPage, MADV_NOHUGEPAGE);  // 4 KiB faults, whatever the policy
    auto* p = static_cast<volatile char*>(m);
    runs.push_back(TimeIt([&] {
      for (size_t i = 0; i < kPages; ++i) p[i * kPage] = 1;
    }));
    ::munmap(m, kPages * kPage);
  }
  return Median(runs) / kPages * 1e6;
}

inline std::string RunCapture(const std::vector<std::string>& argv) {
  return Finish(Spawn(argv), argv[0]);
}

}  // namespace bench
