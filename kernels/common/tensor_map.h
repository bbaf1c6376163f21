#pragma once
// Tensor maps (Hopper's tensor copy engine, TMA) over 16-bit matrices whose boxes land in shared
// memory as 8-column blocks, one after another: element (r, c) of a box of R rows at
// ((c / 8) R + r) 8 + c % 8, the column-blocks-major core-matrix layout that
// warpgroup::CoreTile<T, Cols, R> reads (wgmma operands, ldmatrix). Host side; the copies
// themselves are in tensor_copy.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mhla_kernels {

// Rows of a token-major [batch, tokens, heads, dim] tensor: a box is `box_rows` consecutive
// tokens of one (batch, head), all dim columns; tokens past the sequence read as zeros.
// Coordinates (tensor_copy.cuh, copy_token_rows): token, head, batch.
cudaError_t encode_token_rows_map(CUtensorMap* map, const void* base, int batch, int tokens,
                                  int heads, int dim, int box_rows);

// The same over a strided [batch, tokens, heads, dim] view (strides in elements; the dim
// stride is 1): fails (cudaErrorInvalidValue) where the base or a stride is not a multiple of 16
// bytes, which the tensor copy engine requires.
cudaError_t encode_token_view_map(CUtensorMap* map, const void* base, int batch, int tokens,
                                  int heads, int dim, int64_t batch_stride, int64_t token_stride,
                                  int64_t head_stride, int box_rows);

// The same view with 64-element (128-byte) rows, one box landing as whole rows in the 128-byte
// swizzle (warpgroup::SwizzledTile; the destination must be 1024-byte aligned): one request
// per row instead of eight. Coordinates (copy_swizzled_token_rows): token, head, batch.
cudaError_t encode_swizzled_token_view_map(CUtensorMap* map, const void* base, int batch,
                                           int tokens, int heads, int64_t batch_stride,
                                           int64_t token_stride, int64_t head_stride, int box_rows);

// Rows of a row-major [rows, cols] matrix: a box is `box_rows` consecutive rows, all cols.
// Coordinate (copy_matrix_rows): the first row.
cudaError_t encode_matrix_rows_map(CUtensorMap* map, const void* base, int64_t rows, int cols,
                                   int box_rows);

}  // namespace mhla_kernels
