#include "attention/attention_type.h"
#include "catch_compat.h"
#include "core/config.h"
#include "models/deit.h"
#include "test_helpers.h"
#include "train/optimizer.h"

using namespace mhla;

TEST_CASE("model: DeiT builds for every attention type and gives finite logits and grads", "[model]") {
  for (const auto& attention : attention_registry().names()) {
    INFO(attention);
    Config c = parse_config("", "t", {"model.width=32", "model.depth=2", "model.heads=2",
                                      "model.patch_size=4", "model.image_size=28",
                                      "attention.type=" + attention,
                                      "attention.blocks=4", "model.drop_path=0.2"});
    auto model = model_registry().get("deit").make(c);
    auto x = torch::randn({3, 1, 28, 28});
    auto logits = model->forward(x);
    CHECK(logits.sizes() == std::vector<int64_t>{3, 10});
    CHECK(logits.isfinite().all().item<bool>());
    logits.sum().backward();
    for (const auto& item : model->named_parameters()) {
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      CHECK(item.value().grad().isfinite().all().item<bool>());
    }
  }
}

TEST_CASE("model: the patch grid is padded to whole tiles, tokens block-major", "[model]") {
  // 28 px with patch 4 -> 7x7 grid; 4 blocks (2x2 tiles) need an even grid -> 8x8 (32 px).
  Config c = parse_config("", "t", {"model.image_size=28", "model.patch_size=4", "attention.blocks=4"});
  auto layout = image_token_layout(c);
  CHECK(layout.grid_h == 8);
  CHECK(layout.tiles_h == 2);
  CHECK(layout.tile_h() == 4);
  Config softmax = parse_config("", "t", {"model.image_size=28", "model.patch_size=4",
                                          "attention.type=softmax", "attention.blocks=4"});
  CHECK(image_token_layout(softmax).grid_h == 7);
  CHECK(image_token_layout(softmax).blocks() == 1);
  Config t2 = load_config(test::source_dir() + "/configs/deit_t2_fmnist.yaml", {});
  auto t2_layout = image_token_layout(t2);
  CHECK(t2_layout.tokens() == 256);
  CHECK(t2_layout.blocks() == 16);
  CHECK(t2_layout.tile_h() == 4);
}

TEST_CASE("model: weight decay skips norms, biases, embeddings and MHLA mixing", "[model]") {
  Config c = parse_config("", "t", {"model.width=32", "model.depth=1", "model.heads=2"});
  auto model = model_registry().get("deit").make(c);
  auto groups = make_param_groups(*model, 0.05);
  REQUIRE(groups.size() == 2);
  auto in = [](const ParamGroup& g, const std::string& name) {
    return std::find(g.names.begin(), g.names.end(), name) != g.names.end();
  };
  CHECK(in(groups[0], "blocks.0.attn.qkv.weight"));
  CHECK(in(groups[0], "patch_embed.weight"));
  CHECK(in(groups[1], "blocks.0.attn.mixing"));
  CHECK(in(groups[1], "pos_embed"));
  CHECK(in(groups[1], "blocks.0.norm1.weight"));
  CHECK(in(groups[1], "head.bias"));
  CHECK(groups[1].weight_decay == 0.0);
  CHECK(groups[0].weight_decay == 0.05);
}

TEST_CASE("model: gated DeltaNet's A_log and dt_bias get no weight decay", "[model]") {
  for (const char* type : {"gated_deltanet", "kda"}) {
    INFO(type);
    Config c = parse_config("", "t", {"model.width=32", "model.depth=1", "model.heads=2",
                                      std::string("attention.type=") + type});
    auto model = model_registry().get("deit").make(c);
    auto groups = make_param_groups(*model, 0.05);
    auto in = [](const ParamGroup& g, const std::string& name) {
      return std::find(g.names.begin(), g.names.end(), name) != g.names.end();
    };
    CHECK(in(groups[1], "blocks.0.attn.A_log"));
    CHECK(in(groups[1], "blocks.0.attn.dt_bias"));
    CHECK(in(groups[0], "blocks.0.attn.decay_proj.weight"));
  }
}

