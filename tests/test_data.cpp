#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "catch_compat.h"
#include "core/config.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/idx_file.h"
#include "data/image_dataset.h"
#include "test_helpers.h"

using namespace mhla;
using test::contains;
using test::error_of;
namespace fs = std::filesystem;

namespace {

std::string idx_bytes(uint8_t type, const std::vector<uint32_t>& dims, size_t payload) {
  std::string out = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  for (size_t i = 0; i < payload; ++i) out.push_back(static_cast<char>(i % 7));
  return out;
}

void write_gz(const fs::path& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

}  // namespace

TEST_CASE("data: the real Fashion-MNIST loads with the right shapes and labels", "[data]") {
  Config c = parse_config("", "t", {});
  auto train = load_dataset(c, Split::kTrain);
  auto test = load_dataset(c, Split::kTest);
  CHECK(train.images.sizes() == std::vector<int64_t>{60000, 1, 28, 28});
  CHECK(test.images.sizes() == std::vector<int64_t>{10000, 1, 28, 28});
  auto counts = torch::bincount(train.labels);
  CHECK(torch::equal(counts, torch::full({10}, 6000, torch::kLong)));
  CHECK(test.labels.max().item<int64_t>() == 9);
  // Pixel statistics match the normalization constants we use.
  auto pixels = train.images.to(torch::kFloat64) / 255.0;
  CHECK(pixels.mean().item<double>() == Approx(train.mean).margin(1e-3));
  CHECK(pixels.std().item<double>() == Approx(train.stddev).margin(1e-3));
  Config limited = parse_config("", "t", {"data.train_limit=100", "data.test_limit=10"});
  CHECK(load_dataset(limited, Split::kTrain).size() == 100);
  CHECK(load_dataset(limited, Split::kTest).size() == 10);
}

TEST_CASE("data: IDX reader accepts raw and gzip, rejects every inconsistency with an offset", "[data]") {
  test::TempDir dir("idx");
  const auto good = idx_bytes(0x08, {3, 2, 2}, 12);
  auto raw = dir.path() / "good.idx";
  std::ofstream(raw, std::ios::binary) << good;
  auto array = read_idx_file(raw.string(), 3);
  CHECK(array.dims == std::vector<int64_t>{3, 2, 2});
  CHECK(array.data.size() == 12);
  write_gz(dir.path() / "good.gz", good);
  CHECK(read_idx_file((dir.path() / "good.gz").string(), 3).data == array.data);

  auto check = [&](const std::string& name, const std::string& bytes, int dims,
                   const std::string& expected) {
    auto path = dir.path() / name;
    write_gz(path, bytes);
    auto message = error_of([&] { read_idx_file(path.string(), dims); });
    INFO(message);
    CHECK(contains(message, path.string() + ": byte offset"));
    CHECK(contains(message, expected));
  };
  check("magic.gz", "\x01\x02" + good.substr(2), 3, "byte offset 0: bad magic");
  check("type.gz", idx_bytes(0x0D, {3, 2, 2}, 48), 3, "byte offset 2: element type 0x0d");
  check("dims.gz", good, 1, "byte offset 3: 3 dimensions, expected 1");
  check("truncated.gz", good.substr(0, good.size() - 5), 3, "byte offset 23: file truncated");
  check("header.gz", good.substr(0, 9), 3, "file ends inside the header");
  check("trailing.gz", good + "xyz", 3, "byte offset 28: unexpected bytes");
  check("zero.gz", idx_bytes(0x08, {3, 0, 2}, 0), 3, "dimension 2 is 0");
  CHECK(contains(error_of([&] { read_idx_file((dir.path() / "missing.gz").string(), 3); }),
                 "missing.gz: file not found"));
  // A gzip stream cut in the middle is reported, not read as short data silently.
  {
    write_gz(dir.path() / "big.gz", idx_bytes(0x08, {100, 28, 28}, 78400));
    std::ifstream in(dir.path() / "big.gz", std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir.path() / "cut.gz", std::ios::binary) << all.substr(0, all.size() / 2);
    auto message = error_of([&] { read_idx_file((dir.path() / "cut.gz").string(), 3); });
    INFO(message);
    CHECK(contains(message, "cut.gz: byte offset"));
  }
}

TEST_CASE("data: missing or inconsistent dataset files are named", "[data]") {
  test::TempDir dir("fmnist");
  Config c = parse_config("", "t", {"data.root=" + dir.str()});
  CHECK(contains(error_of([&] { load_dataset(c, Split::kTrain); }),
                 "train-images-idx3-ubyte.gz: file not found"));
  write_gz(dir.path() / "train-images-idx3-ubyte.gz", idx_bytes(0x08, {4, 28, 28}, 4 * 784));
  write_gz(dir.path() / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {5}, 5));
  CHECK(contains(error_of([&] { load_dataset(c, Split::kTrain); }), "holds 4 images but"));
  std::string labels = idx_bytes(0x08, {4}, 0) + std::string("\x01\x02\x0c\x03", 4);
  write_gz(dir.path() / "train-labels-idx1-ubyte.gz", labels);
  CHECK(contains(error_of([&] { load_dataset(c, Split::kTrain); }),
                 "byte offset 10: label 12 is outside 0..9"));
  Config missing = parse_config("", "t", {"data.root=/nonexistent/folder"});
  CHECK(contains(error_of([&] { load_dataset(missing, Split::kTrain); }),
                 "data.root = '/nonexistent/folder' is not a folder"));
}

