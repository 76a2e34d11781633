#include "format/writer.h"

#include <fcntl.h>
#include <simdjson.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>

#include "format/rules.h"
#include "io/file.h"

namespace weightd::format {
namespace {

constexpr size_t kWriteBufferBytes = 4 << 20;

std::string ErrnoText() { return std::strerror(errno); }

// The longest name a Linux file system takes for one file (NAME_MAX).
constexpr size_t kMaxNameBytes = 255;

// Closes the descriptor; the temporary file is removed unless Commit() ran.
class TempFile {
 public:
  explicit TempFile(std::string final_path) : final_path_(std::move(final_path)) {
    static std::atomic<uint64_t> counter{0};
    const std::string suffix =
        ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
    // Beside the file, under its name cut short where the suffix would make
    // a name longer than a folder takes: any name FILE may have works.
    const size_t slash = final_path_.rfind('/');
    const size_t name_at = slash == std::string::npos ? 0 : slash + 1;
    size_t keep = std::min(final_path_.size() - name_at, kMaxNameBytes - suffix.size());
    // Never inside a UTF-8 character: some file systems take only whole ones.
    while (keep > 0 && keep < final_path_.size() - name_at &&
           (static_cast<unsigned char>(final_path_[name_at + keep]) & 0xC0) == 0x80) {
      --keep;
    }
    temp_path_ = final_path_.substr(0, name_at + keep) + suffix;
    // Removed unless committed, and first by a process a signal ends (the
    // CLI's), with no moment between its making and its listing. Not made,
    // it is not listed: whatever has the name (another process's file,
    // where two containers share a volume and a pid) is not ours to remove.
    unfinished_ = io::UnfinishedPath::Make(temp_path_, [&] {
      fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      return fd_ >= 0;
    });
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  int fd() const { return fd_; }
  const std::string& final_path() const { return final_path_; }

  // Makes the file durable, then visible under its name: after a crash the
  // name holds the whole file or nothing. With `replace` false, a file
  // already under the name is an error, in the same step.
  Status Commit(bool replace) {
    if (::fsync(fd_) != 0) return Error(final_path_ + ": fsync failed: " + ErrnoText());
    if (::close(fd_) != 0) {
      fd_ = -1;
      return Error(final_path_ + ": write failed: " + ErrnoText());
    }
    fd_ = -1;
    if (replace) {
      if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) {
        return Error(final_path_ + ": cannot rename into place: " + ErrnoText());
      }
    } else if (Status s = MoveUnlessTaken(); !s.ok()) {
      return s;
    }
    unfinished_->Keep();
    return OkStatus();
  }

 private:
  // rename(2) that fails where the name is taken. A file system without
  // RENAME_NOREPLACE (NFS, 9p, FUSE; a seccomp filter may refuse the call)
  // gets a hard link and an unlink, which fail the same way; one without
  // hard links either, a check and a rename (the one case not atomic).
  Status MoveUnlessTaken() {
    const auto taken = [&] {
      return Error(final_path_ + " exists; left as it is (nothing was written over it)");
    };
    const auto unsupported = [](int e) {
      return e == EINVAL || e == ENOSYS || e == EPERM || e == EOPNOTSUPP;
    };
    if (::renameat2(AT_FDCWD, temp_path_.c_str(), AT_FDCWD, final_path_.c_str(),
                    RENAME_NOREPLACE) == 0) {
      return OkStatus();
    }
    if (errno == EEXIST) return taken();
    if (!unsupported(errno)) {
      return Error(final_path_ + ": cannot rename into place: " + ErrnoText());
    }
    if (::link(temp_path_.c_str(), final_path_.c_str()) == 0 ||
        (errno == EEXIST && SameFile(temp_path_, final_path_))) {  // NFS: a link retried
      if (::unlink(temp_path_.c_str()) != 0) {
        return Error(final_path_ + " is saved, but its temporary name " + temp_path_ +
                     " could not be removed: " + ErrnoText());
      }
      return OkStatus();
    }
    if (errno == EEXIST) return taken();
    if (!unsupported(errno)) {
      return Error(final_path_ + ": cannot move into place: " + ErrnoText());
    }
    struct stat st;
    if (::lstat(final_path_.c_str(), &st) == 0) return taken();
    if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) {
      return Error(final_path_ + ": cannot rename into place: " + ErrnoText());
    }
    return OkStatus();
  }

