#include "memory/host_memory.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

namespace weightd::memory {
namespace {

// A limit this high is no limit: cgroup v1 writes "unlimited" as the
// largest page-aligned 63-bit number.
constexpr uint64_t kNoLimit = uint64_t{1} << 62;
// More CPUs than any quota could mean.
constexpr uint64_t kMaxCpus = 1 << 20;

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  return text.str();
}

// A whole decimal number above 0 and below kNoLimit; nullopt for "max",
// garbage, 0 or anything that means no limit.
std::optional<uint64_t> ParseLimit(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v == 0 || v >= kNoLimit) {
    return std::nullopt;
  }
  return v;
}

std::vector<std::string> Split(std::string_view text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(sep, start);
    parts.emplace_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string Unescape(std::string_view field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size()) {
      const std::string_view oct = field.substr(i + 1, 3);
      if (oct.find_first_not_of("01234567") == std::string_view::npos) {
        out.push_back(static_cast<char>((oct[0] - '0') * 64 + (oct[1] - '0') * 8 + (oct[2] - '0')));
        i += 3;
        continue;
      }
    }
    out.push_back(field[i]);
  }
  return out;
}

struct CgroupMount {
  std::string root;   // the group mounted there, as /proc/self/cgroup names groups
  std::string point;  // where it is mounted
  bool v2 = false;
};

// Whether `path` has a ".." component: how the kernel shows a group outside
// the reader's cgroup namespace, which no mount here shows.
bool LeavesItsRoot(std::string_view path) {
  for (const std::string& part : Split(path, '/')) {
    if (part == "..") return true;
  }
  return false;
}

// `inner` is `outer` or lies below it.
bool AtOrBelow(const std::string& inner, const std::string& outer) {
  return outer == "/" || inner == outer ||
         (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
          inner[outer.size()] == '/');
}

// The control group mounts that show `controller` (cgroup v2's, and v1's
// that has it) and are not covered by a later mount at the same place or
// above it.
std::vector<CgroupMount> ControllerMounts(std::string_view mountinfo, std::string_view controller) {
  std::vector<CgroupMount> mounts;
  std::vector<std::string> points;  // of every mount, in order
  std::vector<size_t> at;           // each such mount's place in `points`
  for (const std::string& line : Split(mountinfo, '\n')) {
    // id parent major:minor root point options [optional...] - type source super-options
    const std::vector<std::string> f = Split(line, ' ');
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 3 >= f.size()) continue;
    points.push_back(Unescape(f[4]));
    const std::string& type = f[dash + 1];
    const std::vector<std::string> super = Split(f[dash + 3], ',');
    const bool has_v1 =
        type == "cgroup" && std::find(super.begin(), super.end(), controller) != super.end();
    if (type != "cgroup2" && !has_v1) continue;
    const std::string root = Unescape(f[3]);
    if (LeavesItsRoot(root)) continue;
    mounts.push_back({root, points.back(), type == "cgroup2"});
    at.push_back(points.size() - 1);
  }
  std::vector<CgroupMount> visible;
  for (size_t i = 0; i < mounts.size(); ++i) {
    bool covered = false;
    for (size_t j = at[i] + 1; j < points.size() && !covered; ++j) {
      covered = AtOrBelow(mounts[i].point, points[j]);
    }
    if (!covered) visible.push_back(std::move(mounts[i]));
  }
  return visible;
}

// `path` relative to `root`, or nullopt when it lies outside it.
std::optional<std::string> Below(const std::string& path, const std::string& root) {
  if (LeavesItsRoot(path) || !AtOrBelow(path, root)) return std::nullopt;
  if (root == "/") return path == "/" ? "" : path;
  return path.substr(root.size());
}

// A "Key:   N kB" line of /proc/meminfo, in bytes.
std::optional<uint64_t> MeminfoKib(std::string_view meminfo, std::string_view key) {
  for (const std::string& line : Split(meminfo, '\n')) {
    if (line.compare(0, key.size(), key) != 0) continue;
    size_t at = key.size();
    while (at < line.size() && line[at] == ' ') ++at;
    uint64_t kib = 0;
    const auto [end, ec] = std::from_chars(line.data() + at, line.data() + line.size(), kib);
    if (ec != std::errc() || std::string_view(end, line.data() + line.size()) != " kB" ||
        kib > UINT64_MAX / 1024) {
      return std::nullopt;
    }
    return kib * 1024;
  }
  return std::nullopt;
}

}  // namespace

