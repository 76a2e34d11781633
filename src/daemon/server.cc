#include "daemon/server.h"

#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "daemon/registry.h"
#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/cuda.h"
#include "memory/host_memory.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"
#include "protocol/text.h"
#include "transform/plan.h"

namespace weightd::daemon {
namespace {

using nlohmann::json;

// An evicted model for the log: where it came from, and its key.
std::string Named(const Eviction& e) {
  return (e.path.empty() ? "" : e.path + ", ") + e.description;
}

// The models evicted, as `evict` and a preload's reply list them: within
// half a frame (an `evict all` of thousands of ranks with long pinned
// names would not fit one), the rest counted in `omitted`.
json EvictionsJson(const std::vector<Eviction>& evicted, uint64_t* omitted) {
  std::vector<json> entries;
  entries.reserve(evicted.size());
  for (const Eviction& e : evicted) {
    // As `status` listed it: a script knows what went without a status before.
    entries.push_back({{"id", e.id},
                       {"key", protocol::ToJson(e.key)},
                       {"description", e.description},
                       {"name", e.name},
                       {"path", protocol::PathToJson(e.path)},
                       {"device", e.key.device},
                       {"bytes", e.bytes},
                       {"leases", e.leases}});
  }
  return protocol::ListWithin(std::move(entries), protocol::kMaxBodyBytes / 2, omitted);
}

constexpr auto kProgressEvery = std::chrono::milliseconds(100);
// A preload's asker hears from the daemon at least this often.
constexpr auto kHeartbeat = std::chrono::seconds(5);
// Serving threads kept ready (each mostly an idle stack), and how long one
// more than those waits for a connection before it ends (one waiting in
// accept() holds a descriptor's place).
constexpr int kKeptWorkers = 64;
// Serving threads at most. A peer that sends part of a frame holds one
// until the rest comes (10 s at most), and an engine waiting for a load
// holds one for as long as it waits: without a bound, a flood of them took
// a thread each until the system's limit, where preloads could start none.
// Past it, connections wait in the backlog, and requests that come on
// parked ones wait there, until a thread is free.
constexpr int kMaxWorkers = 512;
constexpr auto kIdleExit = std::chrono::seconds(10);
// A segment one huge page big: what the start-up line about host pages
// asks the kernel about.
constexpr uint64_t kHostPagesProbeBytes = 2ull << 20;
// A connection with no request for this long between two is parked: it
// waits in an epoll set instead of holding a thread. With more than
// kBusyServing threads serving, at once: a flood of peers that connect and
// say nothing holds that many threads, not one each.
constexpr int kParkAfterMs = 200;
constexpr int kBusyServing = 2 * kKeptWorkers;

// The end of a stop's grace (at most half of it) in which a preload's
// connection, kept writable until then for its answer, is shut both ways.
constexpr double kLastOfTheGraceSeconds = 1;

// What one more read in flight costs the daemon's control group: a pool
// thread's stacks, user and kernel, as the group is charged for them
// (about 35 KiB an idle thread in a release build), with room to spare.
constexpr uint64_t kBytesPerRead = 64 << 10;
// Reads in flight at the least, however small the group: a mount that
// answers each in a round trip needs some.
constexpr int kFewestReads = 16;
constexpr uint64_t kFewestBufferBytes = 1 << 20;
// A fingerprint's first read of each shard (its header and first samples)
// at the least: one read for the header of a few hundred tensors.
constexpr uint64_t kFewestFirstReadBytes = 16 << 10;

// After a preload of this many tensors or more, the freed heap goes back
// to the system (see Preload).
constexpr uint64_t kTrimAfterTensors = 250'000;
void TrimHeap() {
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Creates the socket directory (0700) when missing, then opens it and
// checks it is ours alone: what the daemon makes there, it makes through
// the descriptor.
Result<memory::UniqueFd> ClaimDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Error(Errno("cannot create the socket directory " + dir));
  }
  return protocol::OpenSocketDirectory(dir);
}

// Whether a process listens on the socket at `addr`: a connection it
// would take (one tried, at once, without waiting), or a backlog full of
// them. The listener's pid where the kernel says it.
struct Listener {
  bool there = false;
  pid_t pid = 0;
};
Listener ListenerAt(const sockaddr_un& addr) {
  memory::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return {};
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    return {.there = errno == EAGAIN};
  }
  ucred cred{};
  socklen_t len = sizeof cred;
  const bool said = ::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
  return {.there = true, .pid = said ? cred.pid : 0};
}

std::string ReadSmallFile(int fd) {
  char buf[64] = {};
  ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// The CUDA devices this daemon sees, or why it sees none; `probe` is the
// driver's answer, asked once in the background at start (a slow or hung
// driver must not hold up the host), not ready yet while it thinks.
// `read_only`: per GPU, whether the driver granted a read-only mapping of a
// segment when the daemon tried (after its first preload there).
json CudaJson(const std::shared_future<Result<std::vector<memory::CudaDevice>>>& probe,
              const std::map<std::string, std::string>& read_only) {
  if (!probe.valid()) {
    return {{"available", false}, {"reason", "the CUDA driver was not asked (no thread for it)"}};
  }
  if (probe.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    return {{"available", false}, {"reason", "still asking the CUDA driver"}};
  }
  const auto& devices = probe.get();
  if (!devices.ok()) return {{"available", false}, {"reason", devices.error().message()}};
  json list = json::array();
  for (const memory::CudaDevice& d : *devices) {
    auto ro = read_only.find("cuda:" + d.uuid);
    list.push_back({{"name", "cuda:" + d.uuid},
                    {"ordinal", d.ordinal},
                    {"model", d.name},
                    {"total_bytes", d.total_bytes},
                    {"fd_handles", d.served()},
                    {"not_served", d.served() ? json(nullptr) : json(d.not_served)},
                    {"granularity", d.granularity},
                    {"read_only_mapping", ro == read_only.end() ? "not tried yet" : ro->second}});
  }
  return {{"available", true}, {"devices", list}};
}

json DeviceJson(const Registry::Snapshot& s) {
  json out = json::array();
  for (const Registry::DeviceUse& d : s.devices) {
    out.push_back({{"name", d.device},
                   {"budget", d.budget},
                   {"used", d.used},
                   {"reserved", d.reserved},
                   {"free", d.budget - std::min(d.budget, d.used + d.reserved)},
                   {"evicted_in_use", d.evicted_leased},
                   {"evicted_in_use_models", d.evicted_leased_models}});
  }
  return out;
}

// What the kernel would still give in host memory, as the registry weighs
// a reservation against it. A load keeps an eighth of the limit, at most
// 256 MiB, for the daemon's own working memory (headers, plans, buffers).
std::optional<Registry::Room> HostRoom() {
  const std::optional<memory::MemoryRoom> room = memory::HostMemoryRoom();
  if (!room) return std::nullopt;
  constexpr uint64_t kMostKept = 256ull << 20;
  Registry::Room out{room->free, std::min(kMostKept, room->limit / 8), ""};
  out.what = room->source == "MemAvailable"
                 ? "the machine's MemAvailable"
                 : "the control group's limit of " + protocol::FormatBytes(room->limit) + " in " +
                       room->source + ", " + protocol::FormatBytes(room->held) + " held";
  return out;
}

}  // namespace

struct Server::State {
  explicit State(ServerOptions o)
      : options(std::move(o)),
        registry(options.host_budget, options.check_host_room
                                          ? Registry::RoomProbe([this] { return HostRoomNow(); })
                                          : Registry::RoomProbe()) {
    // A preload's buffers and threads within what is kept of the memory
    // for the daemon's own work (an eighth of a container's limit, at most
    // 256 MiB): room for the segments is weighed less that. Up to a
    // quarter of it goes to the threads of reads in flight, the rest to
    // buffers: on a mount that answers in round trips, a fingerprint keeps
    // 512 out, a thread each, which would take 18 MiB of a 256 MiB group's
    // 32 kept.
    if (options.check_host_room) {
      if (const std::optional<Registry::Room> room = HostRoom()) {
        kept_for_work = room->keep;
        reads_in_flight = static_cast<int>(std::clamp<uint64_t>(
            room->keep / 4 / kBytesPerRead, kFewestReads, static_cast<uint64_t>(reads_in_flight)));
        // Buffers of a MiB at the least: under that, a fingerprint's
        // window would make every sample read a round trip of its own.
        const uint64_t for_threads = static_cast<uint64_t>(reads_in_flight) * kBytesPerRead;
        buffer_bytes =
            std::min(buffer_bytes,
                     std::max(room->keep > for_threads ? room->keep - for_threads : uint64_t{0},
                              kFewestBufferBytes));
        // A fingerprint reads the first bytes of as many shards at once as
        // it has reads in flight, each into a slot of its own, beside its
        // window for the other samples. Where that would be more than the
        // buffers (in a 256 MiB group, 32 MiB of slots for a checkpoint of
        // 128 shards or more, all it keeps, taken before the budget refuses
        // a model too big for it), the slots get a quarter of them at most
        // and the window the rest.
        const uint64_t reads = static_cast<uint64_t>(reads_in_flight);
        if (reads * first_read_bytes + fingerprint::Options{}.remote_window_bytes > buffer_bytes) {
          first_read_bytes = std::clamp<uint64_t>(buffer_bytes / 4 / reads, kFewestFirstReadBytes,
                                                  first_read_bytes);
          window_bytes = buffer_bytes - std::min(buffer_bytes, reads * first_read_bytes);
        }
      }
    }
  }

  // A connection, between its requests and while one is handled.
  struct Connection {
    Connection(uint64_t i, memory::UniqueFd fd, const ucred& p)
        : id(i), ch(std::move(fd)), peer(p) {}
    uint64_t id;
    protocol::Channel ch;
    ucred peer;
    std::vector<std::shared_ptr<ResidentModel>> leases;
    std::chrono::steady_clock::time_point parked_at;
  };
  ServerOptions options;
  Registry registry;
  uint64_t buffer_bytes = loader::LoadOptions{}.buffer_bytes;  // each preload's, together
  int reads_in_flight = fingerprint::Options{}.max_inflight;   // each preload's, at most
  // A fingerprint's first read of each shard, and its window for the rest.
  uint64_t first_read_bytes = fingerprint::Options{}.speculative_bytes;
  uint64_t window_bytes = buffer_bytes;
  uint64_t kept_for_work = 0;  // of a container's memory, for the above; 0: none known
  memory::UniqueFd dir_fd;     // the socket directory, as checked
  memory::UniqueFd lock_fd;
  memory::UniqueFd listen_fd;
  memory::UniqueFd wake_read, wake_write;
  std::string socket_path;
  std::atomic<bool> stopping{false};
  std::atomic<int> stop_signal{0};  // what asked for the stop, if a signal

