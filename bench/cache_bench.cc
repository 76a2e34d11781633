// The resident weight cache against what an engine does without it, all in
// one run on the same generated files. Writes a markdown section to stdout.
//
//   cache_bench WORKDIR --weightd BIN --probe BIN [--big-gb 8] [--repeats 5]
//
// 1. Warm attach (`weightd load`, zero_copy, from a running daemon) of a
//    70,000-tensor many-tensors model and of 1 GB and 8 GB llama models,
//    against a cold load of each from disk (the engine's fallback), page
//    cache warm and evicted.
// 2. Preload throughput (the daemon's loader filling a segment) against
//    `cp` of the same files into /dev/shm, page cache warm and evicted with
//    posix_fadvise(DONTNEED); `dd` to /dev/null beside.
// 3. 64 engines (bench/attach_probe) attaching at once against one alone:
//    p50 and p99.
// 4. Processing: `preload --tp-size 4 --shard-plan llama --quant fp8-block`
//    of a 4 GB llama model against a plain read of its files (dd to
//    /dev/null), and each rank's warm attach against that rank's disk
//    fallback (the engine processing its own rank).
// Every figure is measured by the program doing the work (`seconds` in
// weightd's JSON; wall time of cp and dd), so process start-up is left out
// of weightd's numbers and included in cp's and dd's (about a millisecond).
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attach_rounds.h"
#include "bench_util.h"
#include "fingerprint/stat_cache.h"
#include "format/synthetic.h"
#include "memory/segment.h"

namespace {

using namespace weightd;
using nlohmann::json;
namespace fs = std::filesystem;

[[noreturn]] void Die(const std::string& what) { bench::Die("cache_bench", what); }

std::string weightd_bin;
std::string probe_bin;
std::string socket_dir;
std::string no_daemon_dir;
int repeats = 5;
// Rounds of 64 engines: each is one roll of the scheduler's (and the
// hypervisor's) dice.
constexpr int kConcurrentRounds = 10;

uint64_t DirBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& f : fs::directory_iterator(dir)) n += f.file_size();
  return n;
}

