// libFuzzer target: the input is what a peer writes on the daemon's socket.
// Frames are read from a real socket pair until the first error; every
// frame that is accepted must be a JSON object with a string "type". The
// fields the daemon decodes from requests (a cache key, processing flags, a
// path) are decoded as it does; what decodes must survive a round trip
// through the wire form unchanged.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
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
    DecodeFields(m->body);
  }
  return 0;
}
