// Helpers shared by the tests: temporary directories, whole-file I/O, and
// running the real weightd binary as a separate process.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/file.h"
#include "memory/segment.h"

namespace weightd::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents when
// the object goes away.
class TempDir {
 public:
  TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<std::byte> ReadFileBytes(const std::string& path);
void WriteFileBytes(const std::string& path, const std::vector<std::byte>& bytes);
void WriteFileText(const std::string& path, const std::string& text);
std::vector<std::byte> Bytes(const std::string& text);

// A file system that passes every call to the real one, for a test to
// override what it watches or slows down.
class PassThroughFileSystem : public io::FileSystem {
 public:
  using io::FileSystem::Open;
  Result<std::unique_ptr<io::RandomAccessFile>> Open(const std::string& p,
                                                     io::Symlinks symlinks) override {
    return base_.Open(p, symlinks);
  }
  using io::FileSystem::Stat;
  Result<io::StatSignature> Stat(const std::string& p, io::Symlinks symlinks) override {
    return base_.Stat(p, symlinks);
  }
  Result<bool> IsDirectory(const std::string& p) override { return base_.IsDirectory(p); }
  Result<bool> Exists(const std::string& p) override { return base_.Exists(p); }
  Result<std::vector<io::DirEntry>> ListDirectory(const std::string& p) override {
    return base_.ListDirectory(p);
  }
  Result<std::string> RealPath(const std::string& p) override { return base_.RealPath(p); }

 protected:
  io::FileSystem& base_ = io::PosixFileSystem();
};

// A file that passes every call to another, for a test to override.
class PassThroughFile : public io::RandomAccessFile {
 public:
  explicit PassThroughFile(std::unique_ptr<io::RandomAccessFile> f) : f_(std::move(f)) {}
  const std::string& path() const override { return f_->path(); }
  uint64_t size() const override { return f_->size(); }
  Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
    return f_->ReadExactly(offset, dst);
  }
  Result<io::StatSignature> Stat() const override { return f_->Stat(); }

 private:
  std::unique_ptr<io::RandomAccessFile> f_;
};

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs the weightd binary under test with `args`, in `cwd` when given.
CommandResult RunWeightd(const std::vector<std::string>& args, const std::string& cwd = "");
// Runs the program `args[0]` (found on $PATH) with the rest as arguments.
CommandResult RunCommand(std::vector<std::string> args, const std::string& cwd = "");

// The weightd binary running in the background (a daemon, an engine that
// holds its weights), its output going to files.
class Process {
 public:
  // `prefix` runs before the binary (e.g. {"setpriv", "--reuid=65534", ...}).
  explicit Process(const std::vector<std::string>& args,
                   const std::vector<std::string>& prefix = {});
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process();  // SIGKILL if still running

  int pid() const { return pid_; }
  // Waits until stdout holds `text`; false if `seconds` passed, and
  // std::runtime_error if the process exited first.
  bool WaitForOutput(const std::string& text, double seconds = 60);
  void Signal(int sig);
  // SIGSTOP, and waits until every thread has stopped (call it on a running
  // process: one stopped already never reports again). A stop is not done
  // when kill() returns: until the thread the kernel picked gets a core,
  // the others run on (and serve) on a busy machine.
  void Stop();
  // Waits for the exit; the exit code, or 128 + signal.
  int Wait();
  // Whether it exits within `seconds` (Wait then returns its code at once).
  bool Exits(double seconds);
  std::string out() const;
  std::string err() const;

 private:
  TempDir io_;
  int pid_ = -1;
  int exit_code_ = -1;
};

// Polls `condition` every 20 ms for up to `seconds`; whether it came true.
bool Eventually(const std::function<bool()>& condition, double seconds = 30);

// Whether `p`'s stderr holds `text` within `seconds`: a daemon's log is
// written by a thread of its own, a moment after what it tells of.
bool Logged(const Process& p, const std::string& text, double seconds = 10);

// An exclusive lock on a file under /tmp, held for as long as this lives:
// how a test keeps apart from other processes (this binary run in
// parallel, the bench) that use or change the same machine-wide thing.
class LockFile {
 public:
  LockFile() = default;
  ~LockFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;

