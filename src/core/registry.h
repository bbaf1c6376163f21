#pragma once
// A generic name -> entry registry (models, attention types, datasets, optimizers, schedules).
// Registration is explicit (see builtins.cpp): static initializers in a static library can be
// dropped by the linker, and an explicit list is easier to read.
#include <map>
#include <string>
#include <vector>

#include "core/error.h"

namespace mhla {

template <typename Entry>
class Registry {
 public:
  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  void add(const std::string& name, Entry entry) {
    if (entries_.count(name)) fail("{} '{}' is registered twice", kind_, name);
    entries_.emplace(name, std::move(entry));
  }

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }

  const Entry& get(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      fail("unknown {} '{}'; registered: {}", kind_, name, joined_names());
    }
    return it->second;
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, entry] : entries_) out.push_back(name);
    return out;
  }

  std::string joined_names() const {
    std::string out;
    for (const auto& [name, entry] : entries_) out += (out.empty() ? "" : ", ") + name;
    return out;
  }

  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::string& kind() const { return kind_; }

 private:
  std::string kind_;
  std::map<std::string, Entry> entries_;
};

}  // namespace mhla
