#include "protocol/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace weightd::protocol {

namespace {

// "dir/" names what "dir" points to, and lstat follows a symlink named
// so: the directory is checked, and named, without them.
std::string WithoutTrailingSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

}  // namespace

std::string SocketDirectory(const std::string& flag) {
  if (!flag.empty()) return WithoutTrailingSlashes(flag);
  if (const char* d = std::getenv("WEIGHTD_SOCKET_DIR"); d != nullptr && *d != '\0') {
    return WithoutTrailingSlashes(d);
  }
  if (const char* d = std::getenv("XDG_RUNTIME_DIR"); d != nullptr && *d != '\0') {
    return WithoutTrailingSlashes(d) + "/weightd";
  }
  // The user the directory must belong to (OpenSocketDirectory), and the
  // peers must be: the effective one, as the stat cache's directory.
  return "/tmp/weightd-" + std::to_string(::geteuid());
}

std::string SocketPath(const std::string& dir) { return dir + "/" + kSocketName; }

Result<memory::UniqueFd> OpenSocketDirectory(const std::string& named) {
  const std::string dir = WithoutTrailingSlashes(named);
  // O_NOFOLLOW looks at the last component only: a symlink named before a
  // last `.` or `..` would be followed.
  const std::string last = dir.substr(dir.find_last_of('/') + 1);
  if (last == "." || last == "..") {
    return Error("socket directory " + named + " ends in `" + last +
                 "`; name the directory itself");
  }
  // O_PATH: no permission to list it is needed, only to be its owner.
  memory::UniqueFd fd(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    const int error = errno;
    // Not a directory: a symlink (to one or not), or something else. The
    // lstat only words the refusal; nothing was opened through it.
    struct stat st;
    if (error == ENOTDIR && ::lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      return Error("socket directory " + dir +
                   " is a symlink; refusing it (name the real directory with --socket-dir, or "
                   "remove the link: weightd serve makes the directory)");
    }
    if (error == ENOTDIR) return Error("socket directory " + dir + " is not a directory");
    return Error("socket directory " + dir + ": " + std::strerror(error));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return Error("socket directory " + dir + ": " + std::strerror(errno));
  }
  if (st.st_uid != ::geteuid()) {
    return Error("socket directory " + dir + " is owned by uid " + std::to_string(st.st_uid) +
                 ", not by this user (uid " + std::to_string(::geteuid()) +
                 "); use a directory of your own (--socket-dir, $WEIGHTD_SOCKET_DIR), or have "
                 "its owner remove it");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
    return Error("socket directory " + dir + " has mode " + mode + "; it must be 0700 (chmod 700 " +
                 dir + ")");
  }
  return fd;
}

Status CheckSocketDirectory(const std::string& dir) {
  WEIGHTD_ASSIGN_OR_RETURN(memory::UniqueFd opened, OpenSocketDirectory(dir));
  return OkStatus();
}

Result<std::string> PathThrough(int dir_fd, const std::string& name, const std::string& fallback) {
  const std::string through = "/proc/self/fd/" + std::to_string(dir_fd);
  struct stat via, opened;
  if (::stat(through.c_str(), &via) != 0) {
    if (errno == ENOENT) return fallback;  // no /proc here
    return Error(through + ": " + std::strerror(errno));
  }
  if (::fstat(dir_fd, &opened) != 0) return Error(std::string("fstat: ") + std::strerror(errno));
  // A /proc that is not this process's would lead elsewhere: refused, not
  // the path taken after all.
  if (via.st_dev != opened.st_dev || via.st_ino != opened.st_ino) {
    return Error(through + " does not lead to the directory opened (is /proc this process's?)");
  }
  return through + "/" + name;
}

nlohmann::json PathToJson(const std::string& path) {
  try {
    (void)nlohmann::json(path).dump();  // throws on bytes that are not UTF-8
    return path;
  } catch (const nlohmann::json::type_error&) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    for (unsigned char c : path) {
      hex += kHex[c >> 4];
      hex += kHex[c & 0xf];
    }
    return {{"hex", hex}};
  }
}

Result<std::string> PathFromJson(const nlohmann::json& j) {
  if (j.is_string()) {
    // No path on disk holds a NUL: one that does would open what comes before it.
    if (j.get_ref<const std::string&>().find('\0') != std::string::npos) {
      return Error("a path holds a NUL byte");
    }
    return j.get<std::string>();
  }
  auto it = j.is_object() ? j.find("hex") : j.end();
  if (it == j.end() || !it->is_string() || it->get_ref<const std::string&>().size() % 2 != 0) {
    return Error("a path is a string or {\"hex\": \"...\"}");
  }
  const std::string& hex = it->get_ref<const std::string&>();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string path;
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return Error("a path's hex is not lowercase hex digits");
    // No path on disk holds a NUL: the file opened would be the part before it.
    if (hi == 0 && lo == 0) return Error("a path's hex holds a NUL byte");
    path += static_cast<char>(hi << 4 | lo);
  }
  return path;
}

}  // namespace weightd::protocol
