// libFuzzer target: a checkpoint directory as anyone who may write one
// could lay it out, made of real files, directories and symlinks, and
// listed as a preload lists it (format::ListShards). Whatever the layout
// and whatever its index names, a shard listed must resolve inside the
// checkpoint's directory, or inside the blobs of the model-hub cache that
// directory is a snapshot of: never to the file beside it (`outside`), nor
// anywhere else. Checked with realpath(3), not with the code under test.
//
// The input is lines: `f NAME` a file, `d NAME` a directory, `l NAME<TAB>
// TARGET` a symlink (any target), and `i` whose following lines are all
// the index's text. Names stay inside the checkpoint directory (leading
// slashes dropped, anything with a `..` component skipped), and nothing is
// made through a symlink the input made before (a parent that is one
// skips the entry; files are created exclusively, never followed); the
// targets and the index's names are not confined.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>

#include "format/checkpoint.h"
#include "io/file.h"

namespace {

namespace fs = std::filesystem;

struct Scratch {
  std::string root;
  std::string checkpoint;  // a snapshot, in a model-hub cache's layout
  std::string real_blobs;  // where that cache keeps the files
};

std::string Real(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) __builtin_trap();
  return buf;
}

const Scratch& Dirs() {
  static const Scratch* scratch = [] {
    auto* s = new Scratch;
    // Named for the process, which the test removes however it ends.
    std::string name = "/tmp/weightd-paths-fuzz-" + std::to_string(::getpid()) + "-XXXXXX";
    if (::mkdtemp(name.data()) == nullptr) __builtin_trap();
    s->root = name;
    const std::string hub = s->root + "/hub/models--m";
    fs::create_directories(hub + "/blobs");
    fs::create_directories(hub + "/snapshots");
    fs::create_directories(s->root + "/outside");
    std::ofstream(hub + "/blobs/b1") << "blob";
    std::ofstream(s->root + "/outside/secret.safetensors") << "secret";
    s->checkpoint = hub + "/snapshots/rev";
    s->real_blobs = Real(hub + "/blobs");
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(Dirs().root, ignored);
    });
    return s;
  }();
  return *scratch;
}

bool Inside(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         path[dir.size()] == '/';
}

// `name` made relative and kept inside, or empty to skip it.
std::string Confined(std::string_view name) {
  while (!name.empty() && name.front() == '/') name.remove_prefix(1);
  if (name.empty() || name.find('\0') != std::string_view::npos) return {};
  for (size_t at = 0; at <= name.size();) {
    size_t end = name.find('/', at);
    if (end == std::string_view::npos) end = name.size();
    if (name.substr(at, end - at) == "..") return {};
    at = end + 1;
  }
  return std::string(name);
}

// Makes the directories that `inside`'s parents name below `base`, none
// through a symlink; false (skip the entry) where a parent is a symlink
// or no directory.
bool MakeParents(const std::string& base, const std::string& inside) {
  std::string at = base;
  for (size_t from = 0, slash; (slash = inside.find('/', from)) != std::string::npos;
       from = slash + 1) {
    at += "/" + inside.substr(from, slash - from);
    struct stat st;
    if (::lstat(at.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) return false;  // a symlink is S_ISLNK here
    } else if (::mkdir(at.c_str(), 0755) != 0) {
      return false;
    }
  }
  return true;
}

// A new file holding `text`; nothing where the name is taken (a symlink
// included: O_EXCL never follows one).
void MakeFile(const std::string& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return;
  (void)!::write(fd, text.data(), text.size());
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Scratch& s = Dirs();
  std::error_code ec;
  fs::remove_all(s.checkpoint, ec);
  if (!fs::create_directory(s.checkpoint, ec)) __builtin_trap();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  for (size_t at = 0; at < input.size();) {
    size_t end = input.find('\n', at);
    if (end == std::string_view::npos) end = input.size();
    const std::string_view line = input.substr(at, end - at);
    at = end + 1;
    if (line.size() < 1) continue;
    const char kind = line[0];
    const std::string_view rest = line.substr(line.size() > 1 ? 2 : 1);
    if (kind == 'i') {  // the index: everything after this line
      MakeFile(s.checkpoint + "/model.safetensors.index.json",
               input.substr(std::min(at, input.size())));
      break;
    }
    std::string_view name = rest, target;
    if (kind == 'l') {
      const size_t tab = rest.find('\t');
      if (tab == std::string_view::npos) continue;
      name = rest.substr(0, tab);
      target = rest.substr(tab + 1);
      if (target.empty() || target.find('\0') != std::string_view::npos) continue;
    }
    const std::string inside = Confined(name);
    if (inside.empty()) continue;
    if (!MakeParents(s.checkpoint, inside)) continue;
    const std::string path = s.checkpoint + "/" + inside;
    if (kind == 'f') {
      MakeFile(path, "x");
    } else if (kind == 'd') {
      ::mkdir(path.c_str(), 0755);
    } else if (kind == 'l') {
      (void)::symlink(std::string(target).c_str(), path.c_str());
    }
  }

  // The harness made nothing outside the checkpoint through the input's
  // symlinks: the directories beside it hold what they were made with.
  for (const std::string& dir : {s.root + "/outside", s.real_blobs}) {
    size_t entries = 0;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      ++entries;
    }
    if (ec || entries != 1) __builtin_trap();
  }

  auto listing = weightd::format::ListShards(weightd::io::PosixFileSystem(), s.checkpoint);
  if (!listing.ok()) return 0;
  const std::string real_checkpoint = Real(s.checkpoint);
  // What a load opens (`resolved`), and what the path leads to now.
  for (const weightd::format::ShardRef& shard : listing->shards) {
    if (!Inside(shard.resolved, real_checkpoint) && !Inside(shard.resolved, s.real_blobs)) {
      __builtin_trap();
    }
    char buf[PATH_MAX];
    if (::realpath(shard.path.c_str(), buf) == nullptr || buf != shard.resolved) __builtin_trap();
  }
  return 0;
}