  std::mutex conn_mu;
  std::condition_variable conn_done;
  // The config's models are keyed all at once (so that engines waiting for
  // the daemon know at once which are coming) and loaded one after another,
  // in the config's order: the first is served soonest. `config_turn` is
  // the order of the one that may load now. Guarded by conn_mu.
  size_t config_turn = 0;
  std::condition_variable config_turn_cv;
  // Orders that will never come (no thread could be made for them): the
  // turn passes over them.
  std::set<size_t> config_skipped;
  // By order, the name each of the config's models will be pinned as (or
  // none), expected from the start (Registry::ExpectPin). Set before the
  // server starts and never changed: read without a lock.
  std::vector<std::string> config_pins;
  // The config's pin for `order`; null for none.
  const std::string* ConfigPin(size_t order) const {
    return order < config_pins.size() && !config_pins[order].empty() ? &config_pins[order]
                                                                     : nullptr;
  }
  // Waits (conn_mu held by `lock`) until it is `order`'s turn or the
  // daemon stops; whether it is its turn.
  bool WaitForTurn(std::unique_lock<std::mutex>& lock, size_t order) {
    config_turn_cv.wait(lock, [&] { return config_turn == order || stopping.load(); });
    return !stopping.load();
  }
  // REQUIRES: conn_mu held. The turn after `order`, past any skipped.
  void PassTurn(size_t order) {
    config_turn = std::max(config_turn, order + 1);
    while (config_skipped.contains(config_turn)) ++config_turn;
    config_turn_cv.notify_all();
  }
  std::set<int> open_sockets;  // raw fds of live connections, to shut down on stop
  // Those of them a preload's asker waits on: a stop shuts only their
  // reading side until near the end of its grace, so that the asker hears
  // that its preload was cancelled.
  std::set<int> preloading_sockets;
  int live_connections = 0;
  // Of those, the ones handling a request now: work a stop waits for. The
  // others wait for a request (an engine holding its lease, most often)
  // and end as soon as a stop shuts their socket.
  std::atomic<int> handling{0};
  // Preloads asked for by the daemon's owner (Server::Preload: the config's
  // models), which a stop waits for like connections.
  int live_preloads = 0;
  // Preloads reading a checkpoint (keyed, their turn come, no other load
  // of theirs in flight), for `status`: what, for whom, since when, how far.
  struct Loading {
    std::string path;
    std::string asked_by;
    std::chrono::steady_clock::time_point since;
    uint64_t done = 0;
    uint64_t total = 0;
    // By rank, until it is published: what its host segment holds so far,
    // and at most (its reservation).
    std::map<int, std::pair<std::function<uint64_t()>, uint64_t>> held = {};
  };
  std::mutex loads_mu;  // guards loads_under_way and next_load
  std::map<uint64_t, Loading> loads_under_way;
  uint64_t next_load = 0;
  // One of loads_under_way, for as long as this lives.
  class ListedLoad {
   public:
    ListedLoad(State& s, const std::string& path, const std::string& asked_by) : s_(s) {
      std::lock_guard lock(s_.loads_mu);
      id_ = s_.next_load++;
      s_.loads_under_way[id_] = {path, asked_by, std::chrono::steady_clock::now(), 0, 0};
    }
    ListedLoad(const ListedLoad&) = delete;
    ListedLoad& operator=(const ListedLoad&) = delete;
    ~ListedLoad() {
      std::lock_guard lock(s_.loads_mu);
      s_.loads_under_way.erase(id_);
    }
    void Progress(uint64_t done, uint64_t total) {
      std::lock_guard lock(s_.loads_mu);
      Loading& l = s_.loads_under_way.at(id_);
      l.done = done;
      l.total = total;
    }
    // Rank `rank` fills `segment`, made within its reservation.
    void Fills(int rank, const memory::Segment& segment) {
      auto probe = segment.HeldProbe();
      std::lock_guard lock(s_.loads_mu);
      s_.loads_under_way.at(id_).held[rank] = {std::move(probe), segment.reserved_bytes()};
    }
    // Before rank `rank`'s reservation goes to Publish.
    void Publishing(int rank) {
      std::lock_guard lock(s_.loads_mu);
      s_.loads_under_way.at(id_).held.erase(rank);
    }

   private:
    State& s_;
    uint64_t id_ = 0;
  };
  // What loads in progress hold of their reservations' host memory now.
  uint64_t FilledByLoads() {
    std::lock_guard lock(loads_mu);
    uint64_t filled = 0;
    for (const auto& [id, load] : loads_under_way) {
      for (const auto& [rank, probe] : load.held) {
        // Within the reservations, whose sum the registry holds: no overflow.
        filled += std::min(probe.first(), probe.second);
      }
    }
    return filled;
  }
  // The kernel's figure as a reservation is weighed against it: what
  // loads in progress hold is read first, so that the figure lacks all of
  // it (it may lack more: pages taken between the two reads count twice).
  std::optional<Registry::Room> HostRoomNow() {
    const uint64_t filled = FilledByLoads();
    std::optional<Registry::Room> room = HostRoom();
    if (room) room->filled = filled;
    return room;
  }
  // Run gave up waiting for some connection: its thread may still use the
  // state, which is then never freed.
  bool abandoned = false;
  // Serving threads accept connections themselves, each blocked in accept()
  // (the kernel hands a connection to one of them), and serve what they
  // accepted; one that takes the last idle place starts another first.
  // Threads are kept between connections. A single accepting thread handing
  // connections over put two wake-ups on every attach, one after another
  // through that thread: with 64 engines busy on every core it was starved
  // and the attaches queued behind it.
  int workers = 0;              // accepting threads, the park thread, and those it started
  int idle_workers = 0;         // blocked in accept()
  std::atomic<int> serving{0};  // threads in Serve
  std::mutex spare_mu;
  std::condition_variable spare_cv;
  // A descriptor in reserve (Start), a copy of null_fd; guarded by
  // spare_mu after Start.
  memory::UniqueFd null_fd, spare_fd;
  // A thread runs RefuseWhileOutOfDescriptors; written under spare_mu, read
  // without it first by every accept (TookTheReservesPlace).
  std::atomic<bool> refusing{false};
  std::string refusal_frame;  // what a peer refused for want of descriptors is sent
  // Out of descriptors (accept said so). One thread at a time: until a
  // descriptor is free again, it takes each waiting connection with the
  // one in reserve and tells it why it cannot be served; the others wait,
  // and call accept() no more meanwhile (one could take the reserve's
  // place while it is given up, and keep it).
  void RefuseWhileOutOfDescriptors();
  // Whether a connection just accepted took the place the refusing thread
  // gave up to take one: then it is refused in its stead, and its place
  // kept as the reserve (RefuseAndKeepPlace), or nothing could be refused
  // until a connection ended.
  bool TookTheReservesPlace();
  // Sends `conn` the refusal and keeps its place as the reserve.
  void RefuseAndKeepPlace(memory::UniqueFd conn);
  memory::UniqueFd park_epoll;  // the parked connections' sockets
  memory::UniqueFd park_wake;   // an eventfd: Run wakes the park thread to stop
  std::map<int, std::unique_ptr<Connection>> parked;  // by socket; guarded by conn_mu
  std::atomic<int64_t> last_accept_log{0};            // steady_clock ticks
  std::shared_future<Result<std::vector<memory::CudaDevice>>> cuda_probe;
  std::once_flag gpu_budgets_applied;
  std::atomic<bool> gpu_budgets_done{false};
  std::mutex read_only_mu;
  std::map<std::string, std::string> read_only;  // by GPU: what a read-only mapping got
  uint64_t next_connection = 1;

  // Gives every GPU the daemon sees its budget, once the driver has
  // answered (with `wait`, waits for it).
  void ApplyGpuBudgets(bool wait);
  // An error unless the daemon serves this GPU (waits for the driver).
  Status CheckServed(const memory::Device& device);
  // Maps a new GPU segment read-only here, once per GPU, to learn (and
  // report in status) whether the driver grants that.
  void LearnReadOnly(const memory::Segment& segment);

  void Log(const std::string& line) {
    if (options.log) options.log(line);
  }

  // Serves the connection's requests until it closes, or parks it.
  void Serve(std::unique_ptr<Connection> c);
  // Ends a connection: its leases go back, its socket is closed, it stops
  // being counted.
  void Finish(std::unique_ptr<Connection> c);
  // Hands a quiet connection to the park thread; false (and `c` kept)
  // when the daemon stops or the epoll set refuses it.
  bool Park(std::unique_ptr<Connection>& c);
  // Says that `c`, quiet for options.idle_seconds without a lease, is
  // being closed (`how`: where it waited, or empty).
  void LogIdleClose(const Connection& c, const std::string& how);
  // The park thread: a parked connection that becomes readable (a request,
  // or its close) is served again on a thread of its own; one without
  // leases quiet for options.idle_seconds is closed; a stop ends them all.
  void ParkLoop();
  // Once `stopping` is set: the park thread ends every parked connection
  // and itself.
  void WakeParkThread() {
    const uint64_t one = 1;
    (void)!::write(park_wake.get(), &one, sizeof one);
  }
  void WorkerLoop();
  // Logs `what` with errno `error`, at most once every few seconds.
  void LogNowAndThen(const std::string& what, int error);
  // Checks a new connection's peer; false (logged, answered) when refused.
  bool Admit(memory::UniqueFd& conn, ucred* peer);
  // Starts one more serving thread; false when the system refuses, or
  // kMaxWorkers serve already.
  bool SpawnWorker();
  json CudaStatus() {
    std::lock_guard lock(read_only_mu);
    return CudaJson(cuda_probe, read_only);
  }
  Status Handle(protocol::Channel& ch, const protocol::Message& m, uint64_t id, const ucred& peer,
                std::vector<std::shared_ptr<ResidentModel>>& leases);
  // What a preload has marked in the registry, taken off when it ends
  // (after its failure, if any, is noted). A config's model: announced
  // (Registry::ExpectLoads) until its keys are known, then queued (acquires
  // wait for it) until its turn, then loaded; whatever happens, the marks
  // come off and the turn passes on, in order. Its turn is waited for
  // queued, not loading: another load of the same key (the same model named
  // twice, an engine's --populate) is never held up by one that waits for
  // its turn behind it.
  struct LoadMarks {
    State& s;
    std::optional<size_t> order;
    bool announced;
    std::vector<protocol::CacheKey> queued;
    std::vector<protocol::CacheKey> loading;  // marked by BeginLoad
    bool published = false;                   // some rank of it is resident
    // Expected (Registry::ExpectPin) until the end; null for none. Not a
    // copy: nothing between its ExpectPin and this may fail to drop it.
    const std::string* pin = nullptr;
    ~LoadMarks() {
      if (!loading.empty()) s.registry.EndLoad(loading);
      if (pin != nullptr) s.registry.DropPin(*pin);
      if (announced) s.registry.DropExpected(1);
      if (!queued.empty()) s.registry.Unqueue(queued);
      if (!order) return;
      std::unique_lock lock(s.conn_mu);
      s.WaitForTurn(lock, *order);
      s.PassTurn(*order);
    }
    // Marks `keys` as coming and waits for this model's turn; false once
    // the daemon stops.
    bool QueueAndWaitForTurn(const std::vector<protocol::CacheKey>& keys) {
      if (!order) return true;
      s.registry.Queue(keys);
      announced = false;
      queued = keys;
      std::unique_lock lock(s.conn_mu);
      return s.WaitForTurn(lock, *order);
    }
    // Marks `keys` loading (waiting while another load of any of them is
    // in flight); the queued marks come off.
    void Begin(const std::vector<protocol::CacheKey>& keys) {
      s.registry.BeginLoad(keys);
      loading = keys;
      if (!queued.empty()) s.registry.Unqueue(std::exchange(queued, {}));
    }
  };
  // `only`: the ranks to make (empty: all). `config_order`: a config's
  // model, announced by Registry::ExpectLoads (keyed or dropped here), that
  // loads in its turn.
  // Whatever the load throws (an allocation refused) is its error, which
  // says whether any rank was published first; the caller's threads unwind
  // normally.
  Result<json> Preload(const std::string& path, const protocol::Processing& processing,
                       const std::string& pin, const std::vector<int>& only,
                       const std::string& asked_by,
                       const std::function<void(uint64_t, uint64_t)>& progress,
                       std::optional<size_t> config_order = std::nullopt) {
    // A config's pin was expected when it was announced.
    const std::string* expected_pin = config_order ? ConfigPin(*config_order) : nullptr;
    if (!config_order && !pin.empty()) {
      registry.ExpectPin(pin);
      expected_pin = &pin;
    }
    LoadMarks marks{*this, config_order, config_order.has_value(), {}, {}, false, expected_pin};
    Result<json> r = Error("");
    try {
      r = PreloadUnguarded(path, processing, pin, only, asked_by, progress, marks);
      // A header of a million tensors leaves hundreds of megabytes of freed
      // heap behind (its parse, the plan), given back now rather than kept
      // for good. Not after every preload: the next would fault its memory
      // in again.
      if (r.ok() && r->value("tensors", uint64_t{0}) >= kTrimAfterTensors) TrimHeap();
    } catch (const std::exception& e) {
      const bool memory = dynamic_cast<const std::bad_alloc*>(&e) != nullptr;
      r = Error(path + ": the preload failed: " +
                (memory ? "out of memory (an allocation was refused: see the daemon's ulimit -v "
                          "and vm.overcommit_memory)"
                        : std::string(e.what())) +
                (marks.published ? " once it was resident (see `weightd status`)"
                                 : "; nothing was published"));
    }
    // Before the marks come off: engines waiting for this model, woken
    // then, hear why it did not come.
    if (!r.ok() && !marks.loading.empty()) {
      registry.NoteFailedLoad(marks.loading, r.error().message());
    }
    return r;
  }
  Result<json> PreloadUnguarded(const std::string& path, const protocol::Processing& processing,
                                const std::string& pin, const std::vector<int>& only,
                                const std::string& asked_by,
                                const std::function<void(uint64_t, uint64_t)>& progress,
                                LoadMarks& marks);
};

