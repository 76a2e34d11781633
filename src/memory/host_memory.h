// What of the host this process may use. Memory: the machine's RAM, or
// less where a control group caps it (a container's memory limit, cgroup v1
// or v2); a budget above that ceiling would leave the kernel's OOM killer,
// not the budget, to decide what goes when the segments fill it. CPUs: its
// affinity mask, or fewer where a control group's quota allows fewer (a
// container's --cpus, a Kubernetes pod's CPU limit).
//
// Thread safety: free functions, no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace weightd::memory {

struct MemoryCeiling {
  uint64_t bytes = 0;  // 0: not known
  std::string source;  // "RAM", or the control group file whose limit it is
};

// The lower of RAM and this process's control group limit.
MemoryCeiling HostMemoryCeiling();

// The lowest memory limit this process's control groups are under, as far
// as the mounted control group file systems show them: `proc_self_cgroup`
// and `proc_self_mountinfo` are the texts of /proc/self/cgroup and
// /proc/self/mountinfo; files are read at `prefix` + the mount point (an
// empty prefix on a real system). A group's path is taken relative to its
// mount's root (a container often has its own group mounted as the root),
// and the group and its ancestors up to that root are read: cgroup v2's
// memory.max, v1's memory.limit_in_bytes and the hierarchical_memory_limit
// in its memory.stat (which also counts ancestors the mount does not show).
// nullopt where no limit is set; `where` gets the file that set the one
// returned.
std::optional<uint64_t> CgroupMemoryLimit(std::string_view proc_self_cgroup,
                                          std::string_view proc_self_mountinfo,
                                          const std::string& prefix, std::string* where);

// How much more memory the kernel would give before it refuses or kills:
// the least of the machine's MemAvailable and, for each control group
// limit this process is under, that limit less what the group holds
// beyond the files' page cache (which is reclaimed first). Shared memory
// an engine still maps after the daemon that made it has gone is in what
// the group holds, and in no budget.
struct MemoryRoom {
  uint64_t free = 0;
  uint64_t limit = 0;
  uint64_t held = 0;   // what counts against `limit` and cannot be reclaimed
  std::string source;  // "MemAvailable", or the control group file that sets `limit`
};
std::optional<MemoryRoom> HostMemoryRoom();

// The control group part of HostMemoryRoom, read as CgroupMemoryLimit
// reads (v2: memory.current and memory.stat's active_file and
// inactive_file; v1: memory.usage_in_bytes and total_active_file,
// total_inactive_file): the group with the least room; nullopt where no
// limit is set.
std::optional<MemoryRoom> CgroupMemoryRoom(std::string_view proc_self_cgroup,
                                           std::string_view proc_self_mountinfo,
                                           const std::string& prefix);

// Whether the machine has swap space on (/proc/meminfo's SwapTotal above
// 0); true where that cannot be read.
bool HostHasSwap();

// How many CPUs this process can keep busy, at least 1: its affinity mask,
// or its control groups' lowest CPU quota where that allows fewer. Read
// afresh on each call (a pod's limit can change while the daemon runs).
int HostCpus();

// The lowest CPU quota this process's control groups are under, in CPUs
// rounded up (1.5 CPUs of time: 2 to run on), read as CgroupMemoryLimit
// reads: cgroup v2's cpu.max ("QUOTA PERIOD", or "max PERIOD" for none),
// v1's cpu.cfs_quota_us (-1 for none) over cpu.cfs_period_us. nullopt
// where no quota is set.
std::optional<int> CgroupCpuLimit(std::string_view proc_self_cgroup,
                                  std::string_view proc_self_mountinfo, const std::string& prefix);

}  // namespace weightd::memory
