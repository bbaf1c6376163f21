#pragma once
// Run folders: runs/<name>/{config.yaml, log.txt, metrics.jsonl, checkpoints/}.
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace mhla {

// Picks the folder (run.name, or the config file's stem made unique with -2, -3, ...), creates
// it and writes config.yaml. An explicit run.name that already exists is an error: resume it.
std::string create_run_folder(const Config& config);

// Appends one JSON object per line to metrics.jsonl, flushed line by line.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& run_dir);
  void write(const nlohmann::json& record);
  // Drops records of steps after `step` (on resume, so the file matches an unbroken run).
  void truncate_after(int64_t step);

 private:
  std::string path_;
};

}  // namespace mhla
