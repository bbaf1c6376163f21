#include "train/safetensors.h"

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mhla {
namespace {

struct DtypeName {
  torch::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kFloat64, "F64"}, {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kInt64, "I64"}, {torch::kInt32, "I32"},
    {torch::kInt16, "I16"}, {torch::kInt8, "I8"}, {torch::kUInt8, "U8"}, {torch::kBool, "BOOL"}};

const char* dtype_name(torch::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  fail("safetensors: dtype {} is not supported", c10::toString(type));
}

bool dtype_from_name(const std::string& name, torch::ScalarType* type) {
  for (const auto& d : kDtypes)
    if (name == d.name) return *type = d.type, true;
  return false;
}

}  // namespace

std::string encode_safetensors(const TensorMap& tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> contiguous;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(t);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8 + json.size() + offset, '\0');
  const uint64_t header_size = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header_size >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, json.data(), json.size());
  char* data = out.data() + 8 + json.size();
  for (const auto& t : contiguous) {
    const size_t bytes = t.numel() * t.element_size();
    if (bytes) std::memcpy(data, t.data_ptr(), bytes);
    data += bytes;
  }
  return out;
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata) {
  write_file_atomic(path, encode_safetensors(tensors, metadata));
}

TensorMap decode_safetensors(const std::string& bytes, const std::string& name,
                             Metadata* metadata) {
  if (bytes.size() < 8) fail("{}: byte offset 0: file too short ({} bytes) for a safetensors header", name, bytes.size());
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  if (header_size > bytes.size() - 8) {
    fail("{}: byte offset 0: header length {} exceeds the {} bytes after it (truncated file?)",
         name, header_size, bytes.size() - 8);
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + header_size);
  } catch (const nlohmann::json::parse_error& e) {
    fail("{}: byte offset {}: malformed JSON header ({})", name, 8 + e.byte, e.what());
  }
  if (!header.is_object()) fail("{}: byte offset 8: header is not a JSON object", name);
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = bytes.size() - data_start;

  struct Entry {
    std::string name;
    torch::ScalarType type;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (metadata) {
        if (!value.is_object()) fail("{}: __metadata__ is not an object", name);
        for (const auto& [k, v] : value.items()) {
          if (!v.is_string()) fail("{}: __metadata__.{} is not a string", name, k);
          (*metadata)[k] = v.get<std::string>();
        }
      }
      continue;
    }
    Entry e;
    e.name = key;
    try {
      if (!dtype_from_name(value.at("dtype").get<std::string>(), &e.type)) {
        fail("{}: tensor '{}': unknown dtype '{}'", name, key, value.at("dtype").get<std::string>());
      }
      e.shape = value.at("shape").get<std::vector<int64_t>>();
      auto offsets = value.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2) fail("{}: tensor '{}': data_offsets needs two numbers", name, key);
      e.begin = offsets[0];
      e.end = offsets[1];
    } catch (const nlohmann::json::exception& ex) {
      fail("{}: tensor '{}': malformed header entry ({})", name, key, ex.what());
    }
    int64_t numel = 1;
    for (auto d : e.shape) {
      if (d < 0) fail("{}: tensor '{}': negative dimension", name, key);
      numel *= d;
    }
    const uint64_t expected = numel * c10::elementSize(e.type);
    if (e.end < e.begin || e.end - e.begin != expected) {
      fail("{}: tensor '{}': data_offsets [{}, {}] hold {} bytes, its dtype and shape need {}",
           name, key, e.begin, e.end, e.end - e.begin, expected);
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  uint64_t cursor = 0;
  for (const auto& e : entries) {
    if (e.begin != cursor) {
      fail("{}: byte offset {}: tensor '{}' starts at data offset {}, expected {} (offsets must "
           "be contiguous)", name, data_start + e.begin, e.name, e.begin, cursor);
    }
    cursor = e.end;
  }
  if (cursor != data_size) {
    fail("{}: byte offset {}: the header describes {} data bytes but the file holds {} "
         "({})", name, data_start + std::min(cursor, data_size), cursor, data_size,
         cursor > data_size ? "truncated" : "trailing bytes");
  }
  TensorMap tensors;
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.type));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), bytes.data() + data_start + e.begin, e.end - e.begin);
    tensors.emplace(e.name, std::move(t));
  }
  return tensors;
}

TensorMap load_safetensors(const std::string& path, Metadata* metadata) {
  return decode_safetensors(read_file(path), path, metadata);
}

}  // namespace mhla