Server::Server(ServerOptions options) : state_(std::make_unique<State>(std::move(options))) {}

Server::~Server() {
  if (state_ && state_->abandoned) (void)state_.release();
}

void Server::RequestStop(int signal) {
  if (signal != 0) state_->stop_signal.store(signal);
  state_->stopping.store(true);
  if (state_->wake_write.valid()) {
    const char c = 'x';
    [[maybe_unused]] ssize_t n = ::write(state_->wake_write.get(), &c, 1);
  }
}

bool Server::stopping() const { return state_->stopping.load(); }

Status Server::Start() {
  State& s = *state_;
  // A preload holds every shard open and each engine a connection: take
  // all the descriptors the system allows this process.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  // Kept for the day the others run out: closed to accept one connection
  // and tell it so, rather than leave every peer waiting in the backlog.
  s.null_fd.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  {
    // Made now: out of descriptors, the daemon makes nothing it can avoid.
    rlimit now{};
    ::getrlimit(RLIMIT_NOFILE, &now);
    const std::string body =
        json{{"type", "error"},
             {"message", "the daemon has no file descriptor left (its limit is " +
                             std::to_string(now.rlim_cur) +
                             "): raise it (ulimit -n, LimitNOFILE=); each engine holding weights, "
                             "and each resident model, keeps one"}}
            .dump();
    s.refusal_frame = protocol::FrameHeader(static_cast<uint32_t>(body.size()), 0) + body;
  }
  if (s.null_fd.valid()) s.spare_fd.Reset(::fcntl(s.null_fd.get(), F_DUPFD_CLOEXEC, 0));
  const std::string& dir = s.options.socket_dir;
  // Checked before the directory is made, so a refusal leaves nothing behind.
  s.socket_path = protocol::SocketPath(dir);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (s.socket_path.size() >= sizeof addr.sun_path) {
    return Error("socket path " + s.socket_path + " is too long for a Unix socket (at most " +
                 std::to_string(sizeof addr.sun_path - 1) + " bytes)");
  }
  WEIGHTD_ASSIGN_OR_RETURN(s.dir_fd, ClaimDirectory(dir));
  const int dir_fd = s.dir_fd.get();

  const std::string lock_path = dir + "/" + protocol::kLockName;
  s.lock_fd.Reset(
      ::openat(dir_fd, protocol::kLockName, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!s.lock_fd.valid()) return Error(Errno("cannot open the lock file " + lock_path));
  if (::flock(s.lock_fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      const std::string pid = ReadSmallFile(s.lock_fd.get());
      const std::string who = "another weightd daemon" + (pid.empty() ? "" : " (pid " + pid + ")");
      // Its socket goes first when it stops, and comes last when it starts.
      struct stat st;
      if (::fstatat(dir_fd, protocol::kSocketName, &st, AT_SYMLINK_NOFOLLOW) != 0 &&
          errno == ENOENT) {
        return Error(who + " holds " + dir +
                     ", and its socket is not there: it is stopping or starting (start again "
                     "once it has stopped), or its socket was removed (stop it by its pid)");
      }
      return Error(who + " is already serving " + dir);
    }
    return Error(Errno("cannot lock " + lock_path));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(s.lock_fd.get(), 0) != 0 ||
      ::pwrite(s.lock_fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return Error(Errno("cannot write the lock file " + lock_path));
  }

  // Bound through the directory checked, not through its path, which
  // whoever may write to its parent could point elsewhere by now.
  WEIGHTD_ASSIGN_OR_RETURN(const std::string bind_path,
                           protocol::PathThrough(dir_fd, protocol::kSocketName, s.socket_path));
  if (bind_path.size() >= sizeof addr.sun_path) {
    return Error("socket path " + bind_path + " is too long for a Unix socket");
  }
  std::memcpy(addr.sun_path, bind_path.c_str(), bind_path.size() + 1);
  // We hold the lock: a socket already there was left by a daemon that
  // died, unless someone listens on it (a daemon whose lock file was
  // removed from under it): that one keeps it, and its models.
  struct stat st;
  if (::fstatat(dir_fd, protocol::kSocketName, &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return Error(s.socket_path + " exists and is not a socket; remove it by hand");
    }
    if (const Listener l = ListenerAt(addr); l.there) {
      return Error((l.pid > 0 ? "process " + std::to_string(l.pid) : std::string("a process")) +
                   " is listening on " + s.socket_path + ", though " + lock_path +
                   " was not locked: a daemon whose lock file was removed? Stop it before "
                   "starting another here");
    }
    s.Log("replacing the stale socket of a daemon that is gone");
    ::unlinkat(dir_fd, protocol::kSocketName, 0);
  }
  s.listen_fd.Reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.listen_fd.valid()) return Error(Errno("socket"));
  if (::bind(s.listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return Error(Errno("cannot bind " + s.socket_path));
  }
  // The directory (0700) already keeps others out; the socket says so too.
  if (::fchmodat(dir_fd, protocol::kSocketName, 0600, 0) != 0) {
    return Error(Errno("chmod " + s.socket_path));
  }
  if (::listen(s.listen_fd.get(), 256) != 0) return Error(Errno("listen"));
  // accept() gives up after this long, so that a thread idle that long can
  // end (when enough others are idle too).
  const timeval accept_timeout{std::chrono::seconds(kIdleExit).count(), 0};
  ::setsockopt(s.listen_fd.get(), SOL_SOCKET, SO_RCVTIMEO, &accept_timeout, sizeof accept_timeout);

  // What the host's segments will be made of, as things stand: an operator
  // who sees normal pages learns what would let the kernel fill them 2 MiB
  // at a time. Each preload looks again.
  const memory::HostPlacement pages = memory::PlanHostSegments(kHostPagesProbeBytes);
  if (pages.options.try_huge_pages) {
    s.Log("host segments: huge pages, from the hugetlbfs pool while it has them free");
  } else if (pages.options.transparent_huge_pages) {
    s.Log(
        "host segments: transparent huge pages, where the kernel has free 2 MiB blocks (its "
        "shmem policy is `" +
        memory::ShmemHugePagePolicy() + "`)");
  } else {
    s.Log("host segments: normal pages; a hugetlbfs pool, or `within_size` in " +
          std::string(memory::kShmemHugePagePolicyPath) +
          ", lets preloads fill them 2 MiB at a time (docs/daemon.md)");
  }

  // Where what it keeps for its own work held a preload's reads in
  // flight below the default, the operator hears why.
  if (s.reads_in_flight < fingerprint::Options{}.max_inflight ||
      s.first_read_bytes < fingerprint::Options{}.speculative_bytes) {
    s.Log("reads in flight: at most " + std::to_string(s.reads_in_flight) +
          " per preload, for the " + protocol::FormatBytes(s.kept_for_work) +
          " kept for the daemon's own work (a quarter of it, " + std::to_string(kFewestReads) +
          " at the least); a fingerprint's first read of each shard " +
          protocol::FormatBytes(s.first_read_bytes) + ", its window " +
          protocol::FormatBytes(s.window_bytes));
  }

  // The GPUs, asked in the background and logged once known: the host is
  // served meanwhile, and a hung driver holds up neither serving nor exit
  // (the thread is detached and owns what it uses).
  try {
    auto answer = std::make_shared<std::promise<Result<std::vector<memory::CudaDevice>>>>();
    auto probe = answer->get_future().share();
    // The answer should asking throw (no memory), made here where a throw
    // is caught below.
    Result<std::vector<memory::CudaDevice>> unasked =
        Error("the CUDA driver could not be asked: out of memory");
    std::thread([answer, unasked = std::move(unasked), log = s.options.log]() mutable {
      Result<std::vector<memory::CudaDevice>> gpus = std::move(unasked);
      try {
        gpus = memory::ListCudaDevices();
      } catch (...) {
      }
      try {
        if (log && !gpus.ok()) log("serving the host only; cuda: " + gpus.error().message());
        if (log && gpus.ok()) {
          for (const memory::CudaDevice& d : *gpus) {
            log("cuda:" + std::to_string(d.ordinal) + " is " + d.name + " (cuda:" + d.uuid + ")" +
                (d.served() ? "" : ": not served, " + d.not_served));
          }
        }
      } catch (...) {
        // No memory for the log lines; status has the answer.
      }
      answer->set_value(std::move(gpus));
    }).detach();
    // Only once the thread runs: a promise it never got is no answer.
    s.cuda_probe = std::move(probe);
  } catch (const std::system_error&) {
    // No thread for it: status says the driver was not asked.
  }

  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return Error(Errno("pipe"));
  s.wake_read.Reset(pipe_fds[0]);
  s.wake_write.Reset(pipe_fds[1]);

  // Threads ready for a burst of engines attaching at once; the last thing
  // Start does, so that no failure leaves them running.
  // Counted here, not read from `workers`: a stop asked for meanwhile (a
  // signal) ends them at once, and then Run, not this, waits for them.
  s.park_epoll.Reset(::epoll_create1(EPOLL_CLOEXEC));
  s.park_wake.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s.park_epoll.valid() || !s.park_wake.valid()) return Error(Errno("epoll"));
  epoll_event wake{};
  wake.events = EPOLLIN;
  wake.data.fd = s.park_wake.get();
  if (::epoll_ctl(s.park_epoll.get(), EPOLL_CTL_ADD, s.park_wake.get(), &wake) != 0) {
    return Error(Errno("epoll_ctl"));
  }
  {
    std::lock_guard lock(s.conn_mu);
    ++s.workers;
  }
  try {
    std::thread([&s] { s.ParkLoop(); }).detach();
  } catch (const std::system_error&) {
    std::lock_guard lock(s.conn_mu);
    --s.workers;
    return Error("cannot start the thread that keeps quiet connections");
  }
  int started = 0;
  while (started < kKeptWorkers && s.SpawnWorker()) ++started;
  if (started == 0) {
    // The park thread ends before the state it uses can go.
    s.stopping.store(true);
    s.WakeParkThread();
    std::unique_lock lock(s.conn_mu);
    s.conn_done.wait(lock, [&] { return s.workers == 0; });
    return Error("cannot start any serving thread");
  }
  return OkStatus();
}

Server::Stopped Server::Run() {
  State& s = *state_;
  while (!s.stopping.load()) {
    // While the driver is being asked, look now and then: the GPUs get their
    // budgets (and a --budget naming none is logged) as soon as it answers.
    s.ApplyGpuBudgets(/*wait=*/false);
    pollfd wake{s.wake_read.get(), POLLIN, 0};
    if (::poll(&wake, 1, s.gpu_budgets_done.load() ? -1 : 100) < 0 && errno != EINTR) {
      s.Log(Errno("poll"));
      break;
    }
    if (wake.revents != 0) break;
  }
  s.stopping.store(true);
  {
    int connections = 0, preloads = 0;
    {
      std::lock_guard lock(s.conn_mu);
      connections = s.live_connections;
      preloads = s.live_preloads;
    }
    const char* abbrev = ::sigabbrev_np(s.stop_signal.load());
    s.Log(std::string("stopping") + (abbrev != nullptr ? std::string(" on SIG") + abbrev : "") +
          ": " + std::to_string(connections) + " connection(s) and " + std::to_string(preloads) +
          " preload(s) from the config to end; loads in progress are cancelled");
  }
  s.registry.DropExpected();  // the config's models not begun never will be
  {
    std::lock_guard lock(s.conn_mu);
    s.config_turn_cv.notify_all();
  }
  // Stop: no new connections (every accept() returns at once), no socket to
  // find, every connection ended.
  ::shutdown(s.listen_fd.get(), SHUT_RDWR);
  ::unlinkat(s.dir_fd.get(), protocol::kSocketName, 0);
  s.WakeParkThread();
  std::unique_lock lock(s.conn_mu);
  for (int fd : s.open_sockets) {
    ::shutdown(fd, s.preloading_sockets.contains(fd) ? SHUT_RD : SHUT_RDWR);
  }
  auto all_ended = [&] {
    return s.live_connections == 0 && s.live_preloads == 0 && s.workers == 0;
  };
  // No request being handled: what is left ends on its own, at once.
  auto no_work = [&] { return s.handling.load() == 0 && s.live_preloads == 0; };
  double waited = s.options.stop_grace_seconds;
  // A preload's asker may hear how it ended (its cancel takes a read's
  // while) until shortly before the grace ends; then its connection is
  // shut both ways too, which wakes a send it stalls (an asker that
  // stopped reading), so that only work can outlast the grace.
  const double heard = waited - std::min(kLastOfTheGraceSeconds, waited / 2);
  bool ended = s.conn_done.wait_for(lock, std::chrono::duration<double>(heard), all_ended);
  if (!ended) {
    for (int fd : s.open_sockets) ::shutdown(fd, SHUT_RDWR);
    ended = s.conn_done.wait_for(lock, std::chrono::duration<double>(waited - heard), all_ended);
  }
  if (!ended && no_work()) {
    // Only threads on their way out of accept() or a park, and connections
    // that were waiting for a request, woken above: the grace (which may
    // be 0) is for work, not for them.
    constexpr int kIdleThreadSeconds = 5;
    ended = s.conn_done.wait_for(lock, std::chrono::seconds(kIdleThreadSeconds), all_ended);
    waited += kIdleThreadSeconds;
  }
  if (!ended) {
    s.abandoned = true;
    char grace[32];
    std::snprintf(grace, sizeof grace, "%g", waited);
    const bool work_left = !no_work();
    if (!work_left) {
      s.Log("stopping with " + std::to_string(s.workers) + " idle thread(s) and " +
            std::to_string(s.live_connections) + " idle connection(s) not ended after " + grace +
            " s: not waiting for them");
    } else {
      s.Log("stopping with " + std::to_string(s.handling.load()) + " request(s), " +
            std::to_string(s.live_preloads) + " preload(s) from the config and " +
            std::to_string(s.workers) + " thread(s) still busy after " + grace +
            " s (a file system call that does not return?): not waiting for them");
    }
    // A thread stuck in a FUSE request may outlive even SIGKILL, and with
    // it this process's descriptors: the directory is free for the next
    // daemon now, not when that thread ends.
    s.lock_fd.Reset();
    s.dir_fd.Reset();
    return work_left ? Stopped::kWorkLeft : Stopped::kIdleThreadsLeft;
  }
  s.listen_fd.Reset();
  s.Log("stopped");
  return Stopped::kAllEnded;
}

bool Server::State::Admit(memory::UniqueFd& conn, ucred* peer) {
  // A peer that stops reading must not hold a connection thread (or a
  // preload's progress) forever.
  const timeval send_timeout{10, 0};
  ::setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout);
  socklen_t len = sizeof *peer;
  if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, peer, &len) != 0) {
    Log(Errno("refused a connection: cannot read its credentials"));
    return false;
  }
  if (peer->uid != ::geteuid()) {
    Log("refused a connection from pid " + std::to_string(peer->pid) + ", uid " +
        std::to_string(peer->uid) + ": only uid " + std::to_string(::geteuid()) +
        " may use this daemon");
    protocol::Channel refused(std::move(conn));
    (void)refused.Send(
        {{"type", "error"},
         {"message", "refused: uid " + std::to_string(peer->uid) + " may not use this daemon"}});
    return false;
  }
  return true;
}