namespace {

// Calls visit(dir, v2, own) for this process's group of `controller` in
// every hierarchy the mounts show (at `prefix` + the mount point), then for
// each of its ancestors up to the mount's root (`own` false).
void ForEachGroup(std::string_view controller, std::string_view proc_self_cgroup,
                  std::string_view proc_self_mountinfo, const std::string& prefix,
                  const std::function<void(const std::string&, bool, bool)>& visit) {
  // This process's group in the v2 hierarchy and in v1's of the controller.
  std::optional<std::string> v2_group, v1_group;
  for (const std::string& line : Split(proc_self_cgroup, '\n')) {
    // hierarchy-ID:controller-list:path (the path may hold ':')
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string path = line.substr(second + 1);
    if (path.empty() || path[0] != '/') continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    if (line.compare(0, first, "0") == 0 && controllers.empty()) {
      v2_group = path;
    } else {
      const std::vector<std::string> list = Split(controllers, ',');
      if (std::find(list.begin(), list.end(), controller) != list.end()) v1_group = path;
    }
  }
  for (const CgroupMount& m : ControllerMounts(proc_self_mountinfo, controller)) {
    const std::optional<std::string>& group = m.v2 ? v2_group : v1_group;
    if (!group) continue;
    std::optional<std::string> rel = Below(*group, m.root);
    if (!rel) continue;  // this process's group is not under what is mounted there
    const std::string base = prefix + (m.point == "/" ? "" : m.point);
    for (bool own = true;; own = false) {
      visit(base + *rel, m.v2, own);
      if (rel->empty()) break;
      rel->resize(rel->rfind('/'));
    }
  }
}

// The value of `key` in a memory.stat text ("key value" lines).
std::optional<uint64_t> StatValue(std::string_view stat, std::string_view key) {
  for (const std::string& line : Split(stat, '\n')) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 &&
        line[key.size()] == ' ') {
      uint64_t v = 0;
      const char* begin = line.data() + key.size() + 1;
      const auto [end, ec] = std::from_chars(begin, line.data() + line.size(), v);
      if (ec == std::errc() && end == line.data() + line.size()) return v;
    }
  }
  return std::nullopt;
}

// The limit on group `dir` and the file that sets it: v2's memory.max;
// v1's memory.limit_in_bytes, or on the process's own group the
// hierarchical_memory_limit in its memory.stat where lower (it counts
// ancestors the mount may not show).
std::optional<std::pair<uint64_t, std::string>> GroupLimit(const std::string& dir, bool v2,
                                                           bool own) {
  std::optional<std::pair<uint64_t, std::string>> lowest;
  auto consider = [&](const std::string& file, std::optional<uint64_t> limit) {
    if (limit && (!lowest || *limit < lowest->first)) lowest = {*limit, file};
  };
  if (v2) {
    consider(dir + "/memory.max", ParseLimit(ReadSmallFile(dir + "/memory.max")));
    return lowest;
  }
  consider(dir + "/memory.limit_in_bytes",
           ParseLimit(ReadSmallFile(dir + "/memory.limit_in_bytes")));
  if (own) {
    const std::string stat = dir + "/memory.stat";
    const std::optional<uint64_t> h = StatValue(ReadSmallFile(stat), "hierarchical_memory_limit");
    if (h) consider(stat, ParseLimit(std::to_string(*h)));
  }
  return lowest;
}

}  // namespace

std::optional<uint64_t> CgroupMemoryLimit(std::string_view proc_self_cgroup,
                                          std::string_view proc_self_mountinfo,
                                          const std::string& prefix, std::string* where) {
  std::optional<uint64_t> lowest;
  ForEachGroup("memory", proc_self_cgroup, proc_self_mountinfo, prefix,
               [&](const std::string& dir, bool v2, bool own) {
                 const auto limit = GroupLimit(dir, v2, own);
                 if (limit && (!lowest || limit->first < *lowest)) {
                   lowest = limit->first;
                   if (where != nullptr) *where = limit->second;
                 }
               });
  return lowest;
}

