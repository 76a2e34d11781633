// `weightd demo`: the story so far on a generated model. Until the daemon
// lands it shows what exists: generate a checkpoint, validate it, and time a
// full read against `cat` of the same files.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "cli/output.h"
#include "format/checkpoint.h"
#include "format/synthetic.h"
#include "io/read_many.h"

namespace weightd::cli {
namespace {

struct DemoOptions {
  std::string dir;
  std::string size = "512M";
  bool keep = false;
};

// `cat FILES > /dev/null`, without a shell (paths may hold any character).
bool RunCat(const std::vector<std::string>& paths) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::vector<std::string> args = {"cat"};
  args.insert(args.end(), paths.begin(), paths.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  const int err = posix_spawnp(&pid, "cat", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return false;
  int status = 0;
  return ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Removes the generated checkpoint when the demo ends, however it ends.
class RemoveOnExit {
 public:
  RemoveOnExit(std::string dir, bool keep) : dir_(std::move(dir)), keep_(keep) {}
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;
  ~RemoveOnExit() {
    if (!keep_) io::RemoveFlatDirectory(dir_);
  }

 private:
  std::string dir_;
  bool keep_;
};

double Rate(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

int RunDemo(const DemoOptions& o) {
  auto size = ParseSize(o.size);
  if (!size || *size == 0)
    return ReportError("demo", "--size " + o.size + ": not a size", kExitUsage);
  std::string dir = o.dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/weightd-demo-" + std::to_string(::getpid());
  }

  std::cout << "1. generate a llama-shaped checkpoint of about " << FormatBytes(*size) << " in "
            << dir << "\n";
  format::SyntheticOptions synthetic;
  synthetic.preset = "llama";
  synthetic.size_bytes = *size;
  auto start = std::chrono::steady_clock::now();
  auto plan = format::WriteSyntheticCheckpoint(dir, synthetic);
  if (!plan.ok()) return ReportError("demo", plan.error().message());
  RemoveOnExit cleanup(dir, o.keep);
  std::cout << "   " << plan->tensor_count << " tensors, " << FormatBytes(plan->data_bytes)
            << " in " << plan->shards.size() << " shards, " << SecondsSince(start) << " s\n";

  std::cout << "2. inspect: read and validate every header\n";
  start = std::chrono::steady_clock::now();
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), dir);
  if (!ckpt.ok()) return ReportError("demo", ckpt.error().message());
  std::cout << "   valid: " << ckpt->tensor_count() << " tensors in " << ckpt->shards.size()
            << " shards, index checked, " << SecondsSince(start) * 1e3 << " ms\n";

  std::vector<std::string> paths;
  for (const auto& s : ckpt->shards) {
    paths.push_back(s.path);
  }

  std::cout << "3. full read, page cache warm (the floor under any cold load)\n";
  io::ReadStats stats;
  start = std::chrono::steady_clock::now();
  Status read = io::ReadFilesFully(io::PosixFileSystem(), paths, io::StreamOptions{}, &stats);
  const double ours = SecondsSince(start);
  if (!read.ok()) return ReportError("demo", read.error().message());
  start = std::chrono::steady_clock::now();
  const bool cat_ok = RunCat(paths);
  const double theirs = SecondsSince(start);
  std::cout << "   weightd io: " << FormatBytes(stats.bytes) << " in " << stats.reads << " reads, "
            << ours << " s (" << Rate(stats.bytes, ours) << " GB/s)\n";
  if (cat_ok) {
    std::cout << "   cat:        " << theirs << " s (" << Rate(stats.bytes, theirs)
              << " GB/s); weightd/cat throughput ratio " << theirs / ours << "\n";
  }

  std::cout
      << "\nNext (not built yet): `weightd serve` keeps this model resident, and a restarting\n"
         "engine maps it in milliseconds instead of reading it again.\n";
  if (o.keep) std::cout << "kept " << dir << "\n";
  return kExitOk;
}

}  // namespace

Command AddDemoCommand(CLI::App& root) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* app = root.add_subcommand("demo", "Show what weightd does, on a generated model.");
  app->add_option("--dir", o->dir,
                  "where to generate the model (default: a new folder under $TMPDIR)");
  app->add_option("--size", o->size, "model size (default 512M)");
  app->add_flag("--keep", o->keep, "keep the generated model");
  return {app, [o] { return RunDemo(*o); }};
}

}  // namespace weightd::cli
