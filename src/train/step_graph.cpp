#include "train/step_graph.h"

#include <chrono>

#include "core/error.h"
#include "core/logging.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mhla {

#ifdef MHLA_WITH_CUDA_KERNELS

struct StepGraph::Impl {
  Impl(const torch::Device& device, Body body, std::function<void()> drop_grads, int64_t eager)
      : body(std::move(body)),
        drop_grads(std::move(drop_grads)),
        eager_left(eager),
        side(c10::cuda::getStreamFromPool(false, device.index())),
        lr(torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kFloat32))) {}

  // Work on the side stream, ordered after everything queued on the current stream so far and
  // before everything queued there afterwards.
  template <typename Work>
  void on_side_stream(Work&& work) {
    auto current = c10::cuda::getCurrentCUDAStream(side.device_index());
    c10::cuda::CUDAEvent queued;
    queued.record(current);
    queued.block(side);
    {
      c10::cuda::CUDAStreamGuard guard(side);
      work();
    }
    c10::cuda::CUDAEvent done;
    done.record(side);
    done.block(current);
  }

  void capture(const TrainBatch& batch) {
    input = batch.input.clone();
    target = batch.target.clone();
    const auto start = std::chrono::steady_clock::now();
    on_side_stream([&] {
      drop_grads();
      graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local capture: the loader's threads keep allocating pinned memory and polling
      // its events while the step is captured, which a global-mode capture would refuse.
      graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      try {
        loss = body(TrainBatch{input, target, batch.index}, lr);
        graph->capture_end();
      } catch (const std::exception& e) {
        const std::string what = e.what();
        try {
          graph->capture_end();  // takes the stream out of capture mode
        } catch (...) {
        }
        // Leaked on purpose: after a failed capture_end the caching allocator and the CUDA
        // generator may still refer to this graph, so destroying it could leave them dangling.
        // The error ends the run; the process is not meant to train on after it.
        (void)graph.release();
        fail(
            "train.cuda_graph: the training step could not be captured as a CUDA graph ({}); "
            "run with --set train.cuda_graph=false",
            what.substr(0, what.find('\n')));
      }
    });
    // The eager warm-up's activations sit cached in the side stream's blocks, which neither the
    // replays (the graph's own pool) nor evaluations (the current stream) can reuse: hand them
    // back once.
    c10::cuda::CUDACachingAllocator::emptyCache();
    logger().info(
        "cuda graph: training step captured after the eager warm-up ({:.0f} ms)",
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }

  Body body;
  std::function<void()> drop_grads;
  int64_t eager_left;
  c10::cuda::CUDAStream side;
  torch::Tensor lr, input, target, loss;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
};

StepGraph::StepGraph(const torch::Device& device, Body body, std::function<void()> drop_grads,
                     int64_t eager_steps) {
  if (!device.is_cuda())
    fail("train.cuda_graph: CUDA graphs need a CUDA device, not {}", device.str());
  impl_ = std::make_unique<Impl>(device, std::move(body), std::move(drop_grads), eager_steps);
}

StepGraph::~StepGraph() = default;

bool StepGraph::captured() const {
  return impl_->graph != nullptr;
}

torch::Tensor StepGraph::step(const TrainBatch& batch, double lr) {
  auto& s = *impl_;
  s.lr.fill_(lr);
  if (s.eager_left > 0) {
    --s.eager_left;
    torch::Tensor loss;
    s.on_side_stream([&] {
      loss = s.body(batch, s.lr);
      s.drop_grads();
    });
    return loss;
  }
  if (!s.graph) s.capture(batch);
  if (batch.input.sizes() != s.input.sizes() || batch.target.sizes() != s.target.sizes()) {
    fail(
        "train.cuda_graph: batch shapes changed from input {} / target {} to {} / {}; a captured "
        "step needs fixed shapes (drop_last batches)",
        c10::str(s.input.sizes()), c10::str(s.target.sizes()), c10::str(batch.input.sizes()),
        c10::str(batch.target.sizes()));
  }
  s.input.copy_(batch.input, /*non_blocking=*/true);
  s.target.copy_(batch.target, /*non_blocking=*/true);
  s.graph->replay();
  return s.loss;
}

#else

struct StepGraph::Impl {};

StepGraph::StepGraph(const torch::Device&, Body, std::function<void()>, int64_t) {
  fail("train.cuda_graph: this build has no CUDA kernels (configure with CUDA to use graphs)");
}
StepGraph::~StepGraph() = default;
bool StepGraph::captured() const {
  return false;
}
torch::Tensor StepGraph::step(const TrainBatch&, double) {
  return {};
}

#endif

}  // namespace mhla
