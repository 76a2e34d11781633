// Reads a checkpoint into one resident segment: the one loading path, run
// by the daemon (preload) and by an engine's disk fallback alike, so both
// get the same bytes at the same offsets.
//
// Every header is read and checked first; then the segment is sized,
// allocated (by the caller: the daemon checks its budget there) and its
// manifest written; then every tensor's bytes are read and written into
// their place in the segment, many reads in flight, each through a small
// per-thread buffer (never a copy of the whole model).
// The sampled fingerprint comes from the same bytes (headers and the first
// KiB of each tensor, now in the segment), so the key a daemon publishes
// describes exactly what it loaded. A shard that changed while it was read
// (its stat signature moved) or came up short fails the load; nothing is
// returned half-filled.
//
// Thread safety: LoadCheckpoint may run concurrently with itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "io/file.h"
#include "memory/segment.h"
#include "weightd/result.h"

namespace weightd::loader {

struct LoadOptions {
  // Reads outstanding at once, and the size of each (big tensors are split).
  int max_inflight = 32;
  uint64_t chunk_bytes = 4 << 20;
  // Called now and then with bytes read so far and bytes to read.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Makes the segment once its size is known; by default a host segment.
  std::function<Result<std::unique_ptr<memory::Segment>>(uint64_t bytes)> allocate;
  // When set and it turns true, the load stops with an error (a daemon
  // shutting down). Not owned.
  const std::atomic<bool>* cancel = nullptr;
  // Names the segment (shows in /proc/PID/maps).
  std::string segment_name = "model";
};

struct LoadedModel {
  std::unique_ptr<memory::Segment> segment;  // sealed
  std::string checkpoint_digest;             // sampled fingerprint, tagged
  uint64_t shards = 0;
  uint64_t tensors = 0;
  uint64_t data_bytes = 0;  // tensor bytes read
  uint64_t reads = 0;
  double seconds = 0;
};

Result<LoadedModel> LoadCheckpoint(io::FileSystem& fs, const std::string& path,
                                   const LoadOptions& options = {});

}  // namespace weightd::loader
