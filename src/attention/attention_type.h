#pragma once
// The attention registry: each type names its op backends and how to build its layer.
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "attention/attention_layer.h"
#include "core/registry.h"

namespace mhla {

struct AttentionType {
  std::string description;
  bool uses_blocks = false;                // the op takes OpArgs::blocks/mixing (2-D tiles)
  bool normalizes_qk = false;              // q, k pass an RMSNorm first: any magnitude is fine
  bool unit_qk = false;                    // the op expects L2-normalized q, k (delta rule)
  bool uses_rotary = false;                // with model.positions = rope, q and k are rotated
  std::map<std::string, OpFn> backends;    // "reference" always; "cuda", "cudnn" where built
  std::vector<std::string> gpu_preference; // backends auto tries on CUDA, best first
  std::set<std::string> bidirectional_only; // backends without a causal mode (auto skips them)
  DecodeFn decode;                         // one-token step for causal decoding (if any)
  std::function<std::shared_ptr<AttentionLayerImpl>(const AttentionSpec&, const AttentionType&)>
      make_layer;
  std::vector<bool> causal_modes = {false};  // op modes the backends implement (causal or not)
  // Test/bench inputs beyond q, k, v (a random mixing matrix, gates, ...), for the harnesses;
  // tensors in float32 on the options' device.
  std::function<OpArgs(const OpShape& shape, const torch::TensorOptions& options)> make_args;
};

Registry<AttentionType>& attention_registry();

// Picks the op for a device: an explicit backend must exist and suit the device; auto takes the
// first of gpu_preference that exists on CUDA (and has the causal mode asked for), else reference.
const OpFn& select_backend(const std::string& type_name, const AttentionType& type,
                           const std::string& backend, const torch::Device& device,
                           const std::string& where, bool causal = false);

}  // namespace mhla
