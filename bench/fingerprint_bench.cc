// The fingerprint on a latency-bound file system, against the schemes
// engines use today, all in one run over the same generated files. Writes a
// markdown section to stdout and an SVG plot to --plot.
//
//   fingerprint_bench WORKDIR --latencyfs BIN --baseline BIN [--plot FILE]
//
// 1. k3-layout (about 70,000 tensors, 50 shards) on latencyfs at 5 ms and
//    1 ms per operation: weightd sampled cold (empty stat cache) and warm,
//    the per-tensor scheme (one 1 KiB pread per tensor from 32 threads,
//    headers read with two reads per shard) and header-only hashing shard
//    by shard. Each run gets a fresh mount, so the kernel's attribute cache
//    starts empty.
// 2. A 66-shard, 984-tensor llama at 150 ms per operation (an object-store
//    FUSE mount), with latencyfs's default attribute cache and with it off.
// 3. The local disk, page cache warm: a 2 GB llama's fingerprint against a
//    full read of it.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "format/synthetic.h"
#include "io/read_many.h"

namespace {

using namespace weightd;
namespace fs = std::filesystem;

[[noreturn]] void Die(const std::string& what) { bench::Die("fingerprint_bench", what); }

using bench::RunCapture;

// One latencyfs mount for the lifetime of the object.
class Mount {
 public:
  Mount(const std::string& bin, const std::string& src, const std::string& mnt,
        const std::string& latency, const std::string& attr_cache)
      : mnt_(mnt) {
    fs::create_directories(mnt);
    struct stat outer;
    ::stat(mnt.c_str(), &outer);
    pid_ = ::fork();
    if (pid_ == 0) {
      std::freopen("/dev/null", "w", stderr);
      ::execl(bin.c_str(), "latencyfs", src.c_str(), mnt.c_str(), "--latency", latency.c_str(),
              "--attr-cache", attr_cache.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 1000; ++i) {
      struct stat st;
      if (::stat(mnt.c_str(), &st) == 0 && st.st_dev != outer.st_dev) return;
      ::usleep(10'000);
    }
    Die("latencyfs did not mount " + mnt);
  }
  ~Mount() {
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }
  const std::string& path() const { return mnt_; }

 private:
  std::string mnt_;
  pid_t pid_;
};

struct Row {
  std::string what;
  double seconds = 0;
  uint64_t reads = 0;
  uint64_t bytes = 0;
  uint64_t round_trips = 0;
};

Row Weightd(const std::string& what, const std::string& path, fingerprint::StatCache* cache) {
  fingerprint::Options o;
  o.cache = cache;
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, o);
  if (!fp.ok()) Die(fp.error().message());
  if (cache != nullptr && !cache->Save().ok()) Die("cannot save the stat cache");
  return {what, fp->seconds, fp->reads, fp->bytes_read, fp->round_trips};
}

Row Baseline(const std::string& bin, const std::string& scheme, const std::string& what,
             const std::string& path) {
  auto j = nlohmann::json::parse(RunCapture({bin, scheme, path}));
  return {what, j["seconds"], j["reads"], j["bytes_read"], j["round_trips"]};
}

void Generate(const std::string& dir, const format::SyntheticOptions& o) {
  if (fs::exists(dir)) return;
  std::cerr << "generating " << o.preset << " in " << dir << "\n";
  auto plan = format::WriteSyntheticCheckpoint(dir, o);
  if (!plan.ok()) Die(plan.error().message());
}

void PrintTable(const std::vector<Row>& rows, const Row& reference) {
  std::printf(
      "| scheme | time | reads | bytes read | round trips (critical path) | speed-up vs %s |\n",
      reference.what.c_str());
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.3f s | %llu | %.1f MB | %llu | %.1fx |\n", r.what.c_str(), r.seconds,
                static_cast<unsigned long long>(r.reads), static_cast<double>(r.bytes) / 1e6,
                static_cast<unsigned long long>(r.round_trips), reference.seconds / r.seconds);
  }
  std::printf("\n");
}

