// `weightd load`: behave as an engine does at start.
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "cli/output.h"
#include "daemon/registry.h"
#include "format/writer.h"
#include "io/file.h"
#include "memory/cuda.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"
#include "transform/plan.h"
#include "weightd/client.h"

namespace weightd::cli {
namespace {

using nlohmann::json;

struct LoadCommandOptions {
  LoadSpec spec;
  protocol::Processing processing;
  std::string mode = "zero_copy";
  std::string trust, socket_dir, save;
  bool no_fallback = false, checksum = false, json = false, populate = false, no_cache = false;
  double hold = 0, wait = 0, reply_timeout = AcquireOptions{}.reply_timeout_seconds;
};

// Writes what the engine received as one safetensors file.
Status SaveWeights(const Weights& w, const std::string& path) {
  std::vector<format::TensorSpec> specs;
  for (const Tensor& t : w.tensors()) {
    auto dtype = format::ParseDType(t.dtype);
    if (!dtype) return Error("tensor `" + std::string(t.name) + "` has an unknown dtype");
    specs.push_back({std::string(t.name), *dtype, {t.shape.begin(), t.shape.end()}});
  }
  WEIGHTD_ASSIGN_OR_RETURN(format::ShardLayout layout,
                           format::LayoutShard(std::move(specs), {{"format", "pt"}}));
  // Off a GPU too: the first error there is kept, and the file removed.
  std::optional<Error> failed;
  WEIGHTD_RETURN_IF_ERROR(format::WriteShard(
      path, layout,
      [&](const format::TensorInfo& t, uint64_t offset, std::span<std::byte> dst) {
        if (failed) return;
        if (Status s = w.CopyToHost(*w.Find(t.name), offset, dst); !s.ok()) failed = s.error();
      },
      {.sparse_prefix = std::nullopt, .replace = false}));
  if (failed) {
    std::filesystem::remove(path);
    return *failed;
  }
  return OkStatus();
}

int RunLoad(LoadCommandOptions& o) {
  auto start = std::chrono::steady_clock::now();
  // Ended by a signal, a --save file half written goes first.
  std::optional<CleanUpOnSignal> on_signal;
  if (!o.save.empty()) on_signal.emplace();
  if (Status s = FinishProcessingFlags(o.processing); !s.ok()) {
    return ReportError("load", s.error().message(), kExitUsage);
  }
  o.spec.tp_size = o.processing.tp_size;
  o.spec.tp_rank = o.processing.tp_rank;
  o.spec.dtype = o.processing.dtype;
  o.spec.quant = o.processing.quant;
  o.spec.shard_plan = o.processing.shard_plan;
  o.spec.device = o.processing.device;
  // An engine has started CUDA before it asks for its weights: that time
  // (the driver, which resolving cuda:N starts, and the GPU's context: a
  // tenth of a second and more on an H200) is told apart from the load's.
  // A device that does not resolve, or will not start, is left to the
  // load to report.
  std::unique_ptr<memory::CudaContextHold> cuda;
  std::optional<double> cuda_start_seconds;
  const auto cuda_start = std::chrono::steady_clock::now();
  // This rank's device: --device may name one per rank.
  const std::string device_name = protocol::CheckSupported(o.processing).ok()
                                      ? protocol::DeviceOfRank(o.processing, o.processing.tp_rank)
                                      : o.spec.device;
  if (auto device = memory::ResolveDevice(device_name);
      device.ok() && device->kind == memory::DeviceKind::kCuda) {
    if (auto held = memory::HoldCudaContext(device->uuid); held.ok()) {
      cuda = std::move(*held);
      cuda_start_seconds = SecondsSince(cuda_start);
      start = std::chrono::steady_clock::now();
    }
  }
  AcquireOptions ao;
  ao.mode = o.mode == "copy" ? AcquireMode::kCopy : AcquireMode::kZeroCopy;
  ao.fallback = !o.no_fallback;
  ao.wait_for_daemon_seconds = o.wait;
  ao.reply_timeout_seconds = o.reply_timeout;
  double waited = 0;
  ao.waited_seconds = &waited;
  ao.populate = o.populate;
  ao.trust = o.trust;
  ao.socket_dir = o.socket_dir;
  ao.stat_cache = !o.no_cache;
  ao.fingerprint = o.processing.fingerprint;
  AcquireOptions::Miss miss;
  ao.miss = &miss;
  // Refused before anything is loaded: not a file the user has, and never
  // a shard of the checkpoint itself.
  if (!o.save.empty()) {
    struct stat st;
    if (::lstat(o.save.c_str(), &st) == 0) {
      return ReportError("load --save",
                         S_ISDIR(st.st_mode)
                             ? o.save + " is a directory; --save names the file to write (" +
                                   io::JoinPath(o.save, "weights.safetensors") + ", say)"
                             : o.save + " exists; --save writes a new file (remove it first)",
                         kExitUsage);
    }
    if (errno != ENOENT) {
      return ReportError("load --save", o.save + ": " + std::strerror(errno), kExitUsage);
    }
    // Nor a file that could not be written: a folder missing or shut.
    const std::string parent = io::DirName(o.save);
    if (::access(parent.c_str(), W_OK | X_OK) != 0) {
      return ReportError(
          "load --save",
          o.save + ": cannot create a file in " + parent + ": " + std::strerror(errno), kExitUsage);
    }
  }
  auto weights = Acquire(o.spec, ao);
  // With --json, a failure is one document on stdout too, as a success is:
  // a script reads why, and what differed, from it.
  auto fail = [&](const std::string& command, const std::string& why) {
    if (o.json) {
      std::cout << DumpJson({{"path", protocol::PathToJson(o.spec.path)},
                             {"source", nullptr},
                             {"error", why},
                             {"miss_kind", MissKindName(miss.kind)},
                             {"reason", miss.reason},
                             {"mismatch", miss.fields},
                             {"mismatch_details", miss.mismatch}},
                            2)
                << std::endl;
    }
    return ReportError(command, why);
  };
  if (!weights.ok()) return fail("load", weights.error().message());
  const double seconds = SecondsSince(start);
  const Weights& w = **weights;
  std::string checksum;
  if (o.checksum) {
    auto sum = w.Checksum();
    if (!sum.ok()) return fail("load --checksum", sum.error().message());
    checksum = *sum;
  }
  if (!o.save.empty()) {
    if (Status s = SaveWeights(w, o.save); !s.ok()) return fail("load --save", s.error().message());
  }

  if (o.json) {
    json out = {
        {"path", protocol::PathToJson(o.spec.path)},
        {"source", std::string(w.source())},
        {"reason", w.reason()},
        {"miss_kind", MissKindName(w.miss_kind())},
        {"mismatch", w.mismatch_fields()},
        {"mismatch_details", w.mismatch()},
        {"tensors", w.tensors().size()},
        {"bytes", w.bytes()},
        {"seconds", seconds},
        {"waited_seconds", waited},
        {"cuda_start_seconds", cuda_start_seconds ? json(*cuda_start_seconds) : json(nullptr)},
        {"checkpoint", w.checkpoint_digest()},
        {"device", w.device()},
        {"mode", w.mode() == AcquireMode::kZeroCopy ? "zero_copy" : "copy"},
        {"trusted", w.trusted().empty() ? json(nullptr) : json(w.trusted())}};
    if (o.checksum) out["checksum"] = checksum;
    out["saved"] = o.save.empty() ? json(nullptr) : protocol::PathToJson(o.save);
    std::cout << DumpJson(out, 2) << std::endl;
  } else {
    std::cout << "source: " << w.source() << ", " << Printable(w.reason()) << "\n"
              << Count(w.tensors().size(), "tensor") << ", " << FormatBytes(w.bytes()) << " in "
              << FormatSeconds(seconds) << (w.device() == "host" ? "" : " on " + w.device());
    if (waited > 0) std::cout << " (" << FormatSeconds(waited) << " of it waiting for the daemon)";
    if (cuda_start_seconds) {
      std::cout << " (CUDA started before it, in " << FormatSeconds(*cuda_start_seconds) << ")";
    }
    std::cout << "\n";
    if (o.checksum) std::cout << "checksum: " << checksum << "\n";
    if (!o.save.empty()) std::cout << "saved: " << Printable(o.save) << "\n";
    std::cout << std::flush;
  }
  if (o.hold > 0) {
    // Keep the view (and its lease) as an engine would, then prove the
    // bytes are still the same (the daemon may have died meanwhile).
    std::this_thread::sleep_for(std::chrono::duration<double>(o.hold));
    if (o.checksum) {
      auto sum = w.Checksum();
      if (!sum.ok()) return ReportError("load --hold", sum.error().message());
      const std::string again = *sum;
      if (again != checksum) {
        return ReportError("load", "the weights changed while held: " + again);
      }
      // With --json, stdout holds one document: the line goes to stderr.
      (o.json ? std::cerr : std::cout)
          << (o.json ? "weightd: " : "") << "checksum after hold: " << again << " (unchanged)\n"
          << std::flush;
    }
  }
  return kExitOk;
}

}  // namespace

void AddProcessingFlags(CLI::App& app, protocol::Processing& p, bool placement) {
  p.shard_plan.clear();  // told apart from a plan given (FinishProcessingFlags)
  app.add_option("--tp-size", p.tp_size, "tensor-parallel ranks (needs --shard-plan above 1)")
      ->check(CLI::Range(1, 1024));
  if (placement) {
    app.add_option("--tp-rank", p.tp_rank, "this engine's rank (preload makes every rank)")
        ->check(CLI::Range(0, 1023));
  }
  app.add_option("--dtype", p.dtype, "keep | bf16 | fp16 | fp32: cast floating-point weights")
      ->check(CLI::IsMember({"keep", "bf16", "fp16", "fp32"}));
  app.add_option("--quant", p.quant,
                 "none | fp8-block: column and row layers to F8_E4M3 with 128x128 block scales")
      ->check(CLI::IsMember({"none", "fp8-block"}));
  app.add_option("--shard-plan,--plan", p.shard_plan,
                 "llama | replicate | FILE (TOML rules): how tensors split across ranks")
      ->check(NotEmpty());
  if (placement) {
    app.add_option("--device", p.device,
                   "cpu | cuda:N (this process's numbering) | cuda:GPU-<uuid>: where the weights "
                   "are kept; or one per rank, comma-separated (rank r on the r-th)");
    app.add_option("--fingerprint", p.fingerprint,
                   "sampled | full: the checkpoint's key from each tensor's first KiB (fast on "
                   "network storage), or from every byte (sees any edit; reads it all once per "
                   "change of the files). Daemon and engine must use the same")
        ->check(CLI::IsMember({"sampled", "full"}));
  }
}

Status FinishProcessingFlags(protocol::Processing& p) {
  // The same checks the library makes (a plan named where one is needed, a
  // plan file that reads), reported as usage errors.
  if (auto resolved = transform::ResolveProcessing(p.tp_size, p.dtype, p.quant, p.shard_plan);
      !resolved.ok()) {
    return resolved.error();
  }
  WEIGHTD_RETURN_IF_ERROR(protocol::CheckSupported(p));
  // A plan file is read by the daemon too, from another directory.
  if (transform::IsPlanFile(p.shard_plan)) {
    WEIGHTD_ASSIGN_OR_RETURN(p.shard_plan, io::PosixFileSystem().RealPath(p.shard_plan));
  }
  return OkStatus();
}

Command AddLoadCommand(CLI::App& root) {
  auto o = std::make_shared<LoadCommandOptions>();
  CLI::App* app = root.add_subcommand(
      "load",
      "Behave as an engine: compute the checkpoint's key, acquire the weights from the daemon\n"
      "when it holds exactly them, else load from disk (one line says why). Says where they\n"
      "came from and how long it took. With processing flags, the engine gets its rank's share,\n"
      "cast and quantized as asked, the same bytes whether from the daemon or from disk.");
  app->add_option("DIR", o->spec.path, "checkpoint directory or .safetensors file")
      ->required()
      ->check(NotEmpty("name a checkpoint directory or .safetensors file"));
  AddProcessingFlags(*app, o->processing);
  app->add_option("--mode", o->mode, "zero_copy (map, keep the lease) | copy (copy, release)")
      ->check(CLI::IsMember({"zero_copy", "copy"}));
  app->add_flag("--no-fallback", o->no_fallback, "fail instead of loading from disk");
  app->add_flag("--checksum", o->checksum,
                "print an XXH3-128 over every tensor's name and bytes (daemon and disk agree)");
  AddSecondsOption(*app, "--hold", o->hold,
                   "keep the weights (and lease) this many seconds, then checksum again (with "
                   "--checksum)",
                   7 * 24 * 3600);
  AddSecondsOption(*app, "--wait-for-daemon", o->wait,
                   "seconds to wait for a daemon that is starting, or for its load of this very "
                   "model in flight",
                   protocol::kMaxAcquireWaitSeconds);
  AddSecondsOption(*app, "--reply-timeout", o->reply_timeout,
                   "seconds to wait for each answer from a daemon that accepts but does not "
                   "answer (stopped, hung) before falling back (default 30; not a bound on "
                   "--wait-for-daemon)",
                   3600, /*above_zero=*/true);
  app->add_flag("--populate", o->populate, "after a miss, ask the daemon to preload for next time");
  app->add_option("--trust", o->trust,
                  "accept the model pinned under NAME without checking its content (loud)")
      ->check(CLI::Validator(
          [](std::string& name) {
            Status s = daemon::CheckPinName(name);
            return s.ok() ? std::string() : s.error().message();
          },
          "NAME"));
  app->add_option("--save", o->save,
                  "write the tensors received (this rank, processed) to FILE as safetensors")
      ->check(NotEmpty("name the file to write"));
  app->add_option("--socket-dir", o->socket_dir, "the daemon's socket directory")
      ->check(NotEmpty());
  app->add_flag("--no-cache", o->no_cache, "do not use the fingerprint's stat cache");
  app->add_flag(
      "--json", o->json,
      "print JSON: source, reason, miss_kind (none, no_daemon, not_resident, different, "
      "failed), mismatch, tensors, bytes, seconds (of which waiting for "
      "the daemon: waited_seconds; CUDA's start apart: cuda_start_seconds), checksum, saved");
  return {app, [o] { return RunLoad(*o); }};
}

}  // namespace weightd::cli
