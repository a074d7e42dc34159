// SPEC §2 and §3 through the C++ API: the exact messages, their order, the hints, and
// that a rejected call writes nothing at all.
#include <cmath>
#include <limits>

#include "test_support.hpp"

namespace ropepool::test {
namespace {

// The call every mutation starts from: T = 2, Hq = 8, Hk = 2, D = 128, P = 16, float32, so
// the default C++ shape format prints q as "[2, 8, 128]". The generous tail slack keeps a
// mutated view (one head more, stride 2, ...) inside its buffer should validation ever let
// it through.
Shape base_shape() { return Shape{}; }
Layout base_layout() {
  Layout l;
  l.tail_slack = 8192;
  return l;
}

std::string strides_str(const TensorView& v) {
  std::string s = "(";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.strides[i]);
  return s + ")";
}

std::vector<TensorView*> float_tensors(RopePoolTensors& t) {
  return {&t.q, &t.k, &t.v, &t.k_pool, &t.v_pool, &t.q_out, &t.k_out};
}

void add_unit_dim(TensorView& v) {  // [..] -> [.., 1]
  v.shape[v.ndim] = 1;
  v.strides[v.ndim] = 1;
  ++v.ndim;
}

/// One way to break a call. Mutations edit relative to the current state, so applying two
/// of them breaks both checks, and the expected message is computed from the final state
/// (a later mutation may change a shape the earlier message prints).
struct Mutation {
  const char* name;
  std::function<void(Case&)> apply;
  std::function<std::string(const Case&)> message;
  const char* literal;  // the message when applied alone to the base call
  bool has_hint;        // src/rope_pool.cpp attaches a hint
};

// In SPEC §2 order: the 11 contract checks, then the extended ones SPEC §2 lists
// (positions/slots dtype, head_dim, rope_base, float dtype, devices, layout, slot range).
// The head-count and q_out/k_out checks are not in the SPEC list: they sit where the
// implementation has them, and the order test only requires them after the 11.
const std::vector<Mutation>& mutations() {
  static const std::vector<Mutation> all = {
      {"qkv_not_3d", [](Case& c) { add_unit_dim(c.tensors.q); },
       [](const Case&) { return std::string("rope_pool_fused expects q/k/v to be 3-D"); },
       "rope_pool_fused expects q/k/v to be 3-D", false},
      {"index_not_1d", [](Case& c) { add_unit_dim(c.tensors.slots); },
       [](const Case&) { return std::string("rope_pool_fused expects positions/slots to be 1-D"); },
       "rope_pool_fused expects positions/slots to be 1-D", false},
      {"pool_not_3d",
       [](Case& c) {
         // k_pool as a layer-stacked [1, P, Hk, D] cache.
         TensorView& p = c.tensors.k_pool;
         for (int i = p.ndim; i > 0; --i) {
           p.shape[i] = p.shape[i - 1];
           p.strides[i] = p.strides[i - 1];
         }
         p.strides[0] = p.shape[1] * p.strides[1];
         p.shape[0] = 1;
         ++p.ndim;
       },
       [](const Case&) { return std::string("rope_pool_fused expects pool tensors to be 3-D"); },
       "rope_pool_fused expects pool tensors to be 3-D", true},
      {"q_shape", [](Case& c) { c.tensors.q.shape[1] += 1; },
       [](const Case& c) {
         return "q shape must be [num_tokens, num_qo_heads, head_dim], got " + shape_str(c.tensors.q);
       },
       "q shape must be [num_tokens, num_qo_heads, head_dim], got [2, 9, 128]", false},
      {"k_shape", [](Case& c) { c.tensors.k.shape[0] -= 1; },
       [](const Case& c) {
         return "k shape must be [num_tokens, num_kv_heads, head_dim], got " + shape_str(c.tensors.k);
       },
       "k shape must be [num_tokens, num_kv_heads, head_dim], got [1, 2, 128]", false},
      {"v_shape", [](Case& c) { c.tensors.v.shape[1] -= 1; },
       [](const Case& c) {
         return "v shape must match k shape, got " + shape_str(c.tensors.v) + " vs " +
                shape_str(c.tensors.k);
       },
       "v shape must match k shape, got [2, 1, 128] vs [2, 2, 128]", false},
      {"index_length", [](Case& c) { c.tensors.positions.shape[0] += 1; },
       [](const Case&) { return std::string("positions/slots must have one entry per token"); },
       "positions/slots must have one entry per token", false},
      {"k_pool_shape", [](Case& c) { c.tensors.k_pool.shape[2] -= 2; },
       [](const Case& c) { return "k_pool has incompatible shape " + shape_str(c.tensors.k_pool); },
       "k_pool has incompatible shape [16, 2, 126]", false},
      {"v_pool_shape", [](Case& c) { c.tensors.v_pool.shape[0] -= 1; },
       [](const Case& c) {
         return "v_pool shape must match k_pool shape, got " + shape_str(c.tensors.v_pool) + " vs " +
                shape_str(c.tensors.k_pool);
       },
       "v_pool shape must match k_pool shape, got [15, 2, 128] vs [16, 2, 128]", false},
      {"qkv_dtype", [](Case& c) { c.tensors.v.dtype = DType::BFloat16; },
       [](const Case&) { return std::string("q/k/v dtypes must match"); }, "q/k/v dtypes must match",
       false},
      {"pool_dtype", [](Case& c) { c.tensors.k_pool.dtype = DType::Float16; },
       [](const Case&) { return std::string("pool dtypes must match q/k/v dtype"); },
       "pool dtypes must match q/k/v dtype", false},
      {"positions_dtype", [](Case& c) { c.tensors.positions.dtype = DType::Float32; },
       [](const Case& c) {
         return "rope_pool_fused: positions must be int32 or int64, got " +
                dtype_str(c.tensors.positions.dtype);
       },
       "rope_pool_fused: positions must be int32 or int64, got float32", false},
      {"slots_dtype", [](Case& c) { c.tensors.slots.dtype = DType::Float16; },
       [](const Case& c) {
         return "rope_pool_fused: slots must be int32 or int64, got " + dtype_str(c.tensors.slots.dtype);
       },
       "rope_pool_fused: slots must be int32 or int64, got float16", false},
      {"head_dim_odd",
       [](Case& c) {
         for (TensorView* v : float_tensors(c.tensors))
           if (v->ndim == 3 && v->shape[2] == c.params.head_dim) v->shape[2] -= 1;
         c.params.head_dim -= 1;
       },
       [](const Case& c) {
         return "rope_pool_fused: head_dim must be even and > 0, got " + std::to_string(c.params.head_dim);
       },
       "rope_pool_fused: head_dim must be even and > 0, got 127", false},
      {"rope_base", [](Case& c) { c.params.rope_base = 0; },
       [](const Case& c) {
         return "rope_pool_fused: rope_base must be finite and > 0, got " + std::to_string(c.params.rope_base);
       },
       "rope_pool_fused: rope_base must be finite and > 0, got 0.000000", false},
      {"no_qo_heads",
       [](Case& c) {
         const int64_t Hq = c.params.num_qo_heads;
         c.tensors.q.shape[1] -= Hq;
         c.tensors.q_out.shape[1] -= Hq;
         c.params.num_qo_heads = 0;
       },
       [](const Case& c) {
         return "rope_pool_fused: num_qo_heads and num_kv_heads must be > 0, got " +
                std::to_string(c.params.num_qo_heads) + " and " + std::to_string(c.params.num_kv_heads);
       },
       "rope_pool_fused: num_qo_heads and num_kv_heads must be > 0, got 0 and 2", false},
      {"int_dtype",
       [](Case& c) {
         for (TensorView* v : float_tensors(c.tensors))
           if (v->dtype == DType::Float32) v->dtype = DType::Int32;
       },
       [](const Case& c) {
         return "rope_pool_fused: unsupported dtype " + dtype_str(c.tensors.q.dtype) +
                " for q/k/v/pools; expected float32, float16 or bfloat16";
       },
       "rope_pool_fused: unsupported dtype int32 for q/k/v/pools; expected float32, float16 or bfloat16",
       false},
      {"device", [](Case& c) { c.tensors.v_pool.device = {DeviceType::CUDA, 0}; },
       [](const Case&) {
         return std::string("rope_pool_fused: all tensors must be on one device, got q on cpu and v_pool on cuda:0");
       },
       "rope_pool_fused: all tensors must be on one device, got q on cpu and v_pool on cuda:0", true},
      {"q_out_shape", [](Case& c) { c.tensors.q_out.shape[1] -= 1; },
       [](const Case& c) {
         return "rope_pool_fused: q_out must have the shape and dtype of q (" + shape_str(c.tensors.q) + " " +
                dtype_str(c.tensors.q.dtype) + "), got " + shape_str(c.tensors.q_out) +
                " " + dtype_str(c.tensors.q_out.dtype);
       },
       "rope_pool_fused: q_out must have the shape and dtype of q ([2, 8, 128] float32), got [2, 7, 128] float32", false},
      {"k_out_dtype", [](Case& c) { c.tensors.k_out.dtype = DType::BFloat16; },
       [](const Case& c) {
         return "rope_pool_fused: k_out must have the shape and dtype of k (" + shape_str(c.tensors.k) + " " +
                dtype_str(c.tensors.k.dtype) + "), got " + shape_str(c.tensors.k_out) +
                " " + dtype_str(c.tensors.k_out.dtype);
       },
       "rope_pool_fused: k_out must have the shape and dtype of k ([2, 2, 128] float32), got [2, 2, 128] bfloat16", false},
      {"last_dim_stride", [](Case& c) { c.tensors.k.strides[2] = 2; },
       [](const Case& c) {
         return "rope_pool_fused: k must have a contiguous last dimension (stride 1), got strides " +
                strides_str(c.tensors.k);
       },
       "rope_pool_fused: k must have a contiguous last dimension (stride 1), got strides (256, 128, 2)", true},
      {"overlapping_output", [](Case& c) { c.tensors.k_out.strides[0] = 0; },
       [](const Case& c) {
         return "rope_pool_fused: k_out has overlapping or negative strides " + strides_str(c.tensors.k_out) +
                "; every element it receives needs its own memory";
       },
       "rope_pool_fused: k_out has overlapping or negative strides (0, 128, 1); every element it "
       "receives needs its own memory",
       false},
      {"slot_range",
       [](Case& c) {
         // Through the slots buffer's own dtype and stride: earlier mutations may have
         // relabelled the view.
         TensorView s = c.tensors.slots;
         s.dtype = c.shape.slot_dtype;
         set_index(s, 1, c.shape.pool_size);
       },
       [](const Case& c) {
         return "rope_pool_fused: slots[1] = " + std::to_string(c.shape.pool_size) +
                " is out of range for a pool of " + std::to_string(c.shape.pool_size) + " slots";
       },
       "rope_pool_fused: slots[1] = 16 is out of range for a pool of 16 slots", true},
  };
  return all;
}

// Checks SPEC §2 gives no place among the extended ones.
bool has_spec_position(const Mutation& m) {
  const std::string n = m.name;
  return n != "no_qo_heads" && n != "q_out_shape" && n != "k_out_dtype";
}
constexpr size_t kContractChecks = 11;

const Mutation& mutation(const std::string& name) {
  for (const Mutation& m : mutations())
    if (m.name == name) return m;
  throw std::logic_error("no mutation " + name);
}

class Validation : public SeededTest {
 protected:
  /// Expects both entry points to reject `c` with exactly `message` and to write nothing.
  /// Returns the rope_pool_fused error for further checks.
  Thrown expect_rejected(Case& c, const std::string& message, const CallOptions& options = {}) {
    return expect_rejected_with_one_of(c, {message}, options);
  }

