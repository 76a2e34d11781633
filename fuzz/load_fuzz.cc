// libFuzzer target: a checkpoint of one shard whose bytes are the input,
// loaded as a preload and an engine's fallback load it
// (loader::LoadCheckpoint): kept as stored by one worker (samples hashed
// as they are read, where the file's order allows) and by two (hashed from
// the segment), and replicated to two ranks (the processed path). A file
// the format's rules refuse fails the load; one they accept loads, every
// tensor's bytes, in every segment, are the file's, and the load's digest
// is the fingerprint's. The layout and the copy jobs are made from the
// header alone (untrusted), and a run of small tensors read at once must
// cover each of them whatever their order and sizes (tensors of no bytes
// included).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/manifest.h"
#include "transform/plan.h"

namespace {

namespace fs = std::filesystem;

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
  const std::string path = Dir() + "/model.safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
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
    const format::ShardHeader& header = checkpoint->shards[0].header;
    for (const loader::LoadedRank& rank : loaded->ranks) {
      const auto segment = rank.segment->readable();
      auto manifest = memory::ReadManifest(segment);
      if (!manifest.ok() || manifest->tensors.size() != header.tensors.size()) __builtin_trap();
      for (const memory::TensorRecord& t : manifest->tensors) {
        const format::TensorInfo* info = header.Find(t.name);
        if (info == nullptr || info->bytes() != t.bytes ||
            std::memcmp(segment.data() + t.offset, data + header.data_offset() + info->begin,
                        static_cast<size_t>(t.bytes)) != 0) {
          __builtin_trap();
        }
      }
    }
  }
  return 0;
}
