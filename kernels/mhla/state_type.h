#pragma once
// How a set of block states (S_j and z_j of every batch, head and block) is stored in global
// memory. bf16 halves the bytes of the passes that stream whole sets (the causal passes move
// four such sets, each larger than q, k and v together at D = 128); the tensor-core passes round
// a state to 16 bits when they load it anyway, and every sum over states stays fp32 in registers.
namespace mhla_kernels {

enum class StateType { f32, bf16 };

constexpr int state_element_bytes(StateType type) {
  return type == StateType::f32 ? 4 : 2;
}

}  // namespace mhla_kernels
