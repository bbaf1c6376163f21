#include "data/batch_loader.h"

#include "core/rng.h"

namespace mhla {

torch::Tensor upscale_images(const torch::Tensor& images, int64_t factor) {
  if (factor == 1) return images;
  const double f = static_cast<double>(factor);
  return torch::nn::functional::interpolate(images, torch::nn::functional::InterpolateFuncOptions()
                                                        .scale_factor(std::vector<double>{f, f})
                                                        .mode(torch::kBilinear)
                                                        .align_corners(false));
}

int64_t BatchLoader::batches_per_epoch(int64_t samples, int64_t batch_size, bool drop_last) {
  return drop_last ? samples / batch_size : (samples + batch_size - 1) / batch_size;
}

std::vector<int64_t> BatchLoader::epoch_order(int64_t samples, bool shuffle, uint64_t seed,
                                              int64_t epoch) {
  std::vector<int64_t> order(samples);
  for (int64_t i = 0; i < samples; ++i) order[i] = i;
  if (shuffle) {
    StreamRng rng(seed, 0x5348554646ull /* "SHUFF" */, static_cast<uint64_t>(epoch));
    for (int64_t i = samples - 1; i > 0; --i) {
      std::swap(order[i], order[rng.below(static_cast<uint64_t>(i) + 1)]);
    }
  }
  return order;
}

BatchLoader::BatchLoader(const ImageDataset& dataset, const LoaderOptions& options)
    : dataset_(dataset), options_(options) {
  order_ = epoch_order(dataset.size(), options.shuffle, options.seed, options.epoch);
  batches_ = batches_per_epoch(dataset.size(), options.batch_size, options.drop_last);
  first_batch_ = std::min(options.start_batch, batches_);
  next_batch_ = first_batch_;
  const int64_t workers = std::max<int64_t>(1, options.workers);
  capacity_ = std::max<int64_t>(1, (options.prefetch + workers - 1) / workers);
  for (int64_t w = 0; w < workers; ++w) queues_.push_back(std::make_unique<WorkerQueue>());
  for (int64_t w = 0; w < workers; ++w) threads_.emplace_back([this, w] { work(w); });
}

BatchLoader::~BatchLoader() {
  for (auto& q : queues_) {
    std::lock_guard<std::mutex> lock(q->mutex);
    stopping_ = true;
  }
  for (auto& q : queues_) q->changed.notify_all();
  for (auto& t : threads_) t.join();
}

void BatchLoader::work(int64_t worker) {
  const int64_t workers = static_cast<int64_t>(queues_.size());
  WorkerQueue& queue = *queues_[worker];
  for (int64_t b = first_batch_ + worker; b < batches_; b += workers) {
    {
      std::unique_lock<std::mutex> lock(queue.mutex);
      queue.changed.wait(lock, [&] {
        return stopping_ || static_cast<int64_t>(queue.slots.size()) < capacity_;
      });
      if (stopping_) return;
    }
    Slot slot;
    try {
      slot.batch = build(b);
    } catch (...) {
      slot.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(queue.mutex);
      queue.slots.push_back(std::move(slot));
    }
    queue.changed.notify_all();
  }
}

std::optional<Batch> BatchLoader::next() {
  if (next_batch_ >= batches_) return std::nullopt;
  // Worker w builds batches first_batch_ + w, first_batch_ + w + workers, ...
  WorkerQueue& queue = *queues_[(next_batch_ - first_batch_) % static_cast<int64_t>(queues_.size())];
  Slot slot;
  {
    std::unique_lock<std::mutex> lock(queue.mutex);
    queue.changed.wait(lock, [&] { return !queue.slots.empty(); });
    slot = std::move(queue.slots.front());
    queue.slots.pop_front();
  }
  queue.changed.notify_all();
  ++next_batch_;
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

Batch BatchLoader::build(int64_t batch_index) const {
  const int64_t begin = batch_index * options_.batch_size;
  const int64_t end = std::min<int64_t>(begin + options_.batch_size, dataset_.size());
  const int64_t count = end - begin;
  const int64_t c = dataset_.channels(), h = dataset_.height(), w = dataset_.width();
  const int64_t s = options_.out_size;
  auto float_options = torch::TensorOptions().dtype(torch::kFloat32);
  auto long_options = torch::TensorOptions().dtype(torch::kInt64);
  if (options_.pin_memory) {
    float_options = float_options.pinned_memory(true);
    long_options = long_options.pinned_memory(true);
  }
  Batch batch;
  batch.index = batch_index;
  batch.images = torch::empty({count, c, s, s}, float_options);
  batch.labels = torch::empty({count}, long_options);
  float* out = batch.images.data_ptr<float>();
  int64_t* labels_out = batch.labels.data_ptr<int64_t>();
  const uint8_t* pixels = dataset_.images.data_ptr<uint8_t>();
  const int64_t* labels = dataset_.labels.data_ptr<int64_t>();

  // Pixel p in [0, 255] -> (p / 255 - mean) / std, or 2 p / 255 - 1; canvas background is pixel 0.
  const float scale = options_.unit_range ? 2.0f / 255.0f
                                          : static_cast<float>(1.0 / (255.0 * dataset_.stddev));
  const float shift = options_.unit_range ? -1.0f : static_cast<float>(-dataset_.mean / dataset_.stddev);
  const int64_t p = options_.crop_padding;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t position = begin + i;
    const int64_t sample = order_[position];
    int64_t dy = 0, dx = 0;
    bool flip = false;
    if (p > 0 || options_.hflip) {
      StreamRng rng(options_.seed, static_cast<uint64_t>(options_.epoch) * 0x100000000ull + 7,
                    static_cast<uint64_t>(position));
      if (p > 0) {
        dy = static_cast<int64_t>(rng.below(2 * p + 1)) - p;
        dx = static_cast<int64_t>(rng.below(2 * p + 1)) - p;
      }
      if (options_.hflip) flip = rng.below(2) == 1;
    }
    const int64_t top = (s - h) / 2 + dy, left = (s - w) / 2 + dx;
    const uint8_t* src = pixels + sample * c * h * w;
    float* dst = out + i * c * s * s;
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int64_t y = 0; y < s; ++y) {
        const int64_t sy = y - top;
        float* row = dst + (ch * s + y) * s;
        if (sy < 0 || sy >= h) {
          for (int64_t x = 0; x < s; ++x) row[x] = shift;
          continue;
        }
        const uint8_t* src_row = src + (ch * h + sy) * w;
        for (int64_t x = 0; x < s; ++x) {
          const int64_t canvas_x = flip ? s - 1 - x : x;
          const int64_t sx = canvas_x - left;
          row[x] = (sx >= 0 && sx < w) ? src_row[sx] * scale + shift : shift;
        }
      }
    }
    labels_out[i] = labels[sample];
  }
  return batch;
}

}  // namespace mhla
