// Read-only memory map of a whole file, pages prefetched from the page cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace agentkv {

// What identifies a file's content for agentkv: segment files are written once
// under a new name and never modified, so the same identity means the same bytes.
struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

class MappedFile {
 public:
  // Throws StoreError naming the path when the file cannot be opened or mapped.
  static MappedFile open(const std::string& path);
  // Throws StoreError when the file cannot be stat'ed.
  static FileIdentity identify(const std::string& path);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const {
    return data_;
  }
  size_t size() const {
    return size_;
  }
  const std::string& path() const {
    return path_;
  }
  const FileIdentity& identity() const {
    return identity_;
  }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size, FileIdentity identity)
      : path_(std::move(path)), data_(data), size_(size), identity_(identity) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  FileIdentity identity_;
};

}  // namespace agentkv
