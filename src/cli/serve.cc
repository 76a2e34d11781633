// `weightd serve`, `preload`, `status`, `evict`: the daemon and the commands
// an operator sends it.
#include <malloc.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "cli/output.h"
#include "client/admin.h"
#include "daemon/config.h"
#include "daemon/log_writer.h"
#include "daemon/registry.h"
#include "daemon/server.h"
#include "io/file.h"
#include "memory/cuda.h"
#include "memory/host_memory.h"
#include "protocol/cache_key.h"
#include "protocol/paths.h"
#include "transform/plan.h"

namespace weightd::cli {
namespace {

using nlohmann::json;

daemon::Server* running_server = nullptr;

// The readiness protocol of systemd's Type=notify units: datagrams to the
// socket $NOTIFY_SOCKET names (a path, or an abstract name after `@`),
// READY=1 once the daemon serves and STOPPING=1 as a stop begins, so that
// engines ordered after the unit start once they can be served. Opened
// before the signal handlers are in place: the handler only sends, and
// sendto is safe in a signal handler.
class Supervisor {
 public:
  // Why $NOTIFY_SOCKET cannot be used; empty when it can, or is not set.
  std::string Open() {
    const char* name = std::getenv("NOTIFY_SOCKET");
    if (name == nullptr || *name == '\0') return "";
    const size_t len = std::strlen(name);
    if (name[0] != '/' && name[0] != '@') return "`" + std::string(name) + "` is not a socket path";
    if (len >= sizeof addr_.sun_path) return "`" + std::string(name) + "` is too long a path";
    addr_.sun_family = AF_UNIX;
    std::memcpy(addr_.sun_path, name, len);
    if (name[0] == '@') addr_.sun_path[0] = '\0';
    // A path's terminating zero is counted; an abstract name has none.
    addr_len_ =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len + (name[0] == '/' ? 1 : 0));
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    return fd_ >= 0 ? "" : std::string("no socket: ") + std::strerror(errno);
  }
  bool wanted() const { return fd_ >= 0; }
  // Whether the supervisor's socket took `message`. Never waits: a
  // receiver that does not read (not systemd) cannot hold up a signal
  // handler.
  bool Send(const char* message, size_t len) const {
    return fd_ >= 0 && ::sendto(fd_, message, len, MSG_NOSIGNAL | MSG_DONTWAIT,
                                reinterpret_cast<const sockaddr*>(&addr_),
                                addr_len_) == static_cast<ssize_t>(len);
  }

