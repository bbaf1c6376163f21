// Kernel switches from the environment: what a run log and a bench line record of them.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "catch_compat.h"
#include "core/environment.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

// Sets a variable for one scope and restores what was there.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedVariable() {
    if (had_) {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace

TEST_CASE("environment: the switches set are recorded, misspelt ones marked", "[core]") {
  const ScopedVariable known("MHLA_WARPGROUP_KEY_TILE", "64");
  const ScopedVariable typo("MHLA_WARPGRUP_KEY_TILE", "64");
  const ScopedVariable path("MHLA_DATA_DIR", "/somewhere");
  const std::string set = environment_switches_set();
  CHECK(set.find("MHLA_WARPGROUP_KEY_TILE=64") != std::string::npos);
  CHECK(set.find("MHLA_WARPGRUP_KEY_TILE=64 (unknown)") != std::string::npos);
  // The known switch is not marked; the data path is not a switch.
  CHECK(set.find("MHLA_WARPGROUP_KEY_TILE=64 (unknown)") == std::string::npos);
  CHECK(set.find("MHLA_DATA_DIR") == std::string::npos);
  const auto warnings = environment_switch_warnings();
  const auto warned = [&](const std::string& part) {
    return std::any_of(warnings.begin(), warnings.end(),
                       [&](const std::string& w) { return test::contains(w, part); });
  };
  CHECK(warned("MHLA_WARPGRUP_KEY_TILE is set but no kernel of this build reads it"));
  CHECK_FALSE(warned("MHLA_WARPGROUP_KEY_TILE"));
}

TEST_CASE("environment: a value its switch does not read is marked and warned about", "[core]") {
  const ScopedVariable odd("MHLA_WARPGROUP_KEY_TILE", "46");
  const ScopedVariable form("MHLA_RESIDENT_BACKWARD", "scores");
  const std::string set = environment_switches_set();
  CHECK(test::contains(set, "MHLA_WARPGROUP_KEY_TILE=46 (value not read)"));
  CHECK(test::contains(set, "MHLA_RESIDENT_BACKWARD=scores"));
  CHECK_FALSE(test::contains(set, "MHLA_RESIDENT_BACKWARD=scores ("));
  const auto warnings = environment_switch_warnings();
  REQUIRE(warnings.size() >= 1);
  CHECK(std::any_of(warnings.begin(), warnings.end(), [](const std::string& w) {
    return w == "MHLA_WARPGROUP_KEY_TILE=46 is not a value it reads (64); the default stays";
  }));
}

TEST_CASE("environment: each switch reads the values the kernels compare against", "[core]") {
  const auto find = [](std::string_view name) {
    for (const auto& s : kernel_switches())
      if (s.name == name) return s;
    FAIL("no switch " << name);
    return KernelSwitch{};
  };
  CHECK(find("MHLA_FUSED_NORM").reads("0"));
  CHECK(find("MHLA_FUSED_NORM").reads("1"));
  CHECK_FALSE(find("MHLA_FUSED_NORM").reads("off"));
  CHECK(find("MHLA_SWEEP_AHEAD").reads("15"));
  CHECK_FALSE(find("MHLA_SWEEP_AHEAD").reads("5"));
  CHECK_FALSE(find("MHLA_SWEEP_AHEAD").reads("1|3"));
  CHECK(find("MHLA_STATE_MIX").reads("group8x5"));
  CHECK_FALSE(find("MHLA_STATE_MIX").reads("group"));
  CHECK(find("MHLA_DELTA_WALK_SEGMENTS").reads("8"));
  CHECK_FALSE(find("MHLA_DELTA_WALK_SEGMENTS").reads("0"));
  CHECK_FALSE(find("MHLA_DELTA_WALK_SEGMENTS").reads("eight"));
  CHECK(find("MHLA_FRAGMENT_PASSES").reads("0"));
  CHECK(find("MHLA_FRAGMENT_PASSES").reads("states,key"));
  CHECK_FALSE(find("MHLA_FRAGMENT_PASSES").reads("states,"));
  CHECK_FALSE(find("MHLA_FRAGMENT_PASSES").reads("keys"));
  for (const auto& s : kernel_switches()) {
    INFO(s.name);
    CHECK(!s.values.empty());
  }
}

TEST_CASE("environment: on/off switches read 0 and 1, anything else is the default", "[core]") {
  {
    const ScopedVariable off("MHLA_FUSED_NORM", "0");
    CHECK_FALSE(environment_switch("MHLA_FUSED_NORM", true));
  }
  {
    const ScopedVariable on("MHLA_FUSED_NORM", "1");
    CHECK(environment_switch("MHLA_FUSED_NORM", false));
  }
  {
    const ScopedVariable other("MHLA_FUSED_NORM", "yes");
    CHECK(environment_switch("MHLA_FUSED_NORM", true));
    CHECK_FALSE(environment_switch("MHLA_FUSED_NORM", false));
  }
}

TEST_CASE("environment: the switch list is sorted and has no repeats", "[core]") {
  const auto& names = kernel_switch_names();
  REQUIRE(!names.empty());
  for (size_t i = 1; i < names.size(); ++i) CHECK(names[i - 1] < names[i]);
}

TEST_CASE("environment: mhla info says which switches are set", "[core][cli]") {
  {
    const ScopedVariable known("MHLA_FUSED_NORM", "0");
    const ScopedVariable typo("MHLA_FUSD_NORM", "0");
    const auto r = test::run_mhla("info");
    REQUIRE(r.exit_code == 0);
    CHECK(test::contains(r.output,
                         "set in the environment: MHLA_FUSD_NORM=0 (unknown), "
                         "MHLA_FUSED_NORM=0"));
  }
  // "none" only where this process itself runs without switches (a GPU A/B run may set some).
  if (environment_switches_set().empty()) {
    const auto r = test::run_mhla("info");
    CHECK(test::contains(r.output, "set in the environment: none"));
  }
}

TEST_CASE("environment: bench lines carry the switches set, and a misspelt one is warned about",
          "[core][cli]") {
  const ScopedVariable known("MHLA_FUSED_NORM", "0");
  const ScopedVariable typo("MHLA_FUSD_NORM", "0");
  const auto r = test::run_mhla(
      "bench attention --op linear --backend reference --device cpu --dtype fp32 "
      "--shape 1,1,16,32 --warmup 0 --iters 1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(test::contains(r.output,
                       "warning: MHLA_FUSD_NORM is set but no kernel of this build reads it"));
  CHECK(test::contains(r.output, "\"switches\":\"MHLA_FUSD_NORM=0 (unknown), MHLA_FUSED_NORM=0\""));
}
