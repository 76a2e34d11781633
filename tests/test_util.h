// Helpers shared by the tests: temporary directories, whole-file I/O, and
// running the real weightd binary as a separate process.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace weightd::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents when
// the object goes away.
class TempDir {
 public:
  TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<std::byte> ReadFileBytes(const std::string& path);
void WriteFileBytes(const std::string& path, const std::vector<std::byte>& bytes);
void WriteFileText(const std::string& path, const std::string& text);
std::vector<std::byte> Bytes(const std::string& text);

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs the weightd binary under test with `args`, in `cwd` when given.
CommandResult RunWeightd(const std::vector<std::string>& args, const std::string& cwd = "");

std::string ConformanceDir();
std::string SourceDir();

}  // namespace weightd::testing
