#pragma once
// The safetensors format (readable by Python's `safetensors`): 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}}
// padded with spaces to a multiple of 8, then the tensors' bytes, contiguous, in offset order.
#include <map>
#include <string>

#include <torch/torch.h>

namespace mhla {

using TensorMap = std::map<std::string, torch::Tensor>;
using Metadata = std::map<std::string, std::string>;

std::string encode_safetensors(const TensorMap& tensors, const Metadata& metadata = {});
// Writes atomically (temp file, fsync, rename).
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});
// Validates the whole file (header, dtypes, shapes, contiguous offsets, exact length); every
// problem is an error naming the file and a byte offset. Tensors come back on the CPU.
TensorMap load_safetensors(const std::string& path, Metadata* metadata = nullptr);
TensorMap decode_safetensors(const std::string& bytes, const std::string& name,
                             Metadata* metadata = nullptr);

}  // namespace mhla
