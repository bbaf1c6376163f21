#pragma once
// One registration function per attention type; builtins.cpp calls each once.
#include "attention/attention_type.h"

namespace mhla {

void register_softmax_attention(Registry<AttentionType>& registry);
void register_linear_attention(Registry<AttentionType>& registry);
void register_mhla_attention(Registry<AttentionType>& registry);
void register_gated_delta_attention(Registry<AttentionType>& registry);  // gated_deltanet, kda

}  // namespace mhla
