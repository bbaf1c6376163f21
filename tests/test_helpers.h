#pragma once
// Shared helpers for the tests: temporary folders, running the mhla binary, comparisons.
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace mhla::test {

// A fresh folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag);
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs the built mhla binary with `args` (a shell-quoted string) in `cwd`.
ProcessResult run_mhla(const std::string& args, const std::string& cwd = ".");
std::string shell_quote(const std::string& s);

// The message of the mhla::Error that f throws ("" if it throws none).
std::string error_of(const std::function<void()>& f);
bool contains(const std::string& text, const std::string& part);

// The "loss" of every record of <run_dir>/metrics.jsonl, in order.
std::vector<double> logged_losses(const std::string& run_dir);

// Two runs' named tensors (model_tensors) compared bit for bit: the names whose tensors differ
// (or are missing from `b`), and the largest absolute difference over the shared names.
struct BitComparison {
  std::vector<std::string> differing;
  double largest_difference = 0;
};
BitComparison compare_bits(const std::map<std::string, torch::Tensor>& a,
                           const std::map<std::string, torch::Tensor>& b);

// cuDNN's deterministic algorithms for a scope: the GPU tests that compare two training runs
// (its weight-gradient algorithms may otherwise sum with atomics).
class DeterministicCudnnScope {
 public:
  DeterministicCudnnScope();
  ~DeterministicCudnnScope();
  DeterministicCudnnScope(const DeterministicCudnnScope&) = delete;
  DeterministicCudnnScope& operator=(const DeterministicCudnnScope&) = delete;

 private:
  bool before_;
};

// ||a - b|| / ||b||, in float64.
double relative_error(const torch::Tensor& a, const torch::Tensor& b);

std::string source_dir();
// Where the Fashion-MNIST files are (data/fashion-mnist in the source tree, else Debian's).
std::string fashion_mnist_root();
void write_text(const std::filesystem::path& path, const std::string& text);

// Sets an environment variable for a scope and restores it after (for the kernel switches that
// are read on every call).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    set(value);
  }
  ~ScopedEnv() {
    if (previous_) {
      setenv(name_, previous_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  void set(const char* value) { setenv(name_, value, 1); }

 private:
  const char* name_;
  std::optional<std::string> previous_;
};

}  // namespace mhla::test
