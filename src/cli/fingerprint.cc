// `weightd fingerprint PATH [--mode sampled|full] [--json] [--no-cache] [--max-inflight N]`
#include "fingerprint/fingerprint.h"

#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>

#include "cli/output.h"
#include "protocol/paths.h"

namespace weightd::cli {
namespace {

struct FingerprintCommandOptions {
  std::string path;
  std::string mode = "sampled";
  bool json = false;
  bool no_cache = false;
  bool no_coalesce = false;
  int max_inflight = 512;
};

int RunFingerprint(const FingerprintCommandOptions& o) {
  fingerprint::Options options;
  options.mode = fingerprint::ModeNamed(o.mode);
  options.max_inflight = o.max_inflight;
  options.coalesce = !o.no_coalesce;
  std::unique_ptr<fingerprint::StatCache> cache;
  if (!o.no_cache) {
    cache = fingerprint::StatCache::Load(fingerprint::StatCache::DefaultDirectory());
    options.cache = cache.get();
  }
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), o.path, options);
  if (!fp.ok()) return ReportError("fingerprint", fp.error().message());
  if (cache) {
    // A cache that cannot be written costs the next run its shortcut, not
    // this run its answer.
    if (Status saved = cache->Save(); !saved.ok()) {
      std::cerr << "weightd: warning: " << Printable(saved.error().message()) << "\n";
    }
    // Found when opened, by a lookup, or by the save.
    if (const std::string w = cache->warning(); !w.empty()) {
      std::cerr << "weightd: warning: " << Printable(w) << "\n";
    }
  }

  if (o.json) {
    nlohmann::json shards = nlohmann::json::array();
    for (const auto& s : fp->shards) {
      shards.push_back({{"name", protocol::PathToJson(s.name)},
                        {"digest", s.digest},
                        {"bytes", s.file_bytes},
                        {"tensors", s.tensors},
                        {"cached", s.cached}});
    }
    nlohmann::json out = {{"path", protocol::PathToJson(o.path)},
                          {"digest", fp->digest},
                          {"mode", std::string(fingerprint::ModeName(fp->mode))},
                          {"shards", fp->shards.size()},
                          {"shard_digests", shards},
                          {"tensors", fp->tensors},
                          {"reads", fp->reads},
                          {"bytes_read", fp->bytes_read},
                          {"cache_hits", fp->cache_hits},
                          {"round_trips", fp->round_trips},
                          {"seconds", fp->seconds}};
    std::cout << DumpJson(out, 2) << "\n";
  } else {
    std::cout << fp->digest << "\n";
    std::cerr << Count(fp->shards.size(), "shard") << ", " << Count(fp->tensors, "tensor")
              << " read, " << Count(fp->reads, "read") << ", " << FormatBytes(fp->bytes_read)
              << ", " << fp->cache_hits << " from the stat cache, " << FormatSeconds(fp->seconds)
              << "\n";
    if (fp->mode == fingerprint::Mode::kFull) {
      for (const auto& s : fp->shards)
        std::cerr << "  " << s.digest << "  " << Printable(s.name) << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

Command AddFingerprintCommand(CLI::App& root) {
  auto o = std::make_shared<FingerprintCommandOptions>();
  CLI::App* app = root.add_subcommand(
      "fingerprint",
      "Print the checkpoint's content key and what it cost. sampled (default) hashes each\n"
      "shard's size, header and the first 1 KiB of every tensor; full is SHA-256 of every byte\n"
      "(the per-file value model hubs list). Unchanged shards are answered from a stat cache\n"
      "in $WEIGHTD_CACHE_DIR (else $XDG_CACHE_HOME/weightd, else ~/.cache/weightd).");
  app->add_option("PATH", o->path, "a checkpoint directory or .safetensors file")
      ->required()
      ->check(NotEmpty("name a checkpoint directory or .safetensors file"));
  app->add_option("--mode", o->mode, "sampled | full")->check(CLI::IsMember({"sampled", "full"}));
  app->add_flag(
      "--json", o->json,
      "print JSON: path, digest, mode, shards, shard_digests, tensors, reads, bytes_read,\n"
      "cache_hits, round_trips, seconds (docs/cli.md)");
  app->add_flag("--no-cache", o->no_cache, "neither use nor update the stat cache");
  app->add_option("--max-inflight", o->max_inflight, "reads outstanding at once (default 512)")
      ->check(CLI::Range(1, 4096));
  app->add_flag("--no-coalesce", o->no_coalesce, "one read per sample, never merged");
  return {app, [o] { return RunFingerprint(*o); }};
}

}  // namespace weightd::cli
