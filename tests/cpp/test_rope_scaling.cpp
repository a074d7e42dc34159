// The rope_scaling rules (SPEC §4) from C++: every case of tests/data/rope_scaling_cases.json
// (also read by tests/python/test_rope_scaling_cases.py) gives the exact same message, or
// is accepted, through parse_rope_scaling + make_rope_schedule.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <optional>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ropepool/error.hpp"
#include "ropepool/rope_scaling.hpp"
#include "ropepool/schedule.hpp"

namespace ropepool {
namespace {

// ---- a small JSON reader (what the data file uses: objects, arrays, strings without
// escapes other than \" and \\, numbers, true/false/null); ints and floats kept apart, as
// Python's json module does.
struct Json {
  enum Kind { Null, Bool, Int, Float, String, Array, Object } kind = Null;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<Json> items;  // an array's elements, or an object's values
  // An object's keys, in file order, keys[n] naming items[n] (two vectors: a vector of
  // pair<string, Json> inside Json needs a complete Json, which clang's libstdc++ checks).
  std::vector<std::string> keys;

  const Json* get(const std::string& key) const {
    for (size_t n = 0; n < keys.size(); ++n)
      if (keys[n] == key) return &items[n];
    return nullptr;
  }
};

class Reader {
 public:
  explicit Reader(std::string text) : t_(std::move(text)) {}
  Json value() {
    skip();
    const char c = t_.at(p_);
    if (c == '{') return object();
    if (c == '[') return array();
    if (c == '"') {
      Json j;
      j.kind = Json::String;
      j.s = string();
      return j;
    }
    if (t_.compare(p_, 4, "true") == 0) return p_ += 4, boolean(true);
    if (t_.compare(p_, 5, "false") == 0) return p_ += 5, boolean(false);
    if (t_.compare(p_, 4, "null") == 0) return p_ += 4, Json{};
    return number();
  }

 private:
  std::string t_;
  size_t p_ = 0;
  void skip() {
    while (p_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[p_]))) ++p_;
  }
  static Json boolean(bool b) {
    Json j;
    j.kind = Json::Bool;
    j.b = b;
    return j;
  }
  std::string string() {
    std::string out;
    ++p_;  // opening quote
    while (t_.at(p_) != '"') {
      if (t_[p_] == '\\') ++p_;
      out += t_[p_++];
    }
    ++p_;
    return out;
  }
  Json number() {
    const size_t start = p_;
    while (p_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[p_])) ||
                              std::string("+-.eE").find(t_[p_]) != std::string::npos))
      ++p_;
    const std::string text = t_.substr(start, p_ - start);
    Json j;
    if (text.find_first_of(".eE") == std::string::npos) {
      j.kind = Json::Int;
      j.i = std::stoll(text);
    } else {
      j.kind = Json::Float;
      j.f = std::strtod(text.c_str(), nullptr);
    }
    return j;
  }
  Json array() {
    Json j;
    j.kind = Json::Array;
    ++p_;
    skip();
    if (t_[p_] == ']') return ++p_, j;
    for (;;) {
      j.items.push_back(value());
      skip();
      if (t_[p_++] == ']') return j;
    }
  }
  Json object() {
    Json j;
    j.kind = Json::Object;
    ++p_;
    skip();
    if (t_[p_] == '}') return ++p_, j;
    for (;;) {
      skip();
      std::string key = string();
      skip();
      ++p_;  // ':'
      j.keys.push_back(key);
      j.items.push_back(value());
      skip();
      if (t_[p_++] == '}') return j;
    }
  }
};

ScalingValue to_value(const Json& j) {
  switch (j.kind) {
    case Json::Null: return ScalingValue::null();
    case Json::Bool: return ScalingValue::of(j.b);
    case Json::Int: return ScalingValue::of(j.i);
    case Json::Float: return ScalingValue::of(j.f);
    case Json::String: return ScalingValue::of(j.s);
    case Json::Array: {
      std::vector<double> list;
      for (const Json& x : j.items) {
        if (x.kind != Json::Int && x.kind != Json::Float) {
          ScalingValue v;
          v.kind = ScalingValue::Kind::Other;
          v.text = "list containing a non-number";
          return v;
        }
        list.push_back(x.kind == Json::Int ? double(x.i) : x.f);
      }
      return ScalingValue::of(std::move(list));
    }
    case Json::Object: break;
  }
  ScalingValue v;
  v.kind = ScalingValue::Kind::Other;
  v.text = "dict";
  return v;
}

const Json& cases() {
  static const Json all = [] {
    std::string path = __FILE__;
    path = path.substr(0, path.rfind("/tests/cpp/")) + "/tests/data/rope_scaling_cases.json";
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return Reader(text.str()).value();
  }();
  return all;
}

