// Preloaded into a process (LD_PRELOAD), renames one file over another
// just before the process opens the latter for the N-th time, once (by
// open(2), or by openat2(2) through syscall(2)):
//
//   WEIGHTD_SWAP_PATH  the file the process opens
//   WEIGHTD_SWAP_WITH  the file renamed over it
//   WEIGHTD_SWAP_AT    which of its opens (1, 2, ...) finds the new file
//
// The daemon tests use it to change a checkpoint between two reads of one
// preload (the fingerprint's, the loader's) without depending on timing.
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>

#include <atomic>

namespace {

std::atomic<long> opens{0};

void BeforeOpen(const char* path) {
  const char* target = getenv("WEIGHTD_SWAP_PATH");
  const char* with = getenv("WEIGHTD_SWAP_WITH");
  const char* at = getenv("WEIGHTD_SWAP_AT");
  if (target == nullptr || with == nullptr || at == nullptr || strcmp(path, target) != 0) return;
  if (opens.fetch_add(1) + 1 != atol(at)) return;
  if (rename(with, target) != 0) perror("swap_on_open: rename");
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
  BeforeOpen(path);
  return fn(path, flags, mode);
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
#ifdef SYS_openat2
  if (number == SYS_openat2) BeforeOpen(reinterpret_cast<const char*>(a[1]));
#endif
  return fn(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
