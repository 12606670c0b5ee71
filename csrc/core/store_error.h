// The one error type of the native store code: which file, and what is wrong with it.
#pragma once

#include <stdexcept>
#include <string>

namespace agentkv {

class StoreError : public std::runtime_error {
 public:
  StoreError(std::string path, std::string reason)
      : std::runtime_error(path + ": " + reason),
        path_(std::move(path)),
        reason_(std::move(reason)) {}
  const std::string& path() const {
    return path_;
  }
  const std::string& reason() const {
    return reason_;
  }

 private:
  std::string path_;
  std::string reason_;
};

}  // namespace agentkv
