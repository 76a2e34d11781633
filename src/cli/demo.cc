// `weightd demo`: the whole story on a generated model, each step a real
// `weightd` process: a daemon, an engine's cold start from disk, a preload,
// a warm restart that maps the resident model, and a fine-tune on disk that
// the engine catches and loads from disk instead.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <utility>

#include "cli/output.h"
#include "format/checkpoint.h"
#include "format/synthetic.h"
#include "io/file.h"
#include "protocol/text.h"

namespace weightd::cli {
namespace {

struct DemoOptions {
  std::string dir;
  std::string size = "1G";
  bool keep = false;
};

// A child `weightd` process with its stdout on a pipe.
struct Child {
  pid_t pid = -1;
  int out = -1;
};

// The demo's children as a signal that ends the demo finds them: it ends
// the engine that runs, stops the daemon, and no child starts after it.
struct Children {
  std::mutex mu;
  bool stopping = false;  // guarded by mu
  pid_t engine = -1;      // running; guarded by mu
  Child daemon;           // until it is stopped; guarded by mu
} children;

// Where a signal is ending the demo, its thread ends the process: what
// failed meanwhile (the engine it ended) is not an error to report.
[[noreturn]] void AwaitTheEnd() {
  for (;;) ::pause();
}
void AwaitTheEndIfStopping() {
  std::lock_guard lock(children.mu);
  if (children.stopping) AwaitTheEnd();
}

Result<Child> SpawnSelf(const std::vector<std::string>& args, bool quiet_stderr) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  if (quiet_stderr) posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  // The signals the demo takes on a thread of its own are blocked here; a
  // child must get them (the daemon stops on SIGTERM).
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  std::vector<std::string> all = {"weightd"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  Child c;
  const int err =
      posix_spawn(&c.pid, "/proc/self/exe", &actions, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (err != 0) {
    ::close(fds[0]);
    return Error("cannot start weightd " + args[0]);
  }
  c.out = fds[0];
  return c;
}

// Runs `weightd ARGS` to the end; its stdout parsed as JSON.
Result<nlohmann::json> RunSelf(const std::vector<std::string>& args) {
  Child c;
  {
    std::lock_guard lock(children.mu);
    if (children.stopping) AwaitTheEnd();
    WEIGHTD_ASSIGN_OR_RETURN(c, SpawnSelf(args, true));
    children.engine = c.pid;
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(c.out, buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  ::close(c.out);
  {
    // Not reaped yet: a signal's SIGKILL meanwhile reaches this child only.
    std::lock_guard lock(children.mu);
    children.engine = -1;
    if (children.stopping) AwaitTheEnd();
  }
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Error("weightd " + args[0] + " failed (run it by hand to see why)");
  }
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded()) return Error("weightd " + args[0] + " printed no JSON");
  return j;
}

// The demo's folders and daemon, removed and stopped however the demo ends:
// a signal too (SIGINT, SIGTERM, SIGHUP), which ends its engine as well.
class Cleanup {
 public:
  Cleanup() {
    on_signal_ = std::make_unique<CleanUpOnSignal>([] {
      {
        std::lock_guard lock(children.mu);
        children.stopping = true;
        if (children.engine > 0) ::kill(children.engine, SIGKILL);
      }
      // Its pipe stays open: the demo may be reading it, and a number
      // closed under a read can be another file's by then. The process
      // ends next.
      StopDaemon(/*close_pipe=*/false);
    });
  }
  Cleanup(const Cleanup&) = delete;
  Cleanup& operator=(const Cleanup&) = delete;
  ~Cleanup() {
    StopDaemon();
    dirs_.clear();  // while a signal still finishes the removal, not cuts it short
    on_signal_.reset();
  }
  // Makes a new folder, removed at the end or by a signal; false, with
  // errno, where the path cannot be made (then it is not the demo's).
  bool MakeFolder(const std::string& path) {
    auto made = io::UnfinishedPath::Make(path, [&] { return ::mkdir(path.c_str(), 0700) == 0; });
    if (!made) return false;
    dirs_.push_back(std::move(made));
    return true;
  }
  // The first folder made stays, at the end or on a signal (--keep).
  void KeepFirst() { dirs_.front()->Keep(); }
  // The daemon, started unless a signal is ending the demo.
  Result<Child> StartDaemon(const std::vector<std::string>& args) {
    std::lock_guard lock(children.mu);
    if (children.stopping) AwaitTheEnd();
    WEIGHTD_ASSIGN_OR_RETURN(children.daemon, SpawnSelf(args, true));
    return children.daemon;
  }
  // From the demo, or from the thread a signal wakes: whichever comes
  // first stops it. SIGTERM, and SIGKILL for a daemon not ended 10 s later.
  static bool StopDaemon(bool close_pipe = true) {
    Child daemon;
    {
      std::lock_guard lock(children.mu);
      daemon = std::exchange(children.daemon, Child{});
    }
    if (daemon.pid <= 0) return true;
    ::kill(daemon.pid, SIGTERM);
    int status = 0;
    bool ended = false;
    for (int i = 0; i < 100 && !ended; ++i) {
      ended = ::waitpid(daemon.pid, &status, WNOHANG) == daemon.pid;
      if (!ended) ::usleep(100'000);
    }
    if (!ended) {
      ::kill(daemon.pid, SIGKILL);
      ::waitpid(daemon.pid, &status, 0);
    }
    if (close_pipe) ::close(daemon.out);
    return ended && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }

 private:
  std::unique_ptr<CleanUpOnSignal> on_signal_;             // made first, gone last
  std::vector<std::unique_ptr<io::UnfinishedPath>> dirs_;  // removed, but for --keep's
};

// Rewrites the first KiB of one tensor in place: same layout, other values.
Status FineTuneOneTensor(const std::string& dir, std::string* which) {
  WEIGHTD_ASSIGN_OR_RETURN(format::Checkpoint ckpt,
                           format::OpenCheckpoint(io::PosixFileSystem(), dir));
  for (const format::Shard& shard : ckpt.shards) {
    for (const format::TensorInfo& t : shard.header.tensors) {
      if (t.bytes() < 1024 || t.name.find("mlp") == std::string::npos) continue;
      std::vector<char> bytes(1024);
      const int fd = ::open(shard.path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return Error("cannot open " + shard.path);
      const off_t at = static_cast<off_t>(shard.header.data_offset() + t.begin);
      bool ok = ::pread(fd, bytes.data(), bytes.size(), at) == 1024;
      for (char& b : bytes) b = static_cast<char>(b ^ 0x01);  // nudge every value a little
      ok = ok && ::pwrite(fd, bytes.data(), bytes.size(), at) == 1024;
      ::close(fd);
      if (!ok) return Error("cannot rewrite " + shard.path);
      *which = std::string(t.name) + " in " + shard.name;
      return OkStatus();
    }
  }
  return Error("no tensor to fine-tune");
}

int RunDemo(const DemoOptions& o) {
  // Each line as it is told: the story takes seconds, is often read through
  // a pipe or a log, and a signal ends it with nothing flushed.
  std::cout << std::unitbuf;
  auto size = protocol::ParseSize(o.size);
  if (!size || *size == 0)
    return ReportError("demo", "--size " + o.size + ": not a size", kExitUsage);
  std::string dir = o.dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/weightd-demo-" + std::to_string(::getpid());
  }
  dir = io::WithoutTrailingSlashes(dir);  // "d/" + ".sock" is inside d
  const std::string socket_dir = dir + ".sock", cache_dir = dir + ".cache";
  // A signal from here on stops what the demo started and removes what it
  // made.
  Cleanup cleanup;
  // It removes these at the end: each must be new, so that nothing it did
  // not make (a model, a daemon's socket) goes with them. Made here, in one
  // step each: a second demo given the same --dir is refused, not let in.
  for (const std::string& path : {dir, socket_dir, cache_dir}) {
    if (cleanup.MakeFolder(path)) continue;
    const std::string why =
        errno == EEXIST ? " already exists" : ": " + std::string(std::strerror(errno));
    return ReportError("demo",
                       path + why + ": the demo makes " + dir + ", " + socket_dir + " and " +
                           cache_dir + " and removes them at the end; " +
                           (o.dir.empty() ? "remove it (an earlier demo's?) or give --dir"
                                          : "give --dir a path where none exists"),
                       kExitUsage);
  }
  if (o.keep) cleanup.KeepFirst();
  // The demo's own socket and stat cache: it touches nothing of a real setup.
  ::setenv("WEIGHTD_CACHE_DIR", cache_dir.c_str(), 1);

  std::cout << "1. generate a llama-shaped checkpoint of about " << FormatBytes(*size) << " in "
            << dir << "\n";
  format::SyntheticOptions synthetic;
  synthetic.preset = "llama";
  synthetic.size_bytes = *size;
  auto plan = format::WriteSyntheticCheckpoint(dir, synthetic);
  if (!plan.ok()) return ReportError("demo", plan.error().message());
  std::cout << "   " << plan->tensor_count << " tensors, " << FormatBytes(plan->data_bytes)
            << " in " << plan->shards.size() << " shards\n";

  std::cout << "2. start the daemon: weightd serve --socket-dir " << socket_dir << "\n";
  auto daemon = cleanup.StartDaemon({"serve", "--socket-dir", socket_dir});
  if (!daemon.ok()) return ReportError("demo", daemon.error().message());
  {
    std::string line;
    char c;
    while (::read(daemon->out, &c, 1) == 1 && c != '\n') line += c;
    AwaitTheEndIfStopping();  // the daemon a signal stopped says nothing more
    if (line.find("ready") == std::string::npos)
      return ReportError("demo", "the daemon did not start");
    std::cout << "   " << line << "\n";
  }
  const std::vector<std::string> engine = {"load",         dir,       "--json", "--checksum",
                                           "--socket-dir", socket_dir};

  std::cout << "3. cold start: an engine asks, nothing is resident, it loads from disk\n";
  auto cold = RunSelf(engine);
  if (!cold.ok()) return ReportError("demo", cold.error().message());
  const double cold_s = (*cold)["seconds"];
  std::cout << "   source: " << (*cold)["source"].get<std::string>() << " ("
            << (*cold)["reason"].get<std::string>() << "), " << FormatSeconds(cold_s) << "\n"
            << "   checksum " << (*cold)["checksum"].get<std::string>() << "\n";

  std::cout << "4. preload: the daemon reads the checkpoint once into a sealed memory segment\n";
  auto preload = RunSelf({"preload", dir, "--json", "--socket-dir", socket_dir});
  if (!preload.ok()) return ReportError("demo", preload.error().message());
  std::cout << "   resident: " << FormatBytes((*preload)["bytes"]) << " in "
            << FormatSeconds((*preload)["seconds"]) << "\n";

  std::cout
      << "5. warm restart: the engine proves the checkpoint is the one resident, and maps it\n";
  auto warm = RunSelf(engine);
  if (!warm.ok()) return ReportError("demo", warm.error().message());
  const double warm_s = (*warm)["seconds"];
  const bool same = (*warm)["checksum"] == (*cold)["checksum"];
  std::cout << "   source: " << (*warm)["source"].get<std::string>() << ", "
            << FormatSeconds(warm_s) << " instead of " << FormatSeconds(cold_s) << ": "
            << static_cast<int>(cold_s / warm_s) << "x faster\n"
            << "   checksum " << (*warm)["checksum"].get<std::string>()
            << (same ? " (the same bytes as from disk)" : " (DIFFERENT from disk!)") << "\n";

  std::string tuned;
  if (Status s = FineTuneOneTensor(dir, &tuned); !s.ok())
    return ReportError("demo", s.error().message());
  std::cout << "6. fine-tune on disk: new values in " << tuned << ", same layout; restart\n";
  auto changed = RunSelf(engine);
  if (!changed.ok()) return ReportError("demo", changed.error().message());
  std::cout << "   source: " << (*changed)["source"].get<std::string>() << ", "
            << FormatSeconds((*changed)["seconds"])
            << "\n   why: " << Printable((*changed)["reason"].get<std::string>())
            << "\n   checksum " << (*changed)["checksum"].get<std::string>()
            << " (the fine-tune's, not the "
            << "resident model's)\n";

  std::cout << "7. stop the daemon (SIGTERM); engines keep what they mapped\n";
  const bool stopped = cleanup.StopDaemon();
  std::cout << "   " << (stopped ? "stopped" : "the daemon did not stop cleanly") << "\n";
  if (o.keep) std::cout << "kept " << dir << "\n";
  const bool caught =
      (*changed)["source"] == "disk" && (*changed)["checksum"] != (*cold)["checksum"];
  if (!same || !caught || !stopped || (*warm)["source"] != "daemon") {
    return ReportError("demo", "the story did not go as it should (see above)");
  }
  return kExitOk;
}

}  // namespace

Command AddDemoCommand(CLI::App& root) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* app = root.add_subcommand(
      "demo",
      "Show what weightd does, on a generated model: a daemon, a cold start from disk, a\n"
      "warm restart from memory, and a changed checkpoint caught. Everything it creates is\n"
      "removed at the end, and its daemon stopped.");
  app->add_option("--dir", o->dir,
                  "where to generate the model: a path that does not exist, nor DIR.sock and\n"
                  "DIR.cache beside it (default: a new folder under $TMPDIR)")
      ->check(NotEmpty());
  app->add_option("--size", o->size, "model size (default 1G)")->check(NotEmpty());
  app->add_flag("--keep", o->keep, "keep the generated model");
  return {app, [o] { return RunDemo(*o); }};
}

}  // namespace weightd::cli
