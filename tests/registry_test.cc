// The registry's accounting, per device, in process: budgets, reservations,
// least-recently-used eviction confined to the device that needs room.
#include "daemon/registry.h"

#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <utility>

namespace weightd::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;
const std::string kGpu = "cuda:GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890ab";

// A model of `mib` MiB on `device`, published against its reservation.
std::shared_ptr<ResidentModel> Publish(Registry& r, const std::string& device, uint64_t mib,
                                       const std::string& digest, int tp_rank = 0,
                                       const std::string& name = "",
                                       const std::vector<protocol::CacheKey>& group = {},
                                       bool inherit_name = false) {
  EXPECT_TRUE(r.Reserve(device, mib * kMiB, nullptr).ok());
  auto m = std::make_unique<ResidentModel>();
  m->key.checkpoint = digest;
  m->key.device = device;
  m->key.tp_rank = tp_rank;
  m->key.tp_size = group.empty() ? 1 : static_cast<int>(group.size());
  m->name = name;
  // The registry counts what a segment reserves: host memory stands in for
  // the GPU's here, the accounting reads only its size and the key.
  auto segment = memory::CreateHostSegment(mib * kMiB, "registry-test");
  EXPECT_TRUE(segment.ok());
  m->segment = std::move(segment).value();
  auto published = r.Publish(std::move(m), mib * kMiB, group, nullptr, inherit_name);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // distinct last-used times
  return published;
}

const Registry::DeviceUse* Find(const Registry::Snapshot& s, const std::string& device) {
  for (const auto& d : s.devices) {
    if (d.device == device) return &d;
  }
  return nullptr;
}

TEST(Registry, EachDeviceHasItsOwnBudgetAndEvictsOnlyItsOwnModels) {
  Registry r(8 * kMiB);
  // No budget for a GPU until it is given one.
  auto refused = r.Reserve(kGpu, kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(kGpu), std::string::npos);
  r.SetBudget(kGpu, 8 * kMiB);

  Publish(r, "host", 4, "xxh3-128:h1");
  Publish(r, kGpu, 4, "xxh3-128:g1");
  Publish(r, kGpu, 4, "xxh3-128:g2");
  // The GPU is full: the next GPU model evicts the GPU's oldest idle model,
  // and leaves the host's alone although it is older.
  std::vector<Eviction> evicted;
  ASSERT_TRUE(r.Reserve(kGpu, 4 * kMiB, &evicted).ok());
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_NE(evicted[0].description.find("xxh3-128:g1"), std::string::npos)  // the oldest
      << evicted[0].description;
  EXPECT_NE(evicted[0].description.find(kGpu), std::string::npos) << evicted[0].description;
  Registry::Snapshot s = r.Take();
  ASSERT_EQ(s.devices.size(), 2u);
  EXPECT_EQ(s.devices[0].device, "host");  // the host first
  EXPECT_EQ(r.Devices(), (std::vector<std::string>{"host", kGpu}));
  EXPECT_EQ(Find(s, "host")->used, 4 * kMiB);
  EXPECT_EQ(Find(s, kGpu)->used, 4 * kMiB);
  EXPECT_EQ(Find(s, kGpu)->reserved, 4 * kMiB);
  EXPECT_EQ(Find(s, kGpu)->budget, 8 * kMiB);
  r.Unreserve(kGpu, 4 * kMiB);
  EXPECT_EQ(Find(r.Take(), kGpu)->reserved, 0u);
  EXPECT_EQ(s.models.size(), 2u);
}