// Drops the files' clean pages from the page cache.
void EvictPageCache(const std::string& dir) {
  for (const auto& f : fs::directory_iterator(dir)) {
    int fd = ::open(f.path().c_str(), O_RDONLY);
    if (fd < 0) Die("open " + f.path().string());
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

json Weightd(std::vector<std::string> args) {
  args.insert(args.begin(), weightd_bin);
  return json::parse(bench::RunCapture(args));
}

// `flags`: processing flags (and --tp-rank), after the rest.
double LoadSeconds(const std::string& model, const std::string& sock, const std::string& source,
                   const std::vector<std::string>& flags = {}) {
  std::vector<std::string> args = {"load", model, "--json", "--socket-dir", sock};
  args.insert(args.end(), flags.begin(), flags.end());
  json j = Weightd(args);
  if (j["source"] != source) Die("load of " + model + " came from " + j["source"].dump());
  return j["seconds"];
}

// A preload's time, and where it went (the daemon's `phases`).
struct PreloadTimes {
  double seconds = 0, headers = 0, plan = 0, read = 0, finish = 0;
};

PreloadTimes Preload(const std::string& model, const std::vector<std::string>& flags = {}) {
  Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
  std::vector<std::string> args = {"preload", model, "--json", "--socket-dir", socket_dir};
  args.insert(args.end(), flags.begin(), flags.end());
  const json reply = Weightd(args);
  const json& phases = reply.at("phases");
  return {reply.at("seconds"), phases.at("headers"), phases.at("plan"), phases.at("read"),
          phases.at("finish")};
}

double PreloadSeconds(const std::string& model, const std::vector<std::string>& flags = {}) {
  return Preload(model, flags).seconds;
}

// CPU time of every child waited for so far (cp's, here).
double ChildrenCpuSeconds() {
  rusage r{};
  ::getrusage(RUSAGE_CHILDREN, &r);
  auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  return seconds(r.ru_utime) + seconds(r.ru_stime);
}

// The kernel's policy for transparent huge pages in memfds, set to
// `within_size` around some preloads: the daemon's segments are memfds, and
// where the policy gives them huge pages it makes them of whole ones. The
// machine's own policy is put back after each, and at any exit or signal
// meanwhile; the tests that change it take the same lock.
char saved_policy[32] = "";

bool WritePolicy(const char* policy) {
  const int fd = ::open(memory::kShmemHugePagePolicyPath, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const auto n = static_cast<ssize_t>(std::strlen(policy));
  const bool written = ::write(fd, policy, static_cast<size_t>(n)) == n;
  ::close(fd);
  return written;
}

void PutPolicyBack() {
  if (saved_policy[0] != 0) WritePolicy(saved_policy);
}

void PutPolicyBackAndDie(int sig) {
  PutPolicyBack();  // open, write and close only: safe in a handler
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Runs `f` with the policy `within_size`, then puts the machine's back.
template <typename F>
void WithHugePageMemfds(const std::string& machines, F&& f) {
  static const int lock = [] {
    const int fd = ::open("/tmp/weightd-shmem-policy.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) Die("cannot open the shmem policy's lock file");
    return fd;
  }();
  if (::flock(lock, LOCK_EX) != 0) Die("cannot lock the shmem policy");
  std::snprintf(saved_policy, sizeof saved_policy, "%s", machines.c_str());
  if (!WritePolicy("within_size") || memory::ShmemHugePagePolicy() != "within_size") {
    Die("cannot set " + std::string(memory::kShmemHugePagePolicyPath));
  }
  f();
  if (!WritePolicy(machines.c_str())) Die("cannot set the shmem policy back to " + machines);
  saved_policy[0] = 0;
  ::flock(lock, LOCK_UN);
}

// Whether the model resident now is in transparent huge pages.
bool ResidentInTransparentHugePages() {
  const json models = Weightd({"status", "--json", "--socket-dir", socket_dir})["models"];
  if (models.size() != 1) Die("expected one resident model, status has " + models.dump());
  return models[0].at("transparent_huge_pages").get<bool>();
}

double CopyToShm(const std::string& model) {
  const std::string dst = "/dev/shm/weightd-bench-copy";
  fs::remove_all(dst);
  const double s = bench::TimeIt([&] { bench::RunCapture({"cp", "-r", model, dst}); });
  fs::remove_all(dst);
  return s;
}

double DdToNull(const std::string& model) {
  return bench::TimeIt([&] {
    for (const auto& f : fs::directory_iterator(model)) {
      bench::RunCapture({"dd", "if=" + f.path().string(), "of=/dev/null", "bs=4M"});
    }
  });
}

// Runs `f` `n` times (page cache evicted first when `evict`), median.
template <typename F>
double Repeat(int n, const std::string& model, bool evict, F&& f) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) {
    if (evict) EvictPageCache(model);
    v.push_back(f());
  }
  return bench::Median(v);
}

std::string Ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  return buf;
}

std::string Gbps(uint64_t bytes, double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB/s", static_cast<double>(bytes) / s / 1e9);
  return buf;
}

// Stage 4: every rank made once by the daemon, against reading the files.
void MeasureProcessing(const std::string& work, int gb) {
  const std::string model = work + "/llama-" + std::to_string(gb) + "g";
  if (!fs::exists(model)) {
    std::cerr << "generating " << model << "\n";
    auto plan = format::WriteSyntheticCheckpoint(
        model, {.preset = "llama", .size_bytes = static_cast<uint64_t>(gb) << 30});
    if (!plan.ok()) Die(plan.error().message());
  }
  constexpr int kRanks = 4;
  const std::vector<std::string> flags = {
      "--tp-size", std::to_string(kRanks), "--shard-plan", "llama", "--quant", "fp8-block"};
  auto preload = [&] { return PreloadSeconds(model, flags); };
  auto load = [&](int rank, const std::string& sock, const std::string& source) {
    std::vector<std::string> rank_flags = flags;
    rank_flags.insert(rank_flags.end(), {"--tp-rank", std::to_string(rank)});
    return LoadSeconds(model, sock, source, rank_flags);
  };
  std::cerr << "processing\n";
  const int n = std::max(1, repeats / 2);
  std::vector<double> cat_warm, cat_cold, pre_warm, pre_cold;
  for (int i = 0; i < n; ++i) {
    cat_warm.push_back(DdToNull(model));
    pre_warm.push_back(preload());
    EvictPageCache(model);
    cat_cold.push_back(DdToNull(model));
    EvictPageCache(model);
    pre_cold.push_back(preload());
  }
  preload();  // resident for the attaches, page cache warm
  std::vector<double> attach(kRanks), fallback(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    load(r, socket_dir, "daemon");  // the stat cache, filled
    std::vector<double> a, d;
    for (int i = 0; i < n; ++i) {
      a.push_back(load(r, socket_dir, "daemon"));
      d.push_back(load(r, no_daemon_dir, "disk"));
    }
    attach[r] = bench::Median(a);
    fallback[r] = bench::Median(d);
  }
  const double bytes = static_cast<double>(DirBytes(model));
  std::printf("\n### Processing once: %d ranks, fp8-block, of a %d GB llama\n\n", kRanks, gb);
  std::printf(
      "`weightd preload MODEL --tp-size 4 --shard-plan llama --quant fp8-block`: every rank's\n"
      "segment in one pass (each file byte read once), column and row layers quantized to\n"
      "F8_E4M3 with 128x128 block scales, on %ld cores. Reference: a plain read of the same\n"
      "files (`dd` to /dev/null). Medians of %d.\n\n",
      bench::UsableCores(), n);
  std::printf("| | plain read | preload, 4 ranks, fp8-block | preload / read |\n");
  std::printf("| --- | ---: | ---: | ---: |\n");
  std::printf("| page cache warm | %.2f s (%s) | %.2f s | %.2fx |\n", bench::Median(cat_warm),
              Gbps(static_cast<uint64_t>(bytes), bench::Median(cat_warm)).c_str(),
              bench::Median(pre_warm), bench::Median(pre_warm) / bench::Median(cat_warm));
  std::printf("| page cache evicted | %.2f s (%s) | %.2f s | %.2fx |\n\n", bench::Median(cat_cold),
              Gbps(static_cast<uint64_t>(bytes), bench::Median(cat_cold)).c_str(),
              bench::Median(pre_cold), bench::Median(pre_cold) / bench::Median(cat_cold));
  std::printf(
      "Each rank's engine: warm attach (the daemon's segment) against its disk fallback (the\n"
      "engine reading and quantizing its own rank, page cache warm).\n\n");
  std::printf("| rank | warm attach | disk fallback | attach vs fallback |\n");
  std::printf("| ---: | ---: | ---: | ---: |\n");
  for (int r = 0; r < kRanks; ++r) {
    std::printf("| %d | %s | %s | %.0fx faster |\n", r, Ms(attach[r]).c_str(),
                Ms(fallback[r]).c_str(), fallback[r] / attach[r]);
  }
  std::printf("\n");
}

// The warm attach of `model` (resident) with a stat cache filled to its
// limit with other files' entries: a node's cache after months of models.
double AttachWithFullStatCache(const std::string& work, const std::string& model) {
  const std::string dir = work + "/cache-full";
  fs::remove_all(dir);
  fs::create_directories(dir);
  ::chmod(dir.c_str(), 0700);
  {
    auto cache = fingerprint::StatCache::Load(dir);
    for (uint64_t i = 0; i < fingerprint::StatCache::kMaxEntries; ++i) {
      cache->Insert("sampled-1024", {.device = 1, .inode = i, .size = i, .mtime_ns = 1},
                    "xxh3-128:00000000000000000000000000000000");
    }
    if (!cache->Save().ok()) Die("cannot fill a stat cache");
  }
  const std::string before = ::getenv("WEIGHTD_CACHE_DIR");
  ::setenv("WEIGHTD_CACHE_DIR", dir.c_str(), 1);
  LoadSeconds(model, socket_dir, "daemon");  // the model's own entries go in
  const double attach =
      Repeat(repeats, model, false, [&] { return LoadSeconds(model, socket_dir, "daemon"); });
  ::setenv("WEIGHTD_CACHE_DIR", before.c_str(), 1);
  return attach;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Die("usage: cache_bench WORKDIR --weightd BIN --probe BIN [--big-gb 8] [--processing-gb 4] "
        "[--repeats 5]");
  }
  const std::string work = argv[1];
  int big_gb = 8, processing_gb = 4;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--weightd") weightd_bin = argv[i + 1];
    if (flag == "--probe") probe_bin = argv[i + 1];
    if (flag == "--big-gb") big_gb = std::atoi(argv[i + 1]);
    if (flag == "--processing-gb") processing_gb = std::atoi(argv[i + 1]);
    if (flag == "--repeats") repeats = std::atoi(argv[i + 1]);
  }
  if (weightd_bin.empty() || probe_bin.empty()) Die("--weightd and --probe are required");
  fs::create_directories(work);
  socket_dir = work + "/sock";
  no_daemon_dir = work + "/no-daemon";
  ::setenv("WEIGHTD_CACHE_DIR", (work + "/cache-attach").c_str(), 1);

  struct Model {
    std::string label;
    std::string path;
    format::SyntheticOptions options;
  };
  std::vector<Model> models = {
      {"many-tensors (70,000 tensors)", work + "/many-tensors", {.preset = "many-tensors"}},
      {"llama 1 GB", work + "/llama-1g", {.preset = "llama", .size_bytes = 1ull << 30}},
  };
  if (big_gb > 0) {
    models.push_back({"llama " + std::to_string(big_gb) + " GB",
                      work + "/llama-" + std::to_string(big_gb) + "g",
                      {.preset = "llama", .size_bytes = static_cast<uint64_t>(big_gb) << 30}});
  }
  for (const Model& m : models) {
    if (fs::exists(m.path)) continue;
    std::cerr << "generating " << m.path << "\n";
    auto plan = format::WriteSyntheticCheckpoint(m.path, m.options);
    if (!plan.ok()) Die(plan.error().message());
  }

  // The daemon, with room for the biggest model only.
  fs::create_directories(socket_dir);
  ::chmod(socket_dir.c_str(), 0700);
  const uint64_t budget = (static_cast<uint64_t>(std::max(big_gb, 1)) + 2) << 30;
  bench::Child daemon = bench::Spawn({weightd_bin, "serve", "--socket-dir", socket_dir, "--budget",
                                      "host=" + std::to_string(budget)});
  {
    char c;
    std::string line;
    while (::read(daemon.out, &c, 1) == 1 && c != '\n') line += c;
    if (line.find("ready") == std::string::npos) Die("the daemon did not start");
  }

  std::printf("## Resident weight cache (host memory)\n\n");
  std::printf(
      "Written by `make bench` (bench/cache_bench.cc): a `weightd serve` daemon and `weightd`\n"
      "engines as separate processes. Times are what each program measures itself (`seconds`\n"
      "in weightd's JSON, so process start-up is not in them; wall time for cp and dd). Medians\n"
      "of %d unless said otherwise; 8 GB figures are medians of fewer runs. Touching a fresh\n"
      "page of memory cost %.1f us as this section began (its end gives the figure again).\n\n",
      repeats, bench::FreshPageMicros());

  std::printf("### Warm attach against a cold load from disk\n\n");
  std::printf(
      "| model | bytes | warm attach (daemon, zero_copy) | cold load, page cache warm | cold "
      "load, page cache evicted | attach vs cold (warm cache) |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
  struct Throughput {
    std::string label;
    uint64_t bytes;
    double preload_warm, preload_cold, cp_warm, cp_cold, dd_cold;
    PreloadTimes phases_warm;    // medians of each phase
    double preload_cpu, cp_cpu;  // CPU seconds each took, mean of the warm runs
    // The same preloads into transparent huge pages, where they were measured.
    double thp_warm = 0, thp_cold = 0;
  };
  // Preloads into transparent huge pages are measured beside the others
  // where the machine's segments are normal pages (no hugetlbfs pages free,
  // a policy that gives memfds none) and this process may set the policy.
  const std::string policy = memory::ShmemHugePagePolicy();
  const memory::HostPlacement pages = memory::PlanHostSegments(1ull << 30);
  const bool measure_thp = !pages.options.try_huge_pages && !pages.options.transparent_huge_pages &&
                           !policy.empty() && ::access(memory::kShmemHugePagePolicyPath, W_OK) == 0;
  if (measure_thp) {
    std::atexit(PutPolicyBack);
    ::signal(SIGINT, PutPolicyBackAndDie);
    ::signal(SIGTERM, PutPolicyBackAndDie);
  }
  std::vector<Throughput> throughput;
  double attach_small_cache = 0, attach_full_cache = 0;  // the 1 GB model's
  // 64 engines at once on the 1 GB model: started first, then released
  // together, so what is timed is the attach and not 64 process start-ups.
  // Run right after the 1 GB model's own figures, while it is resident and
  // before the big model's stage leaves the machine reclaiming memory.
  std::vector<double> alone;
  std::vector<bench::AttachRound> rounds;
  // Several rounds, each one alone and then 64 at once, percentiles over
  // all rounds' engines: one round is one roll of the scheduler's dice.
  auto measure_concurrent = [&](const std::string& model) {
    std::cerr << "64 engines\n";
    for (int i = 0; i < kConcurrentRounds; ++i) {
      alone.push_back(bench::AttachAll(probe_bin, model, socket_dir, 1, daemon.pid).seconds[0]);
      rounds.push_back(bench::AttachAll(probe_bin, model, socket_dir, 64, daemon.pid));
    }
  };

  for (const Model& m : models) {
    std::cerr << "model " << m.label << "\n";
    const bool big =
        m.label.find(std::to_string(big_gb) + " GB") != std::string::npos && big_gb > 1;
    const int n = big ? std::max(1, repeats / 2) : repeats;
    const uint64_t bytes = DirBytes(m.path);
    Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
    Throughput t{m.label, bytes, 0, 0, 0, 0, 0, {}, 0, 0};
    // Each round runs every variant once, so that a slow spell of the
    // machine (they come and go on small VMs) falls on all of them alike.
    std::vector<double> cp_warm, cp_cold, dd_cold, disk_warm_v, disk_cold_v, pre_warm, pre_cold;
    std::vector<double> headers_warm, plan_warm, read_warm, finish_warm, thp_warm, thp_cold;
    double preload_cpu = 0, cp_cpu = 0;
    // Every timed copy and preload takes memory that the same copy or
    // preload, run untimed just before, freed: this VM hands memory idle
    // for a few seconds back to its host, and taking it again costs more
    // than the copy itself (up to 3 s per GB), which would otherwise decide
    // every figure here.
    for (int i = 0; i < n; ++i) {
      CopyToShm(m.path);
      const double children_before = ChildrenCpuSeconds();
      cp_warm.push_back(CopyToShm(m.path));
      cp_cpu += ChildrenCpuSeconds() - children_before;
      // A first preload, not timed, as for cp; then emptied, so that
      // freeing its segment is not in the timed preload's CPU time (cp's
      // time has no removal in it either).
      PreloadSeconds(m.path);
      if (measure_thp && ResidentInTransparentHugePages()) {
        Die("a preload meant for normal pages is in transparent huge pages");
      }
      Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
      const double daemon_before = bench::ProcessCpuSeconds(daemon.pid);
      const PreloadTimes warm = Preload(m.path);
      preload_cpu += bench::ProcessCpuSeconds(daemon.pid) - daemon_before;
      pre_warm.push_back(warm.seconds);
      headers_warm.push_back(warm.headers);
      plan_warm.push_back(warm.plan);
      read_warm.push_back(warm.read);
      finish_warm.push_back(warm.finish);
      disk_warm_v.push_back(LoadSeconds(m.path, no_daemon_dir, "disk"));
      CopyToShm(m.path);
      EvictPageCache(m.path);
      cp_cold.push_back(CopyToShm(m.path));
      EvictPageCache(m.path);
      pre_cold.push_back(PreloadSeconds(m.path));
      EvictPageCache(m.path);
      disk_cold_v.push_back(LoadSeconds(m.path, no_daemon_dir, "disk"));
      EvictPageCache(m.path);
      dd_cold.push_back(DdToNull(m.path));
      if (measure_thp) {
        // A first preload into huge pages, not timed, for the reason above:
        // the timed ones take the huge pages it freed.
        WithHugePageMemfds(policy, [&] {
          PreloadSeconds(m.path);  // dd has just read the files back into the page cache
          thp_warm.push_back(PreloadSeconds(m.path));
          Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
          EvictPageCache(m.path);
          thp_cold.push_back(PreloadSeconds(m.path));
          if (!ResidentInTransparentHugePages()) {
            Die("a preload meant for transparent huge pages is not in them");
          }
        });
      }
    }
    if (measure_thp) {
      t.thp_warm = bench::Median(thp_warm);
      t.thp_cold = bench::Median(thp_cold);
    }
    t.cp_warm = bench::Median(cp_warm);
    t.cp_cold = bench::Median(cp_cold);
    t.dd_cold = bench::Median(dd_cold);
    t.preload_warm = bench::Median(pre_warm);
    t.preload_cold = bench::Median(pre_cold);
    t.phases_warm = {t.preload_warm, bench::Median(headers_warm), bench::Median(plan_warm),
                     bench::Median(read_warm), bench::Median(finish_warm)};
    t.preload_cpu = preload_cpu / n;
    t.cp_cpu = cp_cpu / n;
    const double disk_warm = bench::Median(disk_warm_v);
    const double disk_cold = bench::Median(disk_cold_v);
    // The last round left the model evicted from the page cache; it stays
    // resident in the daemon (preload).
    PreloadSeconds(m.path);
    // The first attach fills the stat cache.
    LoadSeconds(m.path, socket_dir, "daemon");
    const double attach =
        Repeat(repeats, m.path, false, [&] { return LoadSeconds(m.path, socket_dir, "daemon"); });
    std::printf("| %s | %.2f GB | %s | %s | %s | %.0fx faster |\n", m.label.c_str(),
                static_cast<double>(bytes) / 1e9, Ms(attach).c_str(), Ms(disk_warm).c_str(),
                Ms(disk_cold).c_str(), disk_warm / attach);
    throughput.push_back(t);
    if (&m == &models[1]) {
      measure_concurrent(m.path);
      attach_small_cache = attach;
      attach_full_cache = AttachWithFullStatCache(work, m.path);
    }
  }

  std::printf("\n### Preload throughput against cp into /dev/shm\n\n");
  std::printf(
      "| model | preload, cache warm | cp, cache warm | preload vs cp (warm) | preload, cache "
      "evicted | cp, cache evicted | preload vs cp (evicted) | dd to /dev/null, evicted |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Throughput& t : throughput) {
    std::printf("| %s | %s | %s | %.2fx | %s | %s | %.2fx | %s |\n", t.label.c_str(),
                Gbps(t.bytes, t.preload_warm).c_str(), Gbps(t.bytes, t.cp_warm).c_str(),
                t.cp_warm / t.preload_warm, Gbps(t.bytes, t.preload_cold).c_str(),
                Gbps(t.bytes, t.cp_cold).c_str(), t.cp_cold / t.preload_cold,
                Gbps(t.bytes, t.dd_cold).c_str());
  }

  std::printf("\nThe segments above are %s.\n",
              pages.options.try_huge_pages ? "huge pages from the hugetlbfs pool"
              : pages.options.transparent_huge_pages
                  ? "transparent huge pages (the machine's shmem policy gives memfds those)"
                  : "normal pages (no hugetlbfs pages free, and a shmem policy that gives "
                    "memfds none)");
  if (measure_thp) {
    std::printf(
        "\n#### Preload into transparent huge pages\n\n"
        "The same preloads, in the same rounds, with the kernel's policy for transparent huge\n"
        "pages in shared memory (%s, `%s` on this machine) set to `within_size` for them\n"
        "alone (and put back after): the daemon then makes each segment of whole 2 MiB pages,\n"
        "which the kernel allocates, charges and lists once per 2 MiB written instead of once\n"
        "per page. As above, a first preload in each round is not timed. cp's figures are\n"
        "those above (its files in /dev/shm follow that mount's own `huge=` option, not this\n"
        "policy). Memory that sat free for seconds on this VM costs far more to take again\n"
        "in huge pages than in normal ones (docs/daemon.md, \"Transparent huge pages\").\n\n",
        memory::kShmemHugePagePolicyPath, policy.c_str());
    std::printf(
        "| model | preload, cache warm | preload vs cp (warm) | normal pages / huge pages "
        "(warm) | preload, cache evicted | preload vs cp (evicted) |\n");
    std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for (const Throughput& t : throughput) {
      std::printf("| %s | %s | %.2fx | %.2fx | %s | %.2fx |\n", t.label.c_str(),
                  Gbps(t.bytes, t.thp_warm).c_str(), t.cp_warm / t.thp_warm,
                  t.preload_warm / t.thp_warm, Gbps(t.bytes, t.thp_cold).c_str(),
                  t.cp_cold / t.thp_cold);
    }
  }

  std::printf(
      "\nWhere a preload's time goes, page cache warm (the daemon's own timers, medians):\n"
      "the shards listed (the index parsed) and their headers read and parsed; the headers\n"
      "checked across shards, processing planned, room made in the budget and the segment\n"
      "made; the weights read into the segment, each shard's fingerprint hashed as soon as\n"
      "it is read; padding and samples no read passed by, the files checked unchanged, the\n"
      "segment sealed and the rest of the fingerprint. The key before the load and the reply\n"
      "are in none. The reads alone against cp tell what any layout of the metadata work\n"
      "could reach at best.\n\n");
  std::printf("| model | headers | plan | reads | seal and digest | reads alone vs cp (warm) |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Throughput& t : throughput) {
    std::printf("| %s | %s | %s | %s | %s | %.2fx |\n", t.label.c_str(),
                Ms(t.phases_warm.headers).c_str(), Ms(t.phases_warm.plan).c_str(),
                Ms(t.phases_warm.read).c_str(), Ms(t.phases_warm.finish).c_str(),
                t.cp_warm / t.phases_warm.read);
  }

  const long cores = bench::UsableCores();
  std::printf(
      "\nCPU time each took, page cache warm (user and system, every thread; the daemon's\n"
      "from its process CPU clock, summed over the runs; its request and reply are in it).\n"
      "Spread perfectly over the %ld cores, the preload's CPU time alone is a\n"
      "floor on its wall time; against cp's wall time, that is the best ratio this machine\n"
      "allows whatever the order of the work.\n\n",
      cores);
  std::printf("| model | preload CPU | cp CPU | preload CPU / %ld cores | best vs cp here |\n",
              cores);
  std::printf("| --- | ---: | ---: | ---: | ---: |\n");
  for (const Throughput& t : throughput) {
    const double floor = t.preload_cpu / static_cast<double>(cores);
    char best[32] = "-";  // no CPU time counted: no floor to speak of
    if (floor > 0) std::snprintf(best, sizeof best, "%.2fx", t.cp_warm / floor);
    std::printf("| %s | %s | %s | %s | %s |\n", t.label.c_str(), Ms(t.preload_cpu).c_str(),
                Ms(t.cp_cpu).c_str(), Ms(floor).c_str(), best);
  }

  const bench::AttachSummary attach = bench::Summarize(alone, rounds, cores);
  const double single = attach.alone;
  std::printf("\n### 64 engines attaching at once\n\n");
  std::printf(
      "Each engine (bench/attach_probe, the C++ API) is started first and waits on a pipe;\n"
      "all are then woken together (the pipe is closed), so the times are attaches, not\n"
      "process start-ups. Each engine times its attach itself, from its read of the pipe\n"
      "returning, which is when it first runs after the wake-up; the row from the release\n"
      "also counts its wait for that first turn on a core. On %ld cores; %d rounds, each one\n"
      "engine alone and then 64 at once; percentiles over all %d.\n\n",
      cores, kConcurrentRounds, kConcurrentRounds * 64);
  std::printf("| | time | vs one alone |\n| --- | ---: | ---: |\n");
  std::printf("| one engine alone (median) | %s | 1.0x |\n", Ms(single).c_str());
  std::printf("| 64 at once, p50 | %s | %.1fx |\n", Ms(attach.p50).c_str(), attach.p50 / single);
  std::printf("| 64 at once, p99 | %s | %.1fx |\n", Ms(attach.p99).c_str(), attach.p99 / single);
  // The same, without the rounds the hypervisor took CPU time in: what
  // weightd and this kernel do, apart from the machine's neighbours.
  if (attach.p99_undisturbed > 0) {
    std::printf("| 64 at once, p99 of the %d rounds with no steal recorded | %s | %.1fx |\n",
                kConcurrentRounds - attach.disturbed, Ms(attach.p99_undisturbed).c_str(),
                attach.p99_undisturbed / single);
  }
  std::printf("| 64 at once, p99 from the release (all rounds) | %s | %.1fx |\n",
              Ms(attach.p99_since_release).c_str(), attach.p99_since_release / single);
  std::printf("| a round's CPU time spread over the %ld cores | %s | %.1fx |\n", cores,
              Ms(attach.share).c_str(), attach.share / single);
  std::printf(
      "\nA round of 64 attaches took %s of CPU time (means of the rounds): the engines' own\n"
      "%s, the daemon's %s (each process's CPU clock). Spread over the %ld cores that is\n"
      "%s: about the soonest the last engine could have its weights after the release, for\n"
      "the work as it was done here. An engine whose attach shares the cores with the\n"
      "others from start to end stretches toward it; how far each one does depends on how\n"
      "the kernel interleaves the 64, which no unprivileged process controls. The share\n"
      "would come within 5x one alone from about %.0f cores, if an attach cost there what it\n"
      "costs here.\n",
      Ms(attach.engines_cpu + attach.daemon_cpu).c_str(), Ms(attach.engines_cpu).c_str(),
      Ms(attach.daemon_cpu).c_str(), cores, Ms(attach.share).c_str(), attach.cores_for_5x);
  std::printf(
      "\nAll 64 were served by the daemon (a thread per connection, each accepting its own).\n"
      "The hypervisor took CPU time from this machine (steal time in /proc/stat, counted in\n"
      "10 ms ticks) during %d of the %d rounds, %s in all. Each round:\n\n",
      attach.disturbed, kConcurrentRounds, Ms(attach.stolen).c_str());
  std::printf(
      "| round | release to last answer | CPU time stolen | p50 | slowest |\n"
      "| ---: | ---: | ---: | ---: | ---: |\n");
  for (size_t i = 0; i < rounds.size(); ++i) {
    const bench::AttachRound& r = rounds[i];
    std::printf("| %zu | %s | %s | %s | %s |\n", i + 1, Ms(r.wall).c_str(), Ms(r.stolen).c_str(),
                Ms(bench::Percentile(r.seconds, 50)).c_str(),
                Ms(*std::max_element(r.seconds.begin(), r.seconds.end())).c_str());
  }
  std::printf("\n");

  std::printf("### Warm attach against the size of the stat cache\n\n");
  std::printf(
      "An engine looks its shards up in the fingerprint's stat cache at every start. The 1 GB\n"
      "model's warm attach with the cache the runs above left (a few entries) and with one\n"
      "filled to its limit (%u entries, as on a node that has fingerprinted shards for\n"
      "months). Medians of %d.\n\n",
      fingerprint::StatCache::kMaxEntries, repeats);
  std::printf("| stat cache | warm attach | vs a few entries |\n| --- | ---: | ---: |\n");
  std::printf("| a few entries | %s | 1.00x |\n", Ms(attach_small_cache).c_str());
  std::printf("| %u entries | %s | %.2fx |\n\n", fingerprint::StatCache::kMaxEntries,
              Ms(attach_full_cache).c_str(), attach_full_cache / attach_small_cache);

  if (processing_gb > 0) {
    Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
    MeasureProcessing(work, processing_gb);
  }

  Weightd({"evict", "all", "--json", "--socket-dir", socket_dir});
  std::printf("Touching a fresh page of memory cost %.1f us as this section ended.\n\n",
              bench::FreshPageMicros());
  ::kill(daemon.pid, SIGTERM);
  bench::Finish(daemon, "the daemon");
  return 0;
}