 private:
  int fd_ = -1;
  sockaddr_un addr_{};
  socklen_t addr_len_ = 0;
};
Supervisor supervisor;

void OnSignal(int signal) {
  const int saved = errno;  // whatever the interrupted code was about to read
  static constexpr char kStopping[] = "STOPPING=1\nSTATUS=stopping";
  static std::atomic<bool> said{false};  // lock-free: safe in a handler
  if (!said.exchange(true)) supervisor.Send(kStopping, sizeof kStopping - 1);
  if (running_server != nullptr) running_server->RequestStop(signal);
  errno = saved;
}

std::string Now() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::tm tm;
  ::gmtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// A request to the daemon that failed: exit 3 where no daemon listens (a
// script starts one), else 1.
int ReportRequestError(std::string_view command, const Error& e, bool no_daemon) {
  return ReportError(command, e.message(), no_daemon ? kExitNoDaemon : kExitFailure);
}

struct ServeOptions {
  std::string socket_dir;
  std::vector<std::string> budgets;
  std::vector<daemon::Budget> config_budgets;  // the config file's; --budget wins per device
  std::string config;
  bool no_cache = false;
  bool budget_only = false;
  bool json = false;  // the ready line and the log as JSON objects, one a line
  double stop_timeout = 10;
  double idle_seconds = 60;
};

// Reads the --config file (see daemon/config.h) and finishes what its text
// alone cannot say: paths relative to the file's directory, wherever the
// daemon was started; the processing checked as preload's flags are (a
// plan file read); and whether two entries name one model.
Status ReadConfig(const std::string& file, ServeOptions& o,
                  std::vector<daemon::ConfigModel>& models) {
  // A regular file of reasonable size: a FIFO or a directory given here is
  // an error, not a wait or a config silently ignored.
  constexpr uint64_t kMaxConfigBytes = 1 << 20;
  WEIGHTD_ASSIGN_OR_RETURN(auto opened, io::PosixFileSystem().Open(file));
  if (opened->size() > kMaxConfigBytes) return Error(file + ": a config file is at most 1 MiB");
  std::string text(static_cast<size_t>(opened->size()), '\0');
  WEIGHTD_RETURN_IF_ERROR(opened->ReadExactly(0, std::as_writable_bytes(std::span(text))));
  WEIGHTD_ASSIGN_OR_RETURN(daemon::Config config, daemon::ParseConfig(text, file));
  auto fail = [&](const std::string& why) { return Error(file + ": " + why); };
  auto beside_config = [&](std::string& relative) -> Status {
    if (relative.empty() || relative.front() == '/') return OkStatus();
    auto dir = io::PosixFileSystem().RealPath(io::DirName(file));
    if (!dir.ok()) return fail(dir.error().message());
    relative = io::JoinPath(*dir, relative);
    return OkStatus();
  };
  if (o.socket_dir.empty() && !config.socket_dir.empty()) {
    o.socket_dir = config.socket_dir;
    WEIGHTD_RETURN_IF_ERROR(beside_config(o.socket_dir));
  }
  o.config_budgets = std::move(config.budgets);
  for (daemon::ConfigModel& m : config.models) {
    protocol::Processing& p = m.processing;
    WEIGHTD_RETURN_IF_ERROR(beside_config(m.path));
    if (transform::IsPlanFile(p.shard_plan)) WEIGHTD_RETURN_IF_ERROR(beside_config(p.shard_plan));
    // The processing and the devices' form now, not after `ready`
    // (which GPU an ordinal names is known once the driver answers).
    if (Status s = FinishProcessingFlags(p); !s.ok()) {
      return fail("[[model]] " + m.path + ": " + s.error().message());
    }
    // Shown in logs and `status` as `weightd preload` shows its paths:
    // real, or at least without `..` where it does not exist (yet).
    if (auto real = io::PosixFileSystem().RealPath(m.path); real.ok()) {
      m.path = *real;
    } else {
      m.path = std::filesystem::path(m.path).lexically_normal().string();
    }
    // The second preload would find the first's model resident and move
    // the name: the first would name nothing.
    for (const daemon::ConfigModel& other : models) {
      if (!m.pin.empty() && !other.pin.empty() && other.path == m.path &&
          other.processing == m.processing) {
        return fail("[[model]] " + m.path + " is pinned as `" + other.pin + "` and as `" + m.pin +
                    "` with the same processing; a model has one name");
      }
    }
    models.push_back(std::move(m));
  }
  return OkStatus();
}

// A preload's headers, plans and buffers (about 150 MB at its peak for a
// model of 70,000 tensors), once freed, stay in the allocator's arena of
// the thread that served it. glibc gives every thread an arena of its own,
// up to 8 per core: a daemon that had served many preloads held that much
// per serving thread (650 MB after 20 such preloads on 2 cores), outside
// any budget. Two arenas keep that within about what two preloads take,
// and cost a preload nothing (giving the memory back after each one would
// cost the next a quarter of its time, faulting it in again). On a VM
// where a fresh page costs ~10 us, that is also faster: with an arena per
// thread, 70,000 tensors' headers took 53 ms against 30 (medians). Threads
// that share an arena take turns on its lock, though (a header's parse
// allocates a few blocks, not one per tensor, for that reason): where the
// trade goes the other way, an operator's own setting (MALLOC_ARENA_MAX,
// or glibc.malloc.arena_max in GLIBC_TUNABLES) wins.
// Whether `text` starts with a number above 0, as glibc takes one.
bool PositiveNumber(const char* text) {
  return text != nullptr && std::strtol(text, nullptr, 10) > 0;
}

void ShareTwoArenas() {
#ifdef __GLIBC__
  // Set to something glibc ignores (empty, 0), it is not the operator's.
  constexpr char kTunable[] = "glibc.malloc.arena_max=";
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const char* tuned = tunables == nullptr ? nullptr : std::strstr(tunables, kTunable);
  if (PositiveNumber(std::getenv("MALLOC_ARENA_MAX")) ||
      (tuned != nullptr && PositiveNumber(tuned + sizeof kTunable - 1))) {
    return;
  }
  ::mallopt(M_ARENA_MAX, 2);
#endif
}

int RunServe(ServeOptions o) {
  // A reader of the log gone (`serve 2>&1 | head`) must not kill the daemon
  // with its socket bound: writes to it fail instead.
  ::signal(SIGPIPE, SIG_IGN);
  ShareTwoArenas();
  std::vector<daemon::ConfigModel> preloads;
  if (!o.config.empty()) {
    if (Status s = ReadConfig(o.config, o, preloads); !s.ok()) {
      return ReportError("serve", s.error().message(), kExitUsage);
    }
  }
  daemon::ServerOptions so;
  // Absolute, so that the `ready` line names a socket a script can use from
  // anywhere.
  so.socket_dir = protocol::SocketDirectory(o.socket_dir);
  if (!so.socket_dir.empty() && so.socket_dir.front() != '/') {
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(so.socket_dir, ec);
    if (!ec) so.socket_dir = absolute.string();
  }
  // Half of what this process may take: the machine's memory, or its
  // control group's limit where that is lower (a container's).
  const memory::MemoryCeiling ceiling = memory::HostMemoryCeiling();
  so.host_budget = ceiling.bytes > 0 ? ceiling.bytes / 2 : 1ull << 30;
  bool host_budget_given = false;
  so.use_stat_cache = !o.no_cache;
  so.check_host_room = !o.budget_only;
  so.stop_grace_seconds = o.stop_timeout;
  so.idle_seconds = o.idle_seconds;
  // The file's first, then the flags: for a device named in both, the last
  // one given (the flag) is the one that holds.
  std::vector<daemon::Budget> budgets = o.config_budgets;
  std::set<std::string> flagged;  // a device twice on the command line: which one was meant?
  for (const std::string& b : o.budgets) {
    const size_t eq = b.find('=');
    auto budget = eq == std::string::npos ? daemon::ParseBudget("host", b)
                                          : daemon::ParseBudget(b.substr(0, eq), b.substr(eq + 1));
    if (!budget.ok()) {
      return ReportError("serve",
                         "--budget " + b + ": " + budget.error().message() +
                             " (expected DEVICE=SIZE, e.g. host=64G, cuda:0=70G)",
                         kExitUsage);
    }
    if (!flagged.insert(budget->same_device).second) {
      return ReportError("serve",
                         "--budget " + b + ": a budget for " + budget->same_device +
                             " was given already; give one per device",
                         kExitUsage);
    }
    budgets.push_back(*budget);
  }
  for (const daemon::Budget& b : budgets) {
    if (b.host) {
      so.host_budget = b.bytes;
      host_budget_given = true;
    } else {
      so.gpu_budgets.emplace_back(b.device, b.bytes);
    }
  }
  // Written by a thread of its own: a log nobody reads for a while (a
  // paused pager, a stalled journal) holds up no request and no stop. A
  // stop waits a second for what is queued (Close, below: a thread left
  // behind, such as the GPU probe's on a hung driver, may hold a copy of
  // `so.log` past the end).
  auto log =
      std::make_shared<daemon::LogWriter>(STDERR_FILENO, [json = o.json](std::string_view message) {
        const std::string line(message);
        // A line that quotes bytes that are not UTF-8 (a path a client sent)
        // comes through as {"hex": ...}, as paths do in every --json output.
        return json ? DumpJson({{"time", Now()}, {"message", protocol::PathToJson(line)}})
                    : Now() + " weightd: " + Printable(line);
      });
  so.log = [log](const std::string& line) { log->Write(line); };
  // What the budgets mean, said once the directory is the daemon's: a
  // daemon refused at start (another serves there) says only why.
  std::vector<std::string> notes;
  // Budgets that cannot mean what they say are taken, and said.
  std::set<std::string> in_force;  // the last budget given for a device holds
  for (auto it = budgets.rbegin(); it != budgets.rend(); ++it) {
    const daemon::Budget& b = *it;
    if (!in_force.insert(b.same_device).second) continue;
    // `host=64` is 64 bytes: taken as given, but likely meant otherwise.
    if (b.unitless && b.bytes > 0 && b.bytes < (uint64_t{1} << 20)) {
      notes.push_back("the budget for " + b.device + " is " + std::to_string(b.bytes) +
                      " bytes: a size without a unit is bytes (" + std::to_string(b.bytes) +
                      "G would be " + std::to_string(b.bytes) + " GiB)");
    }
  }
  if (so.host_budget == 0) {
    notes.push_back("the host budget is 0: no model can be preloaded into host memory");
  } else if (ceiling.bytes > 0 && so.host_budget > ceiling.bytes - ceiling.bytes / 8) {
    // The daemon's own memory, and anything else its group holds, come
    // out of the same limit: preloads then find the kernel's room short
    // before the budget (and evict for it, or are refused).
    notes.push_back(
        "the host budget (" + FormatBytes(so.host_budget) + ") leaves less than an eighth of the " +
        FormatBytes(ceiling.bytes) + " this process may use (" +
        (ceiling.source == "RAM" ? "the machine's memory" : ceiling.source) +
        ") for the daemon itself and everything else: preloads will find the memory short "
        "before the budget, and evict idle models for it or be refused");
  } else if (!host_budget_given && ceiling.bytes == 0) {
    notes.push_back(
        "host budget " + FormatBytes(so.host_budget) +
        ": how much memory this machine has could not be told; give --budget host=SIZE");
  } else if (!host_budget_given && ceiling.source != "RAM") {
    notes.push_back("host budget " + FormatBytes(so.host_budget) + ": half of the " +
                    FormatBytes(ceiling.bytes) + " this process's control group may use (" +
                    ceiling.source + "), less than the machine's memory");
  } else if (!host_budget_given) {
    notes.push_back("host budget " + FormatBytes(so.host_budget) + ": half of the machine's " +
                    FormatBytes(ceiling.bytes) + " of memory (no control group limits it to less)");
  }
  // A checkpoint listed twice with the same processing loads once (the
  // second finds it resident): said, as the config may mean otherwise.
  for (size_t i = 0; i < preloads.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (preloads[j].path == preloads[i].path &&
          preloads[j].processing == preloads[i].processing) {
        notes.push_back("the config lists " + preloads[i].path + " twice (entries " +
                        std::to_string(j + 1) + " and " + std::to_string(i + 1) +
                        ") with the same processing: it is loaded once");
        break;
      }
    }
  }
  daemon::Server server(so);
  // Before the first connection is accepted: an engine that may wait for
  // the daemon is told of the config's models from the start.
  std::vector<std::string> pins;
  for (const auto& m : preloads) pins.push_back(m.pin);
  server.ExpectPreloads(pins);
  // In place before the socket is bound: a stop asked for while it starts
  // is taken too (Run then returns at once and removes the socket).
  running_server = &server;
  if (std::string why = supervisor.Open(); !why.empty()) {
    notes.push_back("NOTIFY_SOCKET: " + why +
                    "; the supervisor will not be told when this daemon "
                    "is ready");
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  ::sigaction(SIGTERM, &sa, nullptr);
  // SIGINT, and SIGHUP (the terminal it ran in gone): a clean stop too, not
  // a death that leaves the socket behind; but a daemon started to ignore
  // them (nohup, a shell's background job) goes on ignoring them.
  for (int sig : {SIGINT, SIGHUP}) {
    struct sigaction was {};
    if (::sigaction(sig, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) {
      ::sigaction(sig, &sa, nullptr);
    } else {
      notes.push_back(std::string(sig == SIGINT ? "SIGINT" : "SIGHUP") +
                      " is ignored, as this daemon was started (nohup, a background job): "
                      "stop it with SIGTERM");
    }
  }
  if (Status s = server.Start(); !s.ok()) {
    running_server = nullptr;
    log->Close(1.0);
    return ReportError("serve", s.error().message());
  }
  for (const std::string& note : notes) so.log(note);
  // A stop asked for while it started: not ready, stopping (Run says so).
  if (!server.stopping()) {
    errno = 0;
    if (o.json) {
      std::cout << DumpJson({{"event", "ready"},
                             {"socket", protocol::PathToJson(protocol::SocketPath(so.socket_dir))},
                             {"pid", ::getpid()},
                             {"host_budget", so.host_budget}})
                << std::endl;
    } else {
      std::cout << "ready: serving " << protocol::SocketPath(so.socket_dir) << " (pid "
                << ::getpid() << ", host budget " << FormatBytes(so.host_budget) << ")"
                << std::endl;
    }
    // Whoever waits for that line (a supervisor, a script) will not see it.
    if (!std::cout) {
      so.log("ready, but the ready line could not be written to stdout: " +
             std::string(errno != 0 ? std::strerror(errno) : "an error of the stream"));
      std::cout.clear();
    }
    // Not after a stop began meanwhile (STOPPING=1 said already).
    const std::string ready = "READY=1\nSTATUS=serving " + protocol::SocketPath(so.socket_dir);
    if (supervisor.wanted() && !server.stopping() && !supervisor.Send(ready.data(), ready.size())) {
      so.log("ready, but the supervisor could not be told so through NOTIFY_SOCKET: " +
             std::string(std::strerror(errno)));
    }
  }
  // Models from the config load in the background: engines may ask (and
  // fall back, or wait for them) meanwhile. Each is keyed at once, on its
  // own thread; the loads take turns in the config's order. A stop cancels
  // them, and Run waits for them with the connections.
  std::vector<std::thread> preloaders;
  preloaders.reserve(preloads.size());
  for (size_t i = 0; i < preloads.size(); ++i) {
    try {
      preloaders.emplace_back([&server, &so, m = preloads[i], i] {
        bool asked = false;
        try {
          daemon::Server::PreloadRequest request{m.path, m.pin, m.processing, i};
          asked = true;  // from here on, the preload passes its turn on itself
          auto r = server.Preload(request, {});
          if (server.stopping()) return;  // cancelled, or refused: nothing to report
          if (!r.ok())
            so.log("preload of " + m.path + " from the config failed: " + r.error().message());
        } catch (...) {
          // No memory (for the request, or the message): the daemon serves
          // on, and the models after this one do not wait for its turn.
          if (!asked) {
            try {
              server.SkipPreload(i);
            } catch (...) {
            }
          }
        }
      });
    } catch (const std::exception& e) {
      // A process or thread limit reached: the daemon serves what it has;
      // this model can still be preloaded by hand or by an engine.
      server.SkipPreload(i);
      so.log("preload of " + preloads[i].path + " from the config not started: no thread for it (" +
             e.what() + ")");
    }
  }
  if (const auto stopped = server.Run(); stopped != daemon::Server::Stopped::kAllEnded) {
    // Some work is stuck in a file system call that does not return, or
    // threads did not leave: Run logged it and let the directory go; the
    // process goes without them. Work left behind is an exit of its own, for
    // a supervisor to tell from a clean stop.
    std::cout.flush();
    log->Close(1.0);
    std::_Exit(stopped == daemon::Server::Stopped::kWorkLeft ? kExitWorkLeft : kExitOk);
  }
  for (std::thread& t : preloaders) t.join();
  running_server = nullptr;
  log->Close(1.0);
  return kExitOk;
}

// A name pins one model: the ones `pin` named until this preload.
void PrintPinTakenFrom(const json& reply, const std::string& pin) {
  for (const json& p : reply.value("pin_taken_from", json::array())) {
    std::cout << "  `" << pin << "` no longer names the model from " << PrintablePath(p) << "\n";
  }
}

// A progress line per 10% when not on a terminal, a bar that redraws when on one.
std::function<void(const json&)> ProgressPrinter() {
  const bool tty = ::isatty(2) != 0;
  auto last_decile = std::make_shared<int>(-1);
  return [tty, last_decile](const json& p) {
    if (!p.is_object() || !p.value("done", json()).is_number_unsigned() ||
        !p.value("total", json()).is_number_unsigned()) {
      return;  // not a progress report this command understands
    }
    const uint64_t total = p["total"].get<uint64_t>();
    const uint64_t done = std::min(p["done"].get<uint64_t>(), total);
    const int pct =
        total == 0
            ? 100
            : static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total));
    if (tty) {
      const int filled = pct / 5;
      std::cerr << "\r[" << std::string(static_cast<size_t>(filled), '#')
                << std::string(static_cast<size_t>(20 - filled), ' ') << "] " << pct << "% "
                << FormatBytes(done) << " / " << FormatBytes(total) << std::flush;
      if (done >= total) std::cerr << "\n";
    } else if (pct / 10 != *last_decile) {
      *last_decile = pct / 10;
      std::cerr << "preload: " << pct << "% (" << FormatBytes(done) << " of " << FormatBytes(total)
                << ")\n";
    }
  };
}

