#include "protocol/paths.h"

#include <unistd.h>

#include <cstdlib>

namespace weightd::protocol {

std::string SocketDirectory(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* d = std::getenv("WEIGHTD_SOCKET_DIR"); d != nullptr && *d != '\0') return d;
  if (const char* d = std::getenv("XDG_RUNTIME_DIR"); d != nullptr && *d != '\0') {
    return std::string(d) + "/weightd";
  }
  return "/tmp/weightd-" + std::to_string(::getuid());
}

std::string SocketPath(const std::string& dir) { return dir + "/" + kSocketName; }

}  // namespace weightd::protocol
