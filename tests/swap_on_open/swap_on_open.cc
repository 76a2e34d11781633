// Preloaded into a process (LD_PRELOAD), changes one file at an exact
// moment: when the process opens it for the N-th time (by open(2), or by
// openat2(2) through syscall(2)), once:
//
//   WEIGHTD_SWAP_PATH      the file the process opens
//   WEIGHTD_SWAP_AT        which of its opens (1, 2, ...) it is
//   WEIGHTD_SWAP_WITH      a file renamed over it just before that open
//   WEIGHTD_TRUNCATE_PAST  a size: the first read through that open's
//                          descriptor that asks for bytes past it cuts the
//                          file to that size first
//
// The daemon tests use it to change a checkpoint between two reads of one
// preload (the fingerprint's, the loader's), or while the loader reads its
// weights, without depending on timing.
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace {

std::atomic<long> opens{0};
std::atomic<int> watched_fd{-1};
std::atomic<bool> truncated{false};

// Whether this open of `path` is the one WEIGHTD_SWAP_AT names; swaps the
// file in first where asked to.
bool BeforeOpen(const char* path) {
  const char* target = getenv("WEIGHTD_SWAP_PATH");
  const char* at = getenv("WEIGHTD_SWAP_AT");
  if (target == nullptr || at == nullptr || strcmp(path, target) != 0) return false;
  if (opens.fetch_add(1) + 1 != atol(at)) return false;
  const char* with = getenv("WEIGHTD_SWAP_WITH");
  if (with != nullptr && rename(with, target) != 0) perror("swap_on_open: rename");
  return true;
}

void AfterOpen(bool watched, long fd) {
  if (watched && fd >= 0 && getenv("WEIGHTD_TRUNCATE_PAST") != nullptr) {
    watched_fd.store(static_cast<int>(fd));
  }
}

void BeforeRead(int fd, size_t n, off_t offset) {
  if (fd < 0 || fd != watched_fd.load() || truncated.load()) return;
  const long long past = atoll(getenv("WEIGHTD_TRUNCATE_PAST"));
  if (static_cast<long long>(offset) + static_cast<long long>(n) <= past) return;
  if (truncated.exchange(true)) return;
  if (truncate(getenv("WEIGHTD_SWAP_PATH"), past) != 0) perror("swap_on_open: truncate");
}

}  // namespace

// open and open64 are one call on a 64-bit system: one definition, under
// both names, forwards to the C library's open.
extern "C" __attribute__((visibility("default"))) int open(const char* path, int flags, ...) {
  using OpenFn = int (*)(const char*, int, ...);
  static std::atomic<OpenFn> real{nullptr};
  OpenFn fn = real.load();
  if (fn == nullptr) {
    fn = reinterpret_cast<OpenFn>(dlsym(RTLD_NEXT, "open"));
    real.store(fn);
  }
  va_list args;
  va_start(args, flags);
  const mode_t mode =
      (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(args, mode_t) : 0;
  va_end(args);
  const bool watched = BeforeOpen(path);
  const int fd = fn(path, flags, mode);
  AfterOpen(watched, fd);
  return fd;
}

extern "C" __attribute__((visibility("default"), alias("open"))) int open64(const char* path,
                                                                            int flags, ...);

// openat2 has no C library wrapper: it is called through syscall(2), whose
// other calls pass through untouched. Every call takes up to six
// word-sized arguments; they are forwarded as they came.
extern "C" __attribute__((visibility("default"))) long syscall(long number, ...) {
  using SyscallFn = long (*)(long, ...);
  static std::atomic<SyscallFn> real{nullptr};
  SyscallFn fn = real.load();
  if (fn == nullptr) {
    fn = reinterpret_cast<SyscallFn>(dlsym(RTLD_NEXT, "syscall"));
    real.store(fn);
  }
  va_list args;
  va_start(args, number);
  long a[6];
  for (long& x : a) x = va_arg(args, long);
  va_end(args);
  bool watched = false;
  constexpr long kOpenat2 = 437;  // as weightd spells it: older headers lack the name
  if (number == kOpenat2) watched = BeforeOpen(reinterpret_cast<const char*>(a[1]));
  const long r = fn(number, a[0], a[1], a[2], a[3], a[4], a[5]);
  AfterOpen(watched, r);
  return r;
}

extern "C" __attribute__((visibility("default"))) ssize_t pread(int fd, void* buf, size_t n,
                                                                off_t offset) {
  using PreadFn = ssize_t (*)(int, void*, size_t, off_t);
  static std::atomic<PreadFn> real{nullptr};
  PreadFn fn = real.load();
  if (fn == nullptr) {
    fn = reinterpret_cast<PreadFn>(dlsym(RTLD_NEXT, "pread"));
    real.store(fn);
  }
  BeforeRead(fd, n, offset);
  return fn(fd, buf, n, offset);
}

extern "C" __attribute__((visibility("default"), alias("pread"))) ssize_t pread64(int fd, void* buf,
                                                                                  size_t n,
                                                                                  off_t offset);