// For commands the daemon answers at once: how long its silence is borne.
void AddReplyTimeoutOption(CLI::App& app, double& seconds) {
  AddSecondsOption(app, "--reply-timeout", seconds,
                   "seconds to wait for the daemon's answer before giving up on it (stopped, "
                   "hung; default 30)",
                   3600, /*above_zero=*/true);
}

}  // namespace

Command AddServeCommand(CLI::App& root) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* app = root.add_subcommand(
      "serve",
      "Run the daemon in the foreground. It keeps preloaded models in sealed memory segments\n"
      "and hands them to engines of the same user over a Unix socket. Prints one `ready` line\n"
      "on stdout when it accepts requests (and, where $NOTIFY_SOCKET is set, tells systemd\n"
      "READY=1: a unit of Type=notify, see deploy/weightd.service); logs every acquire, miss\n"
      "and eviction on stderr. SIGTERM, SIGINT or SIGHUP stops it (engines keep the weights\n"
      "they have mapped).");
  app->add_option("--socket-dir", o->socket_dir,
                  "default: $WEIGHTD_SOCKET_DIR, $XDG_RUNTIME_DIR/weightd, /tmp/weightd-$UID")
      ->check(NotEmpty());
  app->add_option("--budget", o->budgets,
                  "memory the daemon may hold per device, DEVICE=SIZE: host=64G (or 64G), "
                  "cuda:0=70G (this daemon's numbering), cuda:GPU-<uuid>=70G; repeatable "
                  "(default: half of the memory this process may use for the host: RAM, or its "
                  "control group's limit where lower; " +
                      std::to_string(daemon::kDefaultGpuBudgetPercent) + "% of each GPU's memory)");
  app->add_flag("--no-cache", o->no_cache, "preloads do not use the fingerprint's stat cache");
  app->add_flag("--json", o->json,
                "the ready line as one JSON object on stdout ({\"event\": \"ready\", \"socket\", "
                "\"pid\", \"host_budget\" in bytes}), and each log line as one on stderr "
                "({\"time\", \"message\"}): for a supervisor or a log shipper");
  app->add_flag("--budget-only", o->budget_only,
                "weigh host preloads against the budget alone, not also against what the kernel "
                "would still give (MemAvailable, the control group's room): where memory it does "
                "not count comes back on demand (a ZFS ARC, swap)");
  AddSecondsOption(*app, "--stop-timeout", o->stop_timeout,
                   "seconds SIGTERM waits for busy connections and preloads (a read stuck on a "
                   "hung network file system) before the daemon exits without them (default 10)",
                   3600);
  AddSecondsOption(*app, "--idle-timeout", o->idle_seconds,
                   "seconds a connection that holds no lease may stay silent before it is "
                   "closed (default 60; above 0); an engine's connection holding its weights is "
                   "kept",
                   86400, /*above_zero=*/true);
  app->add_option(
         "--config", o->config,
         "TOML file: socket_dir, [budget] host = \"64G\", [[model]] path, pin, device and "
         "tp_size/shard_plan/dtype/quant/fingerprint to preload at start (see docs/cli.md)")
      ->check(NotEmpty());
  return {app, [o] { return RunServe(*o); }};
}