std::optional<MemoryRoom> CgroupMemoryRoom(std::string_view proc_self_cgroup,
                                           std::string_view proc_self_mountinfo,
                                           const std::string& prefix) {
  std::optional<MemoryRoom> least;
  ForEachGroup("memory", proc_self_cgroup, proc_self_mountinfo, prefix,
               [&](const std::string& dir, bool v2, bool own) {
                 const auto limit = GroupLimit(dir, v2, own);
                 if (!limit) return;
                 // What the group holds (its descendants too), less the files' page
                 // cache, which the kernel reclaims before it kills: on the file
                 // LRU lists, where shared memory (memfds, tmpfs) never is; and on
                 // v2 the kernel's reclaimable caches (dentries, inodes).
                 const std::optional<uint64_t> usage = ParseLimit(
                     ReadSmallFile(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")));
                 const std::string stat = ReadSmallFile(dir + "/memory.stat");
                 const char* active = v2 ? "active_file" : "total_active_file";
                 const char* inactive = v2 ? "inactive_file" : "total_inactive_file";
                 const uint64_t file_cache =
                     StatValue(stat, active).value_or(0) + StatValue(stat, inactive).value_or(0) +
                     (v2 ? StatValue(stat, "slab_reclaimable").value_or(0) : 0);
                 const uint64_t held = usage ? *usage - std::min(*usage, file_cache) : 0;
                 const uint64_t room = limit->first - std::min(limit->first, held);
                 if (!least || room < least->free)
                   least = MemoryRoom{room, limit->first, held, limit->second};
               });
  return least;
}

std::optional<MemoryRoom> HostMemoryRoom() {
  std::optional<MemoryRoom> room = CgroupMemoryRoom(ReadSmallFile("/proc/self/cgroup"),
                                                    ReadSmallFile("/proc/self/mountinfo"), "");
  // The machine's own: what the kernel estimates it can give without
  // swapping (free memory and the reclaimable part of its caches).
  const std::string meminfo = ReadSmallFile("/proc/meminfo");
  const std::optional<uint64_t> available = MeminfoKib(meminfo, "MemAvailable:");
  const std::optional<uint64_t> total = MeminfoKib(meminfo, "MemTotal:");
  if (available && total && (!room || *available < room->free)) {
    room = MemoryRoom{*available, *total, *total - std::min(*total, *available), "MemAvailable"};
  }
  return room;
}

bool HostHasSwap() {
  const std::optional<uint64_t> swap = MeminfoKib(ReadSmallFile("/proc/meminfo"), "SwapTotal:");
  return !swap || *swap > 0;
}

std::optional<int> CgroupCpuLimit(std::string_view proc_self_cgroup,
                                  std::string_view proc_self_mountinfo, const std::string& prefix) {
  std::optional<int> fewest;
  ForEachGroup("cpu", proc_self_cgroup, proc_self_mountinfo, prefix,
               [&](const std::string& dir, bool v2, bool) {
                 // v2: "max PERIOD" or "QUOTA PERIOD"; v1: the quota is -1
                 // where none is set, which is no number here.
                 std::optional<uint64_t> quota, period;
                 if (v2) {
                   const std::vector<std::string> f = Split(ReadSmallFile(dir + "/cpu.max"), ' ');
                   if (f.size() == 2) {
                     quota = ParseLimit(f[0]);
                     period = ParseLimit(f[1]);
                   }
                 } else {
                   quota = ParseLimit(ReadSmallFile(dir + "/cpu.cfs_quota_us"));
                   period = ParseLimit(ReadSmallFile(dir + "/cpu.cfs_period_us"));
                 }
                 if (!quota || !period) return;
                 // A part of a CPU is one more to run on.
                 const uint64_t cpus =
                     std::min<uint64_t>(*quota / *period + (*quota % *period != 0), kMaxCpus);
                 if (!fewest || static_cast<int>(cpus) < *fewest) fewest = static_cast<int>(cpus);
               });
  return fewest;
}

int HostCpus() {
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  if (const std::optional<int> quota = CgroupCpuLimit(ReadSmallFile("/proc/self/cgroup"),
                                                      ReadSmallFile("/proc/self/mountinfo"), "")) {
    cpus = std::min(cpus, *quota);
  }
  return std::max(cpus, 1);
}

MemoryCeiling HostMemoryCeiling() {
  MemoryCeiling ceiling;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    ceiling.bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
    ceiling.source = "RAM";
  }
  std::string where;
  if (auto limit = CgroupMemoryLimit(ReadSmallFile("/proc/self/cgroup"),
                                     ReadSmallFile("/proc/self/mountinfo"), "", &where)) {
    if (ceiling.bytes == 0 || *limit < ceiling.bytes) ceiling = {*limit, where};
  }
  return ceiling;
}

}  // namespace weightd::memory