  /// As expect_rejected, where any of `messages` is right.
  Thrown expect_rejected_with_one_of(Case& c, const std::vector<std::string>& messages,
                                     const CallOptions& options = {}) {
    const auto allowed = [&](const std::string& what) {
      return std::find(messages.begin(), messages.end(), what) != messages.end();
    };
    std::string expected = messages.front();
    for (size_t i = 1; i < messages.size(); ++i) expected += "\n  or: " + messages[i];
    const Snapshot before = c.snapshot();
    const Thrown validated = thrown_by([&] { validate_rope_pool(c.tensors, c.params, options); });
    EXPECT_TRUE(validated.error) << validated.other;
    EXPECT_TRUE(allowed(validated.what)) << "validate_rope_pool said\n  " << validated.what
                                         << "\nexpected\n  " << expected;
    expect_unchanged(c, before);
    const Thrown called = thrown_by([&] { rope_pool_fused(c.tensors, c.params, options); });
    EXPECT_TRUE(called.error) << called.other;
    EXPECT_TRUE(allowed(called.what)) << "rope_pool_fused said\n  " << called.what << "\nexpected\n  "
                                      << expected;
    EXPECT_EQ(called.what, validated.what);
    EXPECT_EQ(called.hint, validated.hint);
    if (!called.hint.empty()) {
      EXPECT_EQ(called.what.find(called.hint), std::string::npos) << "the hint leaked into what()";
    }
    expect_unchanged(c, before);
    return called;
  }

