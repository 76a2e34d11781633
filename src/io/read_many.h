// Many positioned reads in flight at once. On local disks a few in flight keep
// the device busy; on network and FUSE file systems each read costs a round
// trip, and only many in flight hide it. Callers describe the reads they
// want; ReadMany issues them from a team of threads, at most `max_inflight`
// at a time, and reports what it did.
//
// Thread safety: ReadMany may be called from several threads at once; each
// call has its own team. The destination buffers must not overlap.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "io/file.h"

namespace weightd::io {

struct ReadRequest {
  const RandomAccessFile* file = nullptr;
  uint64_t offset = 0;
  std::span<std::byte> dst;
};

struct ReadStats {
  uint64_t reads = 0;
  uint64_t bytes = 0;
};

struct ReadOptions {
  // How many reads may be outstanding at once; 1 reads in order on the
  // calling thread.
  int max_inflight = 8;
};

// Performs every request. On failure returns the first error seen (by
// request order among the failures observed); the contents of the buffers are
// then unspecified.
Status ReadMany(std::span<const ReadRequest> requests, const ReadOptions& options,
                ReadStats* stats = nullptr);

// Reads the whole file front to back in `chunk_bytes` pieces, up to
// `max_inflight` chunks at once, and hands each chunk to `consume` in file
// order. A consume error stops the read and is returned.
//
// The defaults come from the page-cache-warm case (docs/benchmarks.md):
// there a read is a memory copy, and chunks that fit in L2 with two copies
// at once beat both `cat` and larger chunks; more readers than cores lose.
struct StreamOptions {
  uint64_t chunk_bytes = 256 << 10;
  int max_inflight = 2;
};
Status StreamFile(const RandomAccessFile& file, const StreamOptions& options,
                  const std::function<Status(uint64_t offset, std::span<const std::byte>)>& consume,
                  ReadStats* stats = nullptr);

// Reads every byte of every file (a checkpoint's shards), the files one
// after another, each with StreamFile. What a cold load costs at least.
Status ReadFilesFully(FileSystem& fs, const std::vector<std::string>& paths,
                      const StreamOptions& options, ReadStats* stats = nullptr);

// Runs body(worker) for worker = 0 .. workers-1, up to `workers` at once on
// the shared WorkerPool (the calling thread is worker 0), and returns when
// all have finished; what a body throws is rethrown then (WorkerPool::RunTeam).
// For per-file work (reading many shards' headers) where ReadMany's unit,
// one read, is too small. Bodies should pull their work from a shared
// counter rather than assume every worker runs at once.
void RunTeam(int workers, const std::function<void(int worker)>& body);

}  // namespace weightd::io