// Bars on a log scale, one group per latency.
void WritePlot(const std::string& path,
               const std::vector<std::pair<std::string, std::vector<Row>>>& groups) {
  std::ofstream svg(path);
  const int bar_h = 18, gap = 6, left = 260, width = 760;
  int rows = 0;
  for (const auto& g : groups) rows += static_cast<int>(g.second.size()) + 1;
  const int height = rows * (bar_h + gap) + 60;
  const double lo = std::log10(0.001), hi = std::log10(100.0);
  auto x = [&](double s) {
    return left + (std::log10(std::max(s, 0.001)) - lo) / (hi - lo) * (width - left - 20);
  };
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << height
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
         "fill='white'/>\n"
      << "<text x='10' y='18' font-weight='bold'>Fingerprint of k3-layout (69,723 tensors, 50 "
         "shards) on "
         "latencyfs, seconds (log scale)</text>\n";
  int y = 34;
  for (const auto& [title, group] : groups) {
    svg << "<text x='10' y='" << y + 13 << "' font-weight='bold'>" << title << "</text>\n";
    y += bar_h + gap;
    for (const Row& r : group) {
      const bool ours = r.what.rfind("weightd", 0) == 0;
      svg << "<text x='20' y='" << y + 13 << "'>" << r.what << "</text>\n"
          << "<rect x='" << left << "' y='" << y << "' width='" << x(r.seconds) - left
          << "' height='" << bar_h << "' fill='" << (ours ? "#2b7bb9" : "#b0b0b0") << "'/>\n"
          << "<text x='" << x(r.seconds) + 4 << "' y='" << y + 13 << "'>" << r.seconds
          << " s</text>\n";
      y += bar_h + gap;
    }
  }
  for (double t : {0.001, 0.01, 0.1, 1.0, 10.0, 100.0}) {
    svg << "<line x1='" << x(t) << "' x2='" << x(t) << "' y1='28' y2='" << y
        << "' stroke='#ddd'/>\n"
        << "<text x='" << x(t) - 10 << "' y='" << y + 14 << "' fill='#666'>" << t << "</text>\n";
  }
  svg << "</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2)
    Die("usage: fingerprint_bench WORKDIR --latencyfs BIN --baseline BIN [--plot FILE]");
  const std::string work = argv[1];
  std::string latencyfs, baseline, plot;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--latencyfs") latencyfs = argv[i + 1];
    if (flag == "--baseline") baseline = argv[i + 1];
    if (flag == "--plot") plot = argv[i + 1];
  }
  if (latencyfs.empty() || baseline.empty()) Die("--latencyfs and --baseline are required");
  fs::create_directories(work);
  // The 66-shard model sits one folder below its mount, as a model does in
  // a bucket: the folder's lookup is then a round trip, as it is in use (a
  // mount's root is the one folder the kernel knows without asking).
  const std::string k3 = work + "/k3-layout", bucket = work + "/bucket-150",
                    llama66 = bucket + "/llama-66", llama2g = work + "/llama";
  Generate(k3, {.preset = "k3-layout"});
  fs::create_directories(bucket);
  Generate(llama66, {.preset = "llama", .layers = 109, .hidden = 256, .shards = 66});
  Generate(llama2g, {.preset = "llama", .size_bytes = 2ull << 30});
  // latencyfs is to be the only slow thing: the pages every scheme reads
  // (headers and the first bytes of each tensor) are brought into the page
  // cache under it first, by one unmeasured fingerprint of each source.
  // Without this the first run after anything that filled memory paid the
  // local disk's random reads (13.8 s instead of 1.2 s once seen).
  for (const std::string& src : {k3, llama66}) {
    if (!fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), src, {}).ok()) {
      Die("cannot read " + src);
    }
  }
  const std::string mnt = work + "/mnt";

  const auto ceiling = nlohmann::json::parse(
      RunCapture({latencyfs, "--ceiling", "--readers", "256", "--seconds", "2"}));
  const double ceiling_ops = ceiling["ceiling_ops_per_second"];

  std::printf("## Fingerprint on a latency-bound file system\n\n");
  std::printf(
      "Written by `make bench` (bench/fingerprint_bench.cc) over `tools/latencyfs`. Every run "
      "gets\n"
      "a fresh mount (kernel attribute cache empty) unless it says `same mount`; `cold` starts "
      "with\n"
      "an empty stat cache, `warm` with the one the cold run left. `warm, same mount` runs right\n"
      "after the cold run, within the attribute cache's 3 s: an engine restarting soon after the\n"
      "last one. Round trips are the operations one after another on the slowest path, as each\n"
      "scheme plans them (weightd's count is an upper bound: it does not know which lookups the\n"
      "kernel answered from its cache).\n\n");
  std::printf(
      "latencyfs ceiling on this machine (%d cores, 256 readers, no delay): **%.0f "
      "operations/s**.\n"
      "No scheme can issue its reads faster than that, whatever the latency.\n\n",
      static_cast<int>(ceiling["cores"]), ceiling_ops);

  std::vector<std::pair<std::string, std::vector<Row>>> plot_groups;
  for (const char* latency : {"5ms", "1ms"}) {
    std::cerr << "k3-layout at " << latency << "\n";
    std::vector<Row> rows;
    fs::path cache_dir = fs::path(work) / ("cache-" + std::string(latency));
    fs::remove_all(cache_dir);
    auto cache = fingerprint::StatCache::Load(cache_dir.string());
    {
      Mount m(latencyfs, k3, mnt, latency, "3s");
      rows.push_back(Weightd("weightd sampled, cold", m.path(), cache.get()));
      rows.push_back(Weightd("weightd sampled, warm, same mount", m.path(), cache.get()));
    }
    {
      Mount m(latencyfs, k3, mnt, latency, "3s");
      rows.push_back(Weightd("weightd sampled, warm, fresh mount", m.path(), cache.get()));
    }
    {
      Mount m(latencyfs, k3, mnt, latency, "3s");
      rows.push_back(
          Baseline(baseline, "per-tensor", "per-tensor, 32 workers (engines today)", m.path()));
    }
    {
      Mount m(latencyfs, k3, mnt, latency, "3s");
      rows.push_back(Baseline(baseline, "header-only", "header-only, shard by shard", m.path()));
    }
    std::printf("### k3-layout at %s per operation\n\n", latency);
    PrintTable(rows, rows[3]);
    const Row& cold = rows[0];
    std::printf(
        "weightd cold issued %.0f reads/s, %.0f%% of the latencyfs ceiling; with unlimited\n"
        "concurrency the floor would be max(round trips x latency, reads / ceiling) = %.3f s.\n\n",
        static_cast<double>(cold.reads) / cold.seconds,
        100.0 * static_cast<double>(cold.reads) / cold.seconds / ceiling_ops,
        std::max(
            static_cast<double>(cold.round_trips) * (latency == std::string("5ms") ? 0.005 : 0.001),
            static_cast<double>(cold.reads) / ceiling_ops));
    plot_groups.push_back({std::string("at ") + latency + " per operation", rows});
  }

  std::printf("### A 66-shard, 984-tensor llama at 150 ms per operation (object-store FUSE)\n\n");
  std::printf(
      "The model is a folder inside the mount (`MNT/llama-66`), as in a bucket, so every scheme\n"
      "pays the folder's lookup.\n\n");
  for (const char* attr : {"3s", "0"}) {
    std::cerr << "llama-66 at 150ms, attr cache " << attr << "\n";
    std::vector<Row> rows;
    fs::path cache_dir = fs::path(work) / (std::string("cache-150-") + attr);
    fs::remove_all(cache_dir);
    auto cache = fingerprint::StatCache::Load(cache_dir.string());
    const std::string model = mnt + "/llama-66";
    {
      Mount m(latencyfs, bucket, mnt, "150ms", attr);
      rows.push_back(Weightd("weightd sampled, cold", model, cache.get()));
      rows.push_back(Weightd("weightd sampled, warm, same mount", model, cache.get()));
    }
    {
      Mount m(latencyfs, bucket, mnt, "150ms", attr);
      rows.push_back(Weightd("weightd sampled, warm, fresh mount", model, cache.get()));
    }
    if (std::string(attr) == "3s") {
      Mount m(latencyfs, bucket, mnt, "150ms", attr);
      rows.push_back(Baseline(baseline, "header-only", "header-only, shard by shard", model));
    }
    std::printf("Attribute cache %s:\n\n",
                std::string(attr) == "0" ? "off" : "3 s (latencyfs default)");
    PrintTable(rows, std::string(attr) == "0" ? rows[0] : rows.back());
    if (std::string(attr) == "3s") {
      std::printf(
          "On a fresh mount no client can go below two round trips (0.3 s): the folder's lookup,\n"
          "then the shards' lookups, however many go out at once. Under 0.3 s is reached while\n"
          "the kernel still holds the attributes (`same mount`).\n\n");
    }
  }

  std::cerr << "local llama\n";
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), llama2g);
  if (!ckpt.ok()) Die(ckpt.error().message());
  std::vector<std::string> paths;
  for (const auto& s : ckpt->shards) paths.push_back(s.path);
  if (!io::ReadFilesFully(io::PosixFileSystem(), paths, {}).ok()) Die("warm-up read");
  std::vector<double> full, sampled;
  for (int r = 0; r < 5; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (!io::ReadFilesFully(io::PosixFileSystem(), paths, {}).ok()) Die("read");
    full.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    sampled.push_back(Weightd("", llama2g, nullptr).seconds);
  }
  std::sort(full.begin(), full.end());
  std::sort(sampled.begin(), sampled.end());
  std::printf("### Local disk, page cache warm\n\n");
  std::printf(
      "A %.2f GB llama checkpoint: weightd sampled fingerprint (no stat cache) %.2f ms against a "
      "full\n"
      "read through src/io %.1f ms: **%.2f%% of a full read** (medians of 5).\n\n",
      static_cast<double>(ckpt->file_bytes()) / 1e9, sampled[2] * 1e3, full[2] * 1e3,
      100.0 * sampled[2] / full[2]);
  if (!plot.empty()) {
    WritePlot(plot, plot_groups);
    std::printf("![fingerprint of k3-layout on latencyfs](%s)\n",
                fs::path(plot).filename().c_str());
  }
  return 0;
}