bool Server::State::SpawnWorker() {
  {
    std::lock_guard lock(conn_mu);
    if (workers >= kMaxWorkers) return false;
    ++workers;
  }
  try {
    std::thread([this] { WorkerLoop(); }).detach();
    return true;
  } catch (...) {
    std::lock_guard lock(conn_mu);
    --workers;
    conn_done.notify_all();
    return false;
  }
}

void Server::State::WorkerLoop() {
  ::pthread_setname_np(::pthread_self(), kServingThreadName);
  while (!stopping.load()) {
    {
      std::lock_guard lock(conn_mu);
      ++idle_workers;
    }
    memory::UniqueFd conn(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    const int error = errno;
    bool spawn = false;
    {
      std::lock_guard lock(conn_mu);
      --idle_workers;
      // Idle for a while with enough others idle too: one fewer thread.
      if (!conn.valid() && error == EAGAIN && idle_workers >= kKeptWorkers) break;
      spawn = conn.valid() && idle_workers == 0;
    }
    // Someone must be in accept() while this thread serves. Where the
    // system gives no thread, connections wait in the backlog for one.
    if (spawn && !SpawnWorker()) {
      LogNowAndThen("no thread for the next connection (the system gave none, or " +
                        std::to_string(kMaxWorkers) +
                        " serve already; connections wait for one to be free)",
                    EAGAIN);
    }
    if (!conn.valid()) {
      if (stopping.load()) break;
      if (error == EMFILE || error == ENFILE) {
        // Out of descriptors: waiting connections stay in the backlog; wait
        // for some descriptors to be closed instead of spinning.
        LogNowAndThen("accept (waiting for descriptors to be closed)", error);
        RefuseWhileOutOfDescriptors();
      } else if (error != EINTR && error != EAGAIN && error != ECONNABORTED) {
        LogNowAndThen("accept", error);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      continue;
    }
    if (TookTheReservesPlace()) {
      RefuseAndKeepPlace(std::move(conn));
      continue;
    }
    try {
      ucred peer{};
      if (!Admit(conn, &peer)) continue;
      auto c = std::make_unique<Connection>(0, std::move(conn), peer);
      {
        std::lock_guard lock(conn_mu);
        if (stopping.load()) break;  // Run() shut the others down already
        c->id = next_connection++;
        open_sockets.insert(c->ch.fd());
        ++live_connections;
      }
      Serve(std::move(c));
    } catch (...) {
      // Out of memory for this connection (a log line, a set's node):
      // it is closed, and this thread serves the next.
    }
  }
  std::lock_guard lock(conn_mu);
  --workers;
  conn_done.notify_all();
}

void Server::State::RefuseWhileOutOfDescriptors() {
  {
    std::unique_lock lock(spare_mu);
    if (refusing) {
      spare_cv.wait_for(lock, std::chrono::seconds(1),
                        [&] { return !refusing || stopping.load(); });
      return;
    }
    refusing = true;
  }
  while (!stopping.load()) {
    // A descriptor free: the reserve back if it was lost, else the end.
    const int probe = ::fcntl(null_fd.get(), F_DUPFD_CLOEXEC, 0);
    if (probe >= 0) {
      std::lock_guard lock(spare_mu);
      if (spare_fd.valid()) {
        ::close(probe);
        break;
      }
      spare_fd.Reset(probe);
      continue;
    }
    pollfd waiting{listen_fd.get(), POLLIN, 0};
    const int ready = ::poll(&waiting, 1, 200);
    if (ready != 1) continue;
    bool given_up = false;
    {
      std::lock_guard lock(spare_mu);
      if (spare_fd.valid()) {
        spare_fd.Reset();
        given_up = true;
      }
    }
    if (!given_up) {
      // Taken: a thread blocked in accept() got the place first; it refuses
      // what it took and gives the place back. Not a spin meanwhile.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    // A thread already blocked in accept() may take the waiting connection,
    // and with it the place just given up, first (TookTheReservesPlace).
    memory::UniqueFd socket(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (socket.valid()) RefuseAndKeepPlace(std::move(socket));
  }
  std::lock_guard lock(spare_mu);
  refusing = false;
  spare_cv.notify_all();
}

bool Server::State::TookTheReservesPlace() {
  if (!refusing.load()) return false;  // the common case, without the lock
  std::lock_guard lock(spare_mu);
  return refusing.load() && !spare_fd.valid();
}

void Server::State::RefuseAndKeepPlace(memory::UniqueFd conn) {
  (void)!::send(conn.get(), refusal_frame.data(), refusal_frame.size(),
                MSG_NOSIGNAL | MSG_DONTWAIT);
  // The connection's place becomes the reserve in one step (dup3 closes
  // the socket). A reserve made meanwhile is closed: a place free again,
  // which ends the refusing.
  if (::dup3(null_fd.get(), conn.get(), O_CLOEXEC) != conn.get()) return;
  std::lock_guard lock(spare_mu);
  spare_fd = std::move(conn);
}

void Server::State::LogNowAndThen(const std::string& what, int error) {
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  auto last = last_accept_log.load();
  if (now - last > std::chrono::nanoseconds(std::chrono::seconds(5)).count() &&
      last_accept_log.compare_exchange_strong(last, now)) {
    errno = error;
    Log(Errno(what));
  }
}

void Server::State::Serve(std::unique_ptr<Connection> c) {
  // However this ends, an exception included, unless it was parked.
  ++serving;
  struct End {
    State& s;
    std::unique_ptr<Connection>& c;
    ~End() {
      --s.serving;
      if (c) s.Finish(std::move(c));
    }
  } end{*this, c};
  while (!stopping.load()) {
    // Quiet for a moment (an engine holding its view, most often): parked,
    // so that it holds no thread while it says nothing.
    pollfd next{c->ch.fd(), POLLIN, 0};
    const int ready = ::poll(&next, 1, serving.load() > kBusyServing ? 0 : kParkAfterMs);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0 && Park(c)) return;
    // Quiet and not parked (epoll refused it: this user's watches used up,
    // or no memory): this thread waits for its request, no longer than the
    // idle timeout unless it holds a lease, as the park thread would.
    const bool unparked = ready == 0 && c->leases.empty();
    auto m = c->ch.Receive(
        unparked ? static_cast<int>(std::min(options.idle_seconds * 1000, double{INT_MAX})) : -1,
        protocol::kMaxRequestBytes);
    if (unparked && !m.ok() && m.error().message() == protocol::Channel::kTimedOut) {
      LogIdleClose(*c, " (not parked)");
      break;
    }
    if (!m.ok()) {
      if (m.error().message() != protocol::Channel::kClosed) {
        Log("connection " + std::to_string(c->id) + " (pid " + std::to_string(c->peer.pid) +
            "): " + m.error().message() + "; closing it");
        (void)c->ch.Send({{"type", "error"}, {"message", m.error().message()}});
      }
      break;
    }
    Status st = OkStatus();
    ++handling;
    try {
      st = Handle(c->ch, *m, c->id, c->peer, c->leases);
    } catch (const std::exception& e) {
      // The last line of defence (an allocation refused, a library
      // throwing): this connection is closed, the daemon serves on.
      st = Error("could not handle a `" + m->type() + "` request: " + e.what());
    }
    --handling;
    if (!st.ok()) {
      if (st.error().message() == protocol::Channel::kClosed) break;  // the peer went first
      Log("connection " + std::to_string(c->id) + " (pid " + std::to_string(c->peer.pid) +
          "): " + st.error().message() + "; closing it");
      (void)c->ch.Send({{"type", "error"}, {"message", st.error().message()}});
      break;
    }
  }
}

void Server::State::Finish(std::unique_ptr<Connection> c) {
  try {
    if (!c->leases.empty()) {
      const std::string n = std::to_string(c->leases.size()) + " lease(s)";
      const std::string pid = std::to_string(c->peer.pid);
      // A stop closes every connection: the engine is still there, and what
      // it mapped stays valid. Logged before the leases go back: whoever
      // sees them gone finds the line.
      Log(stopping.load() ? "stopping: closed the connection of pid " + pid + ", its " + n +
                                " with it (what it mapped stays valid)"
                          : "pid " + pid + " closed its connection; " + n + " released");
    }
  } catch (...) {
    // No memory for the line; the leases go back all the same.
  }
  for (const auto& model : c->leases) registry.Release(model);
  c->leases.clear();
  // Off the list a stop shuts down before its descriptor is closed (the
  // number may be reused at once), and counted last.
  {
    std::lock_guard lock(conn_mu);
    open_sockets.erase(c->ch.fd());
  }
  c.reset();
  std::lock_guard lock(conn_mu);
  --live_connections;
  conn_done.notify_all();
}

void Server::State::LogIdleClose(const Connection& c, const std::string& how) {
  try {
    char quiet[32];
    std::snprintf(quiet, sizeof quiet, "%g", options.idle_seconds);
    Log("connection " + std::to_string(c.id) + " (pid " + std::to_string(c.peer.pid) +
        "): no request for " + quiet + " s and no lease" + how + "; closing it");
  } catch (...) {
    // No memory for the line; it is closed all the same.
  }
}

bool Server::State::Park(std::unique_ptr<Connection>& c) {
  std::lock_guard lock(conn_mu);
  if (stopping.load()) return false;
  const int fd = c->ch.fd();
  c->parked_at = std::chrono::steady_clock::now();
  // Level-triggered and armed once: a request that came meanwhile wakes
  // the park thread at once.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.fd = fd;
  auto [it, inserted] = parked.emplace(fd, std::move(c));
  if (::epoll_ctl(park_epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    c = std::move(it->second);
    parked.erase(it);
    return false;
  }
  return true;
}

void Server::State::ParkLoop() {
  ::pthread_setname_np(::pthread_self(), "weightd-park");
  std::vector<epoll_event> events(64);
  auto last_sweep = std::chrono::steady_clock::now();
  const auto idle = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(std::max(options.idle_seconds, 0.0)));
  while (true) {
    const int n =
        ::epoll_wait(park_epoll.get(), events.data(), static_cast<int>(events.size()), 1000);
    if (n < 0 && errno != EINTR) {
      LogNowAndThen("epoll_wait", errno);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    // Taken out of the set under the lock: each is served by one thread.
    std::vector<std::unique_ptr<Connection>> woken, ending;
    const auto now = std::chrono::steady_clock::now();
    const bool sweep = now - last_sweep >= std::chrono::seconds(1);
    if (sweep) last_sweep = now;
    bool stop = false;
    try {
      std::lock_guard lock(conn_mu);
      // Listed first: if that throws, the connection stays parked and
      // watched.
      auto take = [&](std::map<int, std::unique_ptr<Connection>>::iterator it,
                      std::vector<std::unique_ptr<Connection>>& into) {
        into.push_back(std::move(it->second));
        ::epoll_ctl(park_epoll.get(), EPOLL_CTL_DEL, it->first, nullptr);
        return parked.erase(it);
      };
      for (int i = 0; i < n; ++i) {
        auto it = parked.find(events[static_cast<size_t>(i)].data.fd);
        if (it != parked.end()) take(it, woken);
      }
      stop = stopping.load();
      // The whole list only once a second, or at a stop: not at every
      // engine that lets go.
      for (auto it = parked.begin(); (sweep || stop) && it != parked.end();) {
        // A request that came since the wait returned is served next turn,
        // not cut off.
        pollfd asked{it->first, POLLIN, 0};
        const bool quiet = sweep && it->second->leases.empty() &&
                           now - it->second->parked_at >= idle && ::poll(&asked, 1, 0) == 0;
        it = stop || quiet ? take(it, ending) : std::next(it);
      }
    } catch (...) {
      // No memory for the lists: what was taken is handled below, the rest
      // waits for the next turn.
    }
    if (stop) {
      for (auto& c : woken) ending.push_back(std::move(c));
      woken.clear();
    }
    for (auto& c : ending) {
      if (!c) continue;
      if (!stop) LogIdleClose(*c, "");
      Finish(std::move(c));
    }
    if (stop) break;
    // No thread for `c` (the system gave none, or kMaxWorkers serve
    // already): an engine gone is finished here, its leases back now, not
    // when a thread is free; one with a request is parked again (it is
    // readable, so back here at once), after one pause for all of those
    // woken.
    bool paused = false;
    auto without_thread = [&](std::unique_ptr<Connection>& c) {
      pollfd gone{c->ch.fd(), 0, 0};
      if (::poll(&gone, 1, 0) == 1 && (gone.revents & (POLLHUP | POLLERR)) != 0) {
        Finish(std::move(c));
        return;
      }
      LogNowAndThen("no thread for a connection with a request (the system gave none, or " +
                        std::to_string(kMaxWorkers) + " serve already; tried again)",
                    EAGAIN);
      if (!std::exchange(paused, true)) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (!Park(c)) Finish(std::move(c));
    };
    for (auto& c : woken) {
      // Counted as a worker, so that a stop waits for it to end: it
      // touches the state after it parks the connection again.
      bool room = false;
      {
        std::lock_guard lock(conn_mu);
        room = workers < kMaxWorkers;
        if (room) ++workers;
      }
      if (!room) {
        without_thread(c);
        continue;
      }
      Connection* raw = c.release();
      try {
        std::thread([this, raw] {
          ::pthread_setname_np(::pthread_self(), kServingThreadName);
          try {
            Serve(std::unique_ptr<Connection>(raw));
          } catch (...) {
            // Out of memory for this connection (its frame, a log line), as
            // WorkerLoop catches it: closed as Serve unwound; the daemon
            // serves on, where an exception leaving a thread would end it.
          }
          std::lock_guard lock(conn_mu);
          --workers;
          conn_done.notify_all();
        }).detach();
      } catch (...) {
        {
          std::lock_guard lock(conn_mu);
          --workers;
        }
        c.reset(raw);
        without_thread(c);
      }
    }
  }
  std::lock_guard lock(conn_mu);
  --workers;
  conn_done.notify_all();
}

Status Server::State::Handle(protocol::Channel& ch, const protocol::Message& m, uint64_t id,
                             const ucred& peer,
                             std::vector<std::shared_ptr<ResidentModel>>& leases) {
  const std::string type = m.type();
  const json& body = m.body;
  const std::string who = "pid " + std::to_string(peer.pid);
  if (!m.fds.empty()) return Error("a `" + type + "` request carries no descriptors");

  if (type == "hello") {
    // The client lists the versions it speaks: ours must be one of them.
    const auto versions = body.find("versions");
    if (versions == body.end() || !versions->is_array()) return Error("hello without `versions`");
    if (std::find(versions->begin(), versions->end(), protocol::kProtocolVersion) ==
        versions->end()) {
      // The numbers offered, not the peer's JSON as it came: dumping a
      // deeply nested value recurses once per level.
      std::string offered;
      for (const json& v : *versions) {
        if (!v.is_number_integer() || offered.size() > 64) continue;
        offered += (offered.empty() ? "" : ", ") + std::to_string(v.get<int64_t>());
      }
      return Error("no protocol version in common: this daemon speaks " +
                   std::to_string(protocol::kProtocolVersion) + ", the client offers " +
                   (offered.empty() ? "none" : offered));
    }
    // On every attach: the device names only, not a snapshot of every model.
    ApplyGpuBudgets(/*wait=*/false);
    return ch.Send({{"type", "hello"},
                    {"version", protocol::kProtocolVersion},
                    {"pid", ::getpid()},
                    {"devices", registry.Devices()}});
  }

  if (type == "acquire") {
    if (!body.contains("key")) return Error("acquire without a key");
    WEIGHTD_ASSIGN_OR_RETURN(protocol::CacheKey key, protocol::KeyFromJson(body["key"]));
    std::string trust;
    if (auto it = body.find("trust"); it != body.end()) {
      if (!it->is_string()) return Error("`trust` is not a string");
      trust = it->get<std::string>();
    }
    // An engine may wait for a load of exactly its model in flight (a
    // daemon preloading its config at start) rather than read the same
    // files itself: as long as it said it would wait for the daemon.
    double wait_seconds = 0;
    if (auto it = body.find("wait_seconds"); it != body.end()) {
      if (!it->is_number() || !(it->get<double>() >= 0)) {
        return Error("`wait_seconds` is not a number of seconds");
      }
      wait_seconds = std::min(it->get<double>(), protocol::kMaxAcquireWaitSeconds);
    }
    // The engine's checkpoint, to explain a miss against its own older
    // load rather than any model as far from it.
    std::string engine_path;
    if (auto it = body.find("path"); it != body.end()) {
      auto given = protocol::PathFromJson(*it);
      if (!given.ok()) return Error("`path`: " + given.error().message());
      engine_path = std::move(given).value();
    }
    // The engine's shard files, to tell a changed checkpoint from another
    // model altogether on a miss (an older engine sends none).
    // Only an explanation: one that cannot be read is left out, and the
    // acquire goes on.
    std::optional<std::vector<protocol::ShardSize>> engine_shards;
    if (auto it = body.find("shards"); it != body.end()) {
      auto given = protocol::ShardSizesFromJson(*it);
      if (given.ok()) {
        engine_shards = std::move(given).value();
        std::sort(engine_shards->begin(), engine_shards->end(),
                  [](const auto& a, const auto& b) { return a.name < b.name; });
      } else {
        Log("acquire from " + who + ": `shards` left out: " + given.error().message());
      }
    }
    // Gone: closed (POLLHUP), not only done sending (an engine may shut
    // its side after the request and still read the reply).
    const auto asker_gone = [fd = ch.fd()] {
      pollfd p{fd, 0, 0};
      return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)) != 0;
    };
    // Room for the lease first: once taken, recording it cannot fail, and a
    // lease recorded goes back when the connection ends, whatever fails.
    if (leases.size() == leases.capacity()) leases.reserve(std::max<size_t>(4, 2 * leases.size()));
    Registry::Lookup found =
        registry.Acquire(key, trust,
                         std::chrono::steady_clock::now() +
                             std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(wait_seconds)),
                         engine_path, asker_gone, engine_shards ? &*engine_shards : nullptr);
    if (found.asker_gone) {
      Log("acquire from " + who + ": the engine went away while it waited for a load");
      return Error(protocol::Channel::kClosed);
    }
    if (found.loading) {
      found.reason =
          "the daemon is loading this very model right now, or is about to (an engine that waits "
          "for the daemon, --wait-for-daemon, waits for the load)";
      found.mismatch.clear();
    }
    if (!found.model) {
      json mismatch = json::array(), fields = json::array();
      std::string described;
      for (const auto& d : found.mismatch) {
        mismatch.push_back(d.Describe());
        fields.push_back(d.field);
        described += (described.empty() ? "" : "; ") + d.Describe();
      }
      Log("acquire miss from " + who + ": " + found.reason +
          (described.empty() ? "" : " (" + described + ")"));
      json reply = {
          {"type", "miss"}, {"reason", found.reason}, {"mismatch", mismatch}, {"fields", fields}};
      if (found.waited_seconds > 0) reply["waited_seconds"] = found.waited_seconds;
      return ch.Send(reply);
    }
    leases.push_back(found.model);
    const ResidentModel& model = *found.model;
    // A GPU's segment goes with its manifest in host memory, that first.
    std::vector<memory::UniqueFd> handles;
    for (const memory::Segment* s : {model.manifest.get(), model.segment.get()}) {
      if (s == nullptr) continue;
      auto handle = s->Export();
      if (!handle.ok()) {
        leases.pop_back();
        registry.Release(found.model);
        return ch.Send({{"type", "error"}, {"message", handle.error().message()}});
      }
      handles.push_back(std::move(handle).value());
    }
    std::vector<const memory::UniqueFd*> fds;
    for (const memory::UniqueFd& h : handles) fds.push_back(&h);
    if (!trust.empty()) {
      Log("TRUSTED acquire from " + who + " of pinned model `" + trust + "` (loaded from " +
          model.path +
          (engine_path.empty() || engine_path == model.path ? ""
                                                            : ", for the engine's " + engine_path) +
          "): its content was not compared with the engine's checkpoint");
    }
    Log("acquire hit from " + who + ": " + protocol::ShortDescription(model.key) +
        (found.name.empty() ? "" : " (" + found.name + ")") +
        (found.waited_seconds > 0 ? ", after waiting for its load" : ""));
    json reply = {{"type", "acquired"},
                  {"lease", model.id},
                  {"bytes", model.segment->size()},
                  {"tensors", model.tensors},
                  {"name", found.name},
                  {"key", protocol::ToJson(model.key)},
                  {"path", protocol::PathToJson(model.path)}};
    if (model.manifest) reply["manifest_bytes"] = model.manifest->size();
    if (found.waited_seconds > 0) reply["waited_seconds"] = found.waited_seconds;
    return ch.Send(reply, fds);
  }

  if (type == "release") {
    if (!body.contains("lease") || !body["lease"].is_number_unsigned()) {
      return Error("release without a lease id");
    }
    const auto lease = body["lease"].get<uint64_t>();
    for (auto it = leases.begin(); it != leases.end(); ++it) {
      if ((*it)->id == lease) {
        registry.Release(*it);
        leases.erase(it);
        return ch.Send({{"type", "released"}, {"lease", lease}});
      }
    }
    return ch.Send({{"type", "error"}, {"message", "no lease " + std::to_string(lease)}});
  }

  if (type == "preload") {
    if (!body.contains("path")) return Error("preload without a path");
    WEIGHTD_ASSIGN_OR_RETURN(const std::string path, protocol::PathFromJson(body["path"]));
    protocol::Processing processing;
    if (body.contains("processing")) {
      WEIGHTD_ASSIGN_OR_RETURN(processing, protocol::ProcessingFromJson(body["processing"]));
    }
    // Absolute: this daemon's working directory is not the asker's.
    if (path.empty() || path.front() != '/') return Error("a preload's `path` must be absolute");
    if (transform::IsPlanFile(processing.shard_plan) && processing.shard_plan.front() != '/') {
      return Error("a preload's shard plan file must be an absolute path");
    }
    std::string pin;
    if (body.contains("pin")) {
      if (!body["pin"].is_string()) return Error("`pin` is not a string");
      pin = body["pin"].get<std::string>();
      WEIGHTD_RETURN_IF_ERROR(CheckPinName(pin));
    }
    // Only these ranks (an engine populating its own GPU); default: all.
    std::vector<int> only;
    if (auto it = body.find("ranks"); it != body.end()) {
      if (!it->is_array()) return Error("`ranks` is not an array");
      for (const auto& r : *it) {
        if (!r.is_number_integer() || r.get<int64_t>() < 0 ||
            r.get<int64_t>() >= processing.tp_size) {
          return Error("`ranks` holds something not a rank below tp_size");
        }
        only.push_back(r.get<int>());
      }
    }
    Log("preload of " + path + " requested by " + who);
    // Its asker hears how it ends, a stop's cancel too.
    struct MarkPreloading {
      State& s;
      int fd;
      MarkPreloading(State& state, int f) : s(state), fd(f) {
        std::lock_guard lock(s.conn_mu);
        s.preloading_sockets.insert(fd);
      }
      ~MarkPreloading() {
        std::lock_guard lock(s.conn_mu);
        s.preloading_sockets.erase(fd);
      }
    } preloading{*this, ch.fd()};
    // Progress goes out as the load reports it and, while nothing moves (a
    // fingerprint, another load of the same model to wait for), as a
    // heartbeat at least every kHeartbeat: the asker can tell a busy daemon
    // from a hung one. The preload goes on when the asker has gone away
    // (`load --populate`). Frames are sent by a thread of their own, with
    // no lock held: an asker that stops reading stalls that thread (up to
    // the send timeout), never the load's readers, which report progress
    // under their own lock.
    std::mutex state_mu;  // guards what follows, never held while sending
    std::condition_variable beat_cv;
    bool finished = false, due = false, peer_gone = false, beating = false;
    uint64_t last_done = 0, last_total = 0;
    auto last = std::chrono::steady_clock::now();
    // REQUIRES: `lock` holds state_mu; it is released while sending.
    auto send_progress = [&](std::unique_lock<std::mutex>& lock, bool heartbeat) {
      last = std::chrono::steady_clock::now();
      json p = {{"type", "progress"}, {"done", last_done}, {"total", last_total}};
      if (heartbeat) p["heartbeat"] = true;
      lock.unlock();
      const Status sent = ch.Send(p);
      if (!sent.ok() && sent.error().message() != protocol::Channel::kClosed) {
        // Stopped reading (a suspended `weightd preload`): said, since its
        // asker will not hear how the preload ended.
        Log("preload of " + path + " requested by " + who + ": " + sent.error().message() +
            "; the preload goes on without telling it");
      }
      lock.lock();
      peer_gone = peer_gone || !sent.ok();
    };
    Result<json> result = Error("");
    std::thread beat;
    // However the preload ends, an exception included, the heartbeat ends
    // and is joined before what it uses goes.
    struct StopBeat {
      std::mutex& mu;
      std::condition_variable& cv;
      bool& finished;
      std::thread& beat;
      ~StopBeat() {
        {
          std::lock_guard lock(mu);
          finished = true;
        }
        cv.notify_all();
        if (beat.joinable()) beat.join();
      }
    };
    try {
      beating = true;  // before the thread: it may end (and say so) at once
      beat = std::thread([&] {
        try {
          std::unique_lock lock(state_mu);
          while (true) {
            // Woken by progress due, by the end, or kHeartbeat after the
            // last frame, whatever sent it.
            beat_cv.wait_until(lock, last + kHeartbeat, [&] { return finished || due; });
            if (peer_gone) return;  // nobody to hear it
            if (due) {              // the last report too, before the end
              due = false;
              send_progress(lock, false);
            } else if (finished) {
              return;
            } else if (std::chrono::steady_clock::now() - last >= kHeartbeat) {
              send_progress(lock, true);
            }
          }
        } catch (...) {
          // No memory for a frame: no more heartbeats; the load's reports
          // are sent as it makes them.
          std::lock_guard lock(state_mu);
          beating = false;
        }
      });
    } catch (...) {
      beating = false;  // no thread for it: the same
    }
    {
      StopBeat stop{state_mu, beat_cv, finished, beat};
      result = Preload(path, processing, pin, only, who, [&](uint64_t done, uint64_t total) {
        std::unique_lock lock(state_mu);
        last_done = done;
        last_total = total;
        if (peer_gone ||
            (std::chrono::steady_clock::now() - last < kProgressEvery && done < total)) {
          return;
        }
        // No thread to send it (none could be started): sent here, under
        // the readers' lock. An asker that stops reading then stalls them
        // once, for the send timeout, and hears nothing more; silence until
        // the reply would have the asker give up on a long preload.
        if (!beating) return send_progress(lock, false);
        due = true;
        beat_cv.notify_all();
      });
    }
    json reply;
    if (result.ok()) {
      reply = *result;
      reply["type"] = "preloaded";
    } else {
      Log("preload failed: " + result.error().message());
      // Cancelled by a stop (the fingerprint or the load): said so.
      std::string message = result.error().message();
      if (stopping.load() && message.find(" was cancelled") != std::string::npos) {
        message = "the daemon is stopping: " + message;
      }
      reply = {{"type", "error"}, {"message", message}};
    }
    // An asker that did not wait for the answer (`load --populate`) is no
    // error: the preload was logged above either way. After a frame that
    // could not be sent whole, the connection is closed, not written to.
    if (peer_gone || !ch.Send(reply).ok()) return Error(protocol::Channel::kClosed);
    return OkStatus();
  }

  if (type == "status" || type == "memory") {
    ApplyGpuBudgets(/*wait=*/false);
    Registry::Snapshot snap = registry.Take();
    json reply = {{"type", type}, {"devices", DeviceJson(snap)}, {"cuda", CudaStatus()}};
    // What the kernel would still give in host memory, as preloads are
    // weighed against it: why one is refused within the budget.
    if (options.check_host_room) {
      if (const std::optional<Registry::Room> room = HostRoom()) {
        for (json& d : reply["devices"]) {
          if (d.value("name", "") != "host") continue;
          d["room"] = {{"free", room->free}, {"kept", room->keep}, {"what", room->what}};
        }
      }
    }
    if (type == "status") {
      // The list fits one frame: past about 3/4 of it (a thousand ranks
      // with long paths), the rest are counted, not listed.
      std::vector<json> entries;
      entries.reserve(snap.models.size());
      for (size_t i = 0; i < snap.models.size(); ++i) {
        const ResidentModel& model = *snap.models[i];
        entries.push_back({{"id", model.id},
                           {"key", protocol::ToJson(model.key)},
                           {"description", protocol::ShortDescription(model.key)},
                           {"name", snap.names[i]},
                           {"path", protocol::PathToJson(model.path)},
                           {"device", model.key.device},
                           {"bytes", model.segment->size()},
                           {"reserved_bytes", model.segment->reserved_bytes()},
                           {"huge_pages", model.segment->huge_pages()},
                           {"transparent_huge_pages", model.segment->transparent_huge_pages()},
                           {"tensors", model.tensors},
                           {"leases", snap.leases[i]},
                           {"idle_seconds", snap.idle_seconds[i]},
                           {"load_seconds", model.load_seconds}});
      }
      uint64_t omitted = 0;
      reply["models"] =
          protocol::ListWithin(std::move(entries), protocol::kMaxBodyBytes / 4 * 3, &omitted);
      if (omitted > 0) reply["models_omitted"] = omitted;
      // Loads under way (whose bytes `reserved` counts): for whom, how far.
      std::vector<json> loads;
      {
        std::lock_guard lock(loads_mu);
        const auto now = std::chrono::steady_clock::now();
        for (const auto& [load_id, l] : loads_under_way) {
          loads.push_back({{"path", protocol::PathToJson(l.path)},
                           {"asked_by", l.asked_by},
                           {"seconds", std::chrono::duration<double>(now - l.since).count()},
                           {"done", l.done},
                           {"total", l.total}});
        }
      }
      uint64_t loads_omitted = 0;
      reply["loading"] =
          protocol::ListWithin(std::move(loads), protocol::kMaxBodyBytes / 8, &loads_omitted);
      if (loads_omitted > 0) reply["loading_omitted"] = loads_omitted;
      reply["pid"] = ::getpid();
      std::lock_guard lock(conn_mu);
      reply["connections"] = live_connections;
    }
    return ch.Send(reply);
  }

  if (type == "evict") {
    if (!body.contains("what") || !body["what"].is_string()) return Error("evict without `what`");
    const std::vector<Eviction> evicted = registry.Evict(body["what"].get<std::string>());
    for (const Eviction& e : evicted) Log("evicted " + Named(e) + " (asked by " + who + ")");
    uint64_t omitted = 0;
    json reply = {{"type", "evicted"}, {"models", EvictionsJson(evicted, &omitted)}};
    if (omitted > 0) reply["models_omitted"] = omitted;
    return ch.Send(reply);
  }

  (void)id;
  return Error("unknown request `" + type + "`");
}

void Server::State::ApplyGpuBudgets(bool wait) {
  if (gpu_budgets_done.load()) return;
  if (!cuda_probe.valid()) {
    gpu_budgets_done.store(true);
    return;
  }
  if (!wait && cuda_probe.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
  std::call_once(gpu_budgets_applied, [&] {
    const auto& devices = cuda_probe.get();
    std::vector<bool> used(options.gpu_budgets.size());
    for (const memory::CudaDevice& d :
         devices.ok() ? *devices : std::vector<memory::CudaDevice>{}) {
      if (!d.served()) continue;
      uint64_t budget = d.total_bytes / 100 * kDefaultGpuBudgetPercent;
      std::string named_by;  // the budget that holds, as the user wrote it
      for (size_t i = 0; i < options.gpu_budgets.size(); ++i) {
        auto spec = memory::ParseDevice(options.gpu_budgets[i].first);
        if (!spec.ok()) continue;
        const bool named =
            (spec->kind == memory::DeviceSpec::Kind::kCudaOrdinal && spec->ordinal == d.ordinal) ||
            (spec->kind == memory::DeviceSpec::Kind::kCudaUuid &&
             memory::SameGpu(spec->uuid, d.uuid));
        if (!named) continue;
        // The config's come first, then --budget's: the last one holds.
        if (!named_by.empty()) {
          Log("budgets for " + named_by + " and " + options.gpu_budgets[i].first +
              " name the same GPU (cuda:" + d.uuid + "); " + options.gpu_budgets[i].first +
              "'s holds");
        }
        named_by = options.gpu_budgets[i].first;
        budget = options.gpu_budgets[i].second;
        used[i] = true;
      }
      registry.SetBudget("cuda:" + d.uuid, budget);
    }
    for (size_t i = 0; i < used.size(); ++i) {
      if (!used[i])
        Log("budget for " + options.gpu_budgets[i].first +
            " (--budget or the config): no such GPU is served here");
    }
    gpu_budgets_done.store(true);
  });
}

Status Server::State::CheckServed(const memory::Device& device) {
  ApplyGpuBudgets(/*wait=*/true);
  const auto& gpus =
      cuda_probe.valid()
          ? cuda_probe.get()
          : Result<std::vector<memory::CudaDevice>>(Error("the CUDA driver was not asked"));
  if (!gpus.ok()) {
    return Error("--device " + device.Name() + ": this daemon serves no GPU (" +
                 gpus.error().message() + ")");
  }
  auto it = std::find_if(gpus->begin(), gpus->end(),
                         [&](const auto& d) { return memory::SameGpu(d.uuid, device.uuid); });
  if (it != gpus->end() && !it->served()) {
    return Error("--device " + device.Name() + ": not served: " + it->not_served);
  }
  if (it == gpus->end()) {
    return Error("--device " + device.Name() +
                 ": not a GPU this daemon serves (see `weightd status`; CUDA_VISIBLE_DEVICES "
                 "applies to the daemon too)");
  }
  return OkStatus();
}

void Server::State::LearnReadOnly(const memory::Segment& segment) {
  const std::string name = segment.device().Name();
  {
    std::lock_guard lock(read_only_mu);
    if (read_only.count(name)) return;
  }
  std::string learned;
  auto fd = segment.Export();
  auto mapping = fd.ok() ? memory::MapCudaSegment(*fd, segment.size(), segment.device().uuid)
                         : Result<std::unique_ptr<memory::CudaMapping>>(fd.error());
  if (!mapping.ok()) {
    learned = "could not be tried: " + mapping.error().message();
  } else {
    learned = (*mapping)->read_only() ? "granted" : "refused (engines map read-write)";
  }
  Log(name + ": a read-only mapping of a segment was " + learned);
  std::lock_guard lock(read_only_mu);
  read_only[name] = learned;
}

Result<json> Server::State::PreloadUnguarded(
    const std::string& path, const protocol::Processing& processing, const std::string& pin,
    const std::vector<int>& only, const std::string& asked_by,
    const std::function<void(uint64_t, uint64_t)>& progress, LoadMarks& marks) {
  WEIGHTD_ASSIGN_OR_RETURN(transform::Processing resolved,
                           transform::ResolveProcessing(processing.tp_size, processing.dtype,
                                                        processing.quant, processing.shard_plan));
  WEIGHTD_RETURN_IF_ERROR(protocol::CheckSupported(processing));
  const auto start = std::chrono::steady_clock::now();
  // Each rank's device by its name in keys: a GPU by UUID (an ordinal here
  // is this daemon's; engines and `weightd preload` send UUIDs). One device
  // for every rank, or one per rank.
  std::vector<memory::Device> devices;
  for (int r = 0; r < processing.tp_size; ++r) {
    WEIGHTD_ASSIGN_OR_RETURN(memory::Device device,
                             memory::ResolveDevice(protocol::DeviceOfRank(processing, r)));
    if (device.kind == memory::DeviceKind::kCuda) WEIGHTD_RETURN_IF_ERROR(CheckServed(device));
    devices.push_back(std::move(device));
  }
  // A plan the checkpoint cannot serve fails on its headers alone, before
  // the fingerprint reads its samples.
  if (processing.tp_size > 1 || resolved.dtype || resolved.fp8_block) {
    WEIGHTD_ASSIGN_OR_RETURN(format::Checkpoint ckpt,
                             format::OpenCheckpoint(io::PosixFileSystem(), path));
    auto plan = transform::PlanTensors(transform::SourcesOf(ckpt.shards), resolved);
    if (!plan.ok()) return Error(path + ": " + plan.error().message());
  }
  // Cheap with the stat cache: a model already resident is not read again.
  std::unique_ptr<fingerprint::StatCache> cache;
  if (options.use_stat_cache) {
    cache = fingerprint::StatCache::Load(fingerprint::StatCache::DefaultDirectory());
  }
  fingerprint::Options fo;
  fo.cache = cache.get();
  fo.mode = fingerprint::ModeNamed(processing.fingerprint);
  fo.cancel = &stopping;
  // What a fingerprint keeps out and reads into at once: the same share
  // of the daemon's kept memory as a load's.
  fo.max_inflight = reads_in_flight;
  fo.speculative_bytes = first_read_bytes;
  fo.local_window_bytes = std::min(fo.local_window_bytes, window_bytes);
  fo.remote_window_bytes = std::min(fo.remote_window_bytes, window_bytes);
  // A full key is every byte hashed now: not a digest taken on the
  // strength of a stat signature, which a file system that keeps one
  // through a rewrite (docs/fingerprint.md) would make stale. The cache is
  // still told, for engines.
  if (fo.mode == fingerprint::Mode::kFull) fo.cache_lookups = false;
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, fo);
  if (!fp.ok()) return fp.error();
  if (cache) {
    (void)cache->Save();
    if (const std::string w = cache->warning(); !w.empty()) Log("stat cache: " + w);
  }
  const double fingerprint_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Where a reply's `seconds` went (docs/daemon.md); 0 for what did not run.
  auto phases_json = [&](const loader::LoadedModel::Phases& p) {
    return json{{"fingerprint", fingerprint_seconds},
                {"headers", p.headers},
                {"plan", p.plan},
                {"read", p.read},
                {"finish", p.finish}};
  };
  // Every rank's key; a preload makes them all.
  auto key_of = [&](const std::string& digest, int rank) {
    protocol::Processing p = processing;
    p.device = devices[static_cast<size_t>(rank)].Name();
    p.tp_rank = rank;
    return protocol::MakeKey(digest, p, resolved.plan->name(), resolved.plan->digest());
  };
  const int ranks = processing.tp_size;
  const protocol::CacheKey expected = key_of(fp->digest, 0);
  auto group_of = [&](const std::string& digest) {
    std::vector<protocol::CacheKey> group;
    for (int r = 0; r < ranks; ++r) group.push_back(key_of(digest, r));
    return group;
  };
  // Engines that all missed may ask for the same model at once: one load,
  // the others wait for it and find it resident. Engines that acquire one
  // of its ranks meanwhile may wait for it too.
  auto wanted = [&](int r) {
    return only.empty() || std::find(only.begin(), only.end(), r) != only.end();
  };
  std::vector<protocol::CacheKey> loading;
  for (int r = 0; r < ranks; ++r) {
    if (wanted(r)) loading.push_back(key_of(fp->digest, r));
  }
  if (!marks.QueueAndWaitForTurn(loading)) return Error("the daemon is stopping");
  marks.Begin(loading);
  // Only the ranks not resident are loaded (one may have been evicted). The
  // resident ones are leased meanwhile, so that making room for the others
  // cannot evict them; their name (a pin) goes to the new ranks too.
  std::vector<int> missing;
  std::vector<std::shared_ptr<ResidentModel>> held;
  struct ReleaseHeld {
    Registry& r;
    std::vector<std::shared_ptr<ResidentModel>>& models;
    ~ReleaseHeld() {
      for (const auto& m : models) r.Release(m);
    }
  } release_held{registry, held};
  held.reserve(static_cast<size_t>(ranks));  // a lease taken is then always recorded
  std::string name = pin;
  std::string unpinned;                 // the name the resident ranks had, replaced by `pin`
  std::vector<std::string> taken_from;  // paths of other models `pin` named until now
  auto taken_json = [&] {
    json paths = json::array();
    for (const std::string& p : taken_from) paths.push_back(protocol::PathToJson(p));
    return paths;
  };
  auto log_taken = [&] {
    for (const std::string& p : taken_from) {
      Log("`" + name + "` no longer names the model from " + p + ": a name pins one model");
    }
  };
  for (int r = 0; r < ranks; ++r) {
    if (!wanted(r)) continue;
    Registry::Lookup found = registry.Acquire(key_of(fp->digest, r), "");
    if (!found.model) {
      missing.push_back(r);
      continue;
    }
    held.push_back(std::move(found.model));
    if (name.empty()) name = found.name;
    // A model has one name: a new pin takes the place of the old one.
    if (!pin.empty() && !found.name.empty() && found.name != pin) unpinned = found.name;
  }
  auto pin_all = [&](const std::string& digest) {
    if (name.empty()) return;
    registry.Pin(group_of(digest), name, &taken_from);
    Log("pinned " + protocol::ShortDescription(key_of(digest, 0)) + " (" + std::to_string(ranks) +
        " rank(s)) as `" + name + "`" +
        (unpinned.empty() ? "" : "; `" + unpinned + "` no longer names it"));
  };
  if (missing.empty()) {
    if (!pin.empty()) pin_all(fp->digest);
    log_taken();
    Log("already resident: " + protocol::ShortDescription(key_of(fp->digest, 0)) + " (" +
        std::to_string(ranks) + " rank(s)); not loaded again");
    // The same keys as a load's reply, for scripts that read them either
    // way: nothing loaded, no bytes.
    return json{{"already_resident", true},
                {"key", protocol::ToJson(expected)},
                {"ranks", ranks},
                {"loaded_ranks", json::array()},
                {"bytes", 0},
                {"tensors", held.empty() ? 0 : held.front()->tensors},
                {"seconds",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()},
                {"phases", phases_json({})},
                {"evicted", json::array()},
                {"evicted_omitted", 0},
                {"unpinned", unpinned},
                {"pin_taken_from", taken_json()}};
  }

  // Room made for the ranks loaded, per rank in load order: what Publish
  // has not taken goes back however this returns, an exception (an
  // allocation refused) included.
  struct Reservations {
    Registry& registry;
    std::vector<std::pair<std::string, uint64_t>> ranks;  // device, bytes
    // Rank i's bytes, now accounted by Publish.
    void Take(size_t i) { ranks[i].second = 0; }
    // All of it, for a load made again.
    void GiveBack() {
      for (const auto& [device, bytes] : ranks) {
        if (bytes != 0) registry.Unreserve(device, bytes);
      }
      ranks.clear();
    }
    ~Reservations() { GiveBack(); }
  } reserved{registry, {}};
  std::vector<Eviction> evicted;
  loader::LoadOptions lo;
  lo.cancel = &stopping;
  lo.segment_name = io::BaseName(path);
  lo.buffer_bytes = buffer_bytes;
  lo.max_inflight = std::min(lo.max_inflight, reads_in_flight);
  lo.processing = resolved;
  lo.ranks = missing;
  // Listed in `status` while it reads, however the load ends; until each
  // segment is published, what it holds is known to every reservation's
  // room check (HostRoomNow).
  ListedLoad listed(*this, path, asked_by);
  // Every rank is the same size. On the first rank, room for all of them is
  // reserved, on each device, or for none (no idle model evicted for a load
  // that cannot finish): on a GPU in its allocation granularity, as the
  // segment will be made, in host memory in the pages the segments will be
  // made of.
  // Huge pages planned, room made for them, and the pool no longer has
  // them when a segment is made (another process took them; a container's
  // hugetlb limit the pool's figures do not show): the load is made again,
  // in normal pages, their room weighed against what the kernel would give.
  memory::HostPlacement host;
  bool huge_pages_refused = false, normal_pages_only = false;
  lo.allocate = [&](uint64_t bytes, int rank) -> Result<std::unique_ptr<memory::Segment>> {
    if (reserved.ranks.empty()) {
      uint64_t host_ranks = 0;
      for (int r : missing)
        host_ranks += devices[static_cast<size_t>(r)].kind != memory::DeviceKind::kCuda;
      host = memory::PlanHostSegments(bytes, std::max<uint64_t>(host_ranks, 1),
                                      /*huge_page_pool=*/!normal_pages_only);
      std::vector<std::pair<std::string, uint64_t>> want;
      std::map<std::string, uint64_t> need;
      for (int r : missing) {
        const memory::Device& d = devices[static_cast<size_t>(r)];
        if (d.kind == memory::DeviceKind::kCuda) {
          WEIGHTD_ASSIGN_OR_RETURN(const uint64_t on_gpu, memory::CudaSegmentBytes(bytes, d.uuid));
          want.emplace_back(d.Name(), on_gpu);
        } else {
          want.emplace_back(d.Name(), host.bytes);
        }
        uint64_t& n = need[d.Name()];
        if (__builtin_add_overflow(n, want.back().second, &n)) {
          return Error("the ranks' segments add up to more than 64 bits");
        }
      }
      // Huge pages come from their own pool, which neither MemAvailable
      // nor a control group's memory counts.
      const size_t evicted_before = evicted.size();  // by a try in huge pages, logged
      WEIGHTD_RETURN_IF_ERROR(registry.Reserve({need.begin(), need.end()}, &evicted,
                                               /*weigh_room=*/!host.options.try_huge_pages));
      reserved.ranks = std::move(want);
      for (size_t i = evicted_before; i < evicted.size(); ++i) {
        Log("evicted " + Named(evicted[i]) + ", to make room");
      }
    }
    const memory::Device& device = devices[static_cast<size_t>(rank)];
    if (device.kind == memory::DeviceKind::kCuda) {
      return memory::CreateCudaSegment(bytes, device.uuid);
    }
    auto made = memory::CreateHostSegment(
        bytes, lo.segment_name + (ranks > 1 ? "-rank" + std::to_string(rank) : ""), host.options);
    if (made.ok()) listed.Fills(rank, **made);
    if (!made.ok() && host.options.try_huge_pages) huge_pages_refused = true;
    return made;
  };
  lo.progress = [&](uint64_t done, uint64_t total) {
    listed.Progress(done, total);
    if (progress) progress(done, total);
  };
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, lo);
  if (!loaded.ok() && huge_pages_refused && !stopping.load()) {
    Log("preload of " + path + ": " + loaded.error().message() +
        "; loading it again in normal pages");
    reserved.GiveBack();
    normal_pages_only = true;
    loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, lo);
  }
  if (!loaded.ok()) {
    return Error(path + ": " + loaded.error().message() + "; nothing was published");
  }
  // A load that ended after the stop began is not published: the daemon
  // is going, and its asker was told so.
  if (stopping.load()) return Error(path + ": the daemon is stopping; nothing was published");
  // A GPU's segments cannot be read here: engines get the manifest from
  // host memory, one sealed copy for every rank (the same for all).
  std::shared_ptr<memory::Segment> manifest_copy;
  if (!loaded->manifest.empty()) {
    auto made = memory::CreateHostSegment(loaded->manifest.size(), lo.segment_name + "-manifest");
    Status filled = made.ok() ? (*made)->Write(0, loaded->manifest) : made.error();
    if (filled.ok()) filled = (*made)->Seal();
    if (!filled.ok()) {
      return Error(path + ": the manifest's host copy: " + filled.error().message() +
                   "; nothing was published");
    }
    manifest_copy = std::move(made).value();
  }
  // The key's digest describes exactly the bytes loaded. Sampled: the
  // loader's, from its own reads. Full: every byte was hashed before the
  // load; the files the loader read (the same listing, in the same order),
  // each with one stat signature from its header to its end, must be those
  // files with those signatures: the same device and inode (not another
  // file a shard's symlink pointed to meanwhile), unchanged (a change moves
  // ctime, which never goes back).
  std::string digest = loaded->checkpoint_digest;
  if (fo.mode == fingerprint::Mode::kFull) {
    const bool same = std::equal(
        loaded->read_shards.begin(), loaded->read_shards.end(), fp->shards.begin(),
        fp->shards.end(), [](const auto& read, const fingerprint::ShardFingerprint& hashed) {
          return read.name == hashed.name && read.signature == hashed.signature;
        });
    digest = same ? fp->digest : std::string();
  }
  if (digest != fp->digest) {
    // Rewritten between the fingerprint and the load: the resident ranks,
    // the digest of every byte, and the keys engines may be waiting for
    // (marked as loading) are of the old files, the loaded ones of the new.
    // Or the stat cache answered for files whose content changed while
    // their stat signature did not: then every preload again would fail
    // the same way, so the cache is told what the files hold now.
    std::string stale;
    if (cache && fo.mode == fingerprint::Mode::kSampled && fp->cache_hits > 0) {
      fingerprint::Options fresh = fo;
      fresh.cache_lookups = false;
      auto now = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, fresh);
      if (now.ok() && now->digest == loaded->checkpoint_digest) {
        (void)cache->Save();
        stale =
            "; the stat cache held an old digest of these files (their content changed, their "
            "stat signature did not: see docs/fingerprint.md) and is corrected";
      }
    }
    return Error(path + ": the checkpoint changed while it was preloaded" + stale +
                 "; nothing was published (preload again)");
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  uint64_t bytes = 0;
  const std::vector<protocol::CacheKey> group = group_of(digest);
  for (size_t i = 0; i < loaded->ranks.size(); ++i) {
    loader::LoadedRank& rank = loaded->ranks[i];
    auto model = std::make_unique<ResidentModel>();
    model->key = key_of(digest, rank.rank);
    // A pin asked for is given; else the name the resident ranks have when
    // this one is published (it may have moved to another model, or gone,
    // since they were looked at).
    model->name = pin;
    model->path = path;
    for (const auto& r : loaded->read_shards) model->shards.push_back({r.name, r.signature.size});
    std::sort(model->shards.begin(), model->shards.end(),
              [](const auto& a, const auto& b) { return a.name < b.name; });
    model->tensors = loaded->tensors;
    // What the asker waited for: the fingerprint first, then the load.
    model->load_seconds = seconds;
    model->segment = std::move(rank.segment);
    const bool on_gpu = devices[static_cast<size_t>(rank.rank)].kind == memory::DeviceKind::kCuda;
    if (on_gpu) model->manifest = manifest_copy;
    bytes += model->segment->size();
    listed.Publishing(rank.rank);
    auto published = registry.Publish(std::move(model), reserved.ranks[i].second, group,
                                      &taken_from, /*inherit_name=*/pin.empty());
    reserved.Take(i);
    marks.published = true;
    if (on_gpu) LearnReadOnly(*published->segment);
    const std::string pinned_as = registry.NameOf(*published);
    Log("preloaded " + path + " as " + protocol::ShortDescription(published->key) +
        (pinned_as.empty() ? "" : " (pinned as `" + pinned_as + "`)") + ": " +
        std::to_string(published->segment->size()) + " bytes, " +
        std::to_string(published->tensors) + " tensors in " + std::to_string(seconds) +
        " s (fingerprint " + std::to_string(fingerprint_seconds) + " s, headers " +
        std::to_string(loaded->phases.headers) + " s, plan " + std::to_string(loaded->phases.plan) +
        " s, reads " + std::to_string(loaded->phases.read) + " s, seal and digest " +
        std::to_string(loaded->phases.finish) + " s)");
  }
  // Ranks that stayed resident take a new name too.
  if (!pin.empty() && !held.empty()) pin_all(digest);
  log_taken();
  uint64_t evicted_omitted = 0;
  const json evicted_json = EvictionsJson(evicted, &evicted_omitted);
  return json{{"already_resident", false},
              {"key", protocol::ToJson(key_of(digest, 0))},
              {"ranks", ranks},
              {"loaded_ranks", missing},
              {"bytes", bytes},
              {"tensors", loaded->tensors},
              {"seconds", seconds},
              {"phases", phases_json(loaded->phases)},
              {"workers", loaded->workers},
              {"evicted", evicted_json},
              {"evicted_omitted", evicted_omitted},
              {"unpinned", unpinned},
              {"pin_taken_from", taken_json()}};
}

