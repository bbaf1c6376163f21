#include "train/sweep.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"

namespace mhla {
namespace {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::stringstream in(text);
  while (std::getline(in, part, separator)) parts.push_back(part);
  if (!text.empty() && text.back() == separator) parts.emplace_back();
  return parts;
}

std::string file_safe(const std::string& text) {
  std::string out;
  for (char c : text) {
    const bool safe =
        std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '=';
    out += safe ? c : '_';
  }
  return out;
}

void flatten(const nlohmann::json& value, const std::string& prefix, nlohmann::json& out) {
  if (value.is_object()) {
    for (const auto& [key, item] : value.items())
      flatten(item, prefix.empty() ? key : prefix + "." + key, out);
  } else if (value.is_number()) {
    out[prefix] = value;
  }
}

}  // namespace

SweepAxis parse_sweep_axis(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    fail("--vary {}: expected KEY=V1,V2,... (for example attention.type=softmax,mhla)", text);
  }
  SweepAxis axis{text.substr(0, eq), {}};
  const std::string values = text.substr(eq + 1);
  axis.values = split(values, values.find(';') != std::string::npos ? ';' : ',');
  std::set<std::string> seen;
  for (const auto& v : axis.values) {
    if (v.empty()) fail("--vary {}: an empty value", text);
    if (!seen.insert(v).second) fail("--vary {}: '{}' appears twice", text, v);
  }
  return axis;
}

std::vector<SweepRun> expand_sweep(const std::vector<SweepAxis>& axes, const std::string& prefix) {
  std::set<std::string> keys;
  for (const auto& axis : axes) {
    if (!keys.insert(axis.key).second) fail("--vary {}: the key is varied twice", axis.key);
  }
  std::vector<SweepRun> runs(1);
  for (const auto& axis : axes) {
    std::vector<SweepRun> next;
    for (const auto& run : runs) {
      for (const auto& value : axis.values) {
        SweepRun r = run;
        r.settings.emplace_back(axis.key, value);
        next.push_back(r);
      }
    }
    runs = std::move(next);
  }
  for (auto& run : runs) {
    run.name = prefix;
    for (const auto& [key, value] : run.settings) {
      const auto dot = key.rfind('.');
      run.name += "-" + file_safe(key.substr(dot == std::string::npos ? 0 : dot + 1) + "=" + value);
    }
  }
  return runs;
}

nlohmann::json sweep_row(const SweepRun& run, const std::string& run_dir) {
  nlohmann::json row = {{"run", run.name}, {"run_dir", run_dir}};
  for (const auto& [key, value] : run.settings) row["settings"][key] = value;
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  nlohmann::json last_eval, last_progress;
  for (std::string line; std::getline(metrics, line);) {
    auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) continue;
    if (record.contains("eval"))
      last_eval = record;
    else if (record.contains("loss"))
      last_progress = record;
  }
  if (!last_eval.is_null()) {
    nlohmann::json flat;
    flatten(last_eval["eval"], "", flat);
    row["eval"] = flat;
    row["step"] = last_eval["step"];
    row["train_seconds"] = last_eval.value("train_seconds", 0.0);
  }
  if (!last_progress.is_null()) {
    for (const auto& [key, value] : last_progress.items()) {
      if (key.size() > 11 && key.substr(key.size() - 11) == "_per_second") row["rate"] = value;
    }
  }
  return row;
}

std::string sweep_markdown(const std::vector<SweepAxis>& axes,
                           const std::vector<nlohmann::json>& rows) {
  std::vector<std::string> metrics;  // every eval leaf any row has, in first-seen order
  for (const auto& row : rows) {
    if (!row.contains("eval")) continue;
    for (const auto& [key, value] : row["eval"].items()) {
      if (std::find(metrics.begin(), metrics.end(), key) == metrics.end()) metrics.push_back(key);
    }
  }
  std::string out = "| run |";
  for (const auto& axis : axes) out += " " + axis.key + " |";
  for (const auto& m : metrics) out += " " + m + " |";
  out += " step | train s | rate/s |\n|---|";
  for (size_t i = 0; i < axes.size() + metrics.size() + 3; ++i) out += "---|";
  out += "\n";
  for (const auto& row : rows) {
    out += "| " + row["run"].get<std::string>() + " |";
    for (const auto& axis : axes) out += " " + row["settings"][axis.key].get<std::string>() + " |";
    for (const auto& m : metrics) {
      out += row.contains("eval") && row["eval"].contains(m)
                 ? fmt::format(" {:.6g} |", row["eval"][m].get<double>())
                 : std::string(" — |");
    }
    out += row.contains("step") ? fmt::format(" {} |", row["step"].get<int64_t>())
                                : std::string(" — |");
    out += row.contains("train_seconds")
               ? fmt::format(" {:.0f} |", row["train_seconds"].get<double>())
               : std::string(" — |");
    out += row.contains("rate") ? fmt::format(" {:.0f} |", row["rate"].get<double>())
                                : std::string(" — |");
    out += "\n";
  }
  return out;
}

}  // namespace mhla
