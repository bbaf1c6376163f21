#include <filesystem>
#include <random>

#include "catch_compat.h"
#include "core/atomic_file.h"
#include "test_helpers.h"
#include "data/token_shard.h"
#include "text/bpe_tokenizer.h"
#include "text/pretokenizer.h"

using namespace mhla;
using test::contains;
using test::error_of;

namespace {

std::vector<std::string> pieces(const std::string& text) {
  std::vector<std::string> out;
  for (auto p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

std::string gpt2_folder() {
  for (const char* candidate : {"../shared/data/gpt2", "../../shared/data/gpt2"}) {
    auto path = std::filesystem::path(test::source_dir()) / candidate;
    if (std::filesystem::exists(path / "encoder.json")) return path.string();
  }
  return "";
}

}  // namespace

TEST_CASE("text: the GPT-2 pre-tokenizer splits like its regular expression", "[text]") {
  using V = std::vector<std::string>;
  CHECK(pieces("Hello world") == V{"Hello", " world"});
  CHECK(pieces("Hello world's 123 !!") == V{"Hello", " world", "'s", " 123", " !!"});
  CHECK(pieces("they're I'll we've") == V{"they", "'re", " I", "'ll", " we", "'ve"});
  CHECK(pieces("a  b") == V{"a", " ", " b"});
  CHECK(pieces("x\n\ny") == V{"x", "\n", "\n", "y"});
  CHECK(pieces("end.  ") == V{"end", ".", "  "});
  CHECK(pieces(" 'quoted'") == V{" '", "quoted", "'"});
  CHECK(pieces("caf\xC3\xA9 na\xC3\xAFve") == V{"caf\xC3\xA9", " na\xC3\xAFve"});  // é, ï are letters
  CHECK(pieces("x\xFF\xFEy") == V{"x", "\xFF\xFE", "y"});  // invalid UTF-8: "other" characters
  CHECK(pieces("\xE4\xB8\x80\xE4\xBA\x8C" "3") == V{"\xE4\xB8\x80\xE4\xBA\x8C", "3"});  // CJK letters
  std::string joined;
  for (auto& p : pieces("Mixed\t\tinput, with \xF0\x9F\x98\x80 emoji\r\n and 42.5%")) joined += p;
  CHECK(joined == "Mixed\t\tinput, with \xF0\x9F\x98\x80 emoji\r\n and 42.5%");
}

TEST_CASE("text: GPT-2's tokenizer reproduces the published encodings", "[text]") {
  const auto folder = gpt2_folder();
  if (folder.empty()) {
    WARN("../shared/data/gpt2 not found beside the source tree: skipped");
    return;
  }
  auto gpt2 = BpeTokenizer::load_gpt2(folder);
  CHECK(gpt2.vocab_size() == 50257);
  CHECK(gpt2.encode("Hello world") == std::vector<int32_t>{15496, 995});
  CHECK(gpt2.encode(" Hello world") == std::vector<int32_t>{18435, 995});
  CHECK(gpt2.special("<|endoftext|>") == 50256);
  // The special token's text is ordinary text to BPE: it never becomes id 50256.
  auto eot_text = gpt2.encode("<|endoftext|>");
  CHECK(std::find(eot_text.begin(), eot_text.end(), 50256) == eot_text.end());
  for (const std::string text : {"", "The King James Bible, 1611.\n\nIn the beginning",
                                 "caf\xC3\xA9 \xF0\x9F\x98\x80 \xFF\xFE raw bytes", "  leading spaces"}) {
    CHECK(gpt2.decode(gpt2.encode(text)) == text);
  }
}

TEST_CASE("text: a trained BPE round-trips arbitrary bytes and saves exactly", "[text]") {
  std::vector<std::string> corpus = {
      "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
      "must be in want of a wife.",
      "In the beginning God created the heaven and the earth. And the earth was without form, and "
      "void; and darkness was upon the face of the deep.",
      "the the the then there these those them they"};
  auto t = BpeTokenizer::train(corpus, 300);
  CHECK(t.vocab_size() == 300);
  CHECK(t.special("<|endoftext|>") == 299);
  // The first merge is the most frequent adjacent byte pair of the corpus's pieces: "th"/"he"
  // from the many "the"s ("he" appears in "the", "then", "there", ... as often as "th").
  const std::string first = t.token_bytes(256);
  CHECK((first == "th" || first == "he" || first == " t"));
  auto ids = t.encode(corpus[2]);
  CHECK(ids.size() < corpus[2].size() / 2);  // merges compress
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    std::string bytes(rng() % 200, '\0');
    for (auto& c : bytes) c = static_cast<char>(rng() & 0xFF);
    CHECK(t.decode(t.encode(bytes)) == bytes);
  }
  test::TempDir dir("tok");
  const auto path = (dir.path() / "tok.bpe").string();
  t.save(path);
  auto back = BpeTokenizer::load(path);
  CHECK(back.vocab_size() == t.vocab_size());
  for (const auto& text : corpus) CHECK(back.encode(text) == t.encode(text));
  auto again = BpeTokenizer::train(corpus, 300);  // deterministic
  CHECK(again.encode(corpus[0]) == t.encode(corpus[0]));
}

TEST_CASE("text: malformed tokenizer files are named with their line", "[text]") {
  test::TempDir dir("tokbad");
  auto path = dir.path() / "bad.bpe";
  test::write_text(path, "something else\n");
  CHECK(contains(error_of([&] { BpeTokenizer::load(path.string()); }), "bad.bpe:1: not an mhla tokenizer file"));
  auto t = BpeTokenizer::train({"abab abab abab"}, 260);
  t.save(path.string());
  std::string text = read_file(path.string());
  test::write_text(path, text.substr(0, text.rfind('\n', text.size() - 2) + 1));  // drop the last merge
  CHECK(contains(error_of([&] { BpeTokenizer::load(path.string()); }), "file ends where a merge was expected"));
  test::write_text(path, "mhla-bpe 1\nbytes 1 2\n");
  CHECK(contains(error_of([&] { BpeTokenizer::load(path.string()); }), "bad.bpe:2: byte table needs 256 ids"));
  CHECK(contains(error_of([&] { BpeTokenizer::train({"x"}, 100); }), "must be at least 257"));
  CHECK(contains(error_of([&] { t.decode({5000}); }), "id 5000 is outside the vocabulary"));
}

TEST_CASE("text: token shards round-trip and reject bad headers and truncation", "[text][data]") {
  test::TempDir dir("shard");
  const auto path = (dir.path() / "x.bin").string();
  std::vector<int32_t> tokens = {0, 1, 65535, 300, 7, 8191};
  write_token_shard(path, tokens, 65536);
  {
    TokenShard shard(path);
    REQUIRE(shard.size() == 6);
    CHECK(shard.vocab_size() == 65536);
    for (size_t i = 0; i < tokens.size(); ++i) CHECK(shard.tokens()[i] == tokens[i]);
  }
  CHECK(std::filesystem::file_size(path) == 32 + 12);
  CHECK(contains(error_of([&] { write_token_shard(path, {5, 9000}, 8192); }),
                 "token 9000 at position 1 is outside the vocabulary of 8192"));
  const std::string bytes = read_file(path);
  auto rewrite = [&](std::string b) { test::write_text(path, b); };
  rewrite(bytes.substr(0, bytes.size() - 3));
  CHECK(contains(error_of([&] { TokenShard s(path); }), "byte offset 41: the header announces 6 tokens"));
  CHECK(contains(error_of([&] { TokenShard s(path); }), "(truncated)"));
  rewrite(bytes + "zz");
  CHECK(contains(error_of([&] { TokenShard s(path); }), "(trailing bytes)"));
  rewrite("NOTASHRD" + bytes.substr(8));
  CHECK(contains(error_of([&] { TokenShard s(path); }), "byte offset 0: bad magic"));
  std::string version = bytes;
  version[8] = 2;
  rewrite(version);
  CHECK(contains(error_of([&] { TokenShard s(path); }), "byte offset 8: format version 2 is not supported"));
  rewrite(bytes.substr(0, 10));
  CHECK(contains(error_of([&] { TokenShard s(path); }), "too short"));
}
