#include "attention/token_layout.h"

namespace mhla {

torch::Tensor TokenLayout::to_tokens(const torch::Tensor& grid) const {
  const auto b = grid.size(0), c = grid.size(1);
  TORCH_CHECK(grid.size(2) == grid_h && grid.size(3) == grid_w, "grid shape mismatch");
  return grid.reshape({b, c, tiles_h, tile_h(), tiles_w, tile_w()})
      .permute({0, 2, 4, 3, 5, 1})
      .reshape({b, tokens(), c});
}

torch::Tensor TokenLayout::to_grid(const torch::Tensor& tokens) const {
  const auto b = tokens.size(0), c = tokens.size(2);
  TORCH_CHECK(tokens.size(1) == this->tokens(), "token count mismatch");
  // Channels-last strides: the copy moves whole C-long rows, and convolutions over the grid
  // (CPE, DiT's unpatchify) run cuDNN's NHWC kernels without another transpose.
  return tokens.reshape({b, tiles_h, tiles_w, tile_h(), tile_w(), c})
      .permute({0, 1, 3, 2, 4, 5})
      .reshape({b, grid_h, grid_w, c})
      .permute({0, 3, 1, 2});
}

}  // namespace mhla
