#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "store_error.h"

namespace agentkv {
namespace {

FileIdentity identity_of(const struct stat& st) {
#if defined(__APPLE__)
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtimespec.tv_sec) * 1000000000 + st.st_mtimespec.tv_nsec;
#else
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
#endif
  return FileIdentity{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                      static_cast<uint64_t>(st.st_size), mtime_ns};
}

}  // namespace

FileIdentity MappedFile::identify(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    throw StoreError(path, std::string("cannot stat: ") + std::strerror(errno));
  }
  return identity_of(st);
}

MappedFile MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw StoreError(path, std::string("cannot open: ") + std::strerror(errno));
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw StoreError(path, std::string("cannot stat: ") + std::strerror(err));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    throw StoreError(path, "file is empty");
  }
  int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
  // Map every page-cache page now, in one kernel call, instead of one fault per page.
  flags |= MAP_POPULATE;
#endif
  void* data = ::mmap(nullptr, size, PROT_READ, flags, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    throw StoreError(path, std::string("cannot mmap: ") + std::strerror(err));
  }
#ifndef MAP_POPULATE
  ::madvise(data, size, MADV_WILLNEED);
#endif
  return MappedFile(path, static_cast<const uint8_t*>(data), size, identity_of(st));
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      identity_(other.identity_) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_) {
      ::munmap(const_cast<uint8_t*>(data_), size_);
    }
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    identity_ = other.identity_;
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) {
    ::munmap(const_cast<uint8_t*>(data_), size_);
  }
}

}  // namespace agentkv
