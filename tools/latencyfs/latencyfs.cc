// latencyfs: a read-only FUSE passthrough that delays every operation, to
// stand in for a network file system (NFS, an object-store FUSE mount) in
// tests and benchmarks. See README.md beside this file.
//
// Each request is served at once from the source directory, but its reply
// is held back until its latency has passed (and, for reads, until the
// shared link of --bandwidth has carried its bytes). Replies go out from a
// timer thread, so hundreds of requests can wait at once without a thread
// each: the delays overlap as they do on a network, and the client's
// concurrency decides the time. Reads are direct I/O (no kernel page cache),
// so every client read is one operation here; attributes and entries are
// cached by the kernel for --attr-cache, like NFS's actimeo.
#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 12)

#include <dirent.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  std::string source;
  std::string mountpoint;
  std::chrono::nanoseconds latency{0};
  double bandwidth = 0;  // bytes per second; 0 = unlimited
  double attr_cache_s = 3.0;
  int threads = 8;
  std::string stats_file;
};

// Replies held until they are due, sent in due order from one thread.
class DelayQueue {
 public:
  DelayQueue() : thread_([this] { Run(); }) {}
  ~DelayQueue() { Stop(); }

  // Ends the thread, once what is queued is sent. Called before the session
  // goes: libfuse gives the thread a pipe to splice replies through, freed
  // when the thread ends only while the session lasts.
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Sends every reply still waiting, now. The session must not go away with
  // requests unanswered: called when the loop ends, before unmounting.
  void Drain() {
    std::vector<std::function<void()>> replies;
    {
      std::lock_guard lock(mu_);
      while (!queue_.empty()) {
        replies.push_back(std::move(const_cast<Item&>(queue_.top()).reply));
        queue_.pop();
      }
    }
    for (auto& reply : replies) reply();
  }

  void At(Clock::time_point due, std::function<void()> reply) {
    {
      std::lock_guard lock(mu_);
      queue_.push({due, seq_++, std::move(reply)});
    }
    cv_.notify_one();
  }

 private:
  struct Item {
    Clock::time_point due;
    uint64_t seq;
    std::function<void()> reply;
    bool operator>(const Item& o) const { return std::tie(due, seq) > std::tie(o.due, o.seq); }
  };

  void Run() {
    std::unique_lock lock(mu_);
    while (true) {
      if (queue_.empty()) {
        if (stop_) return;
        cv_.wait(lock);
        continue;
      }
      const auto due = queue_.top().due;
      if (Clock::now() < due) {
        cv_.wait_until(lock, due);
        continue;
      }
      auto reply = std::move(const_cast<Item&>(queue_.top()).reply);
      queue_.pop();
      lock.unlock();
      reply();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue_;
  uint64_t seq_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

struct Stats {
  std::atomic<uint64_t> lookup{0}, getattr{0}, open{0}, read{0}, read_bytes{0}, readdir{0},
      readlink{0};
};

struct State {
  Config config;
  int source_fd = -1;
  std::mutex nodes_mu;
  std::unordered_map<fuse_ino_t, std::string> paths;  // inode -> path relative to the source
  // Source (device, inode) -> our inode number: the source may span file
  // systems, whose inode numbers alone collide.
  std::map<std::pair<dev_t, ino_t>, fuse_ino_t> ids;
  fuse_ino_t next_id = FUSE_ROOT_ID + 1;
  std::mutex link_mu;
  Clock::time_point link_free{};
  Stats stats;
  DelayQueue* delay = nullptr;
};

State* St(fuse_req_t req) { return static_cast<State*>(fuse_req_userdata(req)); }

std::string PathOf(State* s, fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return ".";
  std::lock_guard lock(s->nodes_mu);
  auto it = s->paths.find(ino);
  return it == s->paths.end() ? std::string() : it->second;
}

// Our inode number for a source file, remembering its path.
// REQUIRES: s->nodes_mu held.
fuse_ino_t Remember(State* s, const struct stat& st, const std::string& path) {
  auto [it, added] = s->ids.try_emplace({st.st_dev, st.st_ino}, s->next_id);
  if (added) ++s->next_id;
  s->paths[it->second] = path;
  return it->second;
}

Clock::time_point Due(State* s, uint64_t bytes = 0) {
  const auto now = Clock::now();
  auto due = now + s->config.latency;
  if (bytes > 0 && s->config.bandwidth > 0) {
    // One shared link: transfers queue behind each other.
    const auto transfer = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / s->config.bandwidth));
    std::lock_guard lock(s->link_mu);
    s->link_free = std::max(s->link_free, now) + transfer;
    due = std::max(due, s->link_free);
  }
  return due;
}

void ReplyErrorLater(fuse_req_t req, int err) {
  St(req)->delay->At(Due(St(req)), [req, err] { fuse_reply_err(req, err); });
}

void Init(void* userdata, struct fuse_conn_info* conn) {
  (void)userdata;
  // Without this the kernel serializes lookups in one directory: a client
  // stat-ing 66 shards at once would wait 66 round trips, which is not what
  // a network file system does.
  if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) conn->want |= FUSE_CAP_PARALLEL_DIROPS;
  // Listing a directory returns every entry's attributes in the same round
  // trip (NFS's READDIRPLUS), always rather than when the kernel guesses it
  // pays: that is what lets a client learn many files' attributes at once.
  if (conn->capable & FUSE_CAP_READDIRPLUS) conn->want |= FUSE_CAP_READDIRPLUS;
  conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
  // Reads are spliced from the source file into the reply (see Read).
  if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
}

void Lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  State* s = St(req);
  ++s->stats.lookup;
  const std::string dir = PathOf(s, parent);
  if (dir.empty()) return ReplyErrorLater(req, ESTALE);
  const std::string path = dir == "." ? name : dir + "/" + name;
  struct fuse_entry_param e;
  std::memset(&e, 0, sizeof e);
  if (::fstatat(s->source_fd, path.c_str(), &e.attr, AT_SYMLINK_NOFOLLOW) != 0) {
    return ReplyErrorLater(req, errno);
  }
  {
    std::lock_guard lock(s->nodes_mu);
    e.ino = Remember(s, e.attr, path);
  }
  e.attr.st_ino = e.ino;
  e.attr_timeout = e.entry_timeout = s->config.attr_cache_s;
  s->delay->At(Due(s), [req, e] { fuse_reply_entry(req, &e); });
}

void GetAttr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info*) {
  State* s = St(req);
  ++s->stats.getattr;
  const std::string path = PathOf(s, ino);
  struct stat st;
  if (path.empty() || ::fstatat(s->source_fd, path.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ReplyErrorLater(req, path.empty() ? ESTALE : errno);
  }
  st.st_ino = ino;
  const double timeout = s->config.attr_cache_s;
  s->delay->At(Due(s), [req, st, timeout] { fuse_reply_attr(req, &st, timeout); });
}

void Open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  State* s = St(req);
  ++s->stats.open;
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return ReplyErrorLater(req, EROFS);
  const std::string path = PathOf(s, ino);
  const int fd = path.empty() ? -1 : ::openat(s->source_fd, path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ReplyErrorLater(req, path.empty() ? ESTALE : errno);
  struct fuse_file_info out = *fi;
  out.fh = static_cast<uint64_t>(fd);
  out.direct_io = 1;  // every client read is one operation, never the page cache
  out.keep_cache = 0;
  s->delay->At(Due(s), [req, out] { fuse_reply_open(req, &out); });
}

// A read of two pages or more is read from the source when its reply is
// due, and spliced from its page cache into the kernel's reply (where the
// kernel allows splicing), so this process never holds its bytes. A fresh
// buffer per read cost it 250-400 ms of CPU per cold fingerprint of a
// 66-shard model, nearly all page faults: on the 2-core machines the
// benchmarks run on, CPU its client then waited for, where on a real network
// file system the server spends it on another machine. The source fd stays
// open until the reply: the kernel holds the file while a read is
// outstanding, so no release comes first.
//
// A smaller read, which libfuse would copy through a buffer anyway, is read
// now, on this loop thread, into a small buffer: reading those at reply time
// too put every read of `--ceiling` on the one thread that sends replies
// (a median of 38,000 operations/s against 45,000, in alternating runs).
void Read(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  State* s = St(req);
  ++s->stats.read;
  const int fd = static_cast<int>(fi->fh);
  static const size_t kSpliceFrom = 2 * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (size < kSpliceFrom) {
    auto buf = std::make_shared<std::vector<char>>(size);
    const ssize_t n = ::pread(fd, buf->data(), size, off);
    if (n < 0) return ReplyErrorLater(req, errno);
    s->stats.read_bytes += static_cast<uint64_t>(n);
    s->delay->At(Due(s, static_cast<uint64_t>(n)),
                 [req, buf, n] { fuse_reply_buf(req, buf->data(), static_cast<size_t>(n)); });
    return;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return ReplyErrorLater(req, errno);
  const uint64_t n =
      off >= st.st_size ? 0 : std::min<uint64_t>(size, static_cast<uint64_t>(st.st_size - off));
  s->stats.read_bytes += n;
  // The source's pages start coming in now: at reply time they are read on
  // the one thread that sends every reply.
  ::posix_fadvise(fd, off, static_cast<off_t>(n), POSIX_FADV_WILLNEED);
  s->delay->At(Due(s, n), [req, fd, off, n] {
    struct fuse_bufvec data;  // FUSE_BUFVEC_INIT is a C compound literal
    std::memset(&data, 0, sizeof data);
    data.count = 1;
    data.buf[0].size = static_cast<size_t>(n);
    data.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    data.buf[0].fd = fd;
    data.buf[0].pos = off;
    // A read that fails now is answered with its error by libfuse.
    fuse_reply_data(req, &data, static_cast<fuse_buf_copy_flags>(0));
  });
}

void Release(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  ::close(static_cast<int>(fi->fh));
  fuse_reply_err(req, 0);
}

struct DirListing {
  std::string dir;  // relative to the source
  std::vector<std::pair<std::string, struct stat>> entries;
};

void OpenDir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  State* s = St(req);
  const std::string path = PathOf(s, ino);
  const int fd =
      path.empty() ? -1 : ::openat(s->source_fd, path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ReplyErrorLater(req, path.empty() ? ESTALE : errno);
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    const int err = errno;
    ::close(fd);
    return ReplyErrorLater(req, err);
  }
  auto* listing = new DirListing;
  while (struct dirent* d = ::readdir(dir)) {
    struct stat st;
    std::memset(&st, 0, sizeof st);
    const std::string name = d->d_name;
    if (name == "." || name == ".." ||
        ::fstatat(::dirfd(dir), d->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      st.st_ino = d->d_ino;
      st.st_mode = static_cast<mode_t>(DTTOIF(d->d_type));
    }
    listing->entries.emplace_back(name, st);
  }
  ::closedir(dir);
  listing->dir = path;
  struct fuse_file_info out = *fi;
  out.fh = reinterpret_cast<uint64_t>(listing);
  s->delay->At(Due(s), [req, out] { fuse_reply_open(req, &out); });
}

// An empty reply ends a listing. NFS's READDIRPLUS says "end of directory"
// in the reply that carried the last entries, so a client never pays a round
// trip to learn it; the empty reply FUSE needs instead is answered at once.
void ReplyListing(fuse_req_t req, const std::shared_ptr<std::vector<char>>& buf, size_t used) {
  if (used == 0) {
    fuse_reply_buf(req, nullptr, 0);
    return;
  }
  St(req)->delay->At(Due(St(req)), [req, buf, used] { fuse_reply_buf(req, buf->data(), used); });
}

// One page of a listing from `off`. With `plus`, each entry carries its
// attributes, as a lookup's reply would (NFS's READDIRPLUS).
void ServeListing(fuse_req_t req, size_t size, off_t off, struct fuse_file_info* fi, bool plus) {
  State* s = St(req);
  ++s->stats.readdir;
  auto* listing = reinterpret_cast<DirListing*>(fi->fh);
  auto buf = std::make_shared<std::vector<char>>(size);
  size_t used = 0;
  for (size_t i = static_cast<size_t>(off); i < listing->entries.size(); ++i) {
    const auto& [name, st] = listing->entries[i];
    const bool dots = name == "." || name == "..";
    struct fuse_entry_param e;
    std::memset(&e, 0, sizeof e);
    e.attr = st;
    if (plus && !dots) {
      // Like a lookup: the kernel now knows this entry until the timeout.
      std::lock_guard lock(s->nodes_mu);
      e.ino = Remember(s, st, listing->dir == "." ? name : listing->dir + "/" + name);
      e.attr.st_ino = e.ino;
      e.attr_timeout = e.entry_timeout = s->config.attr_cache_s;
    }
    char* out = buf->data() + used;
    const off_t next = static_cast<off_t>(i + 1);
    const size_t need = plus ? fuse_add_direntry_plus(req, out, size - used, name.c_str(), &e, next)
                             : fuse_add_direntry(req, out, size - used, name.c_str(), &st, next);
    if (need > size - used) break;
    used += need;
  }
  ReplyListing(req, buf, used);
}

void ReadDir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  ServeListing(req, size, off, fi, false);
}

void ReadDirPlus(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  ServeListing(req, size, off, fi, true);
}

void ReleaseDir(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  delete reinterpret_cast<DirListing*>(fi->fh);
  fuse_reply_err(req, 0);
}

void ReadLink(fuse_req_t req, fuse_ino_t ino) {
  State* s = St(req);
  ++s->stats.readlink;
  const std::string path = PathOf(s, ino);
  char target[4096];
  const ssize_t n =
      path.empty() ? -1 : ::readlinkat(s->source_fd, path.c_str(), target, sizeof target - 1);
  if (n < 0) return ReplyErrorLater(req, path.empty() ? ESTALE : errno);
  std::string text(target, static_cast<size_t>(n));
  s->delay->At(Due(s), [req, text] { fuse_reply_readlink(req, text.c_str()); });
}

void StatFs(fuse_req_t req, fuse_ino_t) {
  struct statvfs st;
  if (::fstatvfs(St(req)->source_fd, &st) != 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_statfs(req, &st);
}

void WriteStats(const State& s) {
  const auto& st = s.stats;
  char text[512];
  std::snprintf(text, sizeof text,
                "{\"lookup\": %llu, \"getattr\": %llu, \"open\": %llu, \"read\": %llu, "
                "\"read_bytes\": %llu, \"readdir\": %llu, \"readlink\": %llu}\n",
                static_cast<unsigned long long>(st.lookup.load()),
                static_cast<unsigned long long>(st.getattr.load()),
                static_cast<unsigned long long>(st.open.load()),
                static_cast<unsigned long long>(st.read.load()),
                static_cast<unsigned long long>(st.read_bytes.load()),
                static_cast<unsigned long long>(st.readdir.load()),
                static_cast<unsigned long long>(st.readlink.load()));
  std::fprintf(stderr, "latencyfs: operations %s", text);
  if (!s.config.stats_file.empty()) {
    if (FILE* f = std::fopen(s.config.stats_file.c_str(), "w")) {
      std::fputs(text, f);
      std::fclose(f);
    }
  }
}

// Mounts and serves until unmounted or signalled (SIGTERM, SIGINT, SIGHUP).
int Serve(const Config& config) {
  State state;
  state.config = config;
  state.source_fd = ::open(config.source.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (state.source_fd < 0) {
    std::fprintf(stderr, "latencyfs: error: %s: %s\n", config.source.c_str(), std::strerror(errno));
    return 1;
  }
  DelayQueue delay;
  state.delay = &delay;

  struct fuse_lowlevel_ops ops;
  std::memset(&ops, 0, sizeof ops);
  ops.init = Init;
  ops.lookup = Lookup;
  ops.getattr = GetAttr;
  ops.open = Open;
  ops.read = Read;
  ops.release = Release;
  ops.opendir = OpenDir;
  ops.readdir = ReadDir;
  ops.readdirplus = ReadDirPlus;
  ops.releasedir = ReleaseDir;
  ops.readlink = ReadLink;
  ops.statfs = StatFs;

  std::vector<std::string> argv_text = {"latencyfs", "-o", "ro,fsname=latencyfs,subtype=latencyfs"};
  std::vector<char*> argv;
  for (auto& a : argv_text) argv.push_back(a.data());
  struct fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  struct fuse_session* se = fuse_session_new(&args, &ops, sizeof ops, &state);
  // What parsing the options added to them (libfuse's own), freed at exit.
  struct FreeArgs {
    fuse_args* args;
    ~FreeArgs() { fuse_opt_free_args(args); }
  } free_args{&args};
  if (se == nullptr) return 1;
  int rc = 1;
  if (fuse_set_signal_handlers(se) == 0) {
    if (fuse_session_mount(se, config.mountpoint.c_str()) == 0) {
      std::fprintf(stderr, "latencyfs: serving %s at %s, %.3f ms per operation\n",
                   config.source.c_str(), config.mountpoint.c_str(),
                   std::chrono::duration<double, std::milli>(config.latency).count());
      struct fuse_loop_config* loop = fuse_loop_cfg_create();
      fuse_loop_cfg_set_max_threads(loop, static_cast<unsigned>(config.threads));
      fuse_loop_cfg_set_idle_threads(loop, static_cast<unsigned>(config.threads));
      rc = fuse_session_loop_mt(se, loop);
      fuse_loop_cfg_destroy(loop);
      delay.Drain();
      fuse_session_unmount(se);
    }
    fuse_remove_signal_handlers(se);
  }
  delay.Stop();
  fuse_session_destroy(se);
  WriteStats(state);
  ::close(state.source_fd);
  return rc == 0 ? 0 : 1;
}

// "5ms", "150ms", "1s", "200us", "0" -> nanoseconds; -1 when malformed.
int64_t ParseDuration(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || v < 0) return -1;
  const std::string unit(end);
  const double scale = unit == "ns"                  ? 1
                       : unit == "us"                ? 1e3
                       : unit == "ms"                ? 1e6
                       : unit == "s" || unit.empty() ? 1e9
                                                     : -1;
  return scale < 0 ? -1 : static_cast<int64_t>(v * scale);
}

// "1G", "500M", "0" -> bytes per second; -1 when malformed.
double ParseBandwidth(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || v < 0) return -1;
  const std::string unit(end);
  const double scale = unit.empty()  ? 1
                       : unit == "K" ? 1e3
                       : unit == "M" ? 1e6
                       : unit == "G" ? 1e9
                                     : -1;
  return scale < 0 ? -1 : v * scale;
}

bool WaitForMount(const std::string& mnt, dev_t outer, int seconds) {
  for (int i = 0; i < seconds * 100; ++i) {
    struct stat st;
    if (::stat(mnt.c_str(), &st) == 0 && st.st_dev != outer) return true;
    ::usleep(10'000);
  }
  return false;
}

// Mounts a scratch directory with no delay and hammers it with `threads`
// readers for `seconds`: the most operations per second this machine lets a
// FUSE daemon serve. Every latencyfs figure must be read against it.
int MeasureCeiling(int threads, double seconds) {
  char base[] = "/tmp/latencyfs-ceiling-XXXXXX";
  if (::mkdtemp(base) == nullptr) return 1;
  const std::string src = std::string(base) + "/src", mnt = std::string(base) + "/mnt";
  ::mkdir(src.c_str(), 0700);
  ::mkdir(mnt.c_str(), 0700);
  {
    FILE* f = std::fopen((src + "/data").c_str(), "w");
    std::vector<char> data(1 << 20, 'x');
    std::fwrite(data.data(), 1, data.size(), f);
    std::fclose(f);
  }
  struct stat outer;
  ::stat(mnt.c_str(), &outer);
  const pid_t child = ::fork();
  if (child == 0) {
    ::freopen("/dev/null", "w", stderr);
    Config c;
    c.source = src;
    c.mountpoint = mnt;
    c.threads = 8;
    ::_exit(Serve(c));
  }
  int rc = 1;
  if (WaitForMount(mnt, outer.st_dev, 10)) {
    std::atomic<uint64_t> ops{0};
    std::atomic<bool> stop{false};
    std::vector<std::thread> readers;
    for (int t = 0; t < threads; ++t) {
      readers.emplace_back([&, t] {
        const int fd = ::open((mnt + "/data").c_str(), O_RDONLY);
        char buf[1024];
        uint64_t i = static_cast<uint64_t>(t);
        while (!stop.load(std::memory_order_relaxed)) {
          if (::pread(fd, buf, sizeof buf, static_cast<off_t>((i++ * 4096) % (1 << 20))) > 0) ++ops;
        }
        ::close(fd);
      });
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop = true;
    for (auto& r : readers) r.join();
    std::printf(
        "{\"ceiling_ops_per_second\": %.0f, \"readers\": %d, \"seconds\": %.1f, \"cores\": %ld}\n",
        static_cast<double>(ops.load()) / seconds, threads, seconds,
        ::sysconf(_SC_NPROCESSORS_ONLN));
    rc = 0;
  } else {
    std::fprintf(stderr, "latencyfs: error: the scratch mount did not come up\n");
  }
  ::kill(child, SIGTERM);
  ::waitpid(child, nullptr, 0);
  ::unlink((src + "/data").c_str());
  ::rmdir(src.c_str());
  ::rmdir(mnt.c_str());
  ::rmdir(base);
  return rc;
}

void Usage() {
  std::fprintf(
      stderr,
      "usage: latencyfs SRC MNT [--latency 1ms] [--bandwidth 0|1G] [--attr-cache 3s]\n"
      "                 [--threads 8] [--stats-file FILE]\n"
      "       latencyfs --ceiling [--readers 256] [--seconds 2]\n"
      "Serves SRC read-only at MNT with every operation delayed by --latency and reads\n"
      "limited to --bandwidth (0: unlimited). Stop it with SIGTERM or `fusermount3 -u MNT`;\n"
      "it then prints (and writes to --stats-file) the operations it served.\n"
      "--ceiling measures the operations per second this machine's FUSE can serve.\n");
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  std::vector<std::string> positional;
  bool ceiling = false;
  int readers = 256;
  double seconds = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        Usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--latency") {
      const int64_t ns = ParseDuration(value());
      if (ns < 0) return Usage(), 2;
      config.latency = std::chrono::nanoseconds(ns);
    } else if (arg == "--bandwidth") {
      config.bandwidth = ParseBandwidth(value());
      if (config.bandwidth < 0) return Usage(), 2;
    } else if (arg == "--attr-cache") {
      const int64_t ns = ParseDuration(value());
      if (ns < 0) return Usage(), 2;
      config.attr_cache_s = static_cast<double>(ns) / 1e9;
    } else if (arg == "--threads") {
      config.threads = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--stats-file") {
      config.stats_file = value();
    } else if (arg == "--ceiling") {
      ceiling = true;
    } else if (arg == "--readers") {
      readers = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--seconds") {
      seconds = std::max(0.1, std::atof(value().c_str()));
    } else if (arg == "--help" || arg == "-h") {
      Usage();
      return 0;
    } else if (!arg.empty() && arg[0] == '-') {
      Usage();
      return 2;
    } else {
      positional.push_back(arg);
    }
  }
  if (ceiling) return MeasureCeiling(readers, seconds);
  if (positional.size() != 2) return Usage(), 2;
  config.source = positional[0];
  config.mountpoint = positional[1];
  return Serve(config);
}
