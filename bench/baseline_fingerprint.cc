// The fingerprint schemes engines use today, as references for
// bench/fingerprint_bench.cc. Deliberately independent of weightd's library:
// plain POSIX reads, nlohmann-json for headers, XXH3 for hashing.
//
//   baseline_fingerprint per-tensor DIR [--workers 32]
//     Shard by shard: open, read the 8-byte length, read the header (two
//     reads per shard); then one 1 KiB pread per tensor from 32 worker
//     threads; hash everything in name order.
//   baseline_fingerprint header-only DIR
//     Shard by shard: open, read the length, read the header, hash it. Fast
//     where it works, but blind to a fine-tune with its base's layout.
//
// Prints one JSON line: scheme, digest, shards, tensors, reads, bytes_read,
// round_trips (lookups, opens and reads one after another), seconds.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "baseline_fingerprint: error: %s\n", what.c_str());
  std::exit(1);
}

// The shard names, from the index when there is one (whose size is added
// to `index_bytes`).
std::vector<std::string> Shards(const std::string& dir, uint64_t* index_bytes) {
  std::set<std::string> names;
  const std::string index = dir + "/model.safetensors.index.json";
  if (std::filesystem::exists(index)) {
    *index_bytes = std::filesystem::file_size(index);
    std::ifstream in(index);
    const nlohmann::json parsed = nlohmann::json::parse(in);
    for (const auto& entry : parsed.at("weight_map").items()) {
      names.insert(entry.value().get<std::string>());
    }
  } else {
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") names.insert(e.path().filename().string());
    }
  }
  return {names.begin(), names.end()};
}

void ReadAt(int fd, void* buf, size_t len, uint64_t offset) {
  if (::pread(fd, buf, len, static_cast<off_t>(offset)) != static_cast<ssize_t>(len))
    Die("short read");
}

struct Sample {
  int fd;
  uint64_t offset;
  uint64_t length;
  std::string bytes;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) Die("usage: baseline_fingerprint per-tensor|header-only DIR [--workers N]");
  const std::string scheme = argv[1], dir = argv[2];
  int workers = 32;
  if (argc >= 5 && std::string(argv[3]) == "--workers") workers = std::max(1, std::atoi(argv[4]));
  const bool per_tensor = scheme == "per-tensor";
  if (!per_tensor && scheme != "header-only") Die("unknown scheme " + scheme);

  const auto start = std::chrono::steady_clock::now();
  uint64_t index_bytes = 0;
  const std::vector<std::string> shards = Shards(dir, &index_bytes);
  uint64_t reads = index_bytes > 0 ? 1 : 0, bytes = index_bytes, tensors = 0;
  XXH3_state_t* h = XXH3_createState();
  XXH3_128bits_reset(h);
  std::vector<Sample> samples;
  std::vector<int> fds;
  for (const std::string& name : shards) {
    const int fd = ::open((dir + "/" + name).c_str(), O_RDONLY);
    if (fd < 0) Die(name + ": " + std::strerror(errno));
    fds.push_back(fd);
    uint64_t n = 0;
    ReadAt(fd, &n, 8, 0);
    std::string header(n, '\0');
    ReadAt(fd, header.data(), n, 8);
    reads += 2;
    bytes += 8 + n;
    XXH3_128bits_update(h, name.data(), name.size());
    XXH3_128bits_update(h, header.data(), header.size());
    if (!per_tensor) continue;
    std::map<std::string, std::pair<uint64_t, uint64_t>> by_name;  // name order, as weightd
    const nlohmann::json parsed = nlohmann::json::parse(header);
    for (const auto& entry : parsed.items()) {
      if (entry.key() == "__metadata__") continue;
      const auto& offsets = entry.value().at("data_offsets");
      by_name[entry.key()] = {offsets.at(0).get<uint64_t>(), offsets.at(1).get<uint64_t>()};
    }
    for (const auto& [tensor, range] : by_name) {
      samples.push_back(
          {fd, 8 + n + range.first, std::min<uint64_t>(1024, range.second - range.first), {}});
    }
    tensors += by_name.size();
  }
  if (per_tensor) {
    std::atomic<size_t> next{0};
    std::vector<std::thread> team;
    for (int w = 0; w < workers; ++w) {
      team.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < samples.size();) {
          Sample& s = samples[i];
          s.bytes.resize(s.length);
          ReadAt(s.fd, s.bytes.data(), s.length, s.offset);
        }
      });
    }
    for (auto& t : team) t.join();
    for (const Sample& s : samples) {
      XXH3_128bits_update(h, s.bytes.data(), s.bytes.size());
      bytes += s.length;
    }
    reads += samples.size();
  }
  for (int fd : fds) ::close(fd);
  const XXH128_hash_t digest = XXH3_128bits_digest(h);
  XXH3_freeState(h);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Shards one after another, each: lookup, open, two reads; then the
  // sample reads in waves of `workers`.
  const uint64_t round_trips =
      2 + 4 * shards.size() + (per_tensor ? (samples.size() + workers - 1) / workers : 0);
  std::printf(
      "{\"scheme\": \"%s\", \"digest\": \"%016llx%016llx\", \"shards\": %zu, \"tensors\": %llu, "
      "\"reads\": %llu, \"bytes_read\": %llu, \"round_trips\": %llu, \"seconds\": %.6f}\n",
      scheme.c_str(), static_cast<unsigned long long>(digest.high64),
      static_cast<unsigned long long>(digest.low64), shards.size(),
      static_cast<unsigned long long>(tensors), static_cast<unsigned long long>(reads),
      static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(round_trips),
      seconds);
  return 0;
}
