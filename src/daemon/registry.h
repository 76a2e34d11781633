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
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "memory/segment.h"
#include "protocol/cache_key.h"
#include "weightd/result.h"

namespace weightd::daemon {

struct ResidentModel {
  uint64_t id = 0;
  protocol::CacheKey key;
  // Pinned name (--pin), may be empty. Guarded by the registry's mutex:
  // read it from a Lookup or a Snapshot.
  std::string name;
  std::string path;  // where it was loaded from: for people, never for matching
  // Its shard files as loaded (names and sizes): whether a miss is against
  // a model of the engine's layout, never for matching.
  std::vector<protocol::ShardSize> shards;
  std::unique_ptr<memory::Segment> segment;
  // A GPU's model: its manifest in host memory, sent along with the
  // segment (an engine cannot read it off the GPU without a copy).
  // One copy for all the ranks of a preload.
  std::shared_ptr<memory::Segment> manifest;
  uint64_t tensors = 0;
  double load_seconds = 0;
  // Guarded by the registry's mutex.
  int leases = 0;
  bool evicted = false;  // out of the registry, its bytes counted until the last lease ends
  std::chrono::steady_clock::time_point last_used;
};

// A pinned name (--pin): 1 to 64 letters, digits, '.', '_' and '-', the
// first a letter or a digit, and not `all` (what `evict all` means). An
// error says why.
Status CheckPinName(std::string_view name);

struct Eviction {
  uint64_t id;
  std::string description;
  uint64_t bytes;
  int leases = 0;  // engines that still map it: its bytes stay held until they let go
  protocol::CacheKey key = {};
  std::string path = {};  // where it was loaded from
  std::string name = {};  // its pinned name, or empty
};

class Registry {
 public:
  // What the kernel would still give in host memory, read at every host
  // reservation: `free` (the machine's memory, or its control group's), of
  // which a reservation leaves `keep` for the daemon's own working memory;
  // `what` says where the figure comes from. Memory held outside the
  // budget (segments engines still map from a daemon that stopped, other
  // processes of the same control group) leaves less than the budget says,
  // and idle models are evicted for it as for the budget.
  struct Room {
    uint64_t free = 0;
    uint64_t keep = 0;
    std::string what;
    // Of the reservations of loads in progress, the bytes their segments
    // hold already, read before `free` (which then lacks them): not counted
    // as still to come.
    uint64_t filled = 0;
  };
  using RoomProbe = std::function<std::optional<Room>()>;

  // Devices are named as keys name them ("host", "cuda:GPU-..."); the host
  // has a budget from the start, a GPU once SetBudget gives it one. Without
  // `host_room` (or where it has no figure), the budget alone decides.
  explicit Registry(uint64_t host_budget, RoomProbe host_room = {})
      : host_room_(std::move(host_room)) {
    accounts_["host"].budget = host_budget;
  }

  // Sets `device`'s budget. Models already held stay, over it or not.
  void SetBudget(const std::string& device, uint64_t bytes);

  // Reserves `bytes` on `device` for a model about to be loaded, evicting
  // idle models of that device as needed (reported in `evicted`). Give the
  // bytes back with Unreserve, or hand them to Publish. An error for a
  // device without a budget.
  Status Reserve(const std::string& device, uint64_t bytes, std::vector<Eviction>* evicted);
  // The same on several devices (each named once) at once: room on every
  // one, or an error with nothing evicted anywhere. Without `weigh_room`,
  // the budget alone decides (the bytes come from elsewhere than what the
  // room probe measures: a huge-page pool).
  Status Reserve(const std::vector<std::pair<std::string, uint64_t>>& needs,
                 std::vector<Eviction>* evicted, bool weigh_room = true);
  void Unreserve(const std::string& device, uint64_t bytes);

