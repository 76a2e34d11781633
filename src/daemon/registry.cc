#include "daemon/registry.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <tuple>

#include "protocol/text.h"

namespace weightd::daemon {
namespace {

// Takes one of each of `keys` out of `list` (a key marked twice stays once).
void EraseOnce(std::vector<protocol::CacheKey>& list, const std::vector<protocol::CacheKey>& keys) {
  for (const protocol::CacheKey& k : keys) {
    auto it = std::find(list.begin(), list.end(), k);
    if (it != list.end()) list.erase(it);
  }
}

}  // namespace

Eviction Registry::EvictLocked(size_t index, Dropped& dropped) {
  std::shared_ptr<ResidentModel> m = models_[index];
  dropped.push_back(m);
  models_.erase(models_.begin() + static_cast<std::ptrdiff_t>(index));
  const uint64_t bytes = m->segment->reserved_bytes();
  // Leased: the daemon holds the segment until the last lease ends, and
  // counts it until then (Release).
  m->evicted = true;
  Account& a = AccountLocked(m->key.device);
  if (m->leases == 0) {
    a.used -= bytes;
  } else {
    a.evicted_leased += bytes;
    ++a.evicted_leased_models;
  }
  return {.id = m->id,
          .description =
              protocol::ShortDescription(m->key) + (m->name.empty() ? "" : " (" + m->name + ")"),
          .bytes = bytes,
          .leases = m->leases,
          .key = m->key,
          .path = m->path,
          .name = m->name};
}

Status CheckPinName(std::string_view name) {
  constexpr size_t kMaxPinName = 64;
  auto allowed = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  };
  if (name.empty() || name.size() > kMaxPinName ||
      !std::isalnum(static_cast<unsigned char>(name.front())) ||
      !std::all_of(name.begin(), name.end(), allowed)) {
    return Error(
        "a pinned name is 1 to 64 letters, digits, '.', '_' or '-', starting with a "
        "letter or a digit");
  }
  if (name == "all") return Error("`all` cannot be a pinned name: `evict all` means every model");
  return OkStatus();
}

void Registry::SetBudget(const std::string& device, uint64_t bytes) {
  std::lock_guard lock(mu_);
  accounts_[device].budget = bytes;
}

Status Registry::Reserve(const std::string& device, uint64_t bytes,
                         std::vector<Eviction>* evicted) {
  return Reserve({{device, bytes}}, evicted);
}

