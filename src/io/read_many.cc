#include "io/read_many.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "io/worker_pool.h"

namespace weightd::io {
namespace {

// Keeps the error of the lowest-numbered failed item, so that which error is
// reported does not depend on thread timing more than it must.
class FirstError {
 public:
  void Record(size_t index, const Error& error) {
    std::lock_guard lock(mu_);
    if (!error_ || index < index_) {
      error_ = error;
      index_ = index;
    }
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  Status status() const {
    std::lock_guard lock(mu_);
    if (error_) return *error_;
    return OkStatus();
  }

 private:
  mutable std::mutex mu_;
  std::optional<Error> error_;
  size_t index_ = 0;
  std::atomic<bool> failed_{false};
};

}  // namespace

void RunTeam(int workers, const std::function<void(int)>& body) {
  WorkerPool::Shared().RunTeam(workers, body);
}

Status ReadMany(std::span<const ReadRequest> requests, const ReadOptions& options,
                ReadStats* stats) {
  const size_t n = requests.size();
  const int workers = static_cast<int>(std::min<size_t>(std::max(options.max_inflight, 1), n));
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> reads{0};
  FirstError first_error;

  RunTeam(std::max(workers, 1), [&](int) {
    while (!first_error.failed()) {
      size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      const ReadRequest& r = requests[i];
      Status s = r.file->ReadExactly(r.offset, r.dst);
      if (!s.ok()) {
        first_error.Record(i, s.error());
        return;
      }
      reads.fetch_add(1, std::memory_order_relaxed);
      bytes.fetch_add(r.dst.size(), std::memory_order_relaxed);
    }
  });

  if (stats != nullptr) {
    stats->reads += reads.load();
    stats->bytes += bytes.load();
  }
  return first_error.status();
}

Status StreamFile(const RandomAccessFile& file, const StreamOptions& options,
                  const std::function<Status(uint64_t, std::span<const std::byte>)>& consume,
                  ReadStats* stats) {
  const uint64_t size = file.size();
  const uint64_t chunk = std::max<uint64_t>(std::min(options.chunk_bytes, size), 4096);
  const uint64_t chunks = size / chunk + (size % chunk != 0);
  if (chunks == 0) return OkStatus();
  const int workers =
      static_cast<int>(std::min<uint64_t>(std::max(options.max_inflight, 1), chunks));

  // Each worker claims the next chunk, reads it into its own buffer, then
  // waits for its turn so that `consume` sees the chunks in file order, one
  // at a time, while the other workers' reads are already in flight. Chunks
  // are claimed in order, so the owner of the next chunk to consume is never
  // itself waiting: one worker alone still makes progress.
  std::atomic<uint64_t> next_chunk{0};
  std::mutex mu;
  std::condition_variable turn_changed;
  uint64_t turn = 0;
  FirstError first_error;
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> reads{0};

  // A worker that throws (an allocation refused) between claiming a chunk
  // and passing the turn on would leave the others waiting for that turn:
  // it marks the stream abandoned first, and RunTeam hands the exception on.
  bool abandoned = false;  // guarded by mu
  RunTeam(workers, [&](int) {
    std::unique_ptr<std::byte[]> buffer(new std::byte[chunk]);
    try {
      for (uint64_t c; (c = next_chunk.fetch_add(1)) < chunks;) {
        const uint64_t offset = c * chunk;
        const size_t len = static_cast<size_t>(std::min(chunk, size - offset));
        std::span<std::byte> dst(buffer.get(), len);
        Status read = first_error.failed() ? OkStatus() : file.ReadExactly(offset, dst);
        std::unique_lock lock(mu);
        turn_changed.wait(lock, [&] { return turn == c || first_error.failed() || abandoned; });
        if (first_error.failed() || abandoned) break;
        if (!read.ok()) {
          first_error.Record(c, read.error());
        } else {
          bytes.fetch_add(len, std::memory_order_relaxed);
          reads.fetch_add(1, std::memory_order_relaxed);
          // Consuming under the lock keeps chunks strictly ordered; the other
          // workers are blocked only once their own read has finished.
          Status s = consume(offset, dst);
          if (!s.ok()) first_error.Record(c, s.error());
        }
        ++turn;
        turn_changed.notify_all();
        if (first_error.failed()) break;
      }
    } catch (...) {
      {
        std::lock_guard lock(mu);  // released while unwinding, if it was held
        abandoned = true;
      }
      turn_changed.notify_all();
      throw;
    }
  });

  if (stats != nullptr) {
    stats->reads += reads.load();
    stats->bytes += bytes.load();
  }
  return first_error.status();
}

Status ReadFilesFully(FileSystem& fs, const std::vector<std::string>& paths,
                      const StreamOptions& options, ReadStats* stats) {
  for (const std::string& path : paths) {
    WEIGHTD_ASSIGN_OR_RETURN(auto file, fs.Open(path));
    WEIGHTD_RETURN_IF_ERROR(StreamFile(
        *file, options, [](uint64_t, std::span<const std::byte>) { return OkStatus(); }, stats));
  }
  return OkStatus();
}

}  // namespace weightd::io