Command AddPreloadCommand(CLI::App& root) {
  struct Options {
    std::string path, pin, socket_dir;
    protocol::Processing processing;
    bool json = false;
    double wait = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = root.add_subcommand(
      "preload",
      "Ask the daemon to load a checkpoint and keep it resident, with progress. A model already\n"
      "resident under the same key is not read again. With --tp-size N, every rank's segment\n"
      "is made in one pass over the files.");
  app->add_option("DIR", o->path, "checkpoint directory or .safetensors file")
      ->required()
      ->check(NotEmpty("name a checkpoint directory or .safetensors file"));
  AddProcessingFlags(*app, o->processing);
  app->add_option("--pin", o->pin,
                  "name the model, so engines may `load --trust NAME` without a content check");
  app->add_option("--socket-dir", o->socket_dir, "the daemon's socket directory")
      ->check(NotEmpty());
  AddSecondsOption(*app, "--wait-for-daemon", o->wait,
                   "seconds to wait for a daemon that is starting", 3600);
  app->add_flag("--json", o->json, "print the daemon's reply as JSON");
  auto pin = app->get_option("--pin");
  auto rank = app->get_option("--tp-rank");
  return {app, [o, pin, rank] {
            // Not taken quietly: a rank asked for alone would not be what
            // is loaded.
            if (rank->count() > 0) {
              return ReportError("preload",
                                 "usage: --tp-rank is for `load`: a preload makes every rank "
                                 "of --tp-size",
                                 kExitUsage);
            }
            if (Status s = FinishProcessingFlags(o->processing); !s.ok()) {
              return ReportError("preload", s.error().message(), kExitUsage);
            }
            if (pin->count() > 0) {
              if (Status s = daemon::CheckPinName(o->pin); !s.ok()) {
                return ReportError("preload", "--pin `" + o->pin + "`: " + s.error().message(),
                                   kExitUsage);
              }
            }
            auto real = io::PosixFileSystem().RealPath(o->path);
            if (!real.ok()) return ReportError("preload", real.error().message());
            // cuda:N is this process's numbering; the daemon is told UUIDs
            // (one device, or one per rank).
            std::string devices;
            for (const std::string& named : protocol::SplitDevices(o->processing.device)) {
              auto device = memory::ResolveDevice(named);
              if (!device.ok()) return ReportError("preload", device.error().message());
              devices += (devices.empty() ? "" : ",") + device->Name();
            }
            o->processing.device = devices;
            json request = {{"type", "preload"},
                            {"path", protocol::PathToJson(*real)},
                            {"processing", protocol::ToJson(o->processing)}};
            if (!o->pin.empty()) request["pin"] = o->pin;
            bool absent = false;
            auto reply = client::Request(
                o->socket_dir, request,
                o->json ? std::function<void(const json&)>() : ProgressPrinter(), o->wait, &absent);
            if (!reply.ok()) return ReportRequestError("preload", reply.error(), absent);
            if (o->json) {
              std::cout << DumpJson(*reply, 2) << "\n";
            } else if (reply->value("already_resident", false)) {
              const std::string unpinned = reply->value("unpinned", "");
              std::cout << "already resident: " << Printable(o->path)
                        << (o->pin.empty() ? "" : ", pinned as `" + o->pin + "`")
                        << (unpinned.empty() ? "" : " (no longer as `" + unpinned + "`)") << "\n";
              PrintPinTakenFrom(*reply, o->pin);
            } else {
              const int ranks = reply->value("ranks", 1);
              // Ranks already resident were not loaded again: the bytes and
              // time are those of the ranks that were; tensors are per rank.
              std::string loaded;
              size_t loaded_count = 0;
              for (const auto& r : reply->value("loaded_ranks", json::array())) {
                if (!r.is_number_unsigned()) continue;
                loaded += (loaded.empty() ? "" : ", ") + std::to_string(r.get<uint64_t>());
                ++loaded_count;
              }
              const bool partly =
                  ranks > 1 && loaded_count > 0 && loaded_count < static_cast<size_t>(ranks);
              std::string ranks_said;
              if (partly) {
                ranks_said = (loaded_count == 1 ? "rank " : "ranks ") + loaded + " of " +
                             std::to_string(ranks) + " loaded: ";
              } else if (ranks > 1) {
                ranks_said = std::to_string(ranks) + " ranks of ";
              }
              std::cout << "resident: " << Printable(o->path) << " (" << ranks_said
                        << Count(reply->value("tensors", uint64_t{0}), "tensor")
                        << (partly && loaded_count > 1 ? " each" : "") << ", "
                        << FormatBytes(reply->value("bytes", uint64_t{0})) << ", "
                        << FormatSeconds(reply->value("seconds", 0.0))
                        << (partly ? "; the others were resident already" : "") << ")\n";
              if (const json phases = reply->value("phases", json::object()); !phases.empty()) {
                auto s = [&](const char* phase) { return FormatSeconds(phases.value(phase, 0.0)); };
                std::cout << "  fingerprint " << s("fingerprint") << ", headers " << s("headers")
                          << ", plan " << s("plan") << ", reads " << s("read")
                          << ", seal and digest " << s("finish") << "\n";
              }
              for (const auto& e : reply->value("evicted", json::array())) {
                const std::string path = PrintablePath(e.value("path", json("")));
                std::cout << "  evicted to make room: " << (path.empty() ? "" : path + ", ")
                          << Printable(e.value("description", "")) << "\n";
              }
              if (const uint64_t more = reply->value("evicted_omitted", uint64_t{0}); more > 0) {
                std::cout << "  and " << Count(more, "more model") << " evicted to make room\n";
              }
              if (!o->pin.empty()) std::cout << "  pinned as `" << o->pin << "`\n";
              PrintPinTakenFrom(*reply, o->pin);
            }
            return kExitOk;
          }};
}

Command AddStatusCommand(CLI::App& root) {
  struct Options {
    std::string socket_dir;
    bool json = false;
    double reply_timeout = client::kDefaultReplyTimeoutSeconds;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = root.add_subcommand(
      "status", "What the daemon holds: each model's key, bytes, device and leases.");
  app->add_option("--socket-dir", o->socket_dir, "the daemon's socket directory")
      ->check(NotEmpty());
  app->add_flag("--json", o->json, "print JSON: models (key, bytes, device, leases), devices");
  AddReplyTimeoutOption(*app, o->reply_timeout);
  return {
      app, [o] {
        bool absent = false;
        auto reply =
            client::Request(o->socket_dir, {{"type", "status"}}, {}, 0, &absent, o->reply_timeout);
        if (!reply.ok()) return ReportRequestError("status", reply.error(), absent);
        if (o->json) {
          std::cout << DumpJson(*reply, 2) << "\n";
          return kExitOk;
        }
        for (const auto& d : (*reply)["devices"]) {
          const uint64_t reserved = d.value("reserved", uint64_t{0});
          const uint64_t draining = d.value("evicted_in_use", uint64_t{0});
          const uint64_t draining_models = d.value("evicted_in_use_models", uint64_t{0});
          std::cout << d.value("name", "") << ": " << FormatBytes(d.value("used", uint64_t{0}))
                    << " held of " << FormatBytes(d.value("budget", uint64_t{0}))
                    << (draining > 0 ? " (" + FormatBytes(draining) + " by " +
                                           Count(draining_models, "evicted model") +
                                           " engines still map, freed when they let go)"
                                     : "")
                    << (reserved > 0 ? ", " + FormatBytes(reserved) + " for preloads under way"
                                     : "")
                    << "\n";
          if (const json room = d.value("room", json()); room.is_object()) {
            std::cout << "  the kernel would give " << FormatBytes(room.value("free", uint64_t{0}))
                      << " more (" << Printable(room.value("what", "")) << "), "
                      << FormatBytes(room.value("kept", uint64_t{0}))
                      << " of it kept for the daemon itself\n";
          }
        }
        if (const json cuda = reply->value("cuda", json::object()); !cuda.empty()) {
          if (!cuda.value("available", false)) {
            std::cout << "cuda: " << Printable(cuda.value("reason", "")) << "\n";
          }
          for (const auto& d : cuda.value("devices", json::array())) {
            std::cout << "cuda:" << d.value("ordinal", 0) << " " << d.value("name", "") << "  "
                      << Printable(d.value("model", "")) << "  "
                      << FormatBytes(d.value("total_bytes", uint64_t{0}));
            if (const json why = d.value("not_served", json()); why.is_string()) {
              std::cout << "  not served: " << Printable(why.get<std::string>()) << "\n";
            } else {
              std::cout << "  read-only mapping: " << d.value("read_only_mapping", "") << "\n";
            }
          }
        }
        const auto& models = (*reply)["models"];
        if (models.empty()) std::cout << "no model is resident\n";
        for (const auto& m : models) {
          // #ID: what `evict #ID` takes.
          std::cout << "  #" << m.value("id", uint64_t{0}) << "  "
                    << Printable(m.value("description", "")) << "  "
                    << FormatBytes(m.value("bytes", uint64_t{0})) << "  "
                    << Count(m.value("leases", uint64_t{0}), "lease")
                    << (m.value("name", "").empty() ? "" : "  pinned as " + m.value("name", ""))
                    << "\n    " << PrintablePath(m.value("path", json(""))) << "\n";
        }
        if (const uint64_t more = reply->value("models_omitted", uint64_t{0}); more > 0) {
          std::cout << "  ... and " << Count(more, "more model")
                    << " (the list is cut to fit one reply)\n";
        }
        for (const auto& l : reply->value("loading", json::array())) {
          const uint64_t done = l.value("done", uint64_t{0}), total = l.value("total", uint64_t{0});
          std::cout << "loading " << PrintablePath(l.value("path", json(""))) << " (asked by "
                    << Printable(l.value("asked_by", "")) << ", "
                    << FormatSeconds(l.value("seconds", 0.0)) << " so far): ";
          if (total == 0) {
            std::cout << "reading headers, no progress reported yet\n";
          } else {
            std::cout << done * 100 / total << "%, " << FormatBytes(done) << " of "
                      << FormatBytes(total) << "\n";
          }
        }
        if (const uint64_t more = reply->value("loading_omitted", uint64_t{0}); more > 0) {
          std::cout << "  ... and " << Count(more, "more load") << " under way\n";
        }
        return kExitOk;
      }};
}

Command AddEvictCommand(CLI::App& root) {
  struct Options {
    std::string what, socket_dir;
    bool json = false;
    double reply_timeout = client::kDefaultReplyTimeoutSeconds;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = root.add_subcommand(
      "evict",
      "Drop resident models: WHAT is `all`, a pinned name, the start (8+ characters) of a\n"
      "checkpoint digest, or '#ID' (quoted: # starts a shell comment) for one model as `status`\n"
      "numbers it (one rank). Engines that mapped them keep their bytes until they let go.");
  app->add_option("WHAT", o->what, "all | NAME | DIGEST-PREFIX | #ID")
      ->required()
      ->check(NotEmpty("all, a pinned name, a digest's start or #ID"));
  app->add_option("--socket-dir", o->socket_dir, "the daemon's socket directory")
      ->check(NotEmpty());
  app->add_flag("--json", o->json, "print JSON: models evicted");
  AddReplyTimeoutOption(*app, o->reply_timeout);
  return {app, [o] {
            bool absent = false;
            auto reply = client::Request(o->socket_dir, {{"type", "evict"}, {"what", o->what}}, {},
                                         0, &absent, o->reply_timeout);
            if (!reply.ok()) return ReportRequestError("evict", reply.error(), absent);
            const json models = reply->value("models", json::array());
            const uint64_t more = reply->value("models_omitted", uint64_t{0});
            // `all` with nothing resident has nothing to miss. A miss is an
            // error alone: nothing on stdout a script could take for success.
            if (models.empty() && more == 0 && o->what != "all") {
              return ReportError("evict", "nothing resident matched `" + o->what +
                                              "` (a pinned name, 8 or more characters of a "
                                              "digest, #ID, or all; see `weightd status`)");
            }
            if (o->json) {
              std::cout << DumpJson(*reply, 2) << "\n";
            } else {
              if (models.empty() && more == 0) std::cout << "nothing was resident\n";
              for (const auto& m : models) {
                std::cout << "evicted " << Printable(m.value("description", ""));
                if (const int leases = m.value("leases", 0); leases > 0) {
                  std::cout << " ("
                            << (leases == 1 ? "an engine still maps it"
                                            : std::to_string(leases) + " engines still map it")
                            << ": its " << FormatBytes(m.value("bytes", uint64_t{0}))
                            << " stay held until " << (leases == 1 ? "it lets" : "they let")
                            << " go)";
                }
                std::cout << "\n";
              }
              if (more > 0) std::cout << "and " << Count(more, "more model") << " evicted\n";
            }
            return kExitOk;
          }};
}

}  // namespace weightd::cli