Status Registry::Reserve(const std::vector<std::pair<std::string, uint64_t>>& needs,
                         std::vector<Eviction>* evicted, bool weigh_room) {
  // The kernel's figure first, without the registry's lock: reading it
  // takes a few files (a long mountinfo, a control group's statistics),
  // and acquires must not wait for that. A load that ends meanwhile takes
  // its bytes out of `reserved`, while the figure (and what the probe saw
  // loads in progress hold) may have been read before: published, the
  // figure may not show all its pages yet; given back, the probe may have
  // counted pages the figure then showed free. What ended since is
  // counted as taken.
  std::optional<Room> host_room;
  uint64_t ended_before = 0;
  const bool for_host = std::any_of(needs.begin(), needs.end(),
                                    [](const auto& need) { return need.first == "host"; });
  if (weigh_room && for_host && host_room_) {
    {
      std::lock_guard lock(mu_);
      ended_before = accounts_["host"].ended_bytes;
    }
    host_room = host_room_();
  }
  Dropped dropped;  // freed after the lock is released
  std::lock_guard lock(mu_);
  auto evictable = [&](const ResidentModel& m, const std::string& device) {
    return m.key.device == device && m.leases == 0 && m.name.empty();
  };
  // Huge pages come from their own pool: evicting a model in them gives
  // the kernel's figure nothing back.
  auto frees_room = [](const ResidentModel& m) { return !m.segment->huge_pages(); };
  // Every device is checked before any model is evicted: room on all of
  // them, or nothing evicted for a load that cannot start. What idle
  // models must free on each: within the budget, and within what the
  // kernel would give.
  std::vector<uint64_t> to_free_for_room(needs.size(), 0);
  for (size_t n = 0; n < needs.size(); ++n) {
    const auto& [device, bytes] = needs[n];
    auto account = accounts_.find(device);
    if (account == accounts_.end()) return Error("no memory budget for " + device);
    const Account& a = account->second;
    uint64_t idle = 0, idle_room = 0, pinned = 0;
    for (const auto& m : models_) {
      if (m->key.device == device && m->leases == 0 && !m->name.empty()) {
        pinned += m->segment->reserved_bytes();
      }
      if (!evictable(*m, device)) continue;
      idle += m->segment->reserved_bytes();
      if (frees_room(*m)) idle_room += m->segment->reserved_bytes();
    }
    const uint64_t kept = a.used + a.reserved - std::min(idle, a.used);
    if (bytes > a.budget) {
      return Error("out of budget on " + device + ": the model needs " +
                   protocol::FormatBytes(bytes) + ", more than the whole budget of " +
                   protocol::FormatBytes(a.budget) + "; raise --budget");
    }
    if (kept > a.budget - bytes) {
      // Evicted models engines still map hold bytes no eviction frees;
      // loads in progress hold theirs until they end.
      const uint64_t mapped = std::min(a.evicted_leased, kept);
      const uint64_t loading = std::min(a.reserved, kept - mapped);
      const uint64_t held = kept - mapped - loading;
      // Of those, what `evict NAME` frees at once; the rest only once
      // evicted and let go by every engine that maps it.
      const uint64_t held_pinned = std::min(pinned, held);
      const uint64_t in_use = held - held_pinned;
      std::vector<std::string> who;
      if (in_use > 0) who.push_back(protocol::FormatBytes(in_use) + " by models engines use");
      if (held_pinned > 0) {
        who.push_back(protocol::FormatBytes(held_pinned) + " by pinned models no engine uses");
      }
      if (loading > 0) {
        who.push_back(protocol::FormatBytes(loading) + " by loads in progress");
      }
      if (mapped > 0) {
        who.push_back(protocol::FormatBytes(mapped) + " by " +
                      std::to_string(a.evicted_leased_models) +
                      " evicted model(s) engines still map (freed as they let go)");
      }
      std::string listed;
      for (const std::string& w : who) listed += (listed.empty() ? "" : ", ") + w;
      // The advice is the first step that frees enough, in the order a
      // user can take them: evict what no engine uses, wait for loads (an
      // idle model once done), take models from engines.
      const uint64_t missing = kept - (a.budget - bytes);
      std::string advice = "raise --budget";
      if (held_pinned >= missing) {
        advice = "evict pinned models (weightd evict NAME, or '#ID' for one rank) or " + advice;
      } else if (loading > 0 && held_pinned + loading >= missing) {
        advice = "preload again when the loads in progress end, or " + advice;
      } else if (in_use > 0 && held + loading >= missing) {
        advice += ", or evict models in use and stop their engines";
        if (loading > 0) advice += ", then preload again when the loads in progress end";
      }
      return Error("out of budget on " + device + ": the model needs " +
                   protocol::FormatBytes(bytes) + ", the budget is " +
                   protocol::FormatBytes(a.budget) + ", and " + protocol::FormatBytes(kept) +
                   " are held: " + listed + "; " + advice);
    }
    if (device != "host" || !host_room) continue;
    const Room& room = *host_room;
    // Loads in progress take the rest of their reservations' pages as
    // they go: counted as taken, less what the kernel's figure showed them
    // holding already.
    const uint64_t since = a.ended_bytes - ended_before;
    const uint64_t to_come = a.reserved - std::min(a.reserved, room.filled);
    uint64_t spoken_for = 0;
    if (__builtin_add_overflow(to_come, room.keep, &spoken_for) ||
        __builtin_add_overflow(spoken_for, since, &spoken_for)) {
      spoken_for = UINT64_MAX;
    }
    const uint64_t usable = room.free - std::min(room.free, spoken_for);
    if (bytes <= usable) continue;
    to_free_for_room[n] = bytes - usable;
    if (to_free_for_room[n] > idle_room) {
      std::string why = "out of memory on " + device + ": the model needs " +
                        protocol::FormatBytes(bytes) +
                        ", within the budget, but the kernel would give " +
                        protocol::FormatBytes(room.free) + " more (" + room.what + "), of which " +
                        protocol::FormatBytes(room.keep) + " are kept for the daemon itself";
      if (to_come > 0) {
        why += " and " + protocol::FormatBytes(to_come) +
               " are counted for loads in progress (preload again when they end)";
      }
      if (idle_room > 0) why += "; idle models would free only " + protocol::FormatBytes(idle_room);
      why +=
          ". The rest is held outside the budget: segments engines still map from a daemon that "
          "stopped, the daemon itself, or other processes; lower --budget or free memory";
      return Error(why);
    }
  }
  for (size_t n = 0; n < needs.size(); ++n) {
    const auto& [device, bytes] = needs[n];
    Account& a = accounts_[device];
    uint64_t freed = 0;  // of the kernel's figure
    while (a.used + a.reserved + bytes > a.budget || freed < to_free_for_room[n]) {
      // The idle model used least recently goes first; while the kernel's
      // figure is short, one that gives it something back (any, once only
      // the budget is short).
      const bool room_short = freed < to_free_for_room[n];
      size_t victim = models_.size();
      for (int pass = room_short ? 0 : 1; pass < 2 && victim == models_.size(); ++pass) {
        for (size_t i = 0; i < models_.size(); ++i) {
          if (!evictable(*models_[i], device) || (pass == 0 && !frees_room(*models_[i]))) {
            continue;
          }
          if (victim == models_.size() || models_[i]->last_used < models_[victim]->last_used) {
            victim = i;
          }
        }
      }
      if (victim == models_.size()) break;  // cannot happen: counted above
      const bool gives_room = frees_room(*models_[victim]);
      Eviction e = EvictLocked(victim, dropped);
      if (gives_room) freed += e.bytes;
      if (evicted != nullptr) evicted->push_back(std::move(e));
    }
    a.reserved += bytes;
  }
  return OkStatus();
}