TEST(Registry, ALeasedModelOnAGpuLeavesNoRoomAndTheErrorNamesTheDevice) {
  Registry r(64 * kMiB);
  r.SetBudget(kGpu, 6 * kMiB);
  auto held = Publish(r, kGpu, 4, "xxh3-128:g1");
  protocol::CacheKey key = held->key;
  Registry::Lookup lease = r.Acquire(key, "");
  ASSERT_TRUE(lease.model);
  std::vector<Eviction> evicted;
  auto full = r.Reserve(kGpu, 4 * kMiB, &evicted);
  ASSERT_FALSE(full.ok());
  EXPECT_NE(full.error().message().find("out of budget on " + kGpu), std::string::npos)
      << full.error().message();
  EXPECT_NE(full.error().message().find("4.00 MiB by models engines use"), std::string::npos)
      << full.error().message();
  EXPECT_TRUE(evicted.empty());
  // The host's budget is untouched by the GPU's.
  EXPECT_TRUE(r.Reserve("host", 32 * kMiB, nullptr).ok());
  // Evicted while leased: counted against the GPU until the lease ends.
  ASSERT_EQ(r.Evict("all").size(), 1u);
  EXPECT_EQ(Find(r.Take(), kGpu)->used, 4 * kMiB);
  // Nothing left to evict: the error says what holds the room instead.
  full = r.Reserve(kGpu, 4 * kMiB, &evicted);
  ASSERT_FALSE(full.ok());
  EXPECT_NE(full.error().message().find(
                "held: 4.00 MiB by 1 evicted model(s) engines still map (freed as they let go); "
                "raise --budget"),
            std::string::npos)
      << full.error().message();
  EXPECT_EQ(full.error().message().find("models engines use"), std::string::npos)
      << full.error().message();
  r.Release(lease.model);
  EXPECT_EQ(Find(r.Take(), kGpu)->used, 0u);
  // A lease released twice gives its bytes back once.
  r.Release(lease.model);
  EXPECT_EQ(Find(r.Take(), kGpu)->used, 0u);
  EXPECT_TRUE(r.Reserve(kGpu, 6 * kMiB, nullptr).ok());
  EXPECT_FALSE(r.Reserve(kGpu, kMiB, nullptr).ok());
}

// Room the kernel would still give, less than the budget says (memory
// held outside it): idle models are evicted for it, the least recently
// used first; with none left to evict, a refusal that says whose figure
// it is. Loads in flight count against it until they end.
TEST(Registry, IdleModelsAreEvictedForRoomTheKernelLacksAndThenItRefuses) {
  Registry::Room room{12 * kMiB, 2 * kMiB, "the control group's limit of 1.00 GiB in F"};
  bool known = true;
  Registry r(64 * kMiB, [&] { return known ? std::optional(room) : std::nullopt; });
  auto a = Publish(r, "host", 4, "xxh3-128:a");
  auto b = Publish(r, "host", 4, "xxh3-128:b");
  auto c = Publish(r, "host", 1, "xxh3-128:c");
  // 5 MiB left, 2 of them kept: 3 usable. 6 MiB need 3 more, and the
  // budget has plenty: a, the oldest idle model, goes (4 MiB).
  room.free = 5 * kMiB;
  std::vector<Eviction> evicted;
  ASSERT_TRUE(r.Reserve("host", 6 * kMiB, &evicted).ok());
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_NE(evicted[0].description.find("xxh3-128:a"), std::string::npos);
  // The kernel's figure does not know of that reservation's pages yet: a
  // second one counts it taken: 9 - 6 - 2 leave 1, and 2 MiB more need b
  // evicted.
  evicted.clear();
  room.free = 9 * kMiB;  // a's pages given back
  ASSERT_TRUE(r.Reserve("host", 2 * kMiB, &evicted).ok());
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_NE(evicted[0].description.find("xxh3-128:b"), std::string::npos);
  r.Unreserve("host", 8 * kMiB);
  // Within what is usable: no eviction.
  evicted.clear();
  ASSERT_TRUE(r.Reserve("host", 7 * kMiB, &evicted).ok());
  EXPECT_TRUE(evicted.empty());
  r.Unreserve("host", 7 * kMiB);
  // c leased, nothing to evict: refused, with the figure and its source,
  // and nothing evicted.
  ASSERT_TRUE(r.Acquire(c->key, "").model);
  auto refused = r.Reserve("host", 8 * kMiB, &evicted);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(evicted.empty());
  EXPECT_NE(refused.error().message().find("out of memory on host"), std::string::npos)
      << refused.error().message();
  EXPECT_NE(refused.error().message().find("the kernel would give 9.00 MiB more (the control "
                                           "group's limit of 1.00 GiB in F)"),
            std::string::npos)
      << refused.error().message();
  EXPECT_EQ(r.Take().models.size(), 1u);
  // No figure from the kernel: the budget alone decides.
  known = false;
  EXPECT_TRUE(r.Reserve("host", 8 * kMiB, &evicted).ok());
}

