#pragma once
// Ablation sweeps: the cartesian product of config values, one run folder per combination,
// trained one after another. A sweep can be stopped and started again: finished runs are kept,
// an interrupted one resumes from its checkpoint, the rest follow. After every run the summary
// (<run.root>/<name>.sweep.md and .sweep.jsonl: the varied values and each run's last
// evaluation) is rewritten atomically.
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace mhla {

struct SweepAxis {
  std::string key;
  std::vector<std::string> values;
};

// "key=v1,v2,v3" (or "key=a,b;c,d" when values contain commas: ';' then separates them).
SweepAxis parse_sweep_axis(const std::string& text);

struct SweepRun {
  std::vector<std::pair<std::string, std::string>> settings;  // one value per axis
  std::string name;                                           // run folder name
};

// Every combination, the first axis varying slowest; names are "<prefix>-<key>=<value>-..."
// with the keys' last components and file-name-safe values.
std::vector<SweepRun> expand_sweep(const std::vector<SweepAxis>& axes, const std::string& prefix);

// Rows for the summary: the run's settings and the numeric leaves of its last evaluation.
nlohmann::json sweep_row(const SweepRun& run, const std::string& run_dir);
std::string sweep_markdown(const std::vector<SweepAxis>& axes,
                           const std::vector<nlohmann::json>& rows);

}  // namespace mhla
