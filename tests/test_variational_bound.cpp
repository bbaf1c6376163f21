// The learned-variance bound term (improved DDPM / DiT learn_sigma): the Gaussian KL and the
// discretized decoder likelihood against closed forms, the term vanishing at the true posterior,
// gradients reaching v but not epsilon, and a learned-variance DiT that trains and samples.
#include <cmath>

#include "catch_compat.h"
#include "core/config.h"
#include "diffusion/samplers.h"
#include "diffusion/variational_bound.h"
#include "models/dit.h"
#include "test_helpers.h"
#include "train/run_folder.h"
#include "train/task.h"
#include "train/trainer.h"

using namespace mhla;

TEST_CASE("bound: Gaussian KL and the discretized likelihood match closed forms", "[diffusion]") {
  auto d = torch::TensorOptions().dtype(torch::kFloat64);
  auto scalar = [&](double x) { return torch::tensor({x}, d); };
  CHECK(normal_kl(scalar(0.3), scalar(0.1), scalar(0.3), scalar(0.1)).item<double>() ==
        Approx(0.0).margin(1e-15));
  // KL(N(0.5, 2) || N(-0.3, 0.5)) = 0.5 (-1 + ln 0.25 + 4 + 0.64 / 0.5)
  const double expected = 0.5 * (-1.0 + std::log(0.25) + 4.0 + 0.64 / 0.5);
  CHECK(normal_kl(scalar(0.5), scalar(std::log(2.0)), scalar(-0.3), scalar(std::log(0.5)))
            .item<double>() == Approx(expected).epsilon(1e-12));
  // The 256 bins of [-1, 1] (outer bins open) carry all the probability.
  auto centers = torch::linspace(-1.0, 1.0, 256, d);
  auto probability = torch::exp(discretized_gaussian_log_likelihood(
      centers, torch::full_like(centers, 0.1), torch::full_like(centers, std::log(0.3))));
  CHECK(probability.sum().item<double>() == Approx(1.0).epsilon(1e-9));
  // A Gaussian centred on an inner bin: its mass there is erf(half bin / (sigma sqrt 2)).
  auto sharp = discretized_gaussian_log_likelihood(
      centers.narrow(0, 100, 1), centers.narrow(0, 100, 1), torch::full({1}, std::log(1e-3), d));
  CHECK(std::exp(sharp.item<double>()) ==
        Approx(std::erf((1.0 / 255.0) / (1e-3 * std::sqrt(2.0)))).epsilon(1e-9));
}

TEST_CASE("bound: zero at the true posterior; trains v only", "[diffusion]") {
  NoiseSchedule schedule("linear", 1000);
  torch::manual_seed(3);
  auto x0 = torch::rand({4, 1, 8, 8}) * 1.6 - 0.8;
  auto noise = torch::randn({4, 1, 8, 8});
  auto t = torch::tensor({3, 100, 500, 999}, torch::kLong);
  auto xt = schedule.add_noise(x0, noise, t);
  // v = -1 selects beta~_t; with the true noise the model mean is the true posterior mean.
  auto v = torch::full({4, 1, 8, 8}, -1.0);
  auto term = variational_bound_term(schedule, x0, xt, t, noise, v);
  CHECK(term.abs().max().item<double>() < 1e-4);
  // Away from it the term is positive; its gradient reaches v and never epsilon.
  auto eps = torch::randn({4, 1, 8, 8}).requires_grad_(true);
  auto v2 = torch::zeros({4, 1, 8, 8}).requires_grad_(true);
  auto loss = variational_bound_term(schedule, x0, xt, t, eps, v2).mean();
  CHECK(loss.item<double>() > 0.0);
  loss.backward();
  CHECK(v2.grad().abs().sum().item<double>() > 0.0);
  CHECK(!eps.grad().defined());
  // At t = 0 the term is the decoder NLL (bits per dimension): positive, finite.
  auto t0 = torch::zeros({4}, torch::kLong);
  auto nll = variational_bound_term(schedule, x0, schedule.add_noise(x0, noise, t0), t0, noise, v);
  CHECK((nll > 0).all().item<bool>());
  CHECK(nll.isfinite().all().item<bool>());
}

TEST_CASE("bound: a learned-variance DiT trains and samples with DDPM and DDIM", "[train]") {
  test::TempDir dir("dit-sigma");
  Config c = parse_config(
      "", "dit.yaml",
      {"model.name=dit", "model.image_size=28", "model.patch_size=4", "model.width=32",
       "model.depth=1", "model.heads=2", "model.learn_sigma=true", "attention.blocks=4",
       "data.train_limit=1024", "data.test_limit=128", "data.batch_size=64", "train.epochs=4",
       "optim.lr=2e-3", "optim.weight_decay=0", "train.eval_every=0", "diffusion.steps=50",
       "train.device=cpu", "run.root=" + dir.str(), "run.name=sigma"});
  auto task = task_registry().get("diffusion").make(c, torch::kCPU);
  auto fresh = model_registry().get("dit").make(c);
  const double before = -task->evaluate(*fresh).score;
  auto run_dir = create_run_folder(c);
  Trainer trainer(c, run_dir, false);
  auto outcome = trainer.run();
  const double after = outcome.final_eval["diffusion_loss"].get<double>();
  INFO("before " << before << " after " << after);
  CHECK(after < 0.7 * before);
  auto model = model_registry().get("dit").make(c);
  auto& dit = dynamic_cast<Dit&>(*model);
  CHECK(dit.output_channels() == 2);
  model->eval();
  torch::NoGradGuard no_grad;
  NoiseSchedule schedule("linear", 50);
  EpsilonFn eps = [&](const torch::Tensor& x, const torch::Tensor& t) {
    return dit.denoise(x, t, torch::zeros({x.size(0)}, torch::kLong));
  };
  torch::Generator generator = at::detail::createCPUGenerator(1);
  SamplerOptions options;
  options.steps = 5;
  auto noise = torch::randn({2, 1, 28, 28});
  auto ddpm = ddpm_sample(schedule, eps, noise, options, generator);
  auto ddim = ddim_sample(schedule, eps, noise, options, generator);
  CHECK(ddpm.sizes() == noise.sizes());
  CHECK(ddim.sizes() == noise.sizes());
  CHECK(ddpm.isfinite().all().item<bool>());
}