void Registry::Unreserve(const std::string& device, uint64_t bytes) {
  std::lock_guard lock(mu_);
  Account& a = AccountLocked(device);
  a.reserved -= std::min(a.reserved, bytes);
  a.ended_bytes += bytes;
}

std::string Registry::NameOf(const ResidentModel& model) const {
  std::lock_guard lock(mu_);
  return model.name;
}

std::shared_ptr<ResidentModel> Registry::Publish(std::unique_ptr<ResidentModel> model,
                                                 uint64_t reserved_bytes,
                                                 const std::vector<protocol::CacheKey>& group,
                                                 std::vector<std::string>* taken_from,
                                                 bool inherit_name) {
  // What allocates goes first, and the reservation becomes use last: a
  // refused allocation leaves the reservation the caller's to give back.
  std::shared_ptr<ResidentModel> published(std::move(model));
  std::vector<protocol::CacheKey> with_own = group;
  with_own.push_back(published->key);
  Dropped dropped;  // freed after the lock is released
  dropped.reserve(1);
  std::lock_guard lock(mu_);
  models_.reserve(models_.size() + 1);
  if (inherit_name && published->name.empty()) {
    for (const auto& m : models_) {
      if (!m->name.empty() && m->key != published->key &&
          std::find(group.begin(), group.end(), m->key) != group.end()) {
        published->name = m->name;  // the group's already: taken from no one
        break;
      }
    }
  } else if (!published->name.empty()) {
    TakeNameLocked(published->name, with_own, taken_from);
  }
  for (size_t i = 0; i < models_.size(); ++i) {
    if (models_[i]->key == published->key) {
      EvictLocked(i, dropped);
      break;
    }
  }
  std::erase_if(failed_loads_, [&](const auto& f) { return f.first == published->key; });
  published->id = next_id_++;
  published->last_used = std::chrono::steady_clock::now();
  Account& a = AccountLocked(published->key.device);
  a.reserved -= std::min(a.reserved, reserved_bytes);
  a.used += published->segment->reserved_bytes();
  a.ended_bytes += reserved_bytes;
  models_.push_back(published);
  return published;
}

