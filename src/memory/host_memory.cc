#include "memory/host_memory.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace weightd::memory {
namespace {

// A limit this high is no limit: cgroup v1 writes "unlimited" as the
// largest page-aligned 63-bit number.
constexpr uint64_t kNoLimit = uint64_t{1} << 62;

// The first line of a small file, or nullopt when it cannot be read.
std::optional<std::string> FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

// A whole decimal number below kNoLimit; nullopt for "max", garbage or
// anything that means no limit.
std::optional<uint64_t> ParseLimit(const std::string& text) {
  if (text.empty() || text[0] < '0' || text[0] > '9') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v >= kNoLimit) return std::nullopt;
  return v;
}

// `path` ("/a/b") and each of its ancestors, up to "/".
std::vector<std::string> SelfAndAncestors(std::string path) {
  std::vector<std::string> all;
  while (!path.empty() && path.back() == '/') path.pop_back();
  while (true) {
    all.push_back(path.empty() ? "/" : path);
    if (path.empty()) break;
    path.resize(path.rfind('/') == std::string::npos ? 0 : path.rfind('/'));
  }
  return all;
}

}  // namespace

std::optional<uint64_t> CgroupMemoryLimit(std::string_view proc_self_cgroup,
                                          const std::string& cgroup_root, std::string* where) {
  std::optional<uint64_t> lowest;
  auto consider = [&](const std::string& file) {
    auto line = FirstLine(file);
    if (!line) return;
    auto v = ParseLimit(*line);
    if (v && (!lowest || *v < *lowest)) {
      lowest = v;
      if (where != nullptr) *where = file;
    }
  };
  std::istringstream lines{std::string(proc_self_cgroup)};
  for (std::string line; std::getline(lines, line);) {
    // hierarchy-ID:controller-list:path
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string id = line.substr(0, first);
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (path.empty() || path[0] != '/') continue;
    if (id == "0" && controllers.empty()) {  // v2, mounted alone or beside v1
      for (const std::string& dir : SelfAndAncestors(path)) {
        const std::string rel = dir == "/" ? "" : dir;
        consider(cgroup_root + rel + "/memory.max");
        consider(cgroup_root + "/unified" + rel + "/memory.max");
      }
      continue;
    }
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c != "memory") continue;
      for (const std::string& dir : SelfAndAncestors(path)) {
        consider(cgroup_root + "/memory" + (dir == "/" ? "" : dir) + "/memory.limit_in_bytes");
      }
    }
  }
  return lowest;
}

MemoryCeiling HostMemoryCeiling() {
  MemoryCeiling ceiling;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    ceiling.bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
    ceiling.source = "RAM";
  }
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  std::string where;
  if (auto limit = CgroupMemoryLimit(text.str(), "/sys/fs/cgroup", &where)) {
    if (ceiling.bytes == 0 || *limit < ceiling.bytes) ceiling = {*limit, where};
  }
  return ceiling;
}

}  // namespace weightd::memory
