// How much memory this process may take: the machine's RAM, or less where
// a control group caps it (a container's memory limit, cgroup v1 or v2).
// A budget above that ceiling would leave the kernel's OOM killer, not the
// budget, to decide what goes when the segments fill it.
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

// The lowest memory limit set on the control groups that
// `proc_self_cgroup` (the text of /proc/self/cgroup) names, or on any of
// their ancestors, read from the files under `cgroup_root` (normally
// /sys/fs/cgroup): cgroup v2's memory.max, at the root or under unified/,
// and v1's memory/.../memory.limit_in_bytes. A container often sees its
// own group as the root of the mount, under a path named from outside:
// the ancestors are read up to the root for that reason. nullopt where no
// limit is set; `where` gets the file that set the one returned.
std::optional<uint64_t> CgroupMemoryLimit(std::string_view proc_self_cgroup,
                                          const std::string& cgroup_root, std::string* where);

}  // namespace weightd::memory
