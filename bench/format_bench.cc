// Benchmarks of the format and io layers, each a ratio against a reference
// measured in the same run on the same files (absolute times on shared
// machines are noise). Writes a markdown report to stdout.
//
//   weightd_bench WORKDIR [--llama-size 2G] [--repeats 5]
//
// 1. Header parse + validate throughput on the many-tensors (70,000 tensors)
//    and k3-layout (about 70,000 tensors, 50 shards) headers, in tensors per
//    second, and the parse time as a multiple of reading the header bytes.
// 2. A full sequential read of a llama checkpoint through src/io against
//    `cat` of the same files to /dev/null, page cache warm.
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "format/checkpoint.h"
#include "format/synthetic.h"
#include "io/read_many.h"

namespace {

using namespace weightd;

[[noreturn]] void Die(const std::string& what) { bench::Die("weightd_bench", what); }

using bench::Median;
using bench::TimeIt;

format::Checkpoint Generate(const std::string& dir, const format::SyntheticOptions& o) {
  if (!std::filesystem::exists(dir)) {
    std::cerr << "generating " << o.preset << " in " << dir << "\n";
    auto plan = format::WriteSyntheticCheckpoint(dir, o);
    if (!plan.ok()) Die(plan.error().message());
  }
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), dir);
  if (!ckpt.ok()) Die(ckpt.error().message());
  return std::move(ckpt).value();
}

struct HeaderRow {
  std::string name;
  uint64_t shards = 0, tensors = 0, header_bytes = 0;
  double read_s = 0, parse_s = 0;
};

// Reads every shard's header bytes (the reference: what it costs to have the
// bytes at all), then parses and validates them from memory.
HeaderRow MeasureHeaders(const std::string& name, const format::Checkpoint& ckpt, int repeats) {
  HeaderRow row{name, ckpt.shards.size(), ckpt.tensor_count(), 0, 0, 0};
  std::vector<std::vector<std::byte>> headers(ckpt.shards.size());
  std::vector<double> reads, parses;
  for (int r = 0; r < repeats; ++r) {
    reads.push_back(TimeIt([&] {
      for (size_t i = 0; i < ckpt.shards.size(); ++i) {
        const auto& s = ckpt.shards[i];
        auto file = io::PosixFileSystem().Open(s.path);
        if (!file.ok()) Die(file.error().message());
        headers[i].resize(s.header.data_offset());
        if (!(*file)->ReadExactly(0, headers[i]).ok()) Die("read failed");
      }
    }));
    parses.push_back(TimeIt([&] {
      for (size_t i = 0; i < ckpt.shards.size(); ++i) {
        const auto& s = ckpt.shards[i];
        auto h = format::ParseHeader(
            s.path, std::span(headers[i]).subspan(format::kHeaderLengthBytes), s.file_size);
        if (!h.ok()) Die(h.error().message());
      }
    }));
  }
  for (const auto& h : headers) row.header_bytes += h.size();
  row.read_s = Median(reads);
  row.parse_s = Median(parses);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) Die("usage: weightd_bench WORKDIR [--llama-size 2G] [--repeats 5]");
  const std::string work = argv[1];
  uint64_t llama_size = 2ull << 30;
  int repeats = 5;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--llama-size") llama_size = std::strtoull(argv[i + 1], nullptr, 10) << 20;
    if (flag == "--repeats") repeats = std::atoi(argv[i + 1]);
  }
  std::filesystem::create_directories(work);

  auto many = Generate(work + "/many-tensors", {.preset = "many-tensors"});
  auto k3 = Generate(work + "/k3-layout", {.preset = "k3-layout"});
  auto llama = Generate(work + "/llama", {.preset = "llama", .size_bytes = llama_size});

  std::vector<HeaderRow> rows = {MeasureHeaders("many-tensors", many, repeats),
                                 MeasureHeaders("k3-layout", k3, repeats)};

  // Full read: warm the page cache once, then alternate the two readers.
  std::vector<std::string> paths;
  std::string cat = "cat";
  for (const auto& s : llama.shards) {
    paths.push_back(s.path);
    cat += " '" + s.path + "'";
  }
  cat += " > /dev/null";
  io::ReadStats stats;
  if (!io::ReadFilesFully(io::PosixFileSystem(), paths, {}, &stats).ok())
    Die("warm-up read failed");
  std::vector<double> ours, theirs;
  for (int r = 0; r < repeats; ++r) {
    ours.push_back(TimeIt([&] {
      if (!io::ReadFilesFully(io::PosixFileSystem(), paths, {}).ok()) Die("read failed");
    }));
    theirs.push_back(TimeIt([&] {
      if (std::system(cat.c_str()) != 0) Die("cat failed");
    }));
  }
  const double ours_s = Median(ours), cat_s = Median(theirs);
  const double gb = static_cast<double>(llama.file_bytes()) / 1e9;

  struct utsname u;
  ::uname(&u);
  std::printf("# Benchmarks\n\n");
  std::printf(
      "Written by `make bench` (bench/format_bench.cc). Every figure is a ratio to a\n"
      "reference measured in the same run on the same files; absolute times are shown\n"
      "only to make the ratios checkable. Medians of %d repeats. Machine: %s %s, %ld cores;\n"
      "touching a fresh page of memory cost %.1f us after this section's runs (1-2 us on an\n"
      "idle machine of this kind; every figure that takes fresh memory grows with it).\n\n",
      repeats, u.sysname, u.machine, ::sysconf(_SC_NPROCESSORS_ONLN), bench::FreshPageMicros());
  std::printf("## Header parse and validate (format layer)\n\n");
  std::printf("Reference: reading the same header bytes (`pread`, page cache warm).\n\n");
  std::printf(
      "| checkpoint | shards | tensors | header bytes | read | parse+validate | tensors/s | parse "
      "/ read |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& r : rows) {
    std::printf("| %s | %llu | %llu | %llu | %.2f ms | %.2f ms | %.2f M | %.1fx |\n",
                r.name.c_str(), static_cast<unsigned long long>(r.shards),
                static_cast<unsigned long long>(r.tensors),
                static_cast<unsigned long long>(r.header_bytes), r.read_s * 1e3, r.parse_s * 1e3,
                static_cast<double>(r.tensors) / r.parse_s / 1e6, r.parse_s / r.read_s);
  }
  std::printf("\n## Full sequential read (io layer)\n\n");
  std::printf(
      "A llama checkpoint of %.2f GB in %zu shards, page cache warm. Reference: `cat` of\n"
      "the same files to /dev/null.\n\n",
      gb, paths.size());
  std::printf("| reader | time | GB/s | throughput vs cat |\n| --- | ---: | ---: | ---: |\n");
  std::printf("| cat | %.3f s | %.2f | 1.00x |\n", cat_s, gb / cat_s);
  std::printf("| weightd io (StreamFile, 256 KiB chunks, 2 in flight) | %.3f s | %.2f | %.2fx |\n",
              ours_s, gb / ours_s, cat_s / ours_s);
  return 0;
}
