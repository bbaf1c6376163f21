#pragma once
// The conditional position encoding (CPE) of the attention layers in one pass each way: a 3 x 3
// depthwise convolution (zero padding 1, with bias) over the 2-D patch grid, on tokens that are
// stored block-major (attention/token_layout.h: the grid is cut into tiles_h x tiles_w tiles, and
// each tile's tokens are one contiguous slab). ATen has to gather the tokens into a raster grid,
// convolve and gather them back, and each gather is a strided copy of the whole activation, both
// ways (for MHLA's 4 x 4 tiles: four copies a layer, 10 % of a DeiT-T/2 training step).
//
//   out[b, t, c] = base[b, t, c] + bias[c] + sum_{i, j} w[c, i, j] x[b, token(y_t + i - 1, x_t + j
//   - 1), c] dx[b, s, c]  = sum_{i, j} w[c, i, j] dout[b, token(y_s - i + 1, x_s - j + 1), c] dw[c,
//   i, j]  = sum_{b, t} dout[b, t, c] x[b, token(y_t + i - 1, x_t + j - 1), c] dbias[c]     =
//   sum_{b, t} dout[b, t, c]
// (terms whose grid position falls outside the grid are zero). The weight gradients are summed
// per CTA, then over CTAs in a fixed order: no atomics, the same bits on every run.
// One CTA of 128 threads per (image, band of grid rows, 128-byte chunk of the channels). It
// stages its band with a one-token halo on every side as a raster tile in shared memory (x; in
// the backward also dout), zeros where the halo leaves the grid, so every global row is read
// once with coalesced 16-byte copies and the nine taps of a position are shared-memory reads at
// fixed offsets. Bands are as tall as 48 KB of tiles allow (DeiT-T/2's 16 x 16 grid: one band in
// the forward, two of 8 rows in the backward, which stages two tensors); grids whose three rows
// do not fit take up to 200 KB, and grids wider than 260 tokens are not taken.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

inline constexpr int kGridConvKernel = 3;  // the only size the kernels take

struct GridConvArgs {
  DType dtype = DType::bf16;  // x, out, dout, dx
  int batch = 0, channels = 0;
  int grid_h = 0, grid_w = 0, tiles_h = 1, tiles_w = 1;  // block-major token layout
  const void* x = nullptr;  // [B, N, C]: rows of C contiguous elements, 16-byte aligned
  int64_t x_batch_stride = 0, x_token_stride = 0;  // elements
  const float* weight =
      nullptr;  // [C, 3 * 3] contiguous (the Conv2d's [C, 1, 3, 3]), 16-byte aligned
  const float* bias = nullptr;  // [C], or nullptr
  void* out = nullptr;          // forward output [B, N, C] contiguous
  const void* base = nullptr;   // [B, N, C] contiguous, added to the forward's output, or nullptr
  const void* dout = nullptr;   // backward input [B, N, C] contiguous
  void* dx = nullptr;           // backward outputs: [B, N, C] contiguous
  float* dweight = nullptr;     // [C, 3 * 3]
  float* dbias = nullptr;       // [C], or nullptr
  float* workspace = nullptr;   // grid_conv_workspace_floats(args)
};

// Whether the kernels take this layout and these channels (16-byte channel vectors, tiles that
// divide the grid, 32-bit token counts); the strides and alignment of x are the caller's check.
bool grid_conv_supported(const GridConvArgs& args);
size_t grid_conv_workspace_floats(const GridConvArgs& args);
cudaError_t grid_conv_forward(const GridConvArgs& args, cudaStream_t stream);
cudaError_t grid_conv_backward(const GridConvArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
