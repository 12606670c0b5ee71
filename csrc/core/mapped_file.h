// Read-only memory map of a whole file, pages prefetched from the page cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace agentkv {

class MappedFile {
 public:
  // Throws StoreError naming the path when the file cannot be opened or mapped.
  static MappedFile open(const std::string& path);

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

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

} // namespace agentkv
