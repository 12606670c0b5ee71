#include "mapping_cache.h"

namespace agentkv {

std::shared_ptr<const MappedFile> MappingCache::open(const std::string& path) {
  const FileIdentity identity = MappedFile::identify(path);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(path);
    if (it != index_.end()) {
      if (it->second->second->identity() == identity) {
        lru_.splice(lru_.begin(), lru_, it->second);
        return lru_.front().second;
      }
      bytes_ -= it->second->second->size();
      lru_.erase(it->second);
      index_.erase(it);
    }
  }
  auto mapped = std::make_shared<const MappedFile>(MappedFile::open(path));
  if (mapped->size() > max_bytes_) {
    return mapped;  // used once, not kept
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (index_.find(path) == index_.end()) {
    lru_.emplace_front(path, mapped);
    index_[path] = lru_.begin();
    bytes_ += mapped->size();
    evict_locked();
  }
  return mapped;
}

void MappingCache::forget(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(path);
  if (it != index_.end()) {
    bytes_ -= it->second->second->size();
    lru_.erase(it->second);
    index_.erase(it);
  }
}

void MappingCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  lru_.clear();
  index_.clear();
  bytes_ = 0;
}

void MappingCache::evict_locked() {
  while (bytes_ > max_bytes_ && !lru_.empty()) {
    bytes_ -= lru_.back().second->size();
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

MappingCache& mapping_cache() {
  static MappingCache* cache = new MappingCache(size_t{512} << 20);  // never destroyed
  return *cache;
}

}  // namespace agentkv