void Server::ExpectPreloads(const std::vector<std::string>& pins) {
  State& s = *state_;
  s.config_pins = pins;
  s.registry.ExpectLoads(pins.size());
  for (const std::string& pin : pins) {
    if (!pin.empty()) s.registry.ExpectPin(pin);
  }
}

void Server::SkipPreload(size_t order) {
  State& s = *state_;
  s.registry.DropExpected(1);
  if (const std::string* pin = s.ConfigPin(order)) s.registry.DropPin(*pin);
  std::lock_guard lock(s.conn_mu);
  s.config_skipped.insert(order);
  if (s.config_turn == order) s.PassTurn(order);
}

Result<std::string> Server::Preload(const PreloadRequest& request,
                                    const std::function<void(uint64_t, uint64_t)>& progress) {
  State& s = *state_;
  {
    // Checked under the lock Run's stop waits with: a preload either is
    // counted before Run looks, or sees the stop and does not start.
    std::lock_guard lock(s.conn_mu);
    if (s.stopping.load()) return Error("the daemon is stopping");
    ++s.live_preloads;
  }
  struct Done {  // however the preload ends: Run's stop waits for the count
    State& s;
    ~Done() {
      std::lock_guard lock(s.conn_mu);
      --s.live_preloads;
      s.conn_done.notify_all();
    }
  };
  Result<json> r = Error("");
  {
    Done done{s};
    try {
      s.Log("preload of " + request.path + " requested by the config");
    } catch (...) {
    }
    r = s.Preload(request.path, request.processing, request.pin, {}, "the config", progress,
                  request.order);
  }
  if (!r.ok()) return r.error();
  return r->dump(-1, ' ', false, json::error_handler_t::replace);  // paths need not be UTF-8
}

}  // namespace weightd::daemon