  // Takes the lock, waiting for it unless `wait` is false; whether it has
  // it (errno says why not).
  bool Take(const char* path, bool wait) {
    if (fd_ < 0) fd_ = ::open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) return false;
    int locked;
    while ((locked = ::flock(fd_, wait ? LOCK_EX : LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    return locked == 0;
  }

 private:
  int fd_ = -1;
};

// Held by a test that runs processes as `nobody` (uid 65534), for as long
// as it lives: the kernel counts a user's tasks across every process of
// that user, so one such test's daemon would use up the task limit
// another sets for its own (the test binary runs in parallel with itself).
class NobodysTurn {
 public:
  NobodysTurn() {
    // Without the lock the test would fail by chance, far from the cause.
    if (!lock_.Take(kPath, /*wait=*/true)) {
      throw std::runtime_error(std::string("cannot lock ") + kPath + ": " + std::strerror(errno));
    }
  }

 private:
  static constexpr const char* kPath = "/tmp/weightd-test-nobody.lock";
  LockFile lock_;
};

std::string ConformanceDir();
std::string SourceDir();

// A control group under this test's own in the v1 memory hierarchy
// (mounted whole, as on this project's machines), so that its limit is
// found through an ancestor walk and its use stays within the runner's;
// removed when it goes, once the processes in it are gone. `skip` says why
// none could be made here, `error` what went wrong.
struct MemoryGroup {
  std::string path, skip, error;
  explicit MemoryGroup(uint64_t limit) {
    if (::geteuid() != 0) {
      skip = "needs root to make a control group";
      return;
    }
    std::string own;
    std::ifstream in("/proc/self/cgroup");
    for (std::string line; std::getline(in, line);) {
      const size_t at = line.find(":memory:");
      if (at != std::string::npos) own = line.substr(at + 8);
    }
    if (own.empty()) {
      skip = "no cgroup v1 memory hierarchy";
      return;
    }
    if (own == "/") own.clear();
    static int made = 0;
    const std::string dir = "/sys/fs/cgroup/memory" + own + "/weightd-test-" +
                            std::to_string(::getpid()) + "-" + std::to_string(made++);
    if (::mkdir(dir.c_str(), 0755) != 0) {
      const int e = errno;
      (e == ENOENT || e == EROFS || e == EACCES || e == EPERM ? skip : error) =
          "cannot make a control group " + dir + ": " + std::strerror(e);
      return;
    }
    path = dir;
    WriteFileText(path + "/memory.limit_in_bytes", std::to_string(limit));
  }
  ~MemoryGroup() {
    if (!path.empty()) ::rmdir(path.c_str());
  }
  // What runs a command in the group. Under AddressSanitizer, with a small
  // quarantine and no leak check at exit: freed memory the sanitizer holds
  // back, and the leak checker's own at exit, count against the limit too,
  // and under a parallel test run pushed these processes over it (an
  // engine killed after it had refused its copy). The limits are for
  // weightd's memory; a build without the sanitizer ignores the variable.
  std::vector<std::string> Prefix() const {
    return {"sh", "-c",
            "echo $$ > " + path +
                "/cgroup.procs && export ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}"
                "quarantine_size_mb=8:detect_leaks=0\" && exec \"$@\"",
            "sh"};
  }
  // How many processes the kernel killed for the group's memory.
  int OomKills() const {
    std::ifstream in(path + "/memory.oom_control");
    for (std::string key, value; in >> key >> value;) {
      if (key == "oom_kill") return std::stoi(value);
    }
    return -1;
  }
  // What the group holds and how close it came to its limit, for a failed
  // check's message: whether the kernel killed something there, and for
  // which kind of memory.
  std::string Describe() const {
    std::string out = "control group " + path + ":";
    for (const char* file : {"memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.failcnt",
                             "memory.limit_in_bytes"}) {
      std::ifstream in(path + "/" + file);
      std::string value;
      in >> value;
      out += std::string(" ") + file + "=" + value;
    }
    out += " oom_kill=" + std::to_string(OomKills());
    std::ifstream stat(path + "/memory.stat");
    for (std::string key, value; stat >> key >> value;) {
      if (key == "rss" || key == "cache" || key == "shmem" || key == "mapped_file") {
        out += " " + key + "=" + value;
      }
    }
    return out;
  }
};

// The system's pool of 2 MiB pages (what MFD_HUGE_2MB takes from), raised
// for one test and put back after. Needs root and room the kernel can find
// for the pages; with overcommitted (surplus) pages, a short pool is not
// short, and the test's fallback case cannot be made. The change is made
// under a lock file (two test runs at once would each restore the other's
// value) and undone by this object, in the test's own process (checks that
// may crash run in a child or another process). Tests that use it are named
// HugePagePool* and run alone in their ctest (RUN_SERIAL): other tests'
// segments would take the pages. Another test run on the same machine at
// the same moment could still take them, or get some.
class HugePagePool {
 public:
  static constexpr const char* kDir = "/sys/kernel/mm/hugepages/hugepages-2048kB/";

  static long Read(const char* knob) {
    std::ifstream in(std::string(kDir) + knob);
    long value = -1;
    return in >> value ? value : -1;
  }
  // Pages free and not promised to a mapping already.
  static long Available() { return Read("free_hugepages") - Read("resv_hugepages"); }

  // Raises the pool by `pages`; why not, when it cannot (empty when it did).
  std::string Raise(long pages) {
    if (Read("nr_overcommit_hugepages") != 0) return "the pool is overcommitted or missing";
    if (!lock_.Take("/tmp/weightd-huge-page-test.lock", /*wait=*/true)) return "no lock file";
    old_ = Read("nr_hugepages");
    if (old_ < 0 || !(std::ofstream(std::string(kDir) + "nr_hugepages") << old_ + pages)) {
      old_ = -1;
      return "the pool cannot be raised here (needs root)";
    }
    if (Available() < pages) return "the kernel found no room for the pages";
    return "";
  }
  ~HugePagePool() {
    if (old_ >= 0) std::ofstream(std::string(kDir) + "nr_hugepages") << old_;
  }

 private:
  LockFile lock_;  // let go after the pool is put back
  long old_ = -1;
};

// Sets the kernel's policy for transparent huge pages in memfds and shared
// memory for as long as it lives, then puts back what was there. Tests that
// use it run alone in ctest; against other processes (a second test run,
// the bench) it holds a lock they take too, and gives up where one holds it.
class ShmemHugePagePolicy {
 public:
  ShmemHugePagePolicy() = default;
  ShmemHugePagePolicy(const ShmemHugePagePolicy&) = delete;
  ShmemHugePagePolicy& operator=(const ShmemHugePagePolicy&) = delete;

  static std::string Current() { return memory::ShmemHugePagePolicy(); }

  // Why the policy could not be set (empty when it was).
  std::string Set(const std::string& policy) {
    if (old_.empty()) {
      old_ = Current();
      if (old_.empty()) return "this kernel has no shmem huge page policy";
      if (::access(memory::kShmemHugePagePolicyPath, W_OK) != 0) {
        old_.clear();
        return "the shmem huge page policy cannot be set here (needs root)";
      }
      if (!lock_.Take(kLock, /*wait=*/false)) {
        old_.clear();
        return "another process is changing the shmem huge page policy";
      }
    }
    if (!Write(policy) || Current() != policy) {
      return "the shmem huge page policy cannot be set here (needs root)";
    }
    changed_ = true;
    return "";
  }
  ~ShmemHugePagePolicy() {
    if (changed_ && !Write(old_)) {
      std::fprintf(stderr, "could not put the shmem huge page policy back to %s\n", old_.c_str());
    }
  }

  // Taken by whoever changes the policy: these tests and the bench.
  static constexpr const char* kLock = "/tmp/weightd-shmem-policy.lock";

 private:
  static bool Write(const std::string& policy) {
    std::ofstream knob(memory::kShmemHugePagePolicyPath);
    knob << policy;
    knob.close();  // written now, not when it goes
    return static_cast<bool>(knob);
  }

  std::string old_;
  bool changed_ = false;  // put old_ back: some Set wrote the policy
  LockFile lock_;         // let go after the policy is put back
};

}  // namespace weightd::testing