  // Makes a complete model visible; its reservation (on the device its key
  // names) becomes its use. If it throws (an allocation refused), the
  // reservation is still the caller's. A model with the same key already resident is
  // replaced (its leases keep their own bytes). A named model takes its
  // name from every model whose key is not in `group` (the keys of every
  // rank of the same preload; its own key is always in it); the paths of
  // those models are added to `taken_from`. With `inherit_name` (a preload
  // that names none), an unnamed model takes the name the other ranks of
  // its group have now, if any: decided here, under the lock, not from a
  // look before the load, when a name may since have moved or gone.
  std::shared_ptr<ResidentModel> Publish(std::unique_ptr<ResidentModel> model,
                                         uint64_t reserved_bytes,
                                         const std::vector<protocol::CacheKey>& group = {},
                                         std::vector<std::string>* taken_from = nullptr,
                                         bool inherit_name = false);

  // `model`'s pinned name now (empty for none), read under the lock: a
  // preload pinning the name elsewhere may take it at any time.
  std::string NameOf(const ResidentModel& model) const;

  struct Lookup {
    std::shared_ptr<ResidentModel> model;             // set on a hit, with a lease taken
    std::vector<protocol::FieldDifference> mismatch;  // on a miss, against the closest model
    std::string reason;                               // on a miss
    std::string name;                                 // on a hit: its pinned name, if any
    bool loading = false;       // on a miss: a load of exactly this key is in flight
    double waited_seconds = 0;  // how long it waited for loads; 0 when it answered at once
    bool asker_gone = false;    // the wait ended because `gone` said so
  };
  // Finds the model for `key` and leases it. `trust` (not empty) names a
  // pinned model whose content is not compared (every other field is).
  // Missing it while a load of exactly `key` is in flight or queued (for a
  // GPU key, of the same model into host memory too: the host-tier
  // reload's source), waits for that load until `wait_until` (default: no
  // wait) and looks again;
  // with a wait, also while announced loads are not keyed yet (ExpectLoads).
  // Trusted, with a wait and no resident model of that name on the key's
  // rank and device, it waits instead while loads that will pin that name
  // are coming (ExpectPin), and looks again once none is; never a miss
  // with `loading`.
  // `gone`, when given, is asked every half second of a wait whether the
  // asker went away: then the wait ends, a miss with `asker_gone`.
  // A miss is explained against the same model on another device first,
  // then one loaded from `path` (the engine's checkpoint), then one of the
  // engine's layout (`shards`, its files; where given), then the model
  // with the fewest differing fields: never a hit by path. Where `shards`
  // is given and no model of that layout or from `path` is resident, the
  // miss names no differing fields: a cold start, not a changed checkpoint.
  Lookup Acquire(const protocol::CacheKey& key, const std::string& trust,
                 std::chrono::steady_clock::time_point wait_until = {},
                 const std::string& path = {}, const std::function<bool()>& gone = {},
                 const std::vector<protocol::ShardSize>* shards = nullptr);
  void Release(const std::shared_ptr<ResidentModel>& model);

  // Names every resident model whose key is in `group` (the ranks of one
  // preload), taking the name from every other (their paths are added to
  // `taken_from`); false when none is resident.
  bool Pin(const std::vector<protocol::CacheKey>& group, const std::string& name,
           std::vector<std::string>* taken_from = nullptr);

  // One load per model at a time: BeginLoad waits while another load of
  // any of `keys` (every rank of one preload) is in flight, then marks
  // them all in flight; EndLoad clears the marks.
  void BeginLoad(const std::vector<protocol::CacheKey>& keys);
  void EndLoad(const std::vector<protocol::CacheKey>& keys);

  // Loads announced before their keys are known (the config's models,
  // loaded one after another): an acquire that may wait also waits until
  // each is keyed, since any may be its model. Queue marks a load's keys
  // as coming (acquires wait for them as for a load in flight, and it
  // counts as keyed) while it waits for its turn; Unqueue takes the marks
  // off once BeginLoad has marked the keys loading (never before: between
  // the two, an acquire would find its model neither coming nor resident),
  // or when it gives up. DropExpected(n) for
  // announced loads that fail before Queue; DropExpected() for all of them
  // and every queued mark (a stop).
  void ExpectLoads(size_t n);
  // A load that will pin `name` once its model is resident (a config's
  // model, announced before it is keyed; a preload with a pin), until
  // DropPin: a trusted acquire of that name may wait for it, as one by
  // key waits for its key. Counted: each ExpectPin needs its DropPin.
  // DropExpected() (a stop) drops them all.
  void ExpectPin(const std::string& name);
  void DropPin(const std::string& name);
  void Queue(const std::vector<protocol::CacheKey>& keys);
  void Unqueue(const std::vector<protocol::CacheKey>& keys);
  void DropExpected(size_t n = SIZE_MAX);