Registry::Lookup Registry::Acquire(const protocol::CacheKey& key, const std::string& trust,
                                   std::chrono::steady_clock::time_point wait_until,
                                   const std::string& path, const std::function<bool()>& gone,
                                   const std::vector<protocol::ShardSize>* shards) {
  std::unique_lock lock(mu_);
  Lookup out = AcquireLocked(key, trust, path, shards);
  if (out.model) return out;
  const bool may_wait = wait_until > std::chrono::steady_clock::now();
  // A load of this key in flight or queued is waited for, and, by an
  // acquire that may wait, announced loads not keyed yet (one may be this
  // model). For a GPU, the same model coming into host memory counts too:
  // the engine copies it up from there (the host-tier reload).
  auto for_us = [&](const protocol::CacheKey& k) {
    if (k == key) return true;
    if (key.device == "host" || k.device != "host") return false;
    const auto d = protocol::Compare(k, key, false);
    return d.size() == 1 && d[0].field == "device";
  };
  // A trusted name no resident model of this rank and device has: the
  // loads that will pin it, whatever their keys (all of a load's ranks are
  // published before its pin is dropped), waited for by an acquire that
  // may wait. Where one has it, the miss is explained against that model.
  auto named_here = [&](const std::shared_ptr<ResidentModel>& m) {
    return m->name == trust && m->key.tp_rank == key.tp_rank && m->key.device == key.device;
  };
  if (!trust.empty() && (!may_wait || !pins_coming_.contains(trust) ||
                         std::any_of(models_.begin(), models_.end(), named_here))) {
    return out;
  }
  auto coming = [&] {
    if (!trust.empty()) return pins_coming_.contains(trust);
    return std::any_of(loading_.begin(), loading_.end(), for_us) ||
           std::any_of(queued_.begin(), queued_.end(), for_us);
  };
  // Announced loads not keyed yet may be any key's model; those that will
  // pin a name say so when announced (ExpectPin).
  auto unkeyed = [&] { return trust.empty() && expected_ > 0; };
  if (!coming() && (!unkeyed() || !may_wait)) return out;
  // Published when the load ends (before EndLoad wakes us): look again then.
  auto settled = [&] {
    if (coming()) return false;
    return !unkeyed() || std::any_of(models_.begin(), models_.end(),
                                     [&](const auto& m) { return m->key == key; });
  };
  // Waited a slice at a time, to ask between them whether the asker is
  // still there: a wait is up to an hour, and holds a thread.
  constexpr auto kSlice = std::chrono::milliseconds(500);
  const auto wait_started = std::chrono::steady_clock::now();
  // An acquire that may not wait passes through once, answered at once.
  auto waited = [&] {
    if (!may_wait) return 0.0;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_started).count();
  };
  bool done = false;
  while (!done) {
    const auto slice_end =
        gone ? std::min(wait_until, std::chrono::steady_clock::now() + kSlice) : wait_until;
    done = load_done_.wait_until(lock, slice_end, settled);
    if (done || !gone || std::chrono::steady_clock::now() >= wait_until) break;
    lock.unlock();
    const bool left = gone();
    lock.lock();
    if (left) {
      out.asker_gone = true;
      out.waited_seconds = waited();
      return out;
    }
  }
  // Of exactly this key (a trusted name's load may be of any), still coming.
  if (!done && trust.empty() && coming()) {
    out.loading = true;
    out.waited_seconds = waited();
    return out;
  }
  // Its model among those published meanwhile, or not (yet).
  Lookup after = AcquireLocked(key, trust, path, shards);
  after.waited_seconds = waited();
  return after;
}

void Registry::NoteFailedLoad(const std::vector<protocol::CacheKey>& keys, const std::string& why) {
  std::string reason = why;
  if (reason.size() > kFailedLoadReasonBytes) {
    reason.resize(kFailedLoadReasonBytes);
    reason += "...";
  }
  std::lock_guard lock(mu_);
  for (const protocol::CacheKey& key : keys) {
    std::erase_if(failed_loads_, [&](const auto& f) { return f.first == key; });
    failed_loads_.emplace_back(key, reason);
  }
  while (failed_loads_.size() > kFailedLoadsKept) failed_loads_.pop_front();
}