// What a load in progress has written is out of the kernel's figure
// already: only the rest of its reservation is counted as still to come,
// not the whole of it again.
TEST(Registry, PagesALoadInProgressHoldsAreNotCountedTwice) {
  Registry::Room room{100 * kMiB, 10 * kMiB, "the control group's limit of 1.00 GiB in F"};
  Registry r(1024 * kMiB, [&] { return std::optional(room); });
  ASSERT_TRUE(r.Reserve("host", 60 * kMiB, nullptr).ok());
  // It has written 50 of its 60 MiB: the kernel gives 50 more, of which
  // 10 are kept and 10 still to come: 30 usable.
  room.free = 50 * kMiB;
  room.filled = 50 * kMiB;
  EXPECT_TRUE(r.Reserve("host", 30 * kMiB, nullptr).ok());
  r.Unreserve("host", 30 * kMiB);
  auto refused = r.Reserve("host", 31 * kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(
                "and 10.00 MiB are counted for loads in progress (preload again when they end)"),
            std::string::npos)
      << refused.error().message();
  // Unknown (no probe): the whole reservation is still to come.
  room.filled = 0;
  EXPECT_FALSE(r.Reserve("host", 30 * kMiB, nullptr).ok());
  // A figure above the reservations (a load that published meanwhile)
  // leaves nothing to come, never less: 50 - 10 kept leave 40.
  room.filled = 80 * kMiB;
  EXPECT_FALSE(r.Reserve("host", 41 * kMiB, nullptr).ok());
  ASSERT_TRUE(r.Reserve("host", 40 * kMiB, nullptr).ok());
  // 100 MiB reserved, 80 held: 20 to come.
  EXPECT_FALSE(r.Reserve("host", 21 * kMiB, nullptr).ok());
  EXPECT_TRUE(r.Reserve("host", 20 * kMiB, nullptr).ok());
}

// A load that ends while a reservation is weighed (after the probe saw
// what loads hold, before the registry's lock): its pages may already show
// as free in the kernel's figure while the probe counted them held, so
// what ended meanwhile counts as taken; room is never counted twice.
TEST(Registry, ALoadEndingDuringTheCheckLeavesNoRoomCountedTwice) {
  Registry::Room room{200 * kMiB, 10 * kMiB, "the control group's limit of 1.00 GiB in F"};
  std::function<void()> meanwhile;
  Registry r(1024 * kMiB, [&] {
    if (meanwhile) std::exchange(meanwhile, nullptr)();
    return std::optional(room);
  });
  ASSERT_TRUE(r.Reserve("host", 60 * kMiB, nullptr).ok());  // x
  ASSERT_TRUE(r.Reserve("host", 60 * kMiB, nullptr).ok());  // y
  // x has written 50 MiB and y 10; then x fails, its pages freed: of the
  // 100 MiB the kernel gives, 10 are kept and y's 50 still to come.
  room.free = 100 * kMiB;
  room.filled = 60 * kMiB;
  meanwhile = [&] { r.Unreserve("host", 60 * kMiB); };
  EXPECT_FALSE(r.Reserve("host", 45 * kMiB, nullptr).ok());
  // Once x's end is behind the check, y alone is counted.
  room.filled = 10 * kMiB;
  EXPECT_TRUE(r.Reserve("host", 40 * kMiB, nullptr).ok());
}

// Room taken by a load still in progress is named as such: evicting
// cannot help, that load's end can.
TEST(Registry, ARefusalNamesLoadsInProgressApart) {
  Registry r(8 * kMiB);
  auto leased = Publish(r, "host", 2, "xxh3-128:a");
  ASSERT_TRUE(r.Acquire(leased->key, "").model);
  ASSERT_TRUE(r.Reserve("host", 5 * kMiB, nullptr).ok());
  auto refused = r.Reserve("host", 4 * kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(
                "7.00 MiB are held: 2.00 MiB by models engines use, 5.00 MiB by loads in "
                "progress; preload again when the loads in progress end, or raise --budget"),
            std::string::npos)
      << refused.error().message();
  // The whole budget: the load's end is not enough without the model in use.
  refused = r.Reserve("host", 8 * kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(
                "; raise --budget, or evict models in use and stop their engines, then preload "
                "again when the loads in progress end"),
            std::string::npos)
      << refused.error().message();
}