  std::unique_ptr<Case> fresh(const Shape& s = base_shape(), const Layout& l = base_layout()) {
    auto c = std::make_unique<Case>(s, l);
    c->randomize(rng);
    return c;
  }
};

TEST_F(Validation, BaseCallIsValidAndCorrect) {
  auto c = fresh();
  EXPECT_NO_THROW(validate_rope_pool(c->tensors, c->params));
  run_and_check(*c);
}

TEST_F(Validation, ErrorIsAnInvalidArgument) {
  auto c = fresh();
  c->tensors.q.shape[1] += 1;
  EXPECT_THROW(rope_pool_fused(c->tensors, c->params), std::invalid_argument);
}

class EachCheck : public Validation, public ::testing::WithParamInterface<size_t> {};

TEST_P(EachCheck, ExactMessageHintAndNoWrite) {
  const Mutation& m = mutations()[GetParam()];
  auto c = fresh();
  m.apply(*c);
  const Thrown e = expect_rejected(*c, m.literal);
  EXPECT_EQ(m.message(*c), m.literal) << "test bug: dynamic and literal message disagree";
  if (m.has_hint) {
    EXPECT_FALSE(e.hint.empty()) << "expected a hint";
  }
}

INSTANTIATE_TEST_SUITE_P(Spec2, EachCheck, ::testing::Range<size_t>(0, mutations().size()),
                         [](const auto& info) { return std::string(mutations()[info.param].name); });

// A call that breaks two checks reports the earlier one (SPEC §2 order), for every pair.
// Where SPEC §2 does not order the two (a check it does not list, after the 11 contract
// ones), either message is right, but it must be one of the two and nothing is written.
TEST_F(Validation, FirstFailingCheckWinsForEveryPair) {
  const auto& all = mutations();
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t j = i + 1; j < all.size(); ++j) {
      SCOPED_TRACE(std::string(all[i].name) + " + " + all[j].name);
      const bool ordered = i < kContractChecks || (has_spec_position(all[i]) && has_spec_position(all[j]));
      for (bool i_first : {true, false}) {  // the order the mutations are applied in
        auto c = fresh();
        (i_first ? all[i] : all[j]).apply(*c);
        (i_first ? all[j] : all[i]).apply(*c);
        if (ordered)
          expect_rejected(*c, all[i].message(*c));
        else
          expect_rejected_with_one_of(*c, {all[i].message(*c), all[j].message(*c)});
      }
    }
}

