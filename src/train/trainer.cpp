#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include "core/device.h"
#include "core/environment.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/progress.h"
#include "train/schedule.h"
#include "train/stop_signal.h"

namespace mhla {

namespace fs = std::filesystem;

Trainer::Trainer(const Config& config, const std::string& run_dir, bool resume)
    : config_(config),
      deterministic_sums_(config.train.deterministic),
      run_dir_(run_dir),
      device_(resolve_device(config)),
      bf16_(uses_bf16_autocast(config, device_)),
      metrics_(run_dir) {
  if (config.train.threads > 0) torch::set_num_threads(static_cast<int>(config.train.threads));
  torch::manual_seed(static_cast<uint64_t>(config.train.seed));
  const auto& entry = model_registry().get(config.model.name);
  task_ = task_registry().get(entry.task).make(config, device_);
  steps_per_epoch_ = task_->steps_per_epoch();
  total_steps_ = steps_per_epoch_ * config.train.epochs;

  model_ = entry.make(config);
  model_->to(device_);
  auto groups = make_param_groups(*model_, config.optim.weight_decay);
  for (const auto& group : groups)
    for (const auto& p : group.params) params_.push_back(p);
  optimizer_ = optimizer_registry().get(config.optim.name).make(std::move(groups), config.optim);
  if (config.train.ema_decay > 0) {
    ema_ = std::make_unique<Ema>(*model_, config.train.ema_decay, config.train.ema_warmup);
  }
  std::function<TensorMap()> ema_weights;
  if (ema_) ema_weights = [this] { return ema_->tensors(); };
  task_->attach_run(run_dir_, ema_weights);

  if (resume) {
    Checkpoint checkpoint = read_checkpoint((fs::path(run_dir) / "checkpoints" / "last").string());
    const std::string weights_file = checkpoint.dir + "/model.safetensors";
    load_model_weights(*model_, checkpoint.weights, weights_file);
    if (checkpoint.optimizer.empty()) {
      fail("{}/optimizer.safetensors: missing; cannot resume exactly", checkpoint.dir);
    }
    optimizer_->load_state(checkpoint.optimizer, checkpoint.dir + "/optimizer.safetensors");
    state_ = checkpoint.state;
    if (ema_) {
      if (checkpoint.ema.empty())
        fail("{}/ema.safetensors: missing; cannot resume exactly", checkpoint.dir);
      ema_->load(checkpoint.ema, checkpoint.dir + "/ema.safetensors");
    }
    restore_rng_state(state_.cpu_rng, false, checkpoint.dir + "/trainer.json");
    if (device_.is_cuda() && !state_.cuda_rng.empty()) {
      restore_rng_state(state_.cuda_rng, true, checkpoint.dir + "/trainer.json");
    }
    metrics_.truncate_after(state_.step);
  }
  if (config.train.cuda_graph) {
    if (!device_.is_cuda()) {
      fail("{}: train.cuda_graph = true needs a CUDA device; this run is on {}",
           config.where("train.cuda_graph"), device_.str());
    }
    step_graph_ = std::make_unique<StepGraph>(
        device_,
        [this](const TrainBatch& batch, const torch::Tensor& lr) {
          auto loss = forward_backward(batch);
          optimizer_->step(lr);
          model_->project_parameters();
          return loss;
        },
        [this] { optimizer_->zero_grad(); });
  }
}

torch::Tensor Trainer::forward_backward(const TrainBatch& batch) {
  torch::Tensor loss;
  {
    AutocastScope autocast(device_, bf16_);
    loss = task_->training_loss(*model_, batch);
  }
  loss.backward();
  clip_grad_norm(params_, config_.optim.grad_clip);
  return loss.detach();
}

torch::Tensor Trainer::eager_step(const TrainBatch& batch, double lr) {
  auto loss = forward_backward(batch);
  optimizer_->step(lr);
  model_->project_parameters();
  optimizer_->zero_grad();
  return loss;
}

void Trainer::save(const std::string& name) {
  state_.cpu_rng = capture_rng_state(false);
  state_.cuda_rng = device_.is_cuda() ? capture_rng_state(true) : "";
  save_checkpoint((fs::path(run_dir_) / "checkpoints" / name).string(), config_, *model_,
                  optimizer_.get(), state_, ema_ ? ema_->tensors() : TensorMap{});
}

void Trainer::evaluate_and_record(int64_t epoch) {
  last_eval_ = task_->evaluate(*model_);
  evaluated_ = true;
  logger().info("eval epoch {}/{} step {}: {}", epoch + 1, config_.train.epochs, state_.step,
                last_eval_.summary);
  metrics_.write({{"step", state_.step},
                  {"epoch", epoch + 1},
                  {"eval", last_eval_.metrics},
                  {"train_seconds", state_.train_seconds}});
  if (state_.best_step < 0 || last_eval_.score > state_.best_score) {
    state_.best_score = last_eval_.score;
    state_.best_step = state_.step;
    save("best");
  }
}

TrainOutcome Trainer::run() {
  const auto& c = config_;
  ScheduleSpec schedule{c.optim.lr, c.schedule.min_lr,
                        static_cast<int64_t>(std::llround(c.schedule.warmup_epochs *
                                                          static_cast<double>(steps_per_epoch_))),
                        total_steps_};
  const auto& lr_at = schedule_registry().get(c.schedule.name).lr;

  logger().info(
      "run {}: {} with {} attention ({} parameters) on {}{}, {}, {} steps ({} epochs "
      "x {})",
      run_dir_, c.model.name,
      c.attention.pattern.empty() ? c.attention.type : "[" + c.attention.pattern + "]",
      model_->parameter_count(), device_.str(), bf16_ ? " (bf16 autocast)" : "", task_->describe(),
      total_steps_, c.train.epochs, steps_per_epoch_);
  if (const auto switches = environment_switches_set(); !switches.empty()) {
    logger().info("kernel switches from the environment: {}", switches);
  }
  for (const auto& warning : environment_switch_warnings()) {
    logger().info("warning: {}", warning);
  }
  if (state_.step > 0) {
    logger().info("resuming at step {} (epoch {}, batch {})", state_.step, state_.epoch + 1,
                  state_.batch_in_epoch);
  }

  TrainOutcome outcome;
  outcome.run_dir = run_dir_;
  if (state_.epoch >= c.train.epochs) {
    logger().info("the run is complete ({} steps); nothing to do", state_.step);
    outcome.steps = state_.step;
    return outcome;
  }
  model_->train();
  StepProfiler profiler(run_dir_, device_, {state_.step + profile_.first_step, profile_.steps});
  auto loss_sum = torch::zeros({}, torch::TensorOptions().device(device_));
  int64_t loss_count = 0;
  auto window_start = std::chrono::steady_clock::now();
  int64_t window_steps = 0;
  double seconds_per_step = NAN;

  for (int64_t epoch = state_.epoch; epoch < c.train.epochs; ++epoch) {
    auto batches = task_->epoch(epoch, state_.epoch == epoch ? state_.batch_in_epoch : 0);
    state_.epoch = epoch;

    while (auto batch = batches->next()) {
      const double lr = lr_at(schedule, state_.step);
      profiler.before_step(state_.step);
      const torch::Tensor loss =
          step_graph_ ? step_graph_->step(*batch, lr) : eager_step(*batch, lr);
      if (ema_) ema_->update(*model_, state_.step);  // step counts the updates before this one
      profiler.after_step(state_.step);
      loss_sum += loss;
      ++loss_count;
      ++state_.step;
      ++window_steps;
      state_.batch_in_epoch = batch->index + 1;

      const bool stop = stop_requested() != 0 || (stop_after_ > 0 && state_.step >= stop_after_);
      if (state_.step % c.train.log_every == 0 || stop || state_.step == total_steps_) {
        const double mean_loss = loss_sum.item<double>() / static_cast<double>(loss_count);
        if (!std::isfinite(mean_loss)) {
          // Stop before a diverged model overwrites the last good checkpoint.
          fail(
              "training diverged: mean loss over steps {}..{} is {} (lr {:.2e}); the last good "
              "checkpoint is {}/checkpoints/last; try a lower optim.lr or optim.grad_clip",
              state_.step - loss_count + 1, state_.step, mean_loss, lr, run_dir_);
        }
        const auto now = std::chrono::steady_clock::now();
        const double window = std::chrono::duration<double>(now - window_start).count();
        state_.train_seconds += window;
        seconds_per_step = window / static_cast<double>(window_steps);
        const double rate = static_cast<double>(window_steps * task_->samples_per_step()) / window;
        logger().info(
            "epoch {}/{} step {}/{} loss {:.4f} lr {:.2e} | {:.0f} {}/s | ETA {}", epoch + 1,
            c.train.epochs, state_.step, total_steps_, mean_loss, lr, rate, task_->unit(),
            format_duration(seconds_per_step * static_cast<double>(total_steps_ - state_.step)));
        metrics_.write({{"step", state_.step},
                        {"epoch", epoch + 1},
                        {"loss", mean_loss},
                        {"lr", lr},
                        {std::string(task_->unit()) + "_per_second", rate},
                        {"train_seconds", state_.train_seconds}});
        loss_sum.zero_();
        loss_count = 0;
        window_steps = 0;
        window_start = std::chrono::steady_clock::now();
      }
      if (stop) {
        save("last");
        outcome.interrupted = true;
        outcome.signal = stop_requested();
        outcome.steps = state_.step;
        outcome.train_seconds = state_.train_seconds;
        logger().info(
            "stopped at step {}{}; checkpoint written to {}/checkpoints/last; continue "
            "with: mhla train --resume {}",
            state_.step, outcome.signal ? fmt::format(" (signal {})", outcome.signal) : "",
            run_dir_, run_dir_);
        return outcome;
      }
      if (c.train.eval_every_steps > 0 && state_.step % c.train.eval_every_steps == 0 &&
          state_.step != total_steps_) {
        const auto now = std::chrono::steady_clock::now();
        state_.train_seconds += std::chrono::duration<double>(now - window_start).count();
        evaluate_and_record(epoch);
        model_->train();
        // The next rate covers training steps only (the window restarts); losses keep accumulating.
        window_start = std::chrono::steady_clock::now();
        window_steps = 0;
      }
    }
    // Time since the last progress line belongs to training, not to the evaluation below.
    const auto now = std::chrono::steady_clock::now();
    state_.train_seconds += std::chrono::duration<double>(now - window_start).count();
    state_.epoch = epoch + 1;
    state_.batch_in_epoch = 0;
    const bool last_epoch = epoch + 1 == c.train.epochs;
    if (last_epoch || (c.train.eval_every > 0 && (epoch + 1) % c.train.eval_every == 0)) {
      evaluate_and_record(epoch);
    }
    if (last_epoch ||
        (c.train.checkpoint_every > 0 && (epoch + 1) % c.train.checkpoint_every == 0)) {
      save("last");
    }
    window_start = std::chrono::steady_clock::now();
    window_steps = 0;
  }
  outcome.steps = state_.step;
  if (evaluated_) {
    outcome.final_eval = last_eval_.metrics;
    outcome.final_score = last_eval_.score;
  }
  outcome.train_seconds = state_.train_seconds;
  logger().info("done: {} steps, {} of training; final {}; best checkpoint at step {}", state_.step,
                format_duration(state_.train_seconds),
                evaluated_ ? last_eval_.summary : std::string("(no evaluation)"), state_.best_step);
  return outcome;
}

}  // namespace mhla
