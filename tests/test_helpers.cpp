#include "test_helpers.h"

#include <ATen/Context.h>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <fstream>

namespace mhla::test {

namespace fs = std::filesystem;

TempDir::TempDir(const std::string& tag) {
  static std::atomic<int> counter{0};
  path_ = fs::temp_directory_path() /
          ("mhla-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  remove_tree(path_.string());
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  try {
    remove_tree(path_.string());
  } catch (...) {
  }
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

ProcessResult run_mhla(const std::string& args, const std::string& cwd) {
  const std::string command =
      "cd " + shell_quote(cwd) + " && " + shell_quote(MHLA_BINARY) + " " + args + " 2>&1";
  ProcessResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    result.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.detach().to(torch::kCPU, torch::kFloat64);
  auto b64 = b.detach().to(torch::kCPU, torch::kFloat64);
  const double denominator = b64.norm().item<double>();
  const double numerator = (a64 - b64).norm().item<double>();
  return denominator > 0 ? numerator / denominator : numerator;
}

std::string source_dir() {
  return MHLA_SOURCE_DIR;
}

std::vector<double> logged_losses(const std::string& run_dir) {
  std::vector<double> losses;
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) losses.push_back(record["loss"].get<double>());
  }
  return losses;
}

BitComparison compare_bits(const std::map<std::string, torch::Tensor>& a,
                           const std::map<std::string, torch::Tensor>& b) {
  BitComparison result;
  for (const auto& [name, t] : a) {
    const auto other = b.find(name);
    if (other == b.end()) {
      result.differing.push_back(name);
      continue;
    }
    if (!torch::equal(t, other->second)) result.differing.push_back(name);
    result.largest_difference =
        std::max(result.largest_difference, (t - other->second).abs().max().item<double>());
  }
  return result;
}

DeterministicCudnnScope::DeterministicCudnnScope()
    : before_(at::globalContext().deterministicCuDNN()) {
  at::globalContext().setDeterministicCuDNN(true);
}
DeterministicCudnnScope::~DeterministicCudnnScope() {
  at::globalContext().setDeterministicCuDNN(before_);
}

std::string fashion_mnist_root() {
  const auto local = fs::path(MHLA_SOURCE_DIR) / "data" / "fashion-mnist";
  if (fs::exists(local / "train-images-idx3-ubyte.gz")) return local.string();
  return "/usr/share/datasets/fashion-mnist";
}

void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace mhla::test