// --- more ways to fail each check --------------------------------------------------------

TEST_F(Validation, NotThreeDimensionalQkv) {
  {
    auto c = fresh();  // k flattened to [T, Hk*D]
    c->tensors.k = c->buffer_of(c->tensors.k).contiguous({2, 256});
    expect_rejected(*c, "rope_pool_fused expects q/k/v to be 3-D");
  }
  {
    auto c = fresh();
    add_unit_dim(c->tensors.v);
    expect_rejected(*c, "rope_pool_fused expects q/k/v to be 3-D");
  }
}

TEST_F(Validation, NotOneDimensionalIndex) {
  auto c = fresh();
  c->tensors.positions.ndim = 0;  // a scalar
  expect_rejected(*c, "rope_pool_fused expects positions/slots to be 1-D");
}

TEST_F(Validation, PoolRankHints) {
  {
    auto c = fresh();  // a flat v_pool [P, Hk*D]
    c->tensors.v_pool = c->buffer_of(c->tensors.v_pool).contiguous({16, 256});
    const Thrown e = expect_rejected(*c, "rope_pool_fused expects pool tensors to be 3-D");
    EXPECT_FALSE(e.hint.empty());
  }
  {
    auto c = fresh();  // a stacked [1, P, Hk, D] k_pool
    c->tensors.k_pool = c->buffer_of(c->tensors.k_pool).contiguous({1, 16, 2, 128});
    const Thrown e = expect_rejected(*c, "rope_pool_fused expects pool tensors to be 3-D");
    EXPECT_FALSE(e.hint.empty());
    EXPECT_NE(e.hint.find("k_pool[layer]"), std::string::npos) << e.hint;
  }
}

