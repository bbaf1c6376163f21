// Tensor maps through the driver's cuTensorMapEncodeTiled, found through the runtime (no link
// against libcuda). Each map views its matrix with the columns split into 8-element blocks as a
// separate, outer dimension (stride 16 bytes), so one box arrives block after block.
#include "common/tensor_map.h"

#include <cudaTypedefs.h>

namespace mhla_kernels {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

cudaError_t encode(CUtensorMap* map, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                   const cuuint64_t* strides, const cuuint32_t* box,
                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  const auto fn = encoder();
  if (fn == nullptr) return cudaErrorNotSupported;
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, const_cast<void*>(base), dims,
                        strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t encode_token_rows_map(CUtensorMap* map, const void* base, int batch, int tokens,
                                  int heads, int dim, int box_rows) {
  const int64_t token_stride = static_cast<int64_t>(heads) * dim;
  return encode_token_view_map(map, base, batch, tokens, heads, dim, token_stride * tokens,
                               token_stride, dim, box_rows);
}

cudaError_t encode_token_view_map(CUtensorMap* map, const void* base, int batch, int tokens,
                                  int heads, int dim, int64_t batch_stride, int64_t token_stride,
                                  int64_t head_stride, int box_rows) {
  const auto misaligned = [](int64_t elements) { return (elements * 2) % 16 != 0; };
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || misaligned(batch_stride) ||
      misaligned(token_stride) || misaligned(head_stride))
    return cudaErrorInvalidValue;
  // Dimensions, innermost first: 8 elements, tokens, column blocks, heads, batch.
  const cuuint64_t dims[5] = {8, static_cast<cuuint64_t>(tokens), static_cast<cuuint64_t>(dim / 8),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(token_stride) * 2, 16,
                                 static_cast<cuuint64_t>(head_stride) * 2,
                                 static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[5] = {8, static_cast<cuuint32_t>(box_rows), static_cast<cuuint32_t>(dim / 8),
                             1, 1};
  return encode(map, base, 5, dims, strides, box);
}

cudaError_t encode_swizzled_token_view_map(CUtensorMap* map, const void* base, int batch,
                                           int tokens, int heads, int64_t batch_stride,
                                           int64_t token_stride, int64_t head_stride,
                                           int box_rows) {
  const auto misaligned = [](int64_t elements) { return (elements * 2) % 16 != 0; };
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || misaligned(batch_stride) ||
      misaligned(token_stride) || misaligned(head_stride))
    return cudaErrorInvalidValue;
  // Dimensions, innermost first: 64 elements, tokens, heads, batch.
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(tokens), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(token_stride) * 2,
                                 static_cast<cuuint64_t>(head_stride) * 2,
                                 static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  return encode(map, base, 4, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

cudaError_t encode_matrix_rows_map(CUtensorMap* map, const void* base, int64_t rows, int cols,
                                   int box_rows) {
  const cuuint64_t dims[3] = {8, static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(cols / 8)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2, 16};
  const cuuint32_t box[3] = {8, static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(cols / 8)};
  return encode(map, base, 3, dims, strides, box);
}

}  // namespace mhla_kernels
