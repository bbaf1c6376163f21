#include "column_sum/column_sum.h"

#include <algorithm>
#include <type_traits>

#include "common/packed_access.cuh"
#include "common/partial_sums.cuh"

namespace mhla_kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kUnroll = 4;  // rows a warp loads before adding (loads in flight)
constexpr int kTargetCtas = 132 * 4;
constexpr int kMinRowsPerSlab = 64;

struct Grid {
  int column_tiles, slabs;
  int64_t rows_per_slab;
};

Grid grid_for(int64_t rows, int cols, int vec) {
  Grid g;
  g.column_tiles = (cols + 32 * vec - 1) / (32 * vec);
  const int64_t max_slabs = std::max<int64_t>(1, (rows + kMinRowsPerSlab - 1) / kMinRowsPerSlab);
  g.slabs = static_cast<int>(
      std::clamp<int64_t>((kTargetCtas + g.column_tiles - 1) / g.column_tiles, 1, max_slabs));
  g.rows_per_slab = (rows + g.slabs - 1) / g.slabs;
  return g;
}

// d/dx of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GELU's tanh form (as torch's
// GeluBackward with approximate = "tanh"). The hardware tanh (relative error about 5e-4, below
// the 4e-3 of the 16-bit result): tanhf's twenty-odd instructions made the pass compute-bound.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float gelu_tanh_derivative(float x) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  const float x2 = x * x;
  const float t = fast_tanh(kBeta * x * (1.f + kKappa * x2));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * x2);
}

// d/dx of x Phi(x), GELU's exact form (as torch's GeluBackward with approximate = "none"):
// Phi(x) + x phi(x).
__device__ __forceinline__ float gelu_erf_derivative(float x) {
  constexpr float kSqrtHalf = 0.7071067811865476f, kInvSqrt2Pi = 0.3989422804014327f;
  return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * kInvSqrt2Pi * __expf(-0.5f * x * x);
}

// What the rows summed are: x itself, or the GELU backward x * gelu'(gelu_input) in either form.
enum class Rows { plain, gelu_tanh, gelu_erf };

// VEC elements of row r: x's, or the GELU backward of them (also stored).
template <typename T, int VEC, Rows kRows>
__device__ __forceinline__ Pack<T, VEC> load_row(const ColumnSumArgs& p, int64_t r, int col) {
  const T* x = static_cast<const T*>(p.x);
  const int64_t at = r * p.cols + col;
  Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(x + at);
  if constexpr (kRows != Rows::plain) {
    const auto pre =
        *reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(p.gelu_input) + at);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float u = to_float(pre.v[i]);
      const float slope =
          kRows == Rows::gelu_tanh ? gelu_tanh_derivative(u) : gelu_erf_derivative(u);
      pack.v[i] = from_float<T>(to_float(pack.v[i]) * slope);
    }
    *reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(p.gelu_grad) + at) = pack;
  }
  return pack;
}

// grid (column tiles, slabs), 8 warps: lane = VEC adjacent columns, warps interleave the slab's
// rows; the warps' sums meet in shared memory and one partial row per slab goes to workspace.
// The sums add the values as stored (rounded to T), as a sum over the stored gradient would.
template <typename T, int VEC, Rows kRows>
__global__ void __launch_bounds__(kWarps * 32) slab_kernel(ColumnSumArgs p, int64_t rows_per_slab) {
  __shared__ float partial[kWarps][32 * VEC];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = (blockIdx.x * 32 + lane) * VEC;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_slab;
  const int64_t end = min(begin + rows_per_slab, p.rows);
  float sum[VEC] = {};
  if (col < p.cols) {
    int64_t r = begin + warp;
    for (; r + (kUnroll - 1) * kWarps < end; r += kUnroll * kWarps) {
      Pack<T, VEC> packs[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) packs[u] = load_row<T, VEC, kRows>(p, r + u * kWarps, col);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum[i] += to_float(packs[u].v[i]);
      }
    }
    for (; r < end; r += kWarps) {
      const auto pack = load_row<T, VEC, kRows>(p, r, col);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum[i] += to_float(pack.v[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) partial[warp][lane * VEC + i] = sum[i];
  __syncthreads();
  for (int c = threadIdx.x; c < 32 * VEC; c += kWarps * 32) {
    const int column = blockIdx.x * 32 * VEC + c;
    if (column < p.cols) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += partial[w][c];
      p.workspace[static_cast<int64_t>(blockIdx.y) * p.cols + column] = total;
    }
  }
}

// 16-byte accesses where the columns and pointers allow (8 elements of 16 bits, 4 of fp32),
// else 8-byte ones for 16-bit types (4 elements), else single elements.
int vector_width(const ColumnSumArgs& a) {
  const int bytes = a.dtype == DType::f32 ? 4 : 2;
  auto fits = [&](int vec) {
    bool aligned = reinterpret_cast<uintptr_t>(a.x) % (vec * bytes) == 0;
    if (a.gelu_input != nullptr) {
      aligned = aligned && reinterpret_cast<uintptr_t>(a.gelu_input) % (vec * bytes) == 0 &&
                reinterpret_cast<uintptr_t>(a.gelu_grad) % (vec * bytes) == 0;
    }
    return a.cols % vec == 0 && aligned;
  };
  if (bytes == 2 && fits(8)) return 8;
  return fits(4) ? 4 : 1;
}

}  // namespace

size_t column_sum_workspace_floats(int64_t rows, int cols) {
  // Enough for either vector width (wider tiles mean fewer of them, so more slabs).
  const int slabs = std::max({grid_for(rows, cols, 1).slabs, grid_for(rows, cols, 4).slabs,
                              grid_for(rows, cols, 8).slabs});
  return static_cast<size_t>(slabs) * static_cast<size_t>(cols);
}

cudaError_t column_sum(const ColumnSumArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols <= 0 || !a.x || !a.out || !a.workspace) return cudaErrorInvalidValue;
  if ((a.gelu_input == nullptr) != (a.gelu_grad == nullptr)) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaMemsetAsync(a.out, 0, sizeof(float) * a.cols, stream);
  const int vec = vector_width(a);
  const Grid g = grid_for(a.rows, a.cols, vec);
  if (g.column_tiles > 0x7fffffff || g.slabs > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(g.column_tiles), static_cast<unsigned>(g.slabs));
  // One slab (at most 64 rows): its partial row is the result, written straight to out.
  ColumnSumArgs run = a;
  if (g.slabs == 1) run.workspace = a.out;
  cudaError_t err = with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Rows rows = a.gelu_input == nullptr ? Rows::plain
                      : a.gelu_exact          ? Rows::gelu_erf
                                              : Rows::gelu_tanh;
    auto launch = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      auto kernel = rows == Rows::plain       ? slab_kernel<T, kVec, Rows::plain>
                    : rows == Rows::gelu_tanh ? slab_kernel<T, kVec, Rows::gelu_tanh>
                                              : slab_kernel<T, kVec, Rows::gelu_erf>;
      kernel<<<grid, kWarps * 32, 0, stream>>>(run, g.rows_per_slab);
    };
    if (vec == 8) {
      if constexpr (sizeof(T) == 2) launch(std::integral_constant<int, 8>{});
    } else if (vec == 4) {
      launch(std::integral_constant<int, 4>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    return cudaGetLastError();
  });
  if (err != cudaSuccess || g.slabs == 1) return err;
  return sum_partials(a.workspace, g.slabs, a.cols, StoreInto{a.out}, stream);
}

}  // namespace mhla_kernels
