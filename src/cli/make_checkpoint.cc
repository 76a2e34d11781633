// `weightd make-checkpoint OUT --preset NAME [--seed N] [...]`
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <charconv>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/output.h"
#include "format/synthetic.h"
#include "protocol/paths.h"
#include "protocol/text.h"

namespace weightd::cli {
namespace {

struct MakeOptions {
  std::string out;
  format::SyntheticOptions synthetic;
  std::string size;
  std::string variant = "base";
  bool json = false;
};

int RunMake(MakeOptions o) {
  // Ended by a signal, the folder being written beside OUT goes first.
  const CleanUpOnSignal on_signal;
  // An option the preset does not use would be ignored: said instead.
  const std::string& preset = o.synthetic.preset;
  const std::pair<bool, const char*> unused[] = {
      {!o.size.empty() && preset != "llama", "--size applies to the llama preset only"},
      {o.synthetic.hidden != 0 && preset != "llama", "--hidden applies to the llama preset only"},
      {o.synthetic.layers != 0 && preset != "llama" && preset != "k3-layout",
       "--layers applies to the llama and k3-layout presets only"},
      {o.synthetic.experts != 0 && preset != "k3-layout",
       "--experts applies to the k3-layout preset only"},
      {o.synthetic.tensors != 0 && preset != "many-tensors",
       "--tensors applies to the many-tensors preset only"},
      {!o.size.empty() && o.synthetic.hidden != 0 && o.synthetic.layers != 0,
       "--size with both --layers and --hidden: those two make the size; give one of them, or "
       "no --size"},
  };
  for (const auto& [given, why] : unused) {
    if (given) return ReportError("make-checkpoint", why, kExitUsage);
  }
  if (!o.size.empty()) {
    auto size = protocol::ParseSize(o.size);
    if (!size) {
      return ReportError("make-checkpoint", "--size: " + protocol::WhyNotASize(o.size), kExitUsage);
    }
    if (*size == 0) return ReportError("make-checkpoint", "--size must be above 0", kExitUsage);
    o.synthetic.size_bytes = *size;
  }
  o.synthetic.finetune = o.variant == "finetune";
  const auto start = std::chrono::steady_clock::now();
  // One line rewritten on a terminal, a line per shard otherwise (a log).
  const bool terminal = ::isatty(STDERR_FILENO) == 1;
  auto plan = format::WriteSyntheticCheckpoint(o.out, o.synthetic, [&](size_t done, size_t total) {
    if (total <= 1) return;
    std::cerr << (terminal ? "\r" : "") << "wrote shard " << done << "/" << total
              << (terminal && done < total ? "" : "\n") << std::flush;
  });
  if (!plan.ok()) return ReportError("make-checkpoint", plan.error().message());
  const double seconds = SecondsSince(start);
  // The shape is chosen for the size, in whole layers of at least one: a
  // size far below that is not met, and that is said.
  if (o.synthetic.size_bytes != 0 && plan->data_bytes / 2 > o.synthetic.size_bytes) {
    std::cerr << "weightd: make-checkpoint: --size " << o.size << " is below what this shape "
              << "takes (whole layers: " << (o.synthetic.layers != 0 ? "--layers" : "one at least")
              << "): wrote " << FormatBytes(plan->data_bytes) << "\n";
  }
  // A shard holds a tensor at least: more shards than tensors are fewer.
  if (o.synthetic.shards > 0 && plan->shards.size() < static_cast<size_t>(o.synthetic.shards)) {
    std::cerr << "weightd: make-checkpoint: --shards " << o.synthetic.shards << " is more than "
              << "this model's " << Count(plan->tensor_count, "tensor")
              << " fill (a shard holds one at least): wrote " << Count(plan->shards.size(), "shard")
              << "\n";
  }
  // With --layers given, the hidden size follows from the size's range
  // alone: far fewer bytes than asked are said too.
  if (o.synthetic.size_bytes != 0 && plan->data_bytes < o.synthetic.size_bytes / 2) {
    std::cerr << "weightd: make-checkpoint: --size " << o.size << " is above what this shape "
              << "makes (the hidden size follows from the size's range, the layers from "
              << "--layers; give more layers, or --hidden): wrote " << FormatBytes(plan->data_bytes)
              << "\n";
  }
  if (o.json) {
    nlohmann::json out = {{"path", protocol::PathToJson(o.out)},
                          {"preset", o.synthetic.preset},
                          {"variant", o.variant},
                          {"seed", o.synthetic.seed},
                          {"shards", plan->shards.size()},
                          {"tensors", plan->tensor_count},
                          {"bytes", plan->data_bytes},
                          {"sparse", plan->sparse},
                          {"seconds", seconds}};
    std::cout << DumpJson(out, 2) << "\n";
  } else {
    std::cout << "wrote " << o.out << ": " << o.synthetic.preset
              << (o.synthetic.finetune ? " (finetune variant)" : "") << ", "
              << Count(plan->tensor_count, "tensor") << ", " << FormatBytes(plan->data_bytes)
              << (plan->sparse ? " (sparse)" : "") << " in " << Count(plan->shards.size(), "shard")
              << ", " << FormatSeconds(seconds) << "\n";
  }
  return kExitOk;
}

}  // namespace

Command AddMakeCheckpointCommand(CLI::App& root) {
  auto o = std::make_shared<MakeOptions>();
  CLI::App* app = root.add_subcommand(
      "make-checkpoint",
      "Write a synthetic checkpoint: real layouts, pseudo-random values, the same bytes for\n"
      "the same options and seed. OUT must not exist or be empty; it appears only when complete.");
  app->add_option("OUT", o->out, "directory to create")
      ->required()
      ->check(NotEmpty("name the directory to create"));
  app->add_option("--preset", o->synthetic.preset,
                  "tiny | llama | many-tensors | k3-layout (sparse files, ~1 TB apparent size)")
      ->required()
      ->check(CLI::IsMember({"tiny", "llama", "many-tensors", "k3-layout"}));
  app->add_option("--seed", o->synthetic.seed, "values seed (default 0)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // Whole decimal digits within 64 bits: "-1" and 2^64 are not
            // taken as 2^64 - 1, the same bytes as that seed.
            uint64_t seed = 0;
            const char* end = text.data() + text.size();
            auto [at, error] = std::from_chars(text.data(), end, seed);
            if (text.empty() || error != std::errc() || at != end || !std::isdigit(text[0])) {
              return "not a seed from 0 to " + std::to_string(UINT64_MAX);
            }
            return "";
          },
          "SEED"));
  app->add_option("--variant", o->variant, "base | finetune: same layout, different values")
      ->check(CLI::IsMember({"base", "finetune"}));
  app->add_option("--size", o->size, "llama: approximate size, e.g. 512M, 2G (default 512M)")
      ->check(NotEmpty());
  app->add_option("--layers", o->synthetic.layers, "llama, k3-layout: number of layers")
      ->check(CLI::Range(1, 10000));
  app->add_option("--hidden", o->synthetic.hidden, "llama: hidden size")
      ->check(CLI::Range(8, 65536));
  app->add_option("--experts", o->synthetic.experts, "k3-layout: experts per layer (default 384)")
      ->check(CLI::Range(1, 4096));
  app->add_option("--tensors", o->synthetic.tensors, "many-tensors: how many (default 70000)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{10'000'000}));
  app->add_option("--shards", o->synthetic.shards, "number of shard files (default per preset)")
      ->check(CLI::Range(1, 100000));
  app->add_flag("--json", o->json, "print what was written as JSON");
  return {app, [o] { return RunMake(*o); }};
}

}  // namespace weightd::cli
