// The daemon's resident models: keyed by the cache key, leased by
// connections, held within a memory budget per device.
//
// A model is published only once its segment is complete and sealed. Room
// for a preload is reserved before it starts reading (so concurrent
// preloads cannot overshoot the budget together): idle models (no lease)
// are evicted least recently used first; when leased models alone leave no
// room, the reservation fails with a message that says so. Pinned models
// (named with --pin) are evicted only on request. Evicting a model takes it
// out of the registry; engines that map it keep their bytes, and its bytes
// stay counted against the budget until its last lease ends (the daemon
// holds the segment until then).
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "memory/segment.h"
#include "protocol/cache_key.h"
#include "weightd/result.h"

namespace weightd::daemon {

struct ResidentModel {
  uint64_t id = 0;
  protocol::CacheKey key;
  std::string name;  // pinned name (--pin), may be empty
  std::string path;  // where it was loaded from: for people, never for matching
  std::unique_ptr<memory::Segment> segment;
  uint64_t tensors = 0;
  double load_seconds = 0;
  // Guarded by the registry's mutex.
  int leases = 0;
  bool evicted = false;  // out of the registry, its bytes counted until the last lease ends
  std::chrono::steady_clock::time_point last_used;
};

struct Eviction {
  uint64_t id;
  std::string description;
  uint64_t bytes;
};

class Registry {
 public:
  explicit Registry(uint64_t host_budget) : budget_(host_budget) {}

  // Reserves `bytes` for a model about to be loaded, evicting idle models as
  // needed (reported in `evicted`). Give the bytes back with Unreserve, or
  // hand them to Publish.
  Status Reserve(uint64_t bytes, std::vector<Eviction>* evicted);
  void Unreserve(uint64_t bytes);

  // Makes a complete model visible; its reservation becomes its use. A model
  // with the same key already resident is replaced (its leases keep their
  // own bytes).
  std::shared_ptr<ResidentModel> Publish(std::unique_ptr<ResidentModel> model,
                                         uint64_t reserved_bytes);

  struct Lookup {
    std::shared_ptr<ResidentModel> model;             // set on a hit, with a lease taken
    std::vector<protocol::FieldDifference> mismatch;  // on a miss, against the closest model
    std::string reason;                               // on a miss
  };
  // Finds the model for `key` and leases it. `trust` (not empty) names a
  // pinned model whose content is not compared (every other field is).
  Lookup Acquire(const protocol::CacheKey& key, const std::string& trust);
  void Release(const std::shared_ptr<ResidentModel>& model);

  // Whether a model with exactly this key is resident.
  bool Has(const protocol::CacheKey& key) const;

  // Names the resident model with `key` (taking the name from any other);
  // false when none is resident.
  bool Pin(const protocol::CacheKey& key, const std::string& name);

  // One load per key at a time: BeginLoad waits while another load of
  // `key` is in flight, then marks it in flight; EndLoad clears the mark.
  void BeginLoad(const protocol::CacheKey& key);
  void EndLoad(const protocol::CacheKey& key);

  // Evicts models matching `what`: "all", a pinned name, a prefix (at
  // least 8 characters) of the checkpoint digest, or "#ID" (one model, as
  // status numbers it: one rank of a tensor-parallel preload).
  std::vector<Eviction> Evict(const std::string& what);

  struct Snapshot {
    std::vector<std::shared_ptr<ResidentModel>> models;
    std::vector<int> leases;
    std::vector<double> idle_seconds;
    uint64_t budget = 0;
    uint64_t used = 0;
    uint64_t reserved = 0;
  };
  Snapshot Take() const;

 private:
  // REQUIRES: mu_ held.
  Eviction EvictLocked(size_t index);
  // Takes `name` from every model but the ranks of `group` (keys equal but
  // for tp_rank): a name pins all the ranks one preload made.
  // REQUIRES: mu_ held.
  void TakeNameLocked(const std::string& name, const protocol::CacheKey& group);

  mutable std::mutex mu_;
  std::condition_variable load_done_;
  std::vector<protocol::CacheKey> loading_;
  std::vector<std::shared_ptr<ResidentModel>> models_;
  uint64_t budget_;
  uint64_t used_ = 0;
  uint64_t reserved_ = 0;
  uint64_t next_id_ = 1;
};

}  // namespace weightd::daemon
