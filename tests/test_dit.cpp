#include "attention/attention_type.h"
#include "catch_compat.h"
#include "core/atomic_file.h"
#include "core/config.h"
#include "data/batch_loader.h"
#include "models/dit.h"
#include "test_helpers.h"
#include "train/checkpoint.h"
#include "train/run_folder.h"
#include "train/task.h"
#include "train/trainer.h"

using namespace mhla;

namespace {

Config tiny_dit(const std::string& attention, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model.name=dit", "model.image_size=28", "model.patch_size=4",
                                "model.width=32", "model.depth=2", "model.heads=2",
                                "attention.blocks=4", "attention.type=" + attention,
                                "data.crop_padding=0", "data.hflip=false", "train.device=cpu"};
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_config("", "dit.yaml", o);
}

}  // namespace

TEST_CASE("dit: every bidirectional attention type builds; adaLN-Zero starts at exactly zero", "[model]") {
  for (const auto& name : attention_registry().names()) {
    INFO(name);
    auto model = model_registry().get("dit").make(tiny_dit(name));
    auto& dit = dynamic_cast<Dit&>(*model);
    auto x = torch::randn({3, 1, 28, 28});
    auto t = torch::tensor({0, 500, 999}, torch::kLong), y = torch::tensor({1, 5, 10}, torch::kLong);
    auto out = dit.denoise(x, t, y);
    CHECK(out.sizes() == x.sizes());
    CHECK(out.abs().max().item<double>() == 0.0);  // zero-initialized modulation and final layer
    out.sum().backward();
    // At zero init only the final layer receives gradient; after one perturbation all do.
    CHECK(model->named_parameters()["final_linear.weight"].grad().abs().sum().item<double>() > 0);
  }
}

TEST_CASE("dit: tokens are block-major and the unpatchify inverts patchify's layout", "[model]") {
  auto pe = sincos_position_embedding(4, 4, 8);
  CHECK(pe.sizes() == std::vector<int64_t>{16, 8});
  CHECK(pe[0][0].item<double>() == 0.0);      // sin(0) of the row part
  CHECK(pe[0][2].item<double>() == 1.0);      // cos(0)
  CHECK_FALSE(torch::equal(pe[1], pe[4]));    // (0,1) and (1,0) differ
  auto te = timestep_embedding(torch::tensor({0, 7}, torch::kLong), 16);
  CHECK(te[0].narrow(0, 0, 8).sum().item<double>() == 8.0);  // cos(0) = 1
  // With a final layer that copies each token's patch back (identity patch embedding), denoise
  // would return the input; here: the output shape is the image's and padding is removed.
  auto model = model_registry().get("dit").make(tiny_dit("mhla"));
  auto& dit = dynamic_cast<Dit&>(*model);
  CHECK(dit.layout().grid_h == 8);  // 28 px / patch 4 = 7, rounded up to whole 2x2 tiles
  CHECK(dit.null_class() == 10);
}

TEST_CASE("dit: data.upscale centres the images on a smaller canvas and upsamples them", "[diffusion]") {
  Config c = tiny_dit("mhla", {"model.image_size=56", "data.upscale=2", "data.train_limit=64",
                               "data.batch_size=16"});
  auto task = task_registry().get("diffusion").make(c, torch::kCPU);
  auto batch = task->epoch(0, 0)->next();
  REQUIRE(batch.has_value());
  CHECK(batch->input.sizes() == torch::IntArrayRef({16, 1, 56, 56}));
  CHECK(batch->input.min().item<double>() >= -1.0 - 1e-6);
  CHECK(batch->input.max().item<double>() <= 1.0 + 1e-6);
  // A 28x28 image centred on 28x28 and doubled: 2x2 blocks of (nearly) equal pixels in flat areas,
  // and the corners, far from the garment, stay at the background value -1.
  CHECK(batch->input[0][0][0][0].item<double>() == Approx(-1.0));
  auto direct = upscale_images(torch::ones({1, 1, 4, 4}), 2);
  CHECK(direct.sizes() == torch::IntArrayRef({1, 1, 8, 8}));
  CHECK(direct.min().item<double>() == Approx(1.0));
}

TEST_CASE("dit: evaluation grids go to samples/ and never overwrite earlier ones", "[diffusion]") {
  test::TempDir dir("dit-grid");
  Config c = tiny_dit("mhla", {"data.test_limit=32", "diffusion.steps=20", "diffusion.sample_steps=2",
                               "diffusion.grid_samples=4"});
  auto task = task_registry().get("diffusion").make(c, torch::kCPU);
  task->attach_run(dir.str(), nullptr);
  auto model = model_registry().get("dit").make(c);
  std::filesystem::create_directories(dir.path() / "samples");
  test::write_text(dir.path() / "samples" / "eval_001.png", "from before a resume");
  auto report = task->evaluate(*model);
  CHECK(report.metrics["sample_grid"] == (dir.path() / "samples" / "eval_002.png").string());
  CHECK(std::filesystem::exists(dir.path() / "samples" / "eval_002.png"));
  CHECK(read_file((dir.path() / "samples" / "eval_001.png").string()) == "from before a resume");
  task->evaluate(*model);
  CHECK(std::filesystem::exists(dir.path() / "samples" / "eval_003.png"));
}

