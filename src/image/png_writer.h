#pragma once
// PNG files from image tensors (stb_image_write), written atomically.
#include <string>

#include <torch/torch.h>

namespace mhla {

// image: [C, H, W] with C = 1 or 3, values in [-1, 1] (clamped).
void write_png(const std::string& path, const torch::Tensor& image);
// images [N, C, H, W] in [-1, 1] tiled into a grid `columns` wide with a 2-pixel border.
torch::Tensor image_grid(const torch::Tensor& images, int64_t columns);

}  // namespace mhla
