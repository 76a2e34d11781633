// `weightd demo`: the story so far on a generated model. Until the daemon
// lands it shows what exists: generate a checkpoint, validate it, and time a
// full read against `cat` of the same files.
#include <CLI/CLI.hpp>
#include <unistd.h>

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

double Rate(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

int RunDemo(const DemoOptions& o) {
  auto size = ParseSize(o.size);
  if (!size || *size == 0) return ReportError("demo", "--size " + o.size + ": not a size", kExitUsage);
  std::string dir = o.dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/weightd-demo-" + std::to_string(::getpid());
  }

  std::cout << "1. generate a llama-shaped checkpoint of about " << FormatBytes(*size) << " in " << dir << "\n";
  format::SyntheticOptions synthetic;
  synthetic.preset = "llama";
  synthetic.size_bytes = *size;
  auto start = std::chrono::steady_clock::now();
  auto plan = format::WriteSyntheticCheckpoint(dir, synthetic);
  if (!plan.ok()) return ReportError("demo", plan.error().message());
  std::cout << "   " << plan->tensor_count << " tensors, " << FormatBytes(plan->data_bytes) << " in "
            << plan->shards.size() << " shards, " << SecondsSince(start) << " s\n";

  std::cout << "2. inspect: read and validate every header\n";
  start = std::chrono::steady_clock::now();
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), dir);
  if (!ckpt.ok()) return ReportError("demo", ckpt.error().message());
  std::cout << "   valid: " << ckpt->tensor_count() << " tensors in " << ckpt->shards.size()
            << " shards, index checked, " << SecondsSince(start) * 1e3 << " ms\n";

  std::vector<std::string> paths;
  std::string cat = "cat";
  for (const auto& s : ckpt->shards) {
    paths.push_back(s.path);
    cat += " '" + s.path + "'";
  }
  cat += " > /dev/null";

  std::cout << "3. full read, page cache warm (the floor under any cold load)\n";
  io::ReadStats stats;
  start = std::chrono::steady_clock::now();
  Status read = io::ReadFilesFully(io::PosixFileSystem(), paths, io::StreamOptions{}, &stats);
  const double ours = SecondsSince(start);
  if (!read.ok()) return ReportError("demo", read.error().message());
  start = std::chrono::steady_clock::now();
  const int cat_status = std::system(cat.c_str());
  const double theirs = SecondsSince(start);
  std::cout << "   weightd io: " << FormatBytes(stats.bytes) << " in " << stats.reads << " reads, " << ours
            << " s (" << Rate(stats.bytes, ours) << " GB/s)\n";
  if (cat_status == 0) {
    std::cout << "   cat:        " << theirs << " s (" << Rate(stats.bytes, theirs)
              << " GB/s); weightd/cat throughput ratio " << theirs / ours << "\n";
  }

  std::cout << "\nNext (not built yet): `weightd serve` keeps this model resident, and a restarting\n"
               "engine maps it in milliseconds instead of reading it again.\n";
  if (!o.keep) {
    for (const auto& p : paths) ::unlink(p.c_str());
    ::unlink(io::JoinPath(dir, std::string(format::kIndexFileName)).c_str());
    ::rmdir(dir.c_str());
  } else {
    std::cout << "kept " << dir << "\n";
  }
  return kExitOk;
}

}  // namespace

Command AddDemoCommand(CLI::App& root) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* app = root.add_subcommand("demo", "Show what weightd does, on a generated model.");
  app->add_option("--dir", o->dir, "where to generate the model (default: a new folder under $TMPDIR)");
  app->add_option("--size", o->size, "model size (default 512M)");
  app->add_flag("--keep", o->keep, "keep the generated model");
  return {app, [o] { return RunDemo(*o); }};
}

}  // namespace weightd::cli