// Pinned models no engine uses are named apart from those in use (a pinned
// one an engine maps among them; one on another device in neither): only
// evicting them frees room at once. The advice is what frees enough.
TEST(Registry, ARefusalNamesPinnedModelsApartFromThoseInUse) {
  Registry r(8 * kMiB);
  r.SetBudget(kGpu, 8 * kMiB);
  auto leased = Publish(r, "host", 3, "xxh3-128:a", 0, "live");
  ASSERT_TRUE(r.Acquire(leased->key, "").model);
  Publish(r, "host", 4, "xxh3-128:b", 0, "prod");
  Publish(r, kGpu, 4, "xxh3-128:c", 0, "gpu");
  const std::string held =
      "7.00 MiB are held: 3.00 MiB by models engines use, 4.00 MiB by pinned models no engine "
      "uses; ";
  auto refused = r.Reserve("host", 5 * kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(
                held + "evict pinned models (weightd evict NAME, or '#ID' for one rank) or "
                       "raise --budget"),
            std::string::npos)
      << refused.error().message();
  // 5 MiB short: the pinned models alone would not make room.
  refused = r.Reserve("host", 6 * kMiB, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(
                held + "raise --budget, or evict models in use and stop their engines"),
            std::string::npos)
      << refused.error().message();
}

// Ranks on several devices reserve together: when one device has no room,
// nothing is evicted on the others for a load that cannot start.
TEST(Registry, RoomOnEveryDeviceOrNothingEvicted) {
  Registry r(8 * kMiB);
  const std::string gpu2 = "cuda:GPU-00000000-0000-0000-0000-000000000002";
  r.SetBudget(kGpu, 8 * kMiB);
  r.SetBudget(gpu2, 2 * kMiB);
  Publish(r, kGpu, 8, "xxh3-128:g1");  // idle: evictable
  std::vector<Eviction> evicted;
  auto refused = r.Reserve({{kGpu, 4 * kMiB}, {gpu2, 4 * kMiB}}, &evicted);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find(gpu2), std::string::npos) << refused.error().message();
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(r.Take().models.size(), 1u);
  ASSERT_TRUE(r.Reserve({{kGpu, 4 * kMiB}, {gpu2, 2 * kMiB}}, &evicted).ok());
  EXPECT_EQ(evicted.size(), 1u);
  EXPECT_EQ(Find(r.Take(), gpu2)->reserved, 2 * kMiB);
}

// A pin names every rank of one preload, each on its own GPU; pinning
// another model takes the name from all of them, and only then are they
// evictable.
TEST(Registry, APinNamesEveryRankOfAPreloadAcrossDevices) {
  Registry r(8 * kMiB);
  const std::string gpu2 = "cuda:GPU-00000000-0000-0000-0000-000000000002";
  r.SetBudget(kGpu, 8 * kMiB);
  r.SetBudget(gpu2, 8 * kMiB);
  std::vector<protocol::CacheKey> group(2);
  for (int rank = 0; rank < 2; ++rank) {
    group[rank].checkpoint = "xxh3-128:tp";
    group[rank].device = rank == 0 ? kGpu : gpu2;
    group[rank].tp_rank = rank;
    group[rank].tp_size = 2;
  }
  Publish(r, kGpu, 4, "xxh3-128:tp", 0, "prod", group);
  Publish(r, gpu2, 4, "xxh3-128:tp", 1, "prod", group);
  Registry::Snapshot s = r.Take();
  ASSERT_EQ(s.names.size(), 2u);
  EXPECT_EQ(s.names[0], "prod");
  EXPECT_EQ(s.names[1], "prod");
  // Trusted by name, on either GPU.
  for (const protocol::CacheKey& k : group) {
    Registry::Lookup found = r.Acquire(k, "prod");
    ASSERT_TRUE(found.model) << found.reason;
    EXPECT_EQ(found.name, "prod");
    r.Release(found.model);
  }
  // Pinned: not evicted to make room.
  EXPECT_FALSE(r.Reserve(gpu2, 8 * kMiB, nullptr).ok());

  // Another model takes the name: both ranks lose it and become evictable.
  auto other = Publish(r, "host", 1, "xxh3-128:other");
  std::vector<std::string> taken_from;
  for (auto& m : r.Take().models) m->path = "/models/" + m->key.checkpoint;
  ASSERT_TRUE(r.Pin({other->key}, "prod", &taken_from));
  EXPECT_EQ(taken_from, std::vector<std::string>{"/models/xxh3-128:tp"});  // once for both ranks
  s = r.Take();
  for (size_t i = 0; i < s.models.size(); ++i) {
    EXPECT_EQ(s.names[i], s.models[i]->key.device == "host" ? "prod" : "")
        << s.models[i]->key.device;
  }
  std::vector<Eviction> evicted;
  EXPECT_TRUE(r.Reserve(gpu2, 8 * kMiB, &evicted).ok());
  EXPECT_EQ(evicted.size(), 1u);
  // Pinning a model that is not resident changes nothing.
  EXPECT_FALSE(r.Pin({group[1]}, "prod"));
  EXPECT_EQ(r.Take().names.back(), "prod");
}