TEST_CASE("model: DeiT and GPT with each GPU attention backend match the reference backend", "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  for (const char* model_name : {"deit", "gpt"}) {
    // Gated DeltaNet and KDA: the cuda backend also takes the layer's short-conv and gated-norm
    // kernels (bidirectional DeiT reads the sequence both ways), the reference backend neither.
    for (const char* attention : {"linear", "mhla", "gated_deltanet", "kda"}) {
      for (const auto& [backend, op] : attention_registry().get(attention).backends) {
        const bool causal = std::string(model_name) == "gpt";
        if (backend == "reference" || (causal && attention_registry().get(attention).bidirectional_only.count(backend))) continue;
        INFO(model_name << " / " << attention << " / " << backend);
        auto make = [&](const std::string& chosen) {
          std::vector<std::string> o = {"model.name=" + std::string(model_name), "model.width=64",
                                        "model.depth=2", "model.heads=2", "model.drop_path=0",
                                        "attention.type=" + std::string(attention),
                                        "attention.backend=" + chosen};
          if (causal) {
            o.push_back("model.vocab_size=97");
            o.push_back("model.context=192");  // 3 blocks of 64
            o.push_back("attention.blocks=3");
          }
          Config c = parse_config("", "t", o);
          torch::manual_seed(5);
          auto model = model_registry().get(model_name).make(c);
          model->to(torch::kCUDA);
          return model;
        };
        auto reference = make("reference"), cuda = make(backend);
        torch::manual_seed(6);
        auto cuda_long = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kLong);
        torch::Tensor input, labels;
        if (causal) {
          input = torch::randint(0, 97, {3, 150}, cuda_long);  // a partial last block
          labels = torch::randint(0, 97, {3 * 150}, cuda_long);
        } else {
          input = torch::randn({8, 1, 32, 32}, torch::TensorOptions().device(torch::kCUDA));
          labels = torch::randint(0, 10, {8}, cuda_long);
        }
        auto loss_of = [&](Model& model) {
          auto logits = model.forward(input);
          auto loss = torch::nn::functional::cross_entropy(logits.reshape({labels.size(0), -1}), labels);
          loss.backward();
          return loss.item<double>();
        };
        // fp32 inputs: the kernels multiply in tf32, the reference in fp32.
        CHECK(loss_of(*cuda) == Approx(loss_of(*reference)).epsilon(2e-3));
        auto grads_ref = reference->named_parameters(), grads_cuda = cuda->named_parameters();
        for (const auto& item : grads_ref) {
          INFO(item.key());
          if (!item.value().grad().defined()) continue;
          // The mixing gradient's row-scale component is rounding noise (see the op tests): looser.
          const double tolerance = item.key().find("mixing") != std::string::npos ? 5e-2 : 2e-2;
          CHECK(test::relative_error(grads_cuda[item.key()].grad().cpu(), item.value().grad().cpu()) < tolerance);
        }
      }
    }
  }
}

TEST_CASE("model: every model leaves the attention's own parameters at the attention's init", "[model]") {
  // fla's ranges: A_log = log U(1e-4, 16); dt in [1e-4, 0.1] -> dt_bias = softplus^-1(dt) in
  // [-9.3, -2.2]. A model's generic init (normal(0, 0.02), zeros) would land near 0 instead.
  // MHLA's mixing rows sum to one (locality init; causal: 1/(i+1) on the lower triangle).
  const std::vector<std::string> base = {"model.width=32", "model.depth=1", "model.heads=2"};
  for (const char* model : {"deit", "dit", "gpt"}) {
    for (const char* attention : {"gated_deltanet", "mhla"}) {
      INFO(model << " / " << attention);
      auto o = base;
      o.push_back(std::string("model.name=") + model);
      o.push_back(std::string("attention.type=") + attention);
      if (std::string(model) == "gpt") {
        o.insert(o.end(), {"model.vocab_size=300", "model.context=128", "attention.blocks=2"});
      } else if (std::string(model) == "dit") {
        o.insert(o.end(), {"model.image_size=28", "model.patch_size=4", "attention.blocks=4"});
      }
      auto m = model_registry().get(model).make(parse_config("", "t", o));
      int checked = 0;
      for (const auto& item : m->named_parameters()) {
        const auto& name = item.key();
        const auto& p = item.value();
        if (name.size() >= 5 && name.substr(name.size() - 5) == "A_log") {
          CHECK(p.min().item<double>() >= std::log(1e-4) - 1e-4);
          CHECK(p.max().item<double>() > 0.5);  // some heads decay fast
          ++checked;
        } else if (name.size() >= 7 && name.substr(name.size() - 7) == "dt_bias") {
          CHECK(p.max().item<double>() < -2.0);
          CHECK(p.min().item<double>() > -9.5);
          ++checked;
        } else if (name.size() >= 6 && name.substr(name.size() - 6) == "mixing") {
          CHECK(test::relative_error(p.sum(1), torch::ones({p.size(0)})) < 1e-5);
          ++checked;
        }
      }
      CHECK(checked > 0);
    }
  }
}
