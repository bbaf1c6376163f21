#pragma once
// Multi-threaded batch loader with prefetch. Batch b of an epoch is built by worker b % workers
// into that worker's bounded queue, and next() takes them in order, so the sequence of batches
// is fixed by (seed, epoch) whatever the thread timing. Augmentation (random crop with padding,
// horizontal flip) draws from a per-sample stream seeded by (seed, epoch, position).
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "data/image_dataset.h"

namespace mhla {

struct LoaderOptions {
  int64_t batch_size = 256;
  int64_t workers = 4;
  int64_t prefetch = 6;
  int64_t out_size = 32;      // images are centred on an out_size x out_size canvas
  int64_t crop_padding = 0;   // random shifts in [-p, p] (pad-and-crop); 0 = none
  bool hflip = false;
  bool shuffle = false;
  bool drop_last = false;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t start_batch = 0;    // resume inside an epoch
  bool pin_memory = false;
  bool unit_range = false;    // pixels to [-1, 1] (diffusion) instead of (p - mean) / std
};

struct Batch {
  torch::Tensor images;  // float32 [B, C, out_size, out_size], normalized (or in [-1, 1])
  torch::Tensor labels;  // int64 [B]
  int64_t index = 0;     // batch index in the epoch
};

// Bilinear upsampling of a batch by an integer factor (data.upscale); factor 1 returns it as is.
torch::Tensor upscale_images(const torch::Tensor& images, int64_t factor);

class BatchLoader {
 public:
  BatchLoader(const ImageDataset& dataset, const LoaderOptions& options);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // The next batch in order, or nothing at the end of the epoch. Rethrows worker errors.
  std::optional<Batch> next();
  int64_t batches_in_epoch() const { return batches_; }

  static int64_t batches_per_epoch(int64_t samples, int64_t batch_size, bool drop_last);
  // The sample order of an epoch (a permutation when shuffling, else 0..n-1).
  static std::vector<int64_t> epoch_order(int64_t samples, bool shuffle, uint64_t seed,
                                          int64_t epoch);

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  struct WorkerQueue {
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<Slot> slots;
  };

  void work(int64_t worker);
  Batch build(int64_t batch_index) const;

  const ImageDataset& dataset_;
  LoaderOptions options_;
  std::vector<int64_t> order_;
  int64_t batches_ = 0;
  int64_t first_batch_ = 0;  // fixed before the workers start
  int64_t next_batch_ = 0;   // consumer side only
  int64_t capacity_ = 1;
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<WorkerQueue>> queues_;
  std::vector<std::thread> threads_;
};

}  // namespace mhla
