#include "image/png_writer.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mhla {

void write_png(const std::string& path, const torch::Tensor& image) {
  if (image.dim() != 3 || (image.size(0) != 1 && image.size(0) != 3)) {
    fail("{}: expected an image [1 or 3, H, W], got {}", path, c10::str(image.sizes()));
  }
  auto pixels = ((image.detach().to(torch::kCPU, torch::kFloat32).clamp(-1, 1) + 1) * 127.5)
                    .round()
                    .to(torch::kUInt8)
                    .permute({1, 2, 0})
                    .contiguous();
  const int h = static_cast<int>(pixels.size(0)), w = static_cast<int>(pixels.size(1));
  const int c = static_cast<int>(pixels.size(2));
  std::string bytes;
  auto append = [](void* context, void* data, int size) {
    static_cast<std::string*>(context)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  if (!stbi_write_png_to_func(append, &bytes, w, h, c, pixels.data_ptr<uint8_t>(), w * c)) {
    fail("{}: PNG encoding failed", path);
  }
  write_file_atomic(path, bytes);
}

torch::Tensor image_grid(const torch::Tensor& images, int64_t columns) {
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  const int64_t rows = (n + columns - 1) / columns, border = 2;
  auto grid = torch::full({c, rows * (h + border) + border, columns * (w + border) + border}, -1.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t top = border + (i / columns) * (h + border), left = border + (i % columns) * (w + border);
    grid.narrow(1, top, h).narrow(2, left, w).copy_(images[i].to(torch::kCPU, torch::kFloat32));
  }
  return grid;
}

}  // namespace mhla