TEST_F(Validation, PoolWithHeadsAndHeadDimSwappedGetsAHint) {
  auto c = fresh();
  c->tensors.k_pool = c->buffer_of(c->tensors.k_pool).contiguous({16, 128, 2});
  const Thrown e = expect_rejected(*c, "k_pool has incompatible shape [16, 128, 2]");
  EXPECT_FALSE(e.hint.empty());
}

TEST_F(Validation, IndexLengthEitherWay) {
  {
    auto c = fresh();
    c->tensors.slots.shape[0] = 1;
    expect_rejected(*c, "positions/slots must have one entry per token");
  }
  {
    auto c = fresh();
    c->tensors.positions.shape[0] = 0;
    expect_rejected(*c, "positions/slots must have one entry per token");
  }
}

TEST_F(Validation, QShapeMessageForTokensAndHeadDim) {
  // T comes from q itself, so a short q is reported through k (its T disagrees).
  auto c = fresh();
  c->tensors.q.shape[2] = 64;
  expect_rejected(*c, "q shape must be [num_tokens, num_qo_heads, head_dim], got [2, 8, 64]");
  auto d = fresh();
  d->tensors.q.shape[0] = 1;
  expect_rejected(*d, "k shape must be [num_tokens, num_kv_heads, head_dim], got [2, 2, 128]");
}

TEST_F(Validation, HeadDimZero) {
  auto c = fresh();
  for (TensorView* v : float_tensors(c->tensors)) v->shape[2] = 0;
  c->params.head_dim = 0;
  expect_rejected(*c, "rope_pool_fused: head_dim must be even and > 0, got 0");
}

