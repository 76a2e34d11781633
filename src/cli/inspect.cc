// `weightd inspect PATH [--json] [--values NAME [--limit N]]`
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/output.h"
#include "format/checkpoint.h"
#include "format/dtype.h"
#include "protocol/paths.h"
#include "transform/plan.h"

namespace weightd::cli {
namespace {

using format::Checkpoint;
using format::Shard;
using format::TensorInfo;

struct InspectOptions {
  std::string path;
  bool json = false;
  std::optional<std::string> values;  // a tensor's name ("" is one), when given
  uint64_t limit = 0;
  protocol::Processing processing;
  bool explain = false;  // any processing flag given
};

nlohmann::json MetadataJson(const Shard& shard) {
  nlohmann::json m = nlohmann::json::object();
  for (const auto& [k, v] : shard.header.metadata) m[k] = v;
  return m;
}

void PrintJson(const Checkpoint& ckpt) {
  nlohmann::json out;
  out["path"] = protocol::PathToJson(ckpt.path);
  out["kind"] = ckpt.is_directory ? "checkpoint" : "file";
  out["index"] = ckpt.has_index;
  out["shards"] = nlohmann::json::array();
  out["tensors"] = nlohmann::json::array();
  for (const Shard& s : ckpt.shards) {
    out["shards"].push_back({{"name", protocol::PathToJson(s.name)},
                             {"file_bytes", s.file_size},
                             {"header_bytes", s.header.header_bytes},
                             {"data_offset", s.header.data_offset()},
                             {"tensors", s.header.tensors.size()},
                             {"metadata", MetadataJson(s)}});
    for (const TensorInfo& t : s.header.tensors) {
      out["tensors"].push_back({{"name", t.name},
                                {"shard", protocol::PathToJson(s.name)},
                                {"dtype", std::string(format::DTypeName(t.dtype))},
                                {"shape", t.shape},
                                {"data_offsets", {t.begin, t.end}},
                                {"offset", s.header.data_offset() + t.begin},
                                {"bytes", t.bytes()}});
    }
  }
  out["total_tensors"] = ckpt.tensor_count();
  out["total_bytes"] = ckpt.data_bytes();
  out["file_bytes"] = ckpt.file_bytes();
  std::cout << DumpJson(out, 2) << "\n";
}

void PrintText(const Checkpoint& ckpt) {
  std::cout << Printable(ckpt.path) << ": "
            << (ckpt.is_directory ? "checkpoint" : "safetensors file") << ", "
            << Count(ckpt.shards.size(), "shard")
            << (ckpt.has_index ? " (from model.safetensors.index.json)" : "") << "\n";
  for (const Shard& s : ckpt.shards) {
    std::cout << "\n"
              << Printable(s.name) << ": " << Count(s.header.tensors.size(), "tensor") << ", "
              << FormatBytes(s.file_size) << ", header " << s.header.header_bytes << " bytes\n";
    for (const auto& [k, v] : s.header.metadata)
      std::cout << "  metadata " << Printable(k) << " = " << Printable(v) << "\n";
    for (const TensorInfo& t : s.header.tensors) {
      std::cout << "  " << Printable(t.name) << "  " << format::DTypeName(t.dtype) << " "
                << format::ShapeString(t.shape) << "  offset " << s.header.data_offset() + t.begin
                << "  " << t.bytes() << " bytes\n";
    }
  }
  std::cout << "\ntotal: " << Count(ckpt.tensor_count(), "tensor") << ", "
            << FormatBytes(ckpt.data_bytes()) << " of tensor data in "
            << Count(ckpt.shards.size(), "shard") << "\n";
}

// Values as JSON: numbers, except non-finite floats (strings "nan", "inf",
// "-inf", which JSON numbers cannot express) and C64 ([re, im]).
std::string JsonElement(const format::ElementValue& v) {
  if (const auto* c = std::get_if<format::Complex>(&v)) {
    return "[" + JsonElement(static_cast<double>(c->re)) + "," +
           JsonElement(static_cast<double>(c->im)) + "]";
  }
  const std::string text = format::FormatElement(v);
  if (const auto* d = std::get_if<double>(&v); d && !std::isfinite(*d)) return "\"" + text + "\"";
  return text;
}

int PrintValues(const Checkpoint& ckpt, const InspectOptions& o) {
  const Shard* shard = nullptr;
  const TensorInfo* tensor = nullptr;
  for (const Shard& s : ckpt.shards) {
    if ((tensor = s.header.Find(*o.values)) != nullptr) {
      shard = &s;
      break;
    }
  }
  if (tensor == nullptr)
    return ReportError("inspect", ckpt.path + ": no tensor named `" + *o.values + "`");

  auto file = io::PosixFileSystem().Open(shard->path);
  if (!file.ok()) return ReportError("inspect", file.error().message());

  const uint64_t count = o.limit ? std::min(o.limit, tensor->elements) : tensor->elements;
  if (o.json) {
    std::cout << "{\"name\":" << DumpJson(tensor->name)
              << ",\"shard\":" << DumpJson(protocol::PathToJson(shard->name)) << ",\"dtype\":\""
              << format::DTypeName(tensor->dtype) << "\",\"shape\":" << DumpJson(tensor->shape)
              << ",\"elements\":" << tensor->elements << ",\"values\":[";
  }
  // Read in pieces of whole elements (24 bytes hold a whole number of
  // elements of every width, 6-bit ones included) so a large tensor never
  // needs one large buffer.
  const uint32_t bits = format::DTypeBits(tensor->dtype);
  const uint64_t chunk_bytes = 24 * 43'690;
  const uint64_t chunk_elements = chunk_bytes * 8 / bits;
  std::vector<std::byte> buf;
  for (uint64_t first = 0; first < count; first += chunk_elements) {
    const uint64_t n = std::min(chunk_elements, count - first);
    const uint64_t byte_begin = first * bits / 8;
    const uint64_t byte_len = (n * bits + 7) / 8;
    buf.resize(static_cast<size_t>(byte_len));
    Status read =
        (*file)->ReadExactly(shard->header.data_offset() + tensor->begin + byte_begin, buf);
    if (!read.ok()) {
      if (o.json) std::cout << "]}\n";
      return ReportError("inspect", read.error().message());
    }
    for (uint64_t i = 0; i < n; ++i) {
      const auto v = format::DecodeElement(tensor->dtype, buf, i);
      const uint64_t index = first + i;
      if (o.json) {
        std::cout << (index ? "," : "") << JsonElement(v);
      } else {
        std::cout << format::FormatElement(v)
                  << ((index + 1) % 16 == 0 || index + 1 == count ? "\n" : " ");
      }
    }
  }
  if (o.json) std::cout << "]}\n";
  return kExitOk;
}

// The processing plan, from the headers only: per tensor of every rank's
// segment, where it comes from, how it is cut and converted, its bytes.
int ExplainPlan(const Checkpoint& ckpt, InspectOptions& o) {
  if (Status s = FinishProcessingFlags(o.processing); !s.ok()) {
    return ReportError("inspect", s.error().message(), kExitUsage);
  }
  const protocol::Processing& p = o.processing;
  auto resolved = transform::ResolveProcessing(p.tp_size, p.dtype, p.quant, p.shard_plan);
  if (!resolved.ok()) return ReportError("inspect", resolved.error().message(), kExitUsage);
  const std::vector<transform::SourceTensor> sources = transform::SourcesOf(ckpt.shards);
  auto plan = transform::PlanTensors(sources, *resolved);
  if (!plan.ok()) return ReportError("inspect", ckpt.path + ": " + plan.error().message());
  const std::string plan_name = resolved->plan->name();
  if (o.json) {
    nlohmann::json out = {{"path", protocol::PathToJson(ckpt.path)},
                          {"tp_size", p.tp_size},
                          {"dtype", p.dtype},
                          {"quant", p.quant},
                          {"shard_plan", plan_name},
                          {"plan_digest", resolved->plan->digest()},
                          {"bytes_per_rank", plan->bytes_per_rank},
                          {"source_bytes", ckpt.data_bytes()},
                          {"tensors", nlohmann::json::array()}};
    for (const transform::OutputTensor& t : plan->outputs) {
      out["tensors"].push_back(
          {{"name", t.name},
           {"source", sources[t.source].name},
           {"split", std::string(transform::SplitName(t.split))},
           {"op", std::string(transform::OpName(t.op))},
           {"source_dtype", std::string(format::DTypeName(sources[t.source].dtype))},
           {"source_shape",
            std::vector<uint64_t>(sources[t.source].shape.begin(), sources[t.source].shape.end())},
           {"dtype", std::string(format::DTypeName(t.dtype))},
           {"shape", t.shape},
           {"bytes_per_rank", t.bytes}});
    }
    std::cout << DumpJson(out, 2) << "\n";
    return kExitOk;
  }
  std::cout << Printable(ckpt.path) << ": plan " << plan_name << " (" << resolved->plan->digest()
            << "), " << p.tp_size << (p.tp_size == 1 ? " rank" : " ranks") << ", dtype " << p.dtype
            << ", quant " << p.quant << "\n\n";
  for (const transform::OutputTensor& t : plan->outputs) {
    const transform::SourceTensor& src = sources[t.source];
    std::cout << "  " << Printable(t.name) << "  " << transform::SplitName(t.split) << ", "
              << transform::OpName(t.op) << ": " << format::DTypeName(src.dtype) << " "
              << format::ShapeString(src.shape) << " -> " << format::DTypeName(t.dtype) << " "
              << format::ShapeString(t.shape) << " per rank, " << t.bytes << " bytes\n";
  }
  std::cout << "\nper rank: " << Count(plan->outputs.size(), "tensor") << ", "
            << FormatBytes(plan->bytes_per_rank) << " (the checkpoint has "
            << FormatBytes(ckpt.data_bytes()) << ")\n";
  return kExitOk;
}

int RunInspect(InspectOptions& o) {
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), o.path);
  if (!ckpt.ok()) return ReportError("inspect", ckpt.error().message());
  if (o.values) return PrintValues(*ckpt, o);
  if (o.explain) return ExplainPlan(*ckpt, o);
  if (o.json) {
    PrintJson(*ckpt);
  } else {
    PrintText(*ckpt);
  }
  return kExitOk;
}

}  // namespace