Registry::Lookup Registry::AcquireLocked(const protocol::CacheKey& key, const std::string& trust,
                                         const std::string& path,
                                         const std::vector<protocol::ShardSize>* shards) {
  Lookup out;
  // On a miss: the engine's model failed to load here, that is why, first.
  auto failed_to_load = [&]() -> std::string {
    for (auto it = failed_loads_.rbegin(); it != failed_loads_.rend(); ++it) {
      if (it->first == key) return "the daemon's last preload of this model failed: " + it->second;
    }
    return "";
  };
  if (models_.empty()) {
    const std::string failed = failed_to_load();
    out.reason = failed.empty() ? "no model is resident" : failed;
    return out;
  }
  size_t best = models_.size();
  std::vector<protocol::FieldDifference> best_diff;
  // The model itself first, wherever it was loaded from. Failing that, what
  // a miss is explained against: the same model on another device (which a
  // GPU engine copies from the host); then a model loaded from the engine's
  // own checkpoint directory, however many fields differ (its own model,
  // processed otherwise or changed since, says more than some other model
  // with fewer differences); then one of the engine's layout (a fine-tune
  // of the same base: the stale-weights case); then the fewest differing
  // fields.
  auto other_layout = [&](const ResidentModel& m) {
    return shards == nullptr || !protocol::SameLayout(m.shards, *shards);
  };
  auto rank = [&](const std::vector<protocol::FieldDifference>& d, const ResidentModel& m) {
    const bool device_only = d.size() == 1 && d[0].field == "device";
    return std::tuple(!d.empty(), !device_only, path.empty() || m.path != path, other_layout(m),
                      d.size());
  };
  for (size_t i = 0; i < models_.size(); ++i) {
    const bool trusted = !trust.empty();
    if (trusted && models_[i]->name != trust) continue;
    auto diff = protocol::Compare(models_[i]->key, key, trusted);
    if (best == models_.size() || rank(diff, *models_[i]) < rank(best_diff, *models_[best])) {
      best = i;
      best_diff = std::move(diff);
      if (best_diff.empty()) break;  // the model itself: nothing ranks before it
    }
  }
  if (best == models_.size()) {
    out.reason = "no resident model is pinned as `" + trust + "`";
    return out;
  }
  if (!best_diff.empty()) {
    const std::string failed = failed_to_load();
    // Another checkpoint's model (other content, from elsewhere) is no
    // older version of the engine's: say whose it is, or, when the
    // engine's own failed to load, say nothing of it.
    const ResidentModel& nearest = *models_[best];
    if (trust.empty() && !path.empty() && nearest.path != path &&
        nearest.key.checkpoint != key.checkpoint) {
      if (!failed.empty()) {
        out.reason = failed;
        return out;
      }
      // Nor one of its layout, where the engine said what its files are:
      // another model altogether, whose fields would only raise a false
      // alarm of stale weights.
      if (shards != nullptr && other_layout(nearest)) {
        out.reason = "no model from this checkpoint, or of its layout, is resident";
        return out;
      }
      out.reason = "no model from this checkpoint is resident; the nearest, from " + nearest.path +
                   ", differs";
    } else {
      out.reason =
          failed.empty() ? "no resident model matches" : failed + "; what is resident differs";
    }
    out.mismatch = std::move(best_diff);
    return out;
  }
  out.model = models_[best];
  out.name = out.model->name;
  ++out.model->leases;
  out.model->last_used = std::chrono::steady_clock::now();
  return out;
}

void Registry::Release(const std::shared_ptr<ResidentModel>& model) {
  std::lock_guard lock(mu_);
  // A release with no lease (one released twice, by a fault elsewhere)
  // gives nothing back: an evicted model's bytes would otherwise come off
  // its device's account again, and the account would wrap.
  if (model->leases == 0) return;
  --model->leases;
  if (model->evicted && model->leases == 0) {
    Account& a = AccountLocked(model->key.device);
    a.used -= model->segment->reserved_bytes();
    a.evicted_leased -= model->segment->reserved_bytes();
    --a.evicted_leased_models;
  }
  model->last_used = std::chrono::steady_clock::now();
}

void Registry::TakeNameLocked(const std::string& name, const std::vector<protocol::CacheKey>& group,
                              std::vector<std::string>* taken_from) {
  for (auto& m : models_) {
    if (m->name == name && std::find(group.begin(), group.end(), m->key) == group.end()) {
      m->name.clear();
      if (taken_from != nullptr &&
          std::find(taken_from->begin(), taken_from->end(), m->path) == taken_from->end()) {
        taken_from->push_back(m->path);
      }
    }
  }
}

bool Registry::Pin(const std::vector<protocol::CacheKey>& group, const std::string& name,
                   std::vector<std::string>* taken_from) {
  std::lock_guard lock(mu_);
  auto in_group = [&](const std::shared_ptr<ResidentModel>& m) {
    return std::find(group.begin(), group.end(), m->key) != group.end();
  };
  if (std::none_of(models_.begin(), models_.end(), in_group)) return false;
  TakeNameLocked(name, group, taken_from);
  for (auto& m : models_) {
    if (in_group(m)) m->name = name;
  }
  return true;
}

bool Registry::LoadingLocked(const protocol::CacheKey& key) const {
  return std::find(loading_.begin(), loading_.end(), key) != loading_.end();
}

