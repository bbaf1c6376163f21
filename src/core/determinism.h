#pragma once
// Deterministic sums (train.deterministic): a run repeated on the same GPU with the same config and
// seed gives the same bits. Floating-point atomics add in whatever order the CTAs arrive, so a
// kernel that sums across CTAs that way changes its last bits from run to run, and training
// amplifies those bits (bf16 rounding, AdamW near zero). With the switch on, the MHLA kernels write
// one partial mixing gradient per CTA (and, where chunks share a block state, one partial state
// per chunk) and the bindings sum them in a fixed order; softmax attention takes FlashAttention's
// ordered backward (attention/deterministic_flash_attention.h); the CPE's grid-conv kernel sums
// its weight gradient in a fixed order always; cuDNN takes its deterministic
// algorithms; a GPU path that can only sum with atomics refuses to run, by name.
#include <string>

namespace mhla {

// Process-wide (the trainer sets it from its config). Also sets cuDNN's deterministic mode and
// turns its benchmark search off when on, and restores both when turned off again.
void set_deterministic_sums(bool on);
bool deterministic_sums();

// Fails, naming `what` and the way out, when deterministic sums are on: for the GPU paths whose
// results depend on the order of atomic additions.
void require_ordered_sums(const std::string& what);

// Restores the setting on scope exit (tests).
class DeterministicSumsScope {
 public:
  explicit DeterministicSumsScope(bool on) : before_(deterministic_sums()) {
    set_deterministic_sums(on);
  }
  ~DeterministicSumsScope() { set_deterministic_sums(before_); }
  DeterministicSumsScope(const DeterministicSumsScope&) = delete;
  DeterministicSumsScope& operator=(const DeterministicSumsScope&) = delete;

 private:
  bool before_;
};

}  // namespace mhla