Command AddInspectCommand(CLI::App& root) {
  auto options = std::make_shared<InspectOptions>();
  CLI::App* app = root.add_subcommand(
      "inspect",
      "List the tensors of a safetensors file or checkpoint directory and validate it.\n"
      "Exit 0 when every shard is valid, 1 with the broken rule otherwise. With processing\n"
      "flags (--plan/--shard-plan, --tp-size, --dtype, --quant), explain what each rank would\n"
      "get instead, from the headers alone: split, cast, quantization, bytes per rank.");
  app->add_option("PATH", options->path, "a .safetensors file or a checkpoint directory")
      ->required()
      ->check(NotEmpty("name a checkpoint directory or .safetensors file"));
  app->add_flag("--json", options->json, "print JSON (documented in docs/cli.md)");
  CLI::Option* values =
      app->add_option("--values", options->values, "print the elements of tensor NAME as numbers");
  app->add_option("--limit", options->limit, "with --values: print at most N elements")
      ->needs(values)
      ->check(CLI::Range(uint64_t{1}, UINT64_MAX));
  AddProcessingFlags(*app, options->processing, /*placement=*/false);
  return {app, [options, app] {
            // Any processing flag explains the plan instead of listing tensors.
            for (const char* flag : {"--tp-size", "--dtype", "--quant", "--shard-plan"}) {
              if (app->count(flag) > 0) options->explain = true;
            }
            // --values prints the tensor as the file holds it: no rank's.
            if (options->explain && options->values) {
              return ReportError("usage",
                                 "--values prints a tensor as the checkpoint holds it; it takes "
                                 "no processing flags (load a rank with weightd load --save, "
                                 "then inspect that file; see weightd inspect --help)",
                                 kExitUsage);
            }
            return RunInspect(*options);
          }};
}

}  // namespace weightd::cli