TEST_CASE("dit: a tiny DiT's diffusion loss falls on real Fashion-MNIST", "[train]") {
  test::TempDir dir("dit");
  Config c = tiny_dit("mhla", {"data.train_limit=1024", "data.test_limit=256", "data.batch_size=64",
                               "train.epochs=4", "optim.lr=2e-3", "optim.weight_decay=0",
                               "train.log_every=8", "train.eval_every=0", "train.ema_decay=0.99",
                               "diffusion.steps=200", "run.root=" + dir.str(), "run.name=dit"});
  auto task = task_registry().get("diffusion").make(c, torch::kCPU);
  auto fresh = model_registry().get("dit").make(c);
  const double before = -task->evaluate(*fresh).score;
  CHECK(before == Approx(1.0).margin(0.05));  // predicting zero noise: MSE = E[eps^2] = 1
  auto run_dir = create_run_folder(c);
  Trainer trainer(c, run_dir, false);
  auto outcome = trainer.run();
  const double after = outcome.final_eval["diffusion_loss"].get<double>();
  INFO("before " << before << " after " << after);
  CHECK(after < 0.5 * before);
  CHECK(std::filesystem::exists(run_dir + "/checkpoints/last/ema.safetensors"));
}

// The diffusion step under a CUDA graph, with the fused GELU MLP (model.mlp = gelu_tanh: the
// cuBLASLt epilogue products and the column-sum kernel) inside the capture: the same losses and
// weights as eager steps. The step draws its noise, timesteps and dropped labels on the GPU, so
// this also checks that replays get the random numbers eager steps would have drawn. MHLA on its
// reference backend and cuDNN's deterministic algorithms (the patch embedding) leave only the
// graph-vs-eager difference; fp32 and bf16 autocast.
TEST_CASE("dit: CUDA-graph steps with the fused GELU MLP train the same weights as eager steps",
          "[train][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  test::DeterministicCudnnScope deterministic_cudnn;
  test::TempDir dir("dit-graph");
  auto run = [&](const std::string& name, const std::string& precision, bool graph) {
    Config c = tiny_dit(
        "mhla", {"attention.backend=reference", "model.mlp=gelu_tanh", "train.device=cuda",
                 "train.precision=" + precision, "data.train_limit=256", "data.test_limit=64",
                 "data.batch_size=16", "train.epochs=2", "optim.lr=2e-3", "optim.eps=1e-3",
                 "schedule.warmup_epochs=0", "train.log_every=1", "train.eval_every=0",
                 "train.ema_decay=0.9", "diffusion.steps=100", "run.root=" + dir.str(),
                 "run.name=" + name, std::string("train.cuda_graph=") + (graph ? "true" : "false")});
    auto run_dir = create_run_folder(c);
    Trainer trainer(c, run_dir, false);
    trainer.stop_after_step(20);  // 16 steps per epoch: eager warm-up, capture, replays, epoch end
    CHECK(trainer.run().steps == 20);
    CHECK(trainer.step_graph_captured() == graph);
    const auto losses = test::logged_losses(run_dir);
    return std::make_pair(model_tensors(trainer.model()), losses);
  };
  for (const std::string precision : {"fp32", "bf16"}) {
    INFO("train.precision = " << precision);
    auto [eager, eager_losses] = run("eager_" + precision, precision, false);
    auto [graphed, graphed_losses] = run("graphed_" + precision, precision, true);
    REQUIRE(eager_losses.size() == 20);
    REQUIRE(graphed_losses.size() == 20);
    double worst_loss = 0, worst_weight = 0;
    for (size_t i = 0; i < eager_losses.size(); ++i) {
      worst_loss = std::max(
          worst_loss, std::abs(graphed_losses[i] - eager_losses[i]) / std::abs(eager_losses[i]));
    }
    CHECK(worst_loss <= 1e-3);
    for (const auto& [name, t] : eager) {
      INFO(name);
      const double diff = (graphed.at(name) - t).abs().max().item<double>();
      worst_weight = std::max(worst_weight, diff);
      CHECK(diff <= 3e-4);
    }
    WARN("DiT " << precision << ", CUDA graph vs eager after 20 steps: largest relative loss "
                   "difference " << worst_loss << ", largest weight difference " << worst_weight);
  }
}
