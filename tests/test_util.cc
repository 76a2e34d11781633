#include "test_util.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace weightd::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/weightd-test-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::byte> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return Bytes(s);
}

void WriteFileBytes(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void WriteFileText(const std::string& path, const std::string& text) {
  WriteFileBytes(path, Bytes(text));
}

std::vector<std::byte> Bytes(const std::string& text) {
  std::vector<std::byte> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<std::byte>(text[i]);
  return out;
}

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// In a child: SIGKILL when the test process dies, however it dies. A test
// that aborts (a sanitizer's report, a crash) leaves no daemon behind
// holding the test runner's output pipe open, which would hang the run.
void DieWithTheTest(pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);  // it died before the line above
}

// What waitpid's status says: the exit code, or 128 + the signal.
int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// waitpid, again when a signal interrupts it; false when it fails (the
// status, untouched, would read as an exit with 0).
bool WaitPid(pid_t pid, int* status, int options) {
  while (::waitpid(pid, status, options) != pid) {
    if (errno != EINTR) return false;
  }
  return true;
}

// Every test ends with the environment it started with. Tests set
// variables for the processes they start (a stat cache directory, the
// emulated CUDA driver's library path); run all in one process, as the
// test binary does without a filter, one test's must not reach the next.
class RestoreEnvironment : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo&) override {
    saved_.clear();
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) saved_.emplace_back(*e);
  }
  void OnTestEnd(const ::testing::TestInfo&) override {
    ::clearenv();
    for (const std::string& entry : saved_) {
      const size_t eq = entry.find('=');
      if (eq == std::string::npos) continue;
      ::setenv(entry.substr(0, eq).c_str(), entry.c_str() + eq + 1, 1);
    }
  }
  std::vector<std::string> saved_;
};

[[maybe_unused]] const bool kEnvironmentRestored = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new RestoreEnvironment);
  // Daemons the tests start tell no service manager this run is under
  // that they are ready; a test that wants it names its own socket.
  ::unsetenv("NOTIFY_SOCKET");
  return true;
}();

}  // namespace

CommandResult RunWeightd(const std::vector<std::string>& args, const std::string& cwd) {
  std::vector<std::string> all = {WEIGHTD_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  return RunCommand(all, cwd);
}

CommandResult RunCommand(std::vector<std::string> all, const std::string& cwd) {
  TempDir io;
  const std::string out_path = io.Join("stdout"), err_path = io.Join("stderr");
  const pid_t parent = ::getpid();
  // Built before the fork: a test's other threads may hold the allocator's
  // locks at that moment, and the child would wait for them for ever.
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    DieWithTheTest(parent);
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(out, 1);
    ::dup2(err, 2);
    if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  if (!WaitPid(pid, &status, 0)) throw std::runtime_error("waitpid failed");
  CommandResult r;
  r.exit_code = ExitCode(status);
  r.out = Slurp(out_path);
  r.err = Slurp(err_path);
  return r;
}

Process::Process(const std::vector<std::string>& args, const std::vector<std::string>& prefix) {
  const std::string out_path = io_.Join("stdout"), err_path = io_.Join("stderr");
  const pid_t parent = ::getpid();
  // Built before the fork, as in RunWeightd.
  std::vector<std::string> all = prefix;
  all.push_back(WEIGHTD_BINARY);
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    DieWithTheTest(parent);
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    // Signals as a shell in a terminal leaves them, whatever the test runner
    // ignores (a prefix such as nohup changes them again).
    ::signal(SIGHUP, SIG_DFL);
    ::signal(SIGINT, SIG_DFL);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  // Readable by a child that drops privileges (setpriv) too.
  ::chmod(io_.path().c_str(), 0777);
}

Process::~Process() {
  if (exit_code_ < 0 && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status;
    (void)WaitPid(pid_, &status, 0);  // no throwing here
  }
}

bool Process::WaitForOutput(const std::string& text, double seconds) {
  return Eventually(
      [&] {
        if (out().find(text) != std::string::npos) return true;
        if (exit_code_ < 0) {
          int status = 0;
          if (::waitpid(pid_, &status, WNOHANG) == pid_) {
            exit_code_ = ExitCode(status);
          }
        }
        if (exit_code_ >= 0) throw std::runtime_error("exited before printing `" + text + "`");
        return false;
      },
      seconds);
}

void Process::Signal(int sig) {
  if (exit_code_ < 0) ::kill(pid_, sig);
}

void Process::Stop() {
  if (exit_code_ >= 0) throw std::runtime_error("cannot stop a process that has exited");
  ::kill(pid_, SIGSTOP);
  int status = 0;
  if (!WaitPid(pid_, &status, WUNTRACED)) throw std::runtime_error("waitpid failed");
  if (WIFSTOPPED(status)) return;
  exit_code_ = ExitCode(status);
  throw std::runtime_error("the process ended instead of stopping");
}

int Process::Wait() {
  if (exit_code_ >= 0) return exit_code_;
  int status = 0;
  if (!WaitPid(pid_, &status, 0)) throw std::runtime_error("waitpid failed");
  exit_code_ = ExitCode(status);
  return exit_code_;
}

bool Process::Exits(double seconds) {
  return exit_code_ >= 0 || Eventually(
                                [&] {
                                  int status = 0;
                                  if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
                                  exit_code_ = ExitCode(status);
                                  return true;
                                },
                                seconds);
}

std::string Process::out() const { return Slurp(io_.Join("stdout")); }
std::string Process::err() const { return Slurp(io_.Join("stderr")); }

bool Logged(const Process& p, const std::string& text, double seconds) {
  return Eventually([&] { return p.err().find(text) != std::string::npos; }, seconds);
}

bool Eventually(const std::function<bool()>& condition, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    ::usleep(20'000);
  }
  return condition();
}

std::string ConformanceDir() {
  const char* env = std::getenv("WEIGHTD_CONFORMANCE_DIR");
  return env && *env ? env : WEIGHTD_CONFORMANCE_DIR;
}

std::string SourceDir() { return WEIGHTD_SOURCE_DIR; }

}  // namespace weightd::testing