  static bool SameFile(const std::string& a, const std::string& b) {
    struct stat sa, sb;
    return ::lstat(a.c_str(), &sa) == 0 && ::lstat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
  }

  std::string final_path_;
  std::string temp_path_;
  int fd_ = -1;
  std::unique_ptr<io::UnfinishedPath> unfinished_;
};

Status WriteAllAt(int fd, const std::byte* data, size_t len, uint64_t offset,
                  const std::string& path) {
  while (len > 0) {
    ssize_t n = ::pwrite(fd, data, len, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Error(path + ": write failed: " + ErrnoText());
    }
    data += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return OkStatus();
}

std::string ShapeJson(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string JsonQuote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      static const char* kHex = "0123456789abcdef";
      out += "\\u00";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

Result<ShardLayout> LayoutShard(std::vector<TensorSpec> tensors,
                                const std::vector<std::pair<std::string, std::string>>& metadata) {
  // The reference writer's order: descending dtype, then name.
  std::sort(tensors.begin(), tensors.end(), [](const TensorSpec& a, const TensorSpec& b) {
    if (a.dtype != b.dtype) return a.dtype > b.dtype;
    return a.name < b.name;
  });

  ShardLayout layout;
  std::string json = "{";
  if (!metadata.empty()) {
    auto sorted = metadata;
    std::sort(sorted.begin(), sorted.end());
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (i > 0 && sorted[i].first == sorted[i - 1].first) {
        return Error("metadata key `" + sorted[i].first +
                     "`: " + std::string(rules::kDuplicateName));
      }
      json += (i ? "," : "") + JsonQuote(sorted[i].first) + ":" + JsonQuote(sorted[i].second);
    }
    json += "}";
  }

  std::vector<std::string_view> names;
  uint64_t offset = 0;
  layout.specs = std::make_shared<const std::vector<TensorSpec>>(std::move(tensors));
  for (const TensorSpec& spec : *layout.specs) {
    if (spec.name == "__metadata__" ||
        !simdjson::validate_utf8(spec.name.data(), spec.name.size())) {
      return Error("tensor `" + spec.name + "`: not a valid tensor name");
    }
    TensorInfo info;
    info.name = spec.name;
    info.dtype = spec.dtype;
    info.shape = spec.shape;
    info.elements = 1;
    for (uint64_t d : spec.shape) {
      if (__builtin_mul_overflow(info.elements, d, &info.elements)) {
        return Error("tensor `" + spec.name + "`: " + std::string(rules::kElementCountOverflow));
      }
    }
    uint64_t bits;
    if (__builtin_mul_overflow(info.elements, uint64_t{DTypeBits(spec.dtype)}, &bits)) {
      return Error("tensor `" + spec.name + "`: " + std::string(rules::kByteCountOverflow));
    }
    if (bits % 8 != 0) {
      return Error("tensor `" + spec.name + "`: " + std::string(rules::kSubByteBoundary));
    }
    info.begin = offset;
    if (__builtin_add_overflow(offset, bits / 8, &info.end)) {
      return Error("tensor `" + spec.name + "`: " + std::string(rules::kByteCountOverflow));
    }
    offset = info.end;
    if (json.size() > 1) json += ",";
    json += JsonQuote(spec.name) + ":{\"dtype\":\"" + std::string(DTypeName(spec.dtype)) +
            "\",\"shape\":" + ShapeJson(spec.shape) + ",\"data_offsets\":[" +
            std::to_string(info.begin) + "," + std::to_string(info.end) + "]}";
    layout.tensors.push_back(info);
    names.push_back(spec.name);
  }
  std::sort(names.begin(), names.end());
  if (auto dup = std::adjacent_find(names.begin(), names.end()); dup != names.end()) {
    return Error("tensor `" + std::string(*dup) + "`: " + std::string(rules::kDuplicateName));
  }
  json += "}";
  // Pad with spaces (JSON whitespace) so the data region starts 8-aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kMaxHeaderBytes) return Error(std::string(rules::kHeaderTooLarge));
  layout.header_json = std::move(json);
  layout.data_bytes = offset;
  return layout;
}

Status WriteShard(const std::string& path, const ShardLayout& layout, const TensorFiller& fill,
                  const WriteOptions& options) {
  TempFile out(path);
  if (out.fd() < 0) return Error(path + ": cannot create: " + ErrnoText());

  std::string head(kHeaderLengthBytes, '\0');
  uint64_t n = layout.header_json.size();
  for (size_t i = 0; i < kHeaderLengthBytes; ++i)
    head[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  head += layout.header_json;
  WEIGHTD_RETURN_IF_ERROR(
      WriteAllAt(out.fd(), reinterpret_cast<const std::byte*>(head.data()), head.size(), 0, path));

  const uint64_t base = layout.data_offset();
  if (options.sparse_prefix) {
    if (::ftruncate(out.fd(), static_cast<off_t>(layout.file_size())) != 0) {
      return Error(path + ": cannot size the file: " + ErrnoText());
    }
    std::vector<std::byte> buf;
    for (const TensorInfo& t : layout.tensors) {
      const uint64_t len = std::min(*options.sparse_prefix, t.bytes());
      buf.assign(static_cast<size_t>(len), std::byte{0});
      fill(t, 0, buf);
      WEIGHTD_RETURN_IF_ERROR(WriteAllAt(out.fd(), buf.data(), buf.size(), base + t.begin, path));
    }
    return out.Commit(options.replace);
  }

  // Tensors are contiguous in data order, so the data region is one stream;
  // small tensors share a buffer and a write.
  std::unique_ptr<std::byte[]> buf(new std::byte[kWriteBufferBytes]);
  size_t used = 0;
  uint64_t written = 0;
  for (const TensorInfo& t : layout.tensors) {
    for (uint64_t done = 0; done < t.bytes();) {
      const size_t len =
          static_cast<size_t>(std::min<uint64_t>(kWriteBufferBytes - used, t.bytes() - done));
      fill(t, done, std::span(buf.get() + used, len));
      used += len;
      done += len;
      if (used == kWriteBufferBytes) {
        WEIGHTD_RETURN_IF_ERROR(WriteAllAt(out.fd(), buf.get(), used, base + written, path));
        written += used;
        used = 0;
      }
    }
  }
  WEIGHTD_RETURN_IF_ERROR(WriteAllAt(out.fd(), buf.get(), used, base + written, path));
  return out.Commit(options.replace);
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                        const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::vector<TensorSpec> specs;
  for (const TensorData& t : tensors) specs.push_back(t.spec);
  WEIGHTD_ASSIGN_OR_RETURN(ShardLayout layout, LayoutShard(std::move(specs), metadata));
  // LayoutShard reorders; find each tensor's bytes by name.
  std::vector<const TensorData*> by_name;
  for (const TensorData& t : tensors) by_name.push_back(&t);
  std::sort(by_name.begin(), by_name.end(),
            [](const TensorData* a, const TensorData* b) { return a->spec.name < b->spec.name; });
  for (const TensorInfo& info : layout.tensors) {
    auto it =
        std::lower_bound(by_name.begin(), by_name.end(), info.name,
                         [](const TensorData* t, std::string_view n) { return t->spec.name < n; });
    if ((*it)->bytes.size() != info.bytes()) {
      return Error("tensor `" + std::string(info.name) + "`: " + std::string(rules::kSizeMismatch) +
                   " (" + std::to_string((*it)->bytes.size()) + " bytes given, " +
                   std::to_string(info.bytes()) + " expected)");
    }
  }
  return WriteShard(path, layout,
                    [&](const TensorInfo& t, uint64_t offset, std::span<std::byte> dst) {
                      auto it = std::lower_bound(
                          by_name.begin(), by_name.end(), t.name,
                          [](const TensorData* d, std::string_view n) { return d->spec.name < n; });
                      std::memcpy(dst.data(), (*it)->bytes.data() + offset, dst.size());
                    });
}

}  // namespace weightd::format
