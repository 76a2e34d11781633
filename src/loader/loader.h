// Reads a checkpoint into resident segments, one per tensor-parallel rank,
// processed as asked (split, cast, quantized): the one loading path, run by
// the daemon (preload, every rank in one pass) and by an engine's disk
// fallback (its own rank, reading only what that rank needs) alike, so both
// get the same bytes at the same offsets.
//
// Every header is read and checked first (each shard's alone, then across
// shards and against the index), then the processing is planned
// (transform::PlanTensors: every check that needs no weight bytes, so a
// checkpoint the plan cannot serve fails before any are read); then each
// rank's segment is sized, its outputs laid out by name, and allocated (by
// the caller: the daemon checks its budget there); then every tensor's
// bytes are read and written into place. A load that keeps every tensor as
// stored (one rank, no processing) plans nothing: it lays each shard out as
// its file has it, from that header alone, as soon as it is parsed (shard
// by shard, each in file order), and its manifest, every tensor by name, is
// made by one worker while the others read. Either way,
// many reads in flight, each through a small per-thread buffer (never a copy
// of the whole model), processed on the way where the plan says so, while
// one worker writes the manifest. Each source byte is read once however
// many ranks are built. The sampled fingerprint (headers and the first KiB
// of each tensor as the file has it) comes from the same reads: caught as
// they pass, or hashed from the segment for tensors copied into it
// unchanged, shard by shard as each is read. So the key a daemon publishes
// describes exactly what it loaded. A shard that changed while it was read (its stat signature
// moved) or came up short fails the load; nothing is returned half-filled.
//
// Thread safety: LoadCheckpoint may run concurrently with itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/file.h"
#include "memory/segment.h"
#include "transform/plan.h"
#include "weightd/result.h"

namespace weightd::loader {

struct LoadOptions {
  // Reads outstanding at once, and the size of each (big tensors are split).
  int max_inflight = 32;
  uint64_t chunk_bytes = 4 << 20;
  // What the workers' buffers may take together, about: each worker's is
  // as big as its largest job (a run of small tensors of up to chunk_bytes,
  // a band of rows read, processed and written), and fewer workers run
  // where more would pass this, one at least. A daemon in a container
  // gives what it keeps of its memory limit for its own work.
  uint64_t buffer_bytes = 512ull << 20;
  // Called now and then with bytes read so far and bytes to read.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // What to do to the weights; by default nothing (one rank, as stored).
  transform::Processing processing;
  // The ranks to build, each into its own segment; empty: every rank.
  std::vector<int> ranks;
  // Makes a rank's segment once its size is known; by default a host
  // segment.
  std::function<Result<std::unique_ptr<memory::Segment>>(uint64_t bytes, int rank)> allocate;
  // When set and it turns true, the load stops with an error (a daemon
  // shutting down). Not owned.
  const std::atomic<bool>* cancel = nullptr;
  // Names the segments (shows in /proc/PID/maps).
  std::string segment_name = "model";
};

struct LoadedRank {
  int rank = 0;
  std::unique_ptr<memory::Segment> segment;  // sealed
};

struct LoadedModel {
  std::vector<LoadedRank> ranks;  // as asked
  // A copy of the manifest every segment starts with, in host memory, when
  // some segment cannot be read back here (a GPU's); else empty.
  std::vector<std::byte> manifest;
  std::string checkpoint_digest;  // sampled fingerprint, tagged
  // Each shard read: its name (as a fingerprint names it) and the stat
  // signature its file had from its header's read to the end of the load.
  struct ReadShard {
    std::string name;
    io::StatSignature signature;
  };
  std::vector<ReadShard> read_shards;
  uint64_t shards = 0;
  uint64_t tensors = 0;     // per rank
  uint64_t data_bytes = 0;  // tensor bytes read from the files
  uint64_t reads = 0;
  int workers = 0;  // jobs run at once
  double seconds = 0;
  // Where `seconds` went: the shards listed (the index parsed) and every
  // header read and parsed (and laid out, where tensors are kept as
  // stored); the headers checked across shards, the processing planned and
  // the segments made, by `allocate` (before any weight byte is read); the
  // weights read into place (and the manifest made, where tensors are kept
  // as stored), and the fingerprint
  // of each shard whose samples were all caught as it was read; the
  // vocabulary padding and the samples no read passed by, the files checked
  // unchanged, the segments sealed and the rest of the fingerprint.
  struct Phases {
    double headers = 0;
    double plan = 0;
    double read = 0;
    double finish = 0;
  } phases;
};

Result<LoadedModel> LoadCheckpoint(io::FileSystem& fs, const std::string& path,
                                   const LoadOptions& options = {});

}  // namespace weightd::loader
