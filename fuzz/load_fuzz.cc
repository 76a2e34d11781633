// libFuzzer target: a checkpoint made of the input, loaded as a preload and an engine's fallback
// load it (loader::LoadCheckpoint): kept as stored by one worker (samples hashed as they are read,
// where the file's order allows) and by two (hashed from the segment), and replicated to two ranks
// (the processed path). A file the format's rules refuse fails the load; one they accept loads,
// every tensor's bytes, in every segment, are the file's, and the load's digest is the
// fingerprint's. The layout and the copy jobs are made from the header alone (untrusted), and a run
// of small tensors read at once must cover each of them whatever their order and sizes (tensors of
// no bytes included), and the manifest, made while the reads run, takes every shard's tensors by
// name.
//
// The input is up to four pieces, split at kSeparator: each piece a shard
// (model-0000I-of-0000N.safetensors), except one that starts with `{`,
// which is the index (model.safetensors.index.json).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/manifest.h"
#include "transform/plan.h"

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSeparator = "\xfe\xfe\xfe\xfe";
constexpr size_t kMaxPieces = 4;

const std::string& Dir() {
  static const std::string* dir = [] {
    // Named for the process, which the test removes however it ends.
    std::string name = "/tmp/weightd-load-fuzz-" + std::to_string(::getpid()) + "-XXXXXX";
    if (::mkdtemp(name.data()) == nullptr) __builtin_trap();
    auto* s = new std::string(name);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(Dir(), ignored);
    });
    return s;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> pieces;
  for (size_t at = 0; pieces.size() < kMaxPieces;) {
    const size_t end =
        pieces.size() + 1 == kMaxPieces ? std::string_view::npos : input.find(kSeparator, at);
    pieces.push_back(input.substr(at, end == std::string_view::npos ? end : end - at));
    if (end == std::string_view::npos) break;
    at = end + kSeparator.size();
  }
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(Dir())) fs::remove_all(entry.path(), ignored);
  size_t shard_count = 0;
  for (std::string_view piece : pieces) shard_count += piece.starts_with('{') ? 0 : 1;
  size_t shards_written = 0;
  bool have_index = false;
  for (std::string_view piece : pieces) {
    std::string name;
    if (piece.starts_with('{') && !have_index) {
      name = "model.safetensors.index.json";
      have_index = true;
    } else {
      name = "model-0000" + std::to_string(++shards_written) + "-of-0000" +
             std::to_string(shard_count) + ".safetensors";
    }
    std::ofstream out(Dir() + "/" + name, std::ios::binary | std::ios::trunc);
    out.write(piece.data(), static_cast<std::streamsize>(piece.size()));
    if (!out) __builtin_trap();
  }
  io::FileSystem& files = io::PosixFileSystem();
  auto checkpoint = format::OpenCheckpoint(files, Dir());
  auto fingerprint = fingerprint::FingerprintCheckpoint(files, Dir(), {});
  static const auto replicated = transform::ResolveProcessing(2, "keep", "none", "replicate");
  if (!replicated.ok()) __builtin_trap();
  for (const int way : {0, 1, 2}) {
    const bool split = way == 2;
    loader::LoadOptions options;
    options.max_inflight = way == 0 ? 1 : 2;
    options.chunk_bytes = 4096;  // big tensors in many jobs
    if (split) options.processing = *replicated;
    auto loaded = loader::LoadCheckpoint(files, Dir(), options);
    if (!checkpoint.ok()) {
      if (loaded.ok()) __builtin_trap();  // a file the rules refuse is never loaded
      continue;
    }
    if (!loaded.ok()) continue;  // e.g. a tensor the plan cannot count
    if (!fingerprint.ok() || loaded->checkpoint_digest != fingerprint->digest) __builtin_trap();
    size_t tensors = 0;
    std::map<std::string, std::string> shard_bytes;  // each shard listed, as the file holds it
    for (const format::Shard& shard : checkpoint->shards) {
      tensors += shard.header.tensors.size();
      std::ifstream in(shard.path, std::ios::binary);
      shard_bytes[shard.name].assign(std::istreambuf_iterator<char>(in), {});
    }
    for (const loader::LoadedRank& rank : loaded->ranks) {
      const auto segment = rank.segment->readable();
      auto manifest = memory::ReadManifest(segment);
      if (!manifest.ok() || manifest->tensors.size() != tensors) __builtin_trap();
      for (const memory::TensorRecord& t : manifest->tensors) {
        const format::TensorInfo* info = nullptr;
        std::string_view file;
        for (const format::Shard& shard : checkpoint->shards) {
          if ((info = shard.header.Find(t.name)) != nullptr) {
            file = shard_bytes[shard.name];
            if (file.size() < shard.header.data_offset() + info->end) __builtin_trap();
            file.remove_prefix(static_cast<size_t>(shard.header.data_offset() + info->begin));
            break;
          }
        }
        if (info == nullptr || info->bytes() != t.bytes ||
            std::memcmp(segment.data() + t.offset, file.data(), static_cast<size_t>(t.bytes)) !=
                0) {
          __builtin_trap();
        }
      }
    }
  }
  return 0;
}