TEST_CASE("data: the loader is deterministic whatever the thread count, and resumable", "[data]") {
  Config c = parse_config("", "t", {"data.train_limit=1000"});
  auto dataset = load_dataset(c, Split::kTrain);
  auto collect = [&](int64_t workers, int64_t epoch, int64_t start) {
    LoaderOptions o;
    o.batch_size = 64;
    o.workers = workers;
    o.prefetch = 3;
    o.out_size = 32;
    o.crop_padding = 2;
    o.hflip = true;
    o.shuffle = true;
    o.drop_last = true;
    o.seed = 11;
    o.epoch = epoch;
    o.start_batch = start;
    BatchLoader loader(dataset, o);
    std::vector<Batch> batches;
    while (auto b = loader.next()) batches.push_back(*b);
    return batches;
  };
  auto one = collect(1, 0, 0), four = collect(4, 0, 0), resumed = collect(3, 0, 5);
  REQUIRE(one.size() == 15);
  REQUIRE(four.size() == 15);
  REQUIRE(resumed.size() == 10);
  for (size_t i = 0; i < one.size(); ++i) {
    CHECK(torch::equal(one[i].images, four[i].images));
    CHECK(torch::equal(one[i].labels, four[i].labels));
    CHECK(one[i].index == static_cast<int64_t>(i));
  }
  for (size_t i = 0; i < resumed.size(); ++i) CHECK(torch::equal(resumed[i].images, one[i + 5].images));
  auto next_epoch = collect(2, 1, 0);
  CHECK_FALSE(torch::equal(next_epoch[0].labels, one[0].labels));
  // Every image of the epoch appears once.
  std::vector<torch::Tensor> labels;
  for (auto& b : one) labels.push_back(b.labels);
  CHECK(torch::cat(labels).numel() == 960);
}

TEST_CASE("data: without augmentation a batch is the normalized image centred on the canvas", "[data]") {
  Config c = parse_config("", "t", {"data.test_limit=8"});
  auto dataset = load_dataset(c, Split::kTest);
  LoaderOptions o;
  o.batch_size = 8;
  o.out_size = 32;
  BatchLoader loader(dataset, o);
  auto batch = *loader.next();
  auto expected = (dataset.images.to(torch::kFloat32) / 255.0 - dataset.mean) / dataset.stddev;
  auto centre = batch.images.slice(2, 2, 30).slice(3, 2, 30);
  CHECK(test::relative_error(centre, expected) < 1e-6);
  auto border = batch.images.slice(2, 0, 2);
  CHECK(border.sub(-dataset.mean / dataset.stddev).abs().max().item<double>() < 1e-6);
  CHECK(torch::equal(batch.labels, dataset.labels));
  CHECK_FALSE(loader.next().has_value());
}

TEST_CASE("data: augmentation shifts by at most the padding and flips", "[data]") {
  Config c = parse_config("", "t", {"data.test_limit=64"});
  auto dataset = load_dataset(c, Split::kTest);
  LoaderOptions o;
  o.batch_size = 64;
  o.out_size = 28;
  o.crop_padding = 2;
  o.hflip = true;
  o.seed = 3;
  BatchLoader loader(dataset, o);
  auto batch = *loader.next();
  auto clean = (dataset.images.to(torch::kFloat32) / 255.0 - dataset.mean) / dataset.stddev;
  const double background = -dataset.mean / dataset.stddev;
  int flips = 0, matched = 0;
  for (int64_t i = 0; i < 64; ++i) {
    bool found = false;
    for (bool flip : {false, true}) {
      auto img = flip ? clean[i].flip({2}) : clean[i];
      auto padded = torch::constant_pad_nd(img, {2, 2, 2, 2}, background);
      for (int64_t dy = 0; dy <= 4 && !found; ++dy) {
        for (int64_t dx = 0; dx <= 4 && !found; ++dx) {
          auto crop = padded.slice(1, dy, dy + 28).slice(2, dx, dx + 28);
          if ((crop - batch.images[i]).abs().max().item<double>() < 1e-5) {
            found = true;
            flips += flip;
          }
        }
      }
    }
    matched += found;
  }
  CHECK(matched == 64);
  CHECK(flips > 10);
  CHECK(flips < 54);
}