TEST(Registry, EvictTakesAPinnedNameBeforeADigestPrefixThatReadsTheSame) {
  Registry r(64 * kMiB);
  Publish(r, "host", 1, "xxh3-128:cfb2b2c73ac06040aa", 0, "base");
  Publish(r, "host", 1, "xxh3-128:cfb2b2c73ac06040bb");
  Publish(r, "host", 1, "xxh3-128:0123456789abcdef", 0, "cfb2b2c7");
  // The name: its model alone, not the two whose digests start so.
  std::vector<Eviction> gone = r.Evict("cfb2b2c7");
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].key.checkpoint, "xxh3-128:0123456789abcdef");
  // A prefix as `status` prints it: cut, with an ellipsis; or in capitals.
  gone = r.Evict("xxh3-128:cfb2b2c73ac06040b\u2026");
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].key.checkpoint, "xxh3-128:cfb2b2c73ac06040bb");
  gone = r.Evict("CFB2B2C73AC06040");
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].name, "base");
  // Too short to be a prefix, and no name: nothing.
  Publish(r, "host", 1, "xxh3-128:cfb2b2c7ffff");
  EXPECT_TRUE(r.Evict("cfb2b2c").empty());
}

// A rank loaded beside ranks already resident (one had been evicted) takes
// the name they have when it is published: not the one they had when the
// preload began, which another preload may since have taken.
TEST(Registry, ARankLoadedLaterTakesTheNameItsGroupHasThen) {
  Registry r(64 * kMiB);
  std::vector<protocol::CacheKey> group(2);
  for (int rank = 0; rank < 2; ++rank) {
    group[rank].checkpoint = "xxh3-128:tp";
    group[rank].device = "host";
    group[rank].tp_rank = rank;
    group[rank].tp_size = 2;
  }
  Publish(r, "host", 4, "xxh3-128:tp", 0, "X", group);
  auto later = Publish(r, "host", 4, "xxh3-128:tp", 1, "", group, /*inherit_name=*/true);
  EXPECT_EQ(later->name, "X");
  // Rank 1 evicted; meanwhile another model is pinned as X; rank 1 comes back.
  ASSERT_EQ(r.Evict("#" + std::to_string(later->id)).size(), 1u);
  auto other = Publish(r, "host", 1, "xxh3-128:other");
  ASSERT_TRUE(r.Pin({other->key}, "X"));
  later = Publish(r, "host", 4, "xxh3-128:tp", 1, "", group, /*inherit_name=*/true);
  EXPECT_EQ(later->name, "");
  Registry::Snapshot s = r.Take();
  for (size_t i = 0; i < s.models.size(); ++i) {
    EXPECT_EQ(s.names[i], s.models[i]->key.checkpoint == "xxh3-128:other" ? "X" : "")
        << s.models[i]->key.checkpoint << " rank " << s.models[i]->key.tp_rank;
  }
}

// A lookup that misses while its very key is being loaded says so, or waits
// for the load and finds what it published.
TEST(Registry, ALookupMayWaitForTheLoadOfItsKey) {
  Registry r(8 * kMiB);
  protocol::CacheKey key;
  key.checkpoint = "xxh3-128:loading";
  key.device = "host";
  r.BeginLoad({key});
  Registry::Lookup now = r.Acquire(key, "");
  EXPECT_FALSE(now.model);
  EXPECT_TRUE(now.loading);
  EXPECT_EQ(now.waited_seconds, 0);  // not allowed to wait: answered at once
  std::thread loader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    Publish(r, "host", 1, "xxh3-128:loading");
    r.EndLoad({key});
  });
  Registry::Lookup waited =
      r.Acquire(key, "", std::chrono::steady_clock::now() + std::chrono::minutes(5));
  loader.join();
  ASSERT_TRUE(waited.model) << waited.reason;
  EXPECT_FALSE(waited.loading);
  EXPECT_GT(waited.waited_seconds, 0);
  r.Release(waited.model);
  // Resident now: found at once.
  Registry::Lookup hit = r.Acquire(key, "");
  ASSERT_TRUE(hit.model);
  EXPECT_EQ(hit.waited_seconds, 0);
  r.Release(hit.model);
  // Nothing in flight: a miss is a plain miss, at once.
  protocol::CacheKey other = key;
  other.checkpoint = "xxh3-128:other";
  Registry::Lookup miss =
      r.Acquire(other, "", std::chrono::steady_clock::now() + std::chrono::minutes(5));
  EXPECT_FALSE(miss.model);
  EXPECT_FALSE(miss.loading);
}