// What the Python front end does with one case: parse the dict, make the schedule.
std::string run_case(const Json& c) {
  const Json& kw = *c.get("keywords");
  auto integer = [&](const char* key) -> std::optional<int64_t> {
    const Json* v = kw.get(key);
    return v ? std::optional<int64_t>(v->i) : std::nullopt;
  };
  RopePoolParams p;
  p.head_dim = kw.get("head_dim") ? kw.get("head_dim")->i : 128;
  p.rope_base = kw.get("rope_base") ? kw.get("rope_base")->f : 10000.0;
  p.rotary_dim = kw.get("rotary_dim") ? kw.get("rotary_dim")->i : 0;
  RopeScalingContext context;
  context.rope_base = p.rope_base;
  context.max_position_embeddings = integer("max_position_embeddings");
  context.original_max_position_embeddings = integer("original_max_position_embeddings");
  context.seq_len = integer("seq_len");
  if (const Json* v = kw.get("mrope_section")) {
    std::vector<int64_t> section;
    for (const Json& x : v->items) section.push_back(x.i);
    context.mrope_section = section;
  }
  if (const Json* v = kw.get("mrope_interleaved")) context.mrope_interleaved = v->b;
  ScalingEntries entries;
  if (const Json* rs = c.get("rope_scaling"))
    for (size_t n = 0; n < rs->keys.size(); ++n) entries.emplace_back(rs->keys[n], to_value(rs->items[n]));
  try {
    p.rope_scaling = parse_rope_scaling(entries, context);
    make_rope_schedule(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(RopeScalingCases, SameMessagesAsPython) {
  const Json& all = *cases().get("cases");
  ASSERT_GT(all.items.size(), 20u) << "data file not found or empty";
  for (size_t i = 0; i < all.items.size(); ++i) {
    const Json& c = all.items[i];
    const Json& want = *c.get("message");
    SCOPED_TRACE("case " + std::to_string(i));
    EXPECT_EQ(run_case(c), want.kind == Json::Null ? std::string() : want.s);
  }
}

TEST(RopeScalingCases, RopeTypeParserIsPublic) {
  EXPECT_EQ(parse_rope_type("su"), RopeType::LongRope);
  EXPECT_EQ(parse_rope_type("yarn"), RopeType::Yarn);
  EXPECT_EQ(parse_rope_type("mrope"), RopeType::Default);  // Qwen2-VL's configs (SPEC §7)
  EXPECT_THROW(parse_rope_type("ntk"), Error);
}

// Phi-3 (issue #9): the dict alone is an error; with the top-level length the schedule
// switches to long factors past 4096 and the attention factor is transformers' ~1.19.
TEST(RopeScalingCases, Phi3NeedsItsTopLevelLength) {
  ScalingEntries e = {{"type", ScalingValue::of("longrope")},
                      {"short_factor", ScalingValue::of(std::vector<double>(48, 1.0))},
                      {"long_factor", ScalingValue::of(std::vector<double>(48, 2.0))}};
  RopeScalingContext ctx;
  ctx.max_position_embeddings = 131072;
  ctx.seq_len = 5000;
  RopePoolParams p;
  p.head_dim = 96;
  p.rope_scaling = parse_rope_scaling(e, ctx);
  EXPECT_THROW(make_rope_schedule(p), Error);
  ctx.original_max_position_embeddings = 4096;
  p.rope_scaling = parse_rope_scaling(e, ctx);
  const RopeSchedule s = make_rope_schedule(p);
  EXPECT_NEAR(s.attention_scaling, std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-15);
  EXPECT_NEAR(s.inv_freq[1], std::pow(10000.0, -2.0 / 96) / 2.0, 1e-15);  // long factors
}

// An inv_freq table replaces rope_scaling: both given is an error in C++ too (SPEC §4).
TEST(RopeScalingCases, InvFreqWithRopeScalingIsAnError) {
  std::vector<float> table(64, 0.5f);
  RopePoolParams p;
  p.head_dim = 128;
  p.inv_freq = TensorView::contiguous(table.data(), DType::Float32, {64});
  EXPECT_NO_THROW(make_rope_schedule(p));
  p.rope_scaling.type = RopeType::Linear;
  p.rope_scaling.factor = 2.0;
  try {
    make_rope_schedule(p);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "rope_pool_fused: inv_freq replaces rope_scaling (and max_position_embeddings, "
              "original_max_position_embeddings, seq_len); pass one or the other");
  }
}

}  // namespace
}  // namespace ropepool
