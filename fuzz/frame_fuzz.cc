// libFuzzer target: the input is what a peer writes on the daemon's socket.
// Frames are read from a real socket pair until the first error; every
// frame that is accepted must be a JSON object with a string "type". The
// fields the daemon decodes from requests (a cache key, processing flags, a
// path) are decoded as it does; what decodes must survive a round trip
// through the wire form unchanged.
//
// An input that starts with "FDS!" is a list of writes, each with the
// descriptors a peer passes along with it (SCM_RIGHTS): a byte (its low
// two bits: how many descriptors), a 16-bit little-endian length, and that
// many bytes; up to 64 writes, while the socket takes them. Whatever the
// frames and however many descriptors came with them, every descriptor
// received must be closed once the messages are gone: none may leak into
// the daemon.
#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"

namespace {

using namespace weightd;

void DecodeFields(const nlohmann::json& body) {
  if (auto it = body.find("key"); it != body.end()) {
    if (auto key = protocol::KeyFromJson(*it); key.ok()) {
      auto again = protocol::KeyFromJson(protocol::ToJson(*key));
      if (!again.ok() || !(*again == *key)) __builtin_trap();
      if (!protocol::Compare(*key, *again).empty()) __builtin_trap();
      (void)protocol::ShortDescription(*key);
    }
  }
  if (auto it = body.find("processing"); it != body.end()) {
    if (auto p = protocol::ProcessingFromJson(*it); p.ok()) {
      auto again = protocol::ProcessingFromJson(protocol::ToJson(*p));
      if (!again.ok() || again->tp_size != p->tp_size || again->tp_rank != p->tp_rank ||
          again->dtype != p->dtype || again->quant != p->quant ||
          again->shard_plan != p->shard_plan || again->device != p->device) {
        __builtin_trap();
      }
      if (protocol::CheckSupported(*p).ok()) {
        for (int rank = 0; rank < p->tp_size && rank < 64; ++rank) {
          (void)protocol::DeviceOfRank(*p, rank);
        }
      }
    }
  }
  if (auto it = body.find("path"); it != body.end()) {
    if (auto path = protocol::PathFromJson(*it); path.ok()) {
      auto again = protocol::PathFromJson(protocol::PathToJson(*path));
      if (!again.ok() || *again != *path) __builtin_trap();
    }
  }
}

constexpr char kWithDescriptors[4] = {'F', 'D', 'S', '!'};

// No more writes than the 64 messages read could need (a write may carry
// more than one frame, or part of one).
constexpr int kMaxWrites = 64;

// The descriptors open in this process, by number: a leak that happens
// along with a descriptor wrongly closed is still a change.
std::vector<int> OpenDescriptors() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) __builtin_trap();
  std::vector<int> open;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.' && ::dirfd(dir) != std::atoi(e->d_name)) {
      open.push_back(std::atoi(e->d_name));
    }
  }
  ::closedir(dir);
  std::sort(open.begin(), open.end());
  return open;
}

// Writes `bytes` with `count` descriptors (of /dev/null) attached; false
// when the socket takes no more (its buffer full, or too many descriptors
// in flight for this process's limit).
bool SendWith(int socket, const uint8_t* bytes, size_t size, int count) {
  int passed[3];
  for (int i = 0; i < count; ++i) {
    passed[i] = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (passed[i] < 0) __builtin_trap();
  }
  iovec iov{const_cast<uint8_t*>(bytes), size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof passed)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (count > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(c), passed, sizeof(int) * count);
  }
  const ssize_t sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  const int error = errno;
  for (int i = 0; i < count; ++i) ::close(passed[i]);
  if (sent < 0 && error != EAGAIN && error != ETOOMANYREFS) __builtin_trap();
  // A part written is what the reader gets: frames cut there are its to refuse.
  return sent == static_cast<ssize_t>(size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<int> open_before = OpenDescriptors();
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 0;
  // Inputs are small (-max_len): written at once, before anything reads,
  // they fit the socket buffer.
  if (size >= 4 && std::memcmp(data, kWithDescriptors, 4) == 0) {
    int writes = 0;
    for (size_t at = 4; at + 3 <= size && writes < kMaxWrites;) {
      const int count = data[at] & 3;
      const size_t length =
          std::min<size_t>(data[at + 1] | size_t{data[at + 2]} << 8, size - at - 3);
      at += 3;
      // Descriptors ride on data: a write of nothing carries none.
      if (length > 0 && (++writes, !SendWith(fds[0], data + at, length, count))) break;
      at += length;
    }
  } else if (size > 0 && ::write(fds[0], data, size) != static_cast<ssize_t>(size)) {
    __builtin_trap();
  }
  ::close(fds[0]);
  {
    protocol::Channel channel{memory::UniqueFd(fds[1])};
    for (int i = 0; i < 64; ++i) {
      auto m = channel.Receive(0);
      if (!m.ok()) break;
      if (!m->body.is_object() || m->type().empty()) __builtin_trap();
      for (const memory::UniqueFd& fd : m->fds) {
        if (::fcntl(fd.get(), F_GETFD) < 0) __builtin_trap();  // handed over, open
      }
      DecodeFields(m->body);
    }
  }
  // The socket and every descriptor that arrived on it are closed.
  if (OpenDescriptors() != open_before) __builtin_trap();
  return 0;
}