// A trusted name a load will pin (a config's model, announced at start),
// which no resident model of the key's rank and device has, is waited for
// like a key: by an acquire that may wait, until that load ends. Without a
// wait, or for a name such a model has already, it is a plain miss at
// once, never `loading`; a stop drops what was expected. (An acquire that
// waits asks `gone` every half second: whether one waited is told by
// that, not by a clock.)
TEST(Registry, ATrustedLookupMayWaitForTheLoadThatPinsItsName) {
  Registry r(8 * kMiB);
  protocol::CacheKey trusted;  // an engine's key on trust: no digest
  trusted.device = "host";
  const auto later = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  bool asked = false;
  auto waits = [&] {  // ends a wait at its first slice
    asked = true;
    return true;
  };
  r.ExpectPin("chat");
  Registry::Lookup now = r.Acquire(trusted, "chat");
  EXPECT_FALSE(now.model);
  EXPECT_FALSE(now.loading);
  EXPECT_EQ(now.reason, "no model is resident");
  std::thread loader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    Publish(r, "host", 1, "xxh3-128:chat", 0, "chat");
    r.DropPin("chat");
  });
  Registry::Lookup waited = r.Acquire(trusted, "chat", later);
  loader.join();
  ASSERT_TRUE(waited.model) << waited.reason;
  EXPECT_GT(waited.waited_seconds, 0);
  EXPECT_EQ(waited.name, "chat");
  r.Release(waited.model);

  // A name a resident model has: found, or the miss explained against it,
  // at once, while another load that will pin it is under way.
  r.ExpectPin("chat");
  protocol::CacheKey cast = trusted;
  cast.dtype = "fp16";
  Registry::Lookup differs = r.Acquire(cast, "chat", later, {}, waits);
  EXPECT_FALSE(differs.model);
  EXPECT_FALSE(asked) << "waited for a name a resident model has";
  EXPECT_FALSE(differs.mismatch.empty()) << differs.reason;
  // Another rank of it, not published yet (the name is on rank 0): waited
  // for, as the load pinning the name publishes every rank before it ends.
  protocol::CacheKey rank1 = trusted;
  rank1.tp_rank = 1;
  Registry::Lookup next_rank = r.Acquire(rank1, "chat", later, {}, waits);
  EXPECT_TRUE(asked) << "did not wait for the other ranks of the load pinning the name";
  EXPECT_TRUE(next_rank.asker_gone);
  asked = false;
  r.DropPin("chat");
  // Another name no load will pin; an announced load with no pin: at once.
  r.ExpectLoads(1);
  Registry::Lookup other = r.Acquire(trusted, "other", later, {}, waits);
  EXPECT_FALSE(other.model);
  EXPECT_FALSE(asked) << "waited for a name no load will pin";
  r.DropExpected(1);
  // Expected twice (two loads pin it), dropped once: still coming.
  r.ExpectPin("next");
  r.ExpectPin("next");
  r.DropPin("next");
  Registry::Lookup coming = r.Acquire(trusted, "next", later, {}, waits);
  EXPECT_TRUE(asked) << "did not wait for the second load that pins the name";
  EXPECT_TRUE(coming.asker_gone);
  // A stop: whoever waits for it is let go, with a plain miss.
  std::thread stop([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    r.DropExpected();
  });
  Registry::Lookup stopped = r.Acquire(trusted, "next", later);
  stop.join();
  EXPECT_FALSE(stopped.model);
  EXPECT_FALSE(stopped.loading);
  r.DropPin("next");  // its load ending after the stop: nothing left to drop
  asked = false;
  EXPECT_FALSE(r.Acquire(trusted, "next", later, {}, waits).model);
  EXPECT_FALSE(asked);
}

