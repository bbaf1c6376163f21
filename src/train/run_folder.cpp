#include "train/run_folder.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mhla {

namespace fs = std::filesystem;

std::string create_run_folder(const Config& config) {
  fs::create_directories(config.run.root);
  fs::path dir;
  if (!config.run.name.empty()) {
    dir = fs::path(config.run.root) / config.run.name;
    if (fs::exists(dir)) {
      if (fs::exists(dir / "checkpoints" / "last")) {
        fail("{}: run folder {} exists already; continue it with `mhla train --resume {}` or "
             "choose another run.name", config.where("run.name"), dir.string(), dir.string());
      }
      // Not reused even so: it may be a run still in its first epoch.
      fail("{}: run folder {} exists already but holds no checkpoint to resume (a start that "
           "failed or was stopped before its first save, or a run still in its first epoch); "
           "remove it or choose another run.name", config.where("run.name"), dir.string());
    }
  } else {
    const std::string stem =
        config.source_file.empty() ? "default" : fs::path(config.source_file).stem().string();
    dir = fs::path(config.run.root) / stem;
    for (int i = 2; fs::exists(dir); ++i) {
      dir = fs::path(config.run.root) / (stem + "-" + std::to_string(i));
    }
  }
  fs::create_directories(dir / "checkpoints");
  write_file_atomic((dir / "config.yaml").string(), dump_config(config));
  return dir.string();
}

MetricsLog::MetricsLog(const std::string& run_dir) : path_(run_dir + "/metrics.jsonl") {}

void MetricsLog::write(const nlohmann::json& record) {
  std::ofstream out(path_, std::ios::app);
  if (!out) fail("{}: cannot append", path_);
  out << record.dump() << "\n";
  out.flush();
}

void MetricsLog::truncate_after(int64_t step) {
  if (!fs::exists(path_)) return;
  std::istringstream in(read_file(path_));
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      auto record = nlohmann::json::parse(line);
      if (record.value("step", int64_t{0}) > step) continue;
    } catch (const nlohmann::json::exception&) {
      continue;  // a line cut by a crash
    }
    kept += line + "\n";
  }
  write_file_atomic(path_, kept);
}

}  // namespace mhla