void Registry::BeginLoad(const std::vector<protocol::CacheKey>& keys) {
  std::unique_lock lock(mu_);
  load_done_.wait(lock, [&] {
    return std::none_of(keys.begin(), keys.end(),
                        [&](const protocol::CacheKey& k) { return LoadingLocked(k); });
  });
  loading_.insert(loading_.end(), keys.begin(), keys.end());
}

void Registry::Queue(const std::vector<protocol::CacheKey>& keys) {
  std::lock_guard lock(mu_);
  queued_.insert(queued_.end(), keys.begin(), keys.end());
  if (expected_ > 0) --expected_;
  load_done_.notify_all();
}

void Registry::Unqueue(const std::vector<protocol::CacheKey>& keys) {
  std::lock_guard lock(mu_);
  EraseOnce(queued_, keys);
  load_done_.notify_all();
}

void Registry::ExpectLoads(size_t n) {
  std::lock_guard lock(mu_);
  expected_ += n;
}

void Registry::DropExpected(size_t n) {
  std::lock_guard lock(mu_);
  expected_ -= std::min(expected_, n);
  if (n == SIZE_MAX) {  // a stop: none of them will load
    queued_.clear();
    pins_coming_.clear();
  }
  load_done_.notify_all();
}

void Registry::ExpectPin(const std::string& name) {
  std::lock_guard lock(mu_);
  pins_coming_.insert(name);
}

void Registry::DropPin(const std::string& name) {
  std::lock_guard lock(mu_);
  // Gone already where a stop dropped them all.
  if (auto it = pins_coming_.find(name); it != pins_coming_.end()) pins_coming_.erase(it);
  load_done_.notify_all();
}

void Registry::EndLoad(const std::vector<protocol::CacheKey>& keys) {
  std::lock_guard lock(mu_);
  EraseOnce(loading_, keys);
  load_done_.notify_all();
}

std::vector<Eviction> Registry::Evict(const std::string& what) {
  Dropped dropped;  // freed after the lock is released
  std::lock_guard lock(mu_);
  std::vector<Eviction> out;
  // A pinned name means that model alone, even where it also reads as the
  // start of other models' digests.
  const bool a_name = std::any_of(models_.begin(), models_.end(), [&](const auto& m) {
    return !m->name.empty() && m->name == what;
  });
  // A digest prefix counts without its algorithm tag, and needs 8 hex
  // characters ("xxh3-128" alone must not match every model); in either
  // case, and with the ellipsis `status` prints after a cut digest.
  const size_t colon = what.find(':');
  std::string prefix = colon == std::string::npos ? what : what.substr(colon + 1);
  constexpr std::string_view kEllipsis = "\u2026";
  if (prefix.ends_with(kEllipsis)) prefix.resize(prefix.size() - kEllipsis.size());
  std::transform(prefix.begin(), prefix.end(), prefix.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (size_t i = models_.size(); i-- > 0;) {
    const ResidentModel& m = *models_[i];
    const std::string& digest = m.key.checkpoint;
    const size_t at = digest.find(':');
    const std::string bare = at == std::string::npos ? digest : digest.substr(at + 1);
    const bool match = what == "all" || (a_name && m.name == what) ||
                       (!a_name && prefix.size() >= 8 && bare.starts_with(prefix)) ||
                       what == "#" + std::to_string(m.id);
    if (match) out.push_back(EvictLocked(i, dropped));
  }
  return out;
}

Registry::Snapshot Registry::Take() const {
  std::lock_guard lock(mu_);
  Snapshot s;
  const auto now = std::chrono::steady_clock::now();
  s.models = models_;
  for (const auto& m : models_) {
    s.leases.push_back(m->leases);
    s.names.push_back(m->name);
    s.idle_seconds.push_back(std::chrono::duration<double>(now - m->last_used).count());
  }
  for (const auto& [device, a] : accounts_) {
    s.devices.push_back(
        {device, a.budget, a.used, a.reserved, a.evicted_leased, a.evicted_leased_models});
    if (device == "host") std::rotate(s.devices.begin(), s.devices.end() - 1, s.devices.end());
  }
  return s;
}

std::vector<std::string> Registry::Devices() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out = {"host"};
  for (const auto& [device, a] : accounts_) {
    if (device != "host") out.push_back(device);
  }
  return out;
}

}  // namespace weightd::daemon