// A miss is explained against the same checkpoint on another device first
// (a GPU engine copies that one from the host), then against a model loaded
// from the engine's own directory, then the closest. Never a hit by path.
TEST(Registry, AMissIsExplainedAgainstTheEnginesOwnCheckpointAmongEquals) {
  Registry r(64 * kMiB);
  r.SetBudget(kGpu, 64 * kMiB);
  Publish(r, "host", 1, "xxh3-128:other")->path = "/models/other";
  Publish(r, "host", 1, "xxh3-128:before")->path = "/models/mine";
  protocol::CacheKey changed;
  changed.checkpoint = "xxh3-128:after";
  changed.device = "host";
  auto daemon_has = [](const Registry::Lookup& l) {
    return l.mismatch.size() == 1 ? l.mismatch[0].daemon : "";
  };
  EXPECT_EQ(daemon_has(r.Acquire(changed, "")), "xxh3-128:other");  // the first, with no path
  const Registry::Lookup mine = r.Acquire(changed, "", {}, "/models/mine");
  EXPECT_FALSE(mine.model);
  EXPECT_EQ(daemon_has(mine), "xxh3-128:before");

  // On a GPU: its own older checkpoint is resident there (differing in the
  // checkpoint), the new one in host memory from elsewhere (differing in
  // the device): as close, and the host copy is the one named.
  protocol::CacheKey on_gpu = changed;
  on_gpu.device = kGpu;
  Publish(r, kGpu, 1, "xxh3-128:before")->path = "/models/mine";
  Publish(r, "host", 1, "xxh3-128:after")->path = "/elsewhere/copy";
  const Registry::Lookup reload = r.Acquire(on_gpu, "", {}, "/models/mine");
  EXPECT_FALSE(reload.model);
  ASSERT_EQ(reload.mismatch.size(), 1u);
  EXPECT_EQ(reload.mismatch[0].field, "device");
}

// The model itself is a hit whatever else is resident: beside it, the same
// model on another device and a model from the engine's own directory
// (processed otherwise) are only what a miss would be explained against.
TEST(Registry, TheModelItselfIsFoundBeforeAnyNearMiss) {
  Registry r(64 * kMiB);
  r.SetBudget(kGpu, 64 * kMiB);
  // Published first: a key published again replaces its model.
  auto processed = Publish(r, "host", 1, "xxh3-128:same");
  processed->key.dtype = "bf16";
  processed->path = "/models/mine";
  auto on_host = Publish(r, "host", 1, "xxh3-128:same");
  on_host->path = "/elsewhere/copy";
  auto on_gpu = Publish(r, kGpu, 1, "xxh3-128:same");
  on_gpu->path = "/models/mine";

  protocol::CacheKey want;
  want.checkpoint = "xxh3-128:same";
  want.device = "host";
  const Registry::Lookup host = r.Acquire(want, "", {}, "/models/mine");
  EXPECT_EQ(host.model, on_host) << (host.mismatch.empty() ? "" : host.mismatch[0].Describe());
  want.device = kGpu;
  const Registry::Lookup gpu = r.Acquire(want, "", {}, "/models/mine");
  EXPECT_EQ(gpu.model, on_gpu) << (gpu.mismatch.empty() ? "" : gpu.mismatch[0].Describe());
  if (host.model) r.Release(host.model);
  if (gpu.model) r.Release(gpu.model);
}

// The engine's own model, resident processed otherwise (two ranks): that is
// what its miss names, not another model that differs in its checkpoint
// alone.
TEST(Registry, AMissNamesTheEnginesOwnModelProcessedOtherwise) {
  Registry r(64 * kMiB);
  Publish(r, "host", 1, "xxh3-128:other")->path = "/models/other";
  protocol::CacheKey rank1;
  rank1.checkpoint = "xxh3-128:mine";
  rank1.device = "host";
  rank1.tp_rank = 1;
  rank1.tp_size = 2;
  auto mine = Publish(r, "host", 1, "xxh3-128:mine", 0, "", {protocol::CacheKey{}, rank1});
  mine->path = "/models/mine";
  mine->key.dtype = "bf16";  // two fields differ from what the engine wants, not one
  protocol::CacheKey want;
  want.checkpoint = "xxh3-128:mine";
  want.device = "host";
  const Registry::Lookup miss = r.Acquire(want, "", {}, "/models/mine");
  EXPECT_FALSE(miss.model);
  ASSERT_FALSE(miss.mismatch.empty());
  for (const auto& d : miss.mismatch) EXPECT_NE(d.field, "checkpoint") << d.Describe();
  EXPECT_EQ(miss.mismatch.size(), 2u);
}

