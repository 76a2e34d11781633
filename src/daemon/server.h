// The daemon: one per host, serving every engine of its user over a Unix
// socket.
//
// Start() claims the socket directory: it must be a real directory (not a
// symlink) owned by this user with mode 0700 (created so when missing); a
// lock file in it makes a second daemon fail at once, naming the first; a
// socket left by a crashed daemon is replaced. The socket is 0600, and every
// connection's peer uid (SO_PEERCRED) must be ours: others are refused and
// logged.
//
// Each connection is served on its own thread. A malformed frame, an
// unknown request or any protocol error gets an error reply and closes that
// connection only. A connection's leases end when it closes, however it
// closes (an engine killed with SIGKILL included).
//
// Thread safety: RequestStop may be called from any thread or a signal
// handler; the rest from the thread that owns the Server.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "protocol/cache_key.h"
#include "weightd/result.h"

namespace weightd::daemon {

inline constexpr uint64_t kDefaultGpuBudgetPercent = 50;

// The name (in /proc/PID/task/TID/comm, top -H) of the threads that accept
// and serve connections.
inline constexpr char kServingThreadName[] = "weightd-serve";

struct ServerOptions {
  std::string socket_dir;  // resolved already (protocol::SocketDirectory)
  uint64_t host_budget = 0;
  // Whether a host reservation is also weighed against what the kernel
  // would still give (memory::HostMemoryRoom): memory held outside the
  // budget is then evicted for, or refused, rather than the daemon killed
  // for it.
  bool check_host_room = true;
  // Budgets for GPUs, by the device as the user named it ("cuda:0" in this
  // daemon's numbering, or "cuda:GPU-<uuid>"); a GPU not named gets
  // kDefaultGpuBudgetPercent of its memory.
  std::vector<std::pair<std::string, uint64_t>> gpu_budgets;
  // One line per event (acquire, miss, eviction, refusal, ...).
  std::function<void(const std::string&)> log;
  // Stat cache directory for the fingerprint preloads compute first; empty:
  // the default.
  bool use_stat_cache = true;
  // How long a stop waits for busy connections (a preload stuck in a read
  // that never returns, on a hung network file system) before giving up on
  // them.
  double stop_grace_seconds = 10;
  // A connection that holds no lease and sends nothing for this long is
  // closed. One that holds leases (an engine's view) is kept however long it
  // stays quiet; either waits without a thread of its own.
  double idle_seconds = 60;
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Claims the directory and listens.
  Status Start();

  // How a stop ended. Where anything is left, the caller should exit the
  // process without running destructors: those threads still use the Server.
  enum class Stopped {
    kAllEnded,
    kIdleThreadsLeft,  // every request done; threads that did not leave in 5 s
    kWorkLeft,         // connections or preloads still busy (a hung mount?)
  };

  // Serves until RequestStop; then stops accepting, removes the socket and
  // closes every connection. Connections and Preload calls still busy after
  // stop_grace_seconds are left behind (logged, with what the Server holds
  // left allocated for them, and the lock file let go).
  Stopped Run();

  // Async-signal-safe. `signal`: the one that asked, for the log (0: none).
  void RequestStop(int signal = 0);
  bool stopping() const;

  // The config's models, once, before Start, by the name each will be
  // pinned as (empty: none), in order: engines that may wait for the daemon
  // (--wait-for-daemon) wait for these to be keyed too, as any may be
  // theirs, not only for loads already begun; an engine that trusts one of
  // those names waits for its model's load. Each Preload call below
  // settles one; a stop settles the rest.
  void ExpectPreloads(const std::vector<std::string>& pins);

  // Preloads a model as a `preload` request would (for --config at start),
  // one that ExpectPreloads announced: call it for every model at once, each
  // on its own thread. Each is fingerprinted and keyed at once; the loads
  // then run one after another, by `order` (0, 1, ...; every order must
  // come). A stop cancels it and waits for it as for a connection (Run);
  // once stopping, it refuses. Logs `preload of PATH requested by the
  // config` once counted.
  struct PreloadRequest {
    std::string path;
    std::string pin;
    // As `weightd preload` sends it, but devices as cpu, cuda:N (this
    // daemon's numbering) or cuda:GPU-<uuid>; tp_rank is ignored (every
    // rank is made).
    protocol::Processing processing;
    // The config's models (announced by ExpectPreloads) load one after
    // another, in this order: 0, 1, ..., every one of them called. Without
    // it, a preload like any other.
    std::optional<size_t> order;
  };
  Result<std::string> Preload(const PreloadRequest& request,
                              const std::function<void(uint64_t, uint64_t)>& progress);

  // A model ExpectPreloads announced that will not be preloaded after all
  // (no thread could be made for it): engines stop waiting for it and the
  // models after it in `order` do not wait for its turn.
  void SkipPreload(size_t order);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightd::daemon
