#include "protocol/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

Status CheckSocketDirectory(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    return Error("socket directory " + dir + ": " + std::strerror(errno));
  }
  if (S_ISLNK(st.st_mode)) return Error("socket directory " + dir + " is a symlink; refusing it");
  if (!S_ISDIR(st.st_mode)) return Error("socket directory " + dir + " is not a directory");
  if (st.st_uid != ::geteuid()) {
    return Error("socket directory " + dir + " is owned by uid " + std::to_string(st.st_uid) +
                 ", not by this user (uid " + std::to_string(::geteuid()) + ")");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
    return Error("socket directory " + dir + " has mode " + mode + "; it must be 0700 (chmod 700 " +
                 dir + ")");
  }
  return OkStatus();
}

}  // namespace weightd::protocol
