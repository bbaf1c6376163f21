#include "train/cuda_graph_step.h"

#include "core/error.h"
#include "core/logging.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mhla {

#ifdef MHLA_WITH_CUDA_KERNELS

struct CudaGraphStep::State {
  TrainStepBody body;
  torch::Device device;
  int64_t warmup_steps;
  int64_t eager_steps = 0;
  // Capture needs a stream other than the default one; every step runs on it so that warm-up
  // and replays see the same stream.
  c10::cuda::CUDAStream stream;
  torch::Tensor lr;       // the learning rate the recorded optimizer step reads
  TrainBatch batch;       // the recorded step's input: each replay's batch is copied in
  torch::Tensor loss;     // the recorded step's output
  std::unique_ptr<at::cuda::CUDAGraph> graph;
};

namespace {

bool same_shapes(const TrainBatch& a, const TrainBatch& b) {
  return a.input.sizes() == b.input.sizes() && a.target.sizes() == b.target.sizes() &&
         a.input.scalar_type() == b.input.scalar_type() &&
         a.target.scalar_type() == b.target.scalar_type();
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace

CudaGraphStep::CudaGraphStep(TrainStepBody body, const torch::Device& device, int64_t warmup_steps)
    : state_(new State{std::move(body), device, warmup_steps, 0,
                       c10::cuda::getStreamFromPool(false, device.index()),
                       torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device)),
                       {}, {}, nullptr}) {
  if (!device.is_cuda()) fail("CUDA graphs need a CUDA device, not {}", device.str());
}

CudaGraphStep::~CudaGraphStep() = default;

bool CudaGraphStep::available() { return true; }

bool CudaGraphStep::recorded() const { return state_->graph != nullptr; }

torch::Tensor CudaGraphStep::run(const TrainBatch& batch, double lr) {
  State& s = *state_;
  auto caller = c10::cuda::getCurrentCUDAStream(s.device.index());
  at::cuda::CUDAEvent batch_ready;
  batch_ready.record(caller);  // the batch was copied to the device on the caller's stream
  batch_ready.block(s.stream);
  torch::Tensor loss;
  {
    c10::cuda::CUDAStreamGuard on_step_stream(s.stream);
    s.lr.fill_(lr);
    if (s.graph && same_shapes(batch, s.batch)) {
      s.batch.input.copy_(batch.input, /*non_blocking=*/true);
      s.batch.target.copy_(batch.target, /*non_blocking=*/true);
      s.graph->replay();
      loss = s.loss;
    } else if (!s.graph && s.eager_steps >= s.warmup_steps) {
      s.batch = TrainBatch{batch.input.clone(), batch.target.clone(), batch.index};
      s.graph = std::make_unique<at::cuda::CUDAGraph>();
      // Casts cached by autocast would outlive the recording in the graph's memory pool.
      const bool cache = at::autocast::is_autocast_cache_enabled();
      at::autocast::set_autocast_cache_enabled(false);
      try {
        s.graph->capture_begin();
        s.loss = s.body(s.batch, s.lr);
        s.graph->capture_end();
      } catch (const std::exception& e) {
        at::autocast::set_autocast_cache_enabled(cache);
        fail("recording the training step as a CUDA graph failed: {}; train without graphs "
             "(--set train.cuda_graph=false)", first_line(e.what()));
      }
      at::autocast::set_autocast_cache_enabled(cache);
      s.graph->replay();  // recording ran nothing: this is the recorded batch's step
      loss = s.loss;
      logger().info("training step recorded as a CUDA graph after {} eager steps; later "
                    "batches of shape {} replay it", s.eager_steps,
                    c10::str(s.batch.input.sizes()));
    } else {
      loss = s.body(batch, s.lr);
      ++s.eager_steps;
    }
  }
  at::cuda::CUDAEvent step_done;
  step_done.record(s.stream);
  step_done.block(caller);
  return loss;
}

#else  // no CUDA in this build

struct CudaGraphStep::State {};

CudaGraphStep::CudaGraphStep(TrainStepBody, const torch::Device& device, int64_t) {
  fail("this mhla was built without CUDA; CUDA graphs are unavailable");
}
CudaGraphStep::~CudaGraphStep() = default;
bool CudaGraphStep::available() { return false; }
bool CudaGraphStep::recorded() const { return false; }
torch::Tensor CudaGraphStep::run(const TrainBatch&, double) { return {}; }

#endif

}  // namespace mhla
