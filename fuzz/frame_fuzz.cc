// libFuzzer target: the input is what a peer writes on the daemon's socket.
// Frames are read from a real socket pair until the first error; every
// frame that is accepted must be a JSON object with a string "type".
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "protocol/channel.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 0;
  // Inputs are small (-max_len): they fit the socket buffer in one write.
  if (size > 0 && ::write(fds[0], data, size) != static_cast<ssize_t>(size)) __builtin_trap();
  ::close(fds[0]);
  protocol::Channel channel{memory::UniqueFd(fds[1])};
  for (int i = 0; i < 64; ++i) {
    auto m = channel.Receive(0);
    if (!m.ok()) break;
    if (!m->body.is_object() || m->type().empty()) __builtin_trap();
  }
  return 0;
}
