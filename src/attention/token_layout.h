#pragma once
// Where each token of a sequence sits. Image models keep tokens block-major from the patch
// embedding on: the patch grid is cut into tiles_h x tiles_w 2-D tiles, and each tile's tokens
// are one contiguous slab (tile rows, then rows inside the tile). MHLA's blocks are the tiles.
#include <cstdint>

#include <torch/torch.h>

namespace mhla {

struct TokenLayout {
  int64_t grid_h = 1, grid_w = 1;    // patch grid (1 x N for plain sequences)
  int64_t tiles_h = 1, tiles_w = 1;  // tiles of the grid; block b = tile (b / tiles_w, b % tiles_w)

  int64_t tokens() const { return grid_h * grid_w; }
  int64_t blocks() const { return tiles_h * tiles_w; }
  int64_t tile_h() const { return grid_h / tiles_h; }
  int64_t tile_w() const { return grid_w / tiles_w; }
  bool is_grid() const { return grid_h > 1 && grid_w > 1; }

  // [B, C, grid_h, grid_w] (raster) -> [B, N, C] (block-major).
  torch::Tensor to_tokens(const torch::Tensor& grid) const;
  // [B, N, C] (block-major) -> [B, C, grid_h, grid_w] (raster), in channels-last memory.
  torch::Tensor to_grid(const torch::Tensor& tokens) const;
};

}  // namespace mhla
