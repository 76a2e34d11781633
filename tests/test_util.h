// Helpers shared by the tests: temporary directories, whole-file I/O, and
// running the real weightd binary as a separate process.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

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

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs the weightd binary under test with `args`, in `cwd` when given.
CommandResult RunWeightd(const std::vector<std::string>& args, const std::string& cwd = "");

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
  std::string out() const;
  std::string err() const;

 private:
  TempDir io_;
  int pid_ = -1;
  int exit_code_ = -1;
};

// Polls `condition` every 20 ms for up to `seconds`; whether it came true.
bool Eventually(const std::function<bool()>& condition, double seconds = 30);

std::string ConformanceDir();
std::string SourceDir();

}  // namespace weightd::testing