// A miss against another checkpoint's model says whose it is; one for a
// model whose preload failed says why, until that model is published.
TEST(Registry, AMissSaysWhoseModelDiffersAndWhyTheEnginesOwnIsMissing) {
  Registry r(64 * kMiB);
  r.SetBudget(kGpu, 64 * kMiB);
  protocol::CacheKey want;
  want.checkpoint = "xxh3-128:mine";
  want.device = "host";
  r.NoteFailedLoad({want}, "/models/mine: out of budget on host");
  const std::string failed =
      "the daemon's last preload of this model failed: /models/mine: out of budget on host";
  EXPECT_EQ(r.Acquire(want, "", {}, "/models/mine").reason, failed);
  // Another model's failure is not this one's: the same checkpoint on a
  // GPU, say.
  protocol::CacheKey on_gpu = want;
  on_gpu.device = kGpu;
  EXPECT_EQ(r.Acquire(on_gpu, "", {}, "/models/mine").reason, "no model is resident");

  Publish(r, "host", 1, "xxh3-128:other")->path = "/models/other";
  const Registry::Lookup other_failed = r.Acquire(want, "", {}, "/models/mine");
  EXPECT_FALSE(other_failed.model);
  EXPECT_EQ(other_failed.reason, failed);
  EXPECT_TRUE(other_failed.mismatch.empty());  // the other's digest would read as an older one
  const Registry::Lookup other = r.Acquire(on_gpu, "", {}, "/models/mine");
  EXPECT_EQ(other.reason,
            "no model from this checkpoint is resident; the nearest, from /models/other, differs");
  ASSERT_FALSE(other.mismatch.empty());
  EXPECT_EQ(other.mismatch[0].field, "checkpoint");
  EXPECT_EQ(r.Acquire(on_gpu, "").reason, "no resident model matches");  // no path: no owner

  // The same content from elsewhere is no other checkpoint: the host copy
  // a GPU engine reloads from stays a miss on `device` alone, failure or not.
  Publish(r, "host", 1, "xxh3-128:mine")->path = "/elsewhere/copy";
  r.NoteFailedLoad({on_gpu}, "/models/mine: out of budget on " + kGpu);
  const Registry::Lookup reload = r.Acquire(on_gpu, "", {}, "/models/mine");
  EXPECT_EQ(reload.reason,
            "the daemon's last preload of this model failed: /models/mine: out of "
            "budget on " +
                kGpu + "; what is resident differs");
  ASSERT_EQ(reload.mismatch.size(), 1u);
  EXPECT_EQ(reload.mismatch[0].field, "device");

  // Published, a model is found, and its failure forgotten.
  const Registry::Lookup hit = r.Acquire(want, "", {}, "/models/mine");
  ASSERT_TRUE(hit.model) << hit.reason;
  r.Release(hit.model);
  auto gpu_model = Publish(r, kGpu, 1, "xxh3-128:mine");
  gpu_model->path = "/models/mine";
  r.Evict("all");
  EXPECT_EQ(r.Acquire(on_gpu, "", {}, "/models/mine").reason, "no model is resident");

  // Only the newest kFailedLoadsKept keys are remembered, each reason cut
  // short.
  std::vector<protocol::CacheKey> many(Registry::kFailedLoadsKept);
  for (size_t i = 0; i < many.size(); ++i) {
    many[i].checkpoint = "xxh3-128:m" + std::to_string(i);
    many[i].device = "host";
  }
  r.NoteFailedLoad({want}, "older");
  r.NoteFailedLoad(many, std::string(100'000, 'x'));
  EXPECT_EQ(r.Acquire(want, "", {}, "/models/mine").reason, "no model is resident");
  const std::string cut = r.Acquire(many[0], "", {}, "/models/m0").reason;
  EXPECT_EQ(cut.size(), std::string("the daemon's last preload of this model failed: ").size() +
                            Registry::kFailedLoadReasonBytes + 3);
}

}  // namespace
}  // namespace weightd::daemon