TEST_F(Validation, RopeBaseNotFiniteOrNotPositive) {
  const std::pair<double, const char*> cases[] = {
      {-1.0, "-1.000000"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
  };
  for (auto [base, printed] : cases) {
    SCOPED_TRACE(printed);
    auto c = fresh();
    c->params.rope_base = base;
    expect_rejected(*c, std::string("rope_pool_fused: rope_base must be finite and > 0, got ") + printed);
  }
}

TEST_F(Validation, UnsupportedFloatDtypes) {
  for (DType d : {DType::Int64, DType::Other}) {
    auto c = fresh();
    for (TensorView* v : float_tensors(c->tensors)) v->dtype = d;
    expect_rejected(*c, "rope_pool_fused: unsupported dtype " + dtype_str(d) +
                            " for q/k/v/pools; expected float32, float16 or bfloat16");
  }
}

TEST_F(Validation, IndexDtypes) {
  auto c = fresh();
  c->tensors.slots.dtype = DType::BFloat16;
  expect_rejected(*c, "rope_pool_fused: slots must be int32 or int64, got bfloat16");
  auto d = fresh();
  d->tensors.positions.dtype = DType::Other;
  expect_rejected(*d, "rope_pool_fused: positions must be int32 or int64, got other");
}

TEST_F(Validation, MixedDevices) {
  {
    auto c = fresh();
    c->tensors.positions.device = {DeviceType::CUDA, 1};
    const Thrown e = expect_rejected(
        *c, "rope_pool_fused: all tensors must be on one device, got q on cpu and positions on cuda:1");
    EXPECT_FALSE(e.hint.empty());
  }
  {
    auto c = fresh();
    c->tensors.q.device = {DeviceType::CUDA, 0};
    expect_rejected(*c, "rope_pool_fused: all tensors must be on one device, got q on cuda:0 and k on cpu");
  }
}

TEST_F(Validation, UnsupportedDevice) {
  auto c = fresh();
  for (TensorView* v : {&c->tensors.q, &c->tensors.k, &c->tensors.v, &c->tensors.positions, &c->tensors.slots,
                        &c->tensors.k_pool, &c->tensors.v_pool, &c->tensors.q_out, &c->tensors.k_out})
    v->device = {DeviceType::Other, 0};
  expect_rejected(*c, "rope_pool_fused: unsupported device; expected cpu or cuda tensors");
}

#ifndef ROPEPOOL_WITH_CUDA
TEST_F(Validation, CudaTensorsWithoutCudaBackend) {
  auto c = fresh();
  for (TensorView* v : {&c->tensors.q, &c->tensors.k, &c->tensors.v, &c->tensors.positions, &c->tensors.slots,
                        &c->tensors.k_pool, &c->tensors.v_pool, &c->tensors.q_out, &c->tensors.k_out})
    v->device = {DeviceType::CUDA, 0};
  const Thrown e =
      expect_rejected(*c, "rope_pool_fused: tensors are on cuda:0 but this build of ropepool has no CUDA backend");
  EXPECT_FALSE(e.hint.empty());
}
#endif

TEST_F(Validation, OutputsMustMatchInputs) {
  {
    auto c = fresh();
    c->tensors.q_out.dtype = DType::Float16;
    expect_rejected(*c, "rope_pool_fused: q_out must have the shape and dtype of q ([2, 8, 128] float32), got [2, 8, 128] float16");
  }
  {
    auto c = fresh();
    c->tensors.k_out.shape[2] = 64;
    expect_rejected(*c, "rope_pool_fused: k_out must have the shape and dtype of k ([2, 2, 128] float32), got [2, 2, 64] float32");
  }
  {
    auto c = fresh();
    c->tensors.q_out = c->buffer_of(c->tensors.q_out).contiguous({2, 1024});
    expect_rejected(*c, "rope_pool_fused: q_out must have the shape and dtype of q ([2, 8, 128] float32), got [2, 1024] float32");
  }
}

TEST_F(Validation, LastDimensionMustBeContiguous) {
  {
    auto c = fresh();
    c->tensors.q.strides[2] = 0;  // a broadcast head
    const Thrown e = expect_rejected(
        *c, "rope_pool_fused: q must have a contiguous last dimension (stride 1), got strides (1024, 128, 0)");
    EXPECT_FALSE(e.hint.empty());
  }
  {
    auto c = fresh();
    c->tensors.v_pool.strides[2] = 2;
    expect_rejected(
        *c, "rope_pool_fused: v_pool must have a contiguous last dimension (stride 1), got strides (256, 128, 2)");
  }
  {
    auto c = fresh();
    c->tensors.k_out.strides[2] = 3;
    expect_rejected(
        *c, "rope_pool_fused: k_out must have a contiguous last dimension (stride 1), got strides (256, 128, 3)");
  }
}

TEST_F(Validation, NullDataWithElements) {
  // A view with elements and no memory: rejected (a kernel would fault), nothing written;
  // a k_out with a shape and no memory is not "no k_rot" (only an empty k_out is).
  {
    auto c = fresh();
    c->tensors.q.data = nullptr;
    const Thrown e = expect_rejected(*c, "rope_pool_fused: q [2, 8, 128] has a null data pointer");
    EXPECT_TRUE(e.hint.empty());
  }
  {
    auto c = fresh();
    c->tensors.v_pool.data = nullptr;
    expect_rejected(*c, "rope_pool_fused: v_pool [16, 2, 128] has a null data pointer");
  }
  {
    auto c = fresh();
    c->tensors.k_out.data = nullptr;
    const Thrown e = expect_rejected(*c, "rope_pool_fused: k_out [2, 2, 128] has a null data pointer");
    EXPECT_NE(e.hint.find("leave k_out empty"), std::string::npos) << e.hint;
  }
}

TEST_F(Validation, OverlappingOrNegativeOutputStrides) {
  const auto msg = [](const char* arg, const char* strides) {
    return std::string("rope_pool_fused: ") + arg + " has overlapping or negative strides " + strides +
           "; every element it receives needs its own memory";
  };
  {
    auto c = fresh();
    c->tensors.q_out.strides[1] = 64;  // heads overlap by half a head
    expect_rejected(*c, msg("q_out", "(1024, 64, 1)"));
  }
  {
    auto c = fresh();
    c->tensors.k_pool.strides[0] = 0;  // every slot the same row
    expect_rejected(*c, msg("k_pool", "(0, 128, 1)"));
  }
  {
    auto c = fresh();
    c->tensors.v_pool.strides[0] = 128;  // rows overlap with the next row's heads
    expect_rejected(*c, msg("v_pool", "(128, 128, 1)"));
  }
  {
    auto c = fresh();  // a pool walked backwards
    TensorView& p = c->tensors.v_pool;
    p.data = element(p, 15);
    p.strides[0] = -256;
    expect_rejected(*c, msg("v_pool", "(-256, 128, 1)"));
  }
}

TEST_F(Validation, ShapeFormatterPrintsEachArgument) {
  CallOptions options;
  options.format_shape = [](Arg a, const TensorView& v) {
    static const char* names[] = {"q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out", "k_out"};
    return std::string("torch.Size(") + names[int(a)] + shape_str(v) + ")";
  };
  const std::pair<const char*, std::string> cases[] = {
      {"q_shape", "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size(q[2, 9, 128])"},
      {"k_shape", "k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size(k[1, 2, 128])"},
      {"v_shape", "v shape must match k shape, got torch.Size(v[2, 1, 128]) vs torch.Size(k[2, 2, 128])"},
      {"k_pool_shape", "k_pool has incompatible shape torch.Size(k_pool[16, 2, 126])"},
      {"v_pool_shape", "v_pool shape must match k_pool shape, got torch.Size(v_pool[15, 2, 128]) vs "
          "torch.Size(k_pool[16, 2, 128])"},
      {"q_out_shape", "rope_pool_fused: q_out must have the shape and dtype of q (torch.Size(q[2, 8, 128]) float32), got torch.Size(q_out[2, 7, 128]) float32"},
  };
  for (const auto& [name, message] : cases) {
    SCOPED_TRACE(name);
    auto c = fresh();
    mutation(name).apply(*c);
    expect_rejected(*c, message, options);
  }
}

// --- SPEC §3: slot range and duplicates ---------------------------------------------------

class SlotChecks : public Validation {
 protected:
  std::unique_ptr<Case> big(DType slot_dtype = DType::Int32) {
    Shape s;
    s.dtype = DType::BFloat16;
    s.num_tokens = 300;
    s.pool_size = 600;
    s.slot_dtype = slot_dtype;
    return fresh(s, Layout{});
  }
};

TEST_F(SlotChecks, OutOfRangeNamesFirstBadTokenAndWritesNothing) {
  for (DType slot_dtype : {DType::Int32, DType::Int64}) {
    SCOPED_TRACE(dtype_str(slot_dtype));
    auto c = big(slot_dtype);
    const int64_t first = rng.integer(1, 150);
    c->set_slot(first, 600 + rng.integer(0, 1000));
    c->set_slot(first + rng.integer(1, 100), 600);
    c->set_slot(299, 601);
    const Thrown e = expect_rejected(*c, "rope_pool_fused: slots[" + std::to_string(first) + "] = " +
                                             std::to_string(c->slot(first)) +
                                             " is out of range for a pool of 600 slots");
    EXPECT_FALSE(e.hint.empty());
  }
}

TEST_F(SlotChecks, OutOfRangeLastTokenAndHugeInt64Slot) {
  auto c = big(DType::Int64);
  c->set_slot(299, int64_t(1) << 40);
  expect_rejected(*c, "rope_pool_fused: slots[299] = 1099511627776 is out of range for a pool of 600 slots");
}

TEST_F(SlotChecks, OutOfRangeWithSlotCheckingAndThreads) {
  ThreadCountGuard guard;
  for (int threads : {1, 2, 4}) {
    set_cpu_num_threads(threads);
    auto c = big();
    c->set_slot(0, 600);
    CallOptions options;
    options.check_slots = true;
    expect_rejected(*c, "rope_pool_fused: slots[0] = 600 is out of range for a pool of 600 slots", options);
  }
}

TEST_F(SlotChecks, EmptyPoolAcceptsOnlyNegativeSlots) {
  Shape s;
  s.num_tokens = 5;
  s.pool_size = 0;
  auto c = std::make_unique<Case>(s, base_layout());
  c->randomize(rng, /*negative_fraction=*/1.0);
  run_and_check(*c);
  c->set_slot(3, 0);
  expect_rejected(*c, "rope_pool_fused: slots[3] = 0 is out of range for a pool of 0 slots");
}

TEST_F(SlotChecks, DuplicateRejectedWithCheckSlots) {
  auto c = big();
  // A row no other token writes, given to tokens 17 and 200.
  std::vector<bool> used(600);
  for (int64_t t = 0; t < 300; ++t)
    if (c->slot(t) >= 0) used[size_t(c->slot(t))] = true;
  int64_t row = rng.integer(0, 599);
  while (used[size_t(row)]) row = (row + 1) % 600;
  c->set_slot(17, row);
  c->set_slot(200, row);
  CallOptions options;
  options.check_slots = true;
  expect_rejected(*c, "rope_pool_fused: slots[200] = " + std::to_string(row) +
                          " repeats slots[17]; with check_slots each slot may be written once per call",
                  options);
  // The range check comes first.
  c->set_slot(250, 600);
  expect_rejected(*c, "rope_pool_fused: slots[250] = 600 is out of range for a pool of 600 slots", options);
}

TEST_F(SlotChecks, RepeatedNegativeSlotsAreNotDuplicates) {
  auto c = big(DType::Int64);
  for (int64_t t : {3, 4, 5, 150}) c->set_slot(t, -1);
  c->set_slot(6, INT64_MIN);
  c->set_slot(7, INT64_MIN);
  CallOptions options;
  options.check_slots = true;
  run_and_check(*c, options);
}


// CallOptions::data_readable = false (shapes-only validation while a framework traces):
// null data pointers are never read, the data checks are left to the call that has the
// data, every other check still runs; rope_pool_fused refuses the option.
TEST_F(SlotChecks, ShapesOnlyValidationReadsNoData) {
  Shape s;
  s.num_tokens = 300;
  s.pool_size = 600;
  s.position_dtype = DType::Int64;  // int64 positions: the CPU angle check scans them
  s.slot_dtype = DType::Int64;
  auto c = fresh(s, Layout{});
  c->set_slot(7, 600);  // out of range: a data check
  RopePoolTensors nulls = c->tensors;
  for (TensorView* v : {&nulls.q, &nulls.k, &nulls.v, &nulls.positions, &nulls.slots,
                        &nulls.k_pool, &nulls.v_pool, &nulls.q_out, &nulls.k_out})
    v->data = nullptr;
  CallOptions shapes_only;
  shapes_only.data_readable = false;
  EXPECT_NO_THROW(validate_rope_pool(nulls, c->params, shapes_only));
  nulls.q.shape[1] += 1;
  const Thrown e = thrown_by([&] { validate_rope_pool(nulls, c->params, shapes_only); });
  EXPECT_TRUE(e.error) << e.other;
  EXPECT_EQ(e.what, "q shape must be [num_tokens, num_qo_heads, head_dim], got [300, " +
                        std::to_string(c->tensors.q.shape[1] + 1) + ", " +
                        std::to_string(c->tensors.q.shape[2]) + "]");
  // With the data, the same call reports the slot.
  expect_rejected(*c, "rope_pool_fused: slots[7] = 600 is out of range for a pool of 600 slots");
  const Snapshot before = c->snapshot();
  EXPECT_THROW(rope_pool_fused(c->tensors, c->params, shapes_only), std::invalid_argument);
  expect_unchanged(*c, before);
}

}  // namespace
}  // namespace ropepool::test