  // A preload that failed once its keys were known (out of budget, a read
  // error, the files changed), and why: told to engines that then miss
  // asking for exactly one of those keys, until a model with that key is
  // published. The newest kFailedLoadsKept keys are kept, each reason cut
  // to kFailedLoadReasonBytes.
  void NoteFailedLoad(const std::vector<protocol::CacheKey>& keys, const std::string& why);
  static constexpr size_t kFailedLoadsKept = 64;
  static constexpr size_t kFailedLoadReasonBytes = 1024;

  // Evicts models matching `what`: "all", a pinned name (that model alone,
  // when it also reads as a digest prefix), a prefix (at least 8
  // characters, either case, a trailing ellipsis ignored) of the checkpoint
  // digest, or "#ID" (one model, as status numbers it: one rank of a
  // tensor-parallel preload).
  std::vector<Eviction> Evict(const std::string& what);

  struct DeviceUse {
    std::string device;
    uint64_t budget = 0;
    uint64_t used = 0;
    uint64_t reserved = 0;
    // Of `used`: evicted models that engines still map, freed when the
    // last of them lets go.
    uint64_t evicted_leased = 0;
    uint64_t evicted_leased_models = 0;
  };
  struct Snapshot {
    std::vector<std::shared_ptr<ResidentModel>> models;
    std::vector<int> leases;
    std::vector<std::string> names;
    std::vector<double> idle_seconds;
    std::vector<DeviceUse> devices;  // host first, then GPUs by name
  };
  Snapshot Take() const;
  // The devices with a budget, the host first (cheap: for every hello).
  std::vector<std::string> Devices() const;

 private:
  // Models taken out, kept here until the registry's lock is released: the
  // last reference may free a GPU's memory, which can take a while.
  using Dropped = std::vector<std::shared_ptr<ResidentModel>>;
  // REQUIRES: mu_ held.
  Eviction EvictLocked(size_t index, Dropped& dropped);
  // REQUIRES: mu_ held.
  Lookup AcquireLocked(const protocol::CacheKey& key, const std::string& trust,
                       const std::string& path, const std::vector<protocol::ShardSize>* shards);
  // REQUIRES: mu_ held.
  bool LoadingLocked(const protocol::CacheKey& key) const;
  // Takes `name` from every model whose key is not in `group`: a name pins
  // all the ranks one preload made, whatever device each is on.
  // REQUIRES: mu_ held.
  void TakeNameLocked(const std::string& name, const std::vector<protocol::CacheKey>& group,
                      std::vector<std::string>* taken_from);

  mutable std::mutex mu_;
  std::condition_variable load_done_;
  std::vector<protocol::CacheKey> loading_;
  std::deque<std::pair<protocol::CacheKey, std::string>> failed_loads_;  // key, why; newest last
  size_t expected_ = 0;                     // announced loads not keyed yet
  std::vector<protocol::CacheKey> queued_;  // keys of announced loads waiting for their turn
  std::multiset<std::string> pins_coming_;  // names loads in flight or announced will pin
  struct Account {
    uint64_t budget = 0;
    uint64_t used = 0;
    uint64_t reserved = 0;
    uint64_t evicted_leased = 0;  // of `used`
    uint64_t evicted_leased_models = 0;
    // Reservations that ended, all told: made use of, or given back.
    uint64_t ended_bytes = 0;
  };
  // REQUIRES: mu_ held.
  Account& AccountLocked(const std::string& device) { return accounts_[device]; }

  std::vector<std::shared_ptr<ResidentModel>> models_;
  std::map<std::string, Account> accounts_;  // by device
  const RoomProbe host_room_;                // called without mu_: it reads files
  uint64_t next_id_ = 1;
};

}  // namespace weightd::daemon
