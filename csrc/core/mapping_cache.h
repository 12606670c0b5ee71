// Process-wide cache of segment mappings, least recently used first out.
//
// Segment files are immutable once written, so a mapping stays valid for as
// long as the file's identity (device, inode, size, mtime) is unchanged; every
// lookup re-checks it with one stat(2). Reloading an agent whose segments are
// still mapped skips mmap, page-table population and munmap, which cost about
// as much as copying the data. Every read is still checksummed.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "mapped_file.h"

namespace agentkv {

class MappingCache {
 public:
  explicit MappingCache(size_t max_bytes) : max_bytes_(max_bytes) {}

  // The mapping of `path`, reused if the file is unchanged; throws StoreError.
  std::shared_ptr<const MappedFile> open(const std::string& path);
  // Drop the mapping of a file that is being deleted, so its space is freed.
  void forget(const std::string& path);
  void clear();
  size_t max_bytes() const {
    return max_bytes_;
  }

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const MappedFile>>;
  void evict_locked();

  const size_t max_bytes_;
  size_t bytes_ = 0;
  std::list<Entry> lru_;  // front: most recently used
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  mutable std::mutex mutex_;
};

MappingCache& mapping_cache();

}  // namespace agentkv
