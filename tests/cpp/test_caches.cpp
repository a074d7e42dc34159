// SPEC §6 production KV caches through the C++ API: paged pools (NHD, HND; page sizes 1, 5,
// 16, 64), strided pools (a layer of a stack, the other head/row order, the K/V halves of
// vLLM's and FlashInfer's combined caches), float8_e4m3fn pools with k_scale/v_scale (numbers
// and tensors read when the kernel runs), fp8 q_rot with q_scale, and their validation.
// Every call is checked whole by the test kit: q_rot/k_rot against the float64 reference, v
// bit-exact in e4m3, k within one e4m3 step of e4m3(exact / k_scale), every byte outside the
// rows written (the other half, the other layers, padding, guards) unchanged.
#include <cmath>
#include <cstring>
#include <tuple>

#include "test_support.hpp"

namespace ropepool::test {
namespace {

const char* layout_str(KvLayout l) { return kv_layout_name(l); }

// ---- the grid ---------------------------------------------------------------------------

// dtype, kv_layout, page_size, fp8 pools, pool layout, tensor scales
using CacheParam = std::tuple<DType, KvLayout, int64_t, bool, PoolLayout, bool>;

class Caches : public SeededTest, public ::testing::WithParamInterface<CacheParam> {};

TEST_P(Caches, WholeContract) {
  const auto [dtype, kv_layout, page_size, fp8, pool, tensor_scales] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = 37;
  s.num_qo_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 48;
  s.pool_size = 150;
  s.kv_layout = kv_layout;
  s.page_size = page_size;
  s.slot_dtype = DType::Int64;
  if (fp8) {
    s.pool_dtype = DType::Float8E4M3FN;
    // k's values reach 8 * sqrt(2): 1/64 pushes some beyond 448 (saturation), v's scale keeps
    // most in range.
    s.k_scale = 0.015625 * 1.37;
    s.v_scale = 0.3;
    s.tensor_scales = tensor_scales;
  }
  Case c(s, Layout{QkvLayout::Fused, pool, OutLayout::Contiguous, IndexLayout::Strided});
  c.randomize(rng);
  run_and_check(c);
}

std::string cache_name(const ::testing::TestParamInfo<CacheParam>& info) {
  const auto [dtype, kv_layout, page_size, fp8, pool, tensor_scales] = info.param;
  return dtype_str(dtype) + "_" + layout_str(kv_layout) + "_ps" + std::to_string(page_size) +
         (fp8 ? std::string("_fp8") + (tensor_scales ? "_tensor_scales" : "_float_scales") : "") +
         "_" + name(pool);
}

const auto kAllPools = ::testing::Values(PoolLayout::Contiguous, PoolLayout::LayerOfStack,
                                         PoolLayout::HeadMajor, PoolLayout::CombinedVllm,
                                         PoolLayout::CombinedFlashInfer);
const auto kDtypes = ::testing::Values(DType::Float32, DType::Float16, DType::BFloat16);

INSTANTIATE_TEST_SUITE_P(Paged, Caches,
                         ::testing::Combine(kDtypes, ::testing::Values(KvLayout::NHD, KvLayout::HND),
                                            ::testing::Values<int64_t>(1, 5, 16, 64),
                                            ::testing::Bool(), kAllPools, ::testing::Values(false)),
                         cache_name);
INSTANTIATE_TEST_SUITE_P(Flat, Caches,
                         ::testing::Combine(kDtypes, ::testing::Values(KvLayout::None),
                                            ::testing::Values<int64_t>(1), ::testing::Bool(),
                                            kAllPools, ::testing::Values(false)),
                         cache_name);
INSTANTIATE_TEST_SUITE_P(TensorScales, Caches,
                         ::testing::Combine(kDtypes, ::testing::Values(KvLayout::None, KvLayout::HND),
                                            ::testing::Values<int64_t>(16), ::testing::Values(true),
                                            ::testing::Values(PoolLayout::CombinedFlashInfer),
                                            ::testing::Values(true)),
                         cache_name);

// ---- every §4 keyword with §6 ------------------------------------------------------------

// dtype, fp8 pools, fp8 q_rot, interleaved, partial rotary, rope type, in place, threads
using ComboParam = std::tuple<DType, bool, bool, bool, bool, RopeType, bool>;
class CacheCombos : public SeededTest, public ::testing::WithParamInterface<ComboParam> {};

TEST_P(CacheCombos, WholeContract) {
  const auto [dtype, fp8_pool, fp8_q, interleaved, partial, rope_type, many_tokens] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = many_tokens ? 3000 : 29;
  s.num_qo_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.rotary_dim = partial ? 40 : 0;
  s.interleaved = interleaved;
  s.rope_scaling = scaling_preset(rope_type, partial ? 40 : 64);
  s.pool_size = many_tokens ? 4000 : 100;
  s.kv_layout = KvLayout::HND;
  s.page_size = 16;
  s.position_dtype = DType::Int64;
  if (fp8_pool) {
    s.pool_dtype = DType::Float8E4M3FN;
    s.k_scale = 0.02;
  }
  if (fp8_q) {
    s.q_out_dtype = DType::Float8E4M3FN;
    s.q_scale = 0.011;
  }
  ThreadCountGuard guard;
  set_cpu_num_threads(many_tokens ? 3 : 1);
  Case c(s, Layout{QkvLayout::Padded, PoolLayout::CombinedFlashInfer, OutLayout::Padded,
                   IndexLayout::Contiguous});
  c.randomize(rng);
  const Snapshot before = c.snapshot();
  run_and_check(c);
  // SPEC §4 return_k_rot=False: q_out and the pools exactly as with k_rot
  for (const std::string& problem : check_without_k_rot(c, before)) ADD_FAILURE() << problem;
}

std::string combo_name(const ::testing::TestParamInfo<ComboParam>& info) {
  const auto [dtype, fp8_pool, fp8_q, interleaved, partial, rope_type, many] = info.param;
  const char* types[] = {"default", "linear", "dynamic", "yarn", "llama3", "longrope"};
  return dtype_str(dtype) + (fp8_pool ? "_fp8pool" : "_pool") + (fp8_q ? "_fp8q" : "_q") +
         (interleaved ? "_gptj" : "_neox") + (partial ? "_partial" : "_full") + "_" +
         types[int(rope_type)] + (many ? "_threads" : "");
}

INSTANTIATE_TEST_SUITE_P(All, CacheCombos,
                         ::testing::Combine(kDtypes, ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(RopeType::Default, RopeType::Yarn),
                                            ::testing::Values(false)),
                         combo_name);
INSTANTIATE_TEST_SUITE_P(Threads, CacheCombos,
                         ::testing::Combine(kDtypes, ::testing::Values(true), ::testing::Bool(),
                                            ::testing::Values(false), ::testing::Values(false),
                                            ::testing::Values(RopeType::Llama3),
                                            ::testing::Values(true)),
                         combo_name);

// In-place rotation with an fp8 paged pool: q and k become q_rot/k_rot.
TEST_F(SeededTest, InPlaceWithFp8PagedPool) {
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16}) {
    Shape s;
    s.dtype = dtype;
    s.num_tokens = 21;
    s.num_qo_heads = 4;
    s.num_kv_heads = 2;
    s.head_dim = 32;
    s.pool_size = 64;
    s.kv_layout = KvLayout::NHD;
    s.page_size = 16;
    s.pool_dtype = DType::Float8E4M3FN;
    s.v_scale = 0.5;
    Case c(s);
    c.randomize(rng);
    Case ref(s);
    ref.randomize(rng);
    for (auto [a, b] : {std::pair{&c.tensors.q, &ref.tensors.q}, {&c.tensors.k, &ref.tensors.k},
                        {&c.tensors.v, &ref.tensors.v}, {&c.tensors.positions, &ref.tensors.positions},
                        {&c.tensors.slots, &ref.tensors.slots}})
      copy_elements(*a, *b);
    ASSERT_NO_THROW(rope_pool_fused(ref.tensors, ref.params));
    RopePoolTensors t = c.tensors;
    t.q_out = t.q;
    t.k_out = t.k;
    ASSERT_NO_THROW(rope_pool_fused(t, c.params));
    EXPECT_EQ(count_bit_differences(c.tensors.q, ref.tensors.q_out), 0) << dtype_str(dtype);
    EXPECT_EQ(count_bit_differences(c.tensors.k, ref.tensors.k_out), 0) << dtype_str(dtype);
    for (int64_t slot = 0; slot < 64; ++slot)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 32; ++d)
          for (auto [a, b] : {std::pair{&c.tensors.k_pool, &ref.tensors.k_pool},
                              {&c.tensors.v_pool, &ref.tensors.v_pool}})
            if (*static_cast<uint8_t*>(reference::pool_element(*a, KvLayout::NHD, slot, h, d)) !=
                *static_cast<uint8_t*>(reference::pool_element(*b, KvLayout::NHD, slot, h, d))) {
              // rows no token wrote hold each case's own poison; compare written rows only
              bool written = false;
              for (int64_t i = 0; i < 21; ++i) written |= c.slot(i) == slot;
              if (written) ADD_FAILURE() << "pool slot " << slot << " differs, " << dtype_str(dtype);
            }
  }
}

// ---- the fp8 rule itself -------------------------------------------------------------------

// v is stored bit-exactly as e4m3(v / v_scale) with the division in float32: chosen inputs on
// every rounding boundary (midpoints between e4m3 neighbours, one float32 ulp either side),
// the saturation edge (448, 464, inf), subnormals, NaN.
TEST_F(SeededTest, VOnEveryE4M3BoundaryIsExact) {
  std::vector<float> values;
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = e4m3_to_float(uint8_t(code)), hi = e4m3_to_float(uint8_t(code + 1));
    const float mid = lo + (hi - lo) / 2;  // exact in float32
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), hi})
      values.push_back(x), values.push_back(-x);
  }
  for (float x : {448.0f, 449.0f, 463.99f, 464.0f, 465.0f, 1e6f, INFINITY, -INFINITY, NAN, -NAN,
                  0.0f, -0.0f, 1e-30f, 0x1p-10f, 0x1.8p-10f, 0x1.0000002p-10f})
    values.push_back(x);
  for (float scale : {1.0f, 0.5f, 0.3f, 3.0f}) {
    Shape s;
    s.dtype = DType::Float32;
    s.num_kv_heads = 1;
    s.num_qo_heads = 1;
    s.head_dim = 16;
    s.num_tokens = int64_t((values.size() + 15) / 16);
    s.pool_size = s.num_tokens;
    s.kv_layout = KvLayout::NHD;
    s.page_size = 5;
    s.pool_dtype = DType::Float8E4M3FN;
    s.v_scale = scale;
    Case c(s);
    c.randomize(rng, 0.0);
    for (int64_t t = 0; t < s.num_tokens; ++t)
      for (int64_t d = 0; d < 16; ++d) {
        const size_t i = size_t(t * 16 + d);
        // values times the scale: x / scale then lands on the boundary (exact where the
        // product is; otherwise still a float32 near it)
        store(c.tensors.v, t, 0, d, i < values.size() ? values[i] * scale : 1.0f);
      }
    run_and_check(c);
    for (int64_t t = 0; t < s.num_tokens; ++t)
      for (int64_t d = 0; d < 16; ++d) {
        const float x = float(load(c.tensors.v, t, 0, d));
        const uint8_t got = *static_cast<uint8_t*>(
            reference::pool_element(c.tensors.v_pool, KvLayout::NHD, c.slot(t), 0, d));
        ASSERT_EQ(got, float_to_e4m3(x / scale)) << "v = " << x << ", scale " << scale;
      }
  }
}

// The scalar rule (half.hpp) against an independent decode: every code round-trips, and
// every float32 between two neighbours rounds to the nearer one (ties to the even code).
TEST(E4M3Rule, RoundTripAndNearest) {
  for (int b = 0; b < 256; ++b) {
    const float v = e4m3_to_float(uint8_t(b));
    if (std::isnan(v)) {
      EXPECT_EQ(float_to_e4m3(v) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(float_to_e4m3(v), (b == 0x80 ? 0x80 : b)) << b;
  }
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // torch gives NaN here (tests/python)
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);     // half the smallest subnormal: tie to even 0
  EXPECT_EQ(float_to_e4m3(0x1.8p-9f), 0x02);    // 1.5 steps: tie to even 2
  EXPECT_EQ(float_to_e4m3(0x1.000002p-10f), 0x01);
}

// ---- tensor scales are read when the kernel runs ------------------------------------------

TEST_F(SeededTest, TensorScaleIsReadAtRunTime) {
  Shape s;
  s.dtype = DType::BFloat16;
  s.num_tokens = 9;
  s.num_kv_heads = 2;
  s.num_qo_heads = 2;
  s.head_dim = 32;
  s.pool_size = 32;
  s.kv_layout = KvLayout::HND;
  s.page_size = 16;
  s.pool_dtype = DType::Float8E4M3FN;
  s.q_out_dtype = DType::Float8E4M3FN;
  s.k_scale = 0.25, s.v_scale = 0.5, s.q_scale = 2;
  s.tensor_scales = true;
  Case c(s);
  c.randomize(rng, 0.0);
  run_and_check(c);
  // New values in the same tensors: the next call quantises with them.
  for (auto [scale, value] : {std::pair{&c.params.k_scale, 3.0f}, {&c.params.v_scale, 0.125f},
                              {&c.params.q_scale, 0.0625f}})
    *static_cast<float*>(scale->tensor.data) = value;
  c.shape.k_scale = 3.0, c.shape.v_scale = 0.125, c.shape.q_scale = 0.0625;
  c.poison_outputs(rng);
  run_and_check(c);
}

// ---- validation ---------------------------------------------------------------------------

Thrown expect_rejected(Case& c, const std::string& message, const RopePoolParams* params = nullptr) {
  const Snapshot before = c.snapshot();
  const RopePoolParams& p = params ? *params : c.params;
  const Thrown e = thrown_by([&] { rope_pool_fused(c.tensors, p); });
  EXPECT_TRUE(e.error) << e.other;
  EXPECT_EQ(e.what, message);
  const Thrown v = thrown_by([&] { validate_rope_pool(c.tensors, p); });
  EXPECT_EQ(v.what, e.what) << "validate_rope_pool disagrees with the op";
  expect_unchanged(c, before);
  return e;
}

Shape small_shape() {
  Shape s;
  s.num_tokens = 3;
  s.num_qo_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 16;
  s.pool_size = 32;
  return s;
}

TEST_F(SeededTest, ShapeMessages) {
  {  // a 4-D pool without kv_layout: SPEC §2 message 3, the note names the layouts
    Shape s = small_shape();
    s.kv_layout = KvLayout::NHD;
    s.page_size = 16;
    Case c(s);
    c.randomize(rng);
    RopePoolParams p = c.params;
    p.kv_layout = KvLayout::None;
    const Thrown e = expect_rejected(c, "rope_pool_fused expects pool tensors to be 3-D", &p);
    EXPECT_NE(e.hint.find("kv_layout"), std::string::npos) << e.hint;
  }
  {  // a 3-D pool with kv_layout
    Case c(small_shape());
    c.randomize(rng);
    RopePoolParams p = c.params;
    p.kv_layout = KvLayout::HND;
    expect_rejected(c,
                    "rope_pool_fused: kv_layout \"HND\" expects 4-D pools [pages, num_kv_heads = "
                    "2, page_size, head_dim = 16], got k_pool [32, 2, 16]",
                    &p);
  }
  {  // an NHD pool passed as HND: message 8, the note says which layout fits
    Shape s = small_shape();
    s.kv_layout = KvLayout::NHD;
    s.page_size = 8;
    Case c(s);
    c.randomize(rng);
    RopePoolParams p = c.params;
    p.kv_layout = KvLayout::HND;
    const Thrown e = expect_rejected(c, "k_pool has incompatible shape [4, 8, 2, 16]", &p);
    EXPECT_NE(e.hint.find("this pool fits kv_layout \"NHD\""), std::string::npos) << e.hint;
  }
  {  // one fp8 pool, one bf16: message 11
    Shape s = small_shape();
    s.dtype = DType::BFloat16;
    Case c(s);
    c.randomize(rng);
    c.tensors.k_pool.dtype = DType::Float8E4M3FN;
    expect_rejected(c, "pool dtypes must match q/k/v dtype");
  }
  {  // e5m2 pools are not e4m3fn
    Shape s = small_shape();
    s.pool_dtype = DType::Float8E4M3FN;
    Case c(s);
    c.randomize(rng);
    c.tensors.k_pool.dtype = c.tensors.v_pool.dtype = DType::Float8E5M2;
    expect_rejected(c, "pool dtypes must match q/k/v dtype");
  }
  {  // a slot past pages * page_size: nothing written
    Shape s = small_shape();
    s.kv_layout = KvLayout::NHD;
    s.page_size = 5;
    s.pool_size = 20;
    s.pool_dtype = DType::Float8E4M3FN;
    Case c(s);
    c.randomize(rng, 0.0);
    c.set_slot(1, 20);
    expect_rejected(c, "rope_pool_fused: slots[1] = 20 is out of range for a pool of 20 slots");
  }
}

TEST_F(SeededTest, ScaleMessages) {
  struct Bad {
    const char* what;
    std::function<void(Case&, RopePoolParams&)> change;
    std::string message;
    bool fp8_pool = true;
  };
  HostBuffer scale2("scale2", DType::Float32, 2);
  HostBuffer scale16("scale16", DType::Float16, 1);
  HostBuffer scale_zero("zero", DType::Float32, 1);
  HostBuffer scale_nan("nan", DType::Float32, 1);
  *static_cast<float*>(scale_zero.data()) = 0.0f;
  *static_cast<float*>(scale_nan.data()) = NAN;
  HostBuffer scale_ok("ok", DType::Float32, 1);
  *static_cast<float*>(scale_ok.data()) = 1.5f;
  const std::vector<Bad> cases = {
      {"k_scale with a float32 pool", [](Case&, RopePoolParams& p) { p.k_scale.value = 2.0; },
       "rope_pool_fused: k_scale is given but the pools are float32; k_scale and v_scale "
       "quantise float8_e4m3fn pools only",
       false},
      {"q_scale without fp8 q_rot", [](Case&, RopePoolParams& p) { p.q_scale.value = 2.0; },
       "rope_pool_fused: q_scale is given but q_rot is float32; q_scale quantises a "
       "float8_e4m3fn q_rot only"},
      {"zero", [](Case&, RopePoolParams& p) { p.k_scale.value = 0.0; },
       "rope_pool_fused: k_scale must be finite and > 0, got 0.0"},
      {"negative", [](Case&, RopePoolParams& p) { p.v_scale.value = -1.0; },
       "rope_pool_fused: v_scale must be finite and > 0, got -1.0"},
      {"inf", [](Case&, RopePoolParams& p) { p.v_scale.value = INFINITY; },
       "rope_pool_fused: v_scale must be finite and > 0, got inf"},
      {"nan", [](Case&, RopePoolParams& p) { p.k_scale.value = NAN; },
       "rope_pool_fused: k_scale must be finite and > 0, got nan"},
      {"zero as float32", [](Case&, RopePoolParams& p) { p.k_scale.value = 1e-50; },
       "rope_pool_fused: k_scale must be finite and > 0, got 1e-50 (0.0 as float32)"},
      {"inf as float32", [](Case&, RopePoolParams& p) { p.k_scale.value = 1e39; },
       "rope_pool_fused: k_scale must be finite and > 0, got 1e+39 (inf as float32)"},
      {"both", [&](Case&, RopePoolParams& p) { p.k_scale.value = 1.0, p.k_scale.tensor = scale_ok.contiguous({1}); },
       "rope_pool_fused: k_scale is both a number and a tensor; pass one of them"},
      {"two elements", [&](Case&, RopePoolParams& p) { p.v_scale.tensor = scale2.contiguous({2}); },
       "rope_pool_fused: v_scale must be a number or a one-element float32 tensor, got shape [2]"},
      {"float16", [&](Case&, RopePoolParams& p) { p.k_scale.tensor = scale16.contiguous({1}); },
       "rope_pool_fused: k_scale must be a float32 tensor, got float16"},
      {"device", [&](Case&, RopePoolParams& p) { p.k_scale.tensor = scale_ok.contiguous({1}, 0, Device{DeviceType::CUDA, 0}); },
       "rope_pool_fused: k_scale must be on the pools' device (cpu), got cuda:0"},
      {"tensor zero", [&](Case&, RopePoolParams& p) { p.k_scale.tensor = scale_zero.contiguous({1}); },
       "rope_pool_fused: k_scale must be finite and > 0, got 0.0 (the tensor's value)"},
      {"tensor nan", [&](Case&, RopePoolParams& p) { p.v_scale.tensor = scale_nan.contiguous({}); },
       "rope_pool_fused: v_scale must be finite and > 0, got nan (the tensor's value)"},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.what);
    Shape s = small_shape();
    if (b.fp8_pool) s.pool_dtype = DType::Float8E4M3FN;
    Case c(s);
    c.randomize(rng);
    RopePoolParams p = c.params;
    b.change(c, p);
    expect_rejected(c, b.message, &p);
  }
  {  // a scale tensor that is a view into a pool: an input overlapping an output
    Shape s = small_shape();
    s.pool_dtype = DType::Float8E4M3FN;
    Case c(s);
    c.randomize(rng);
    RopePoolParams p = c.params;
    TensorView in_pool = c.tensors.v_pool;
    in_pool.dtype = DType::Float32;
    in_pool.ndim = 1;
    in_pool.shape[0] = 1;
    in_pool.strides[0] = 1;
    *static_cast<float*>(in_pool.data) = 1.0f;
    p.k_scale.tensor = in_pool;
    expect_rejected(c,
                    "rope_pool_fused: v_pool and k_scale overlap in memory (they share at least "
                    "one byte); the result would depend on the order of reads and writes",
                    &p);
  }
}

// The K and V halves of one combined cache are accepted (they interleave without sharing a
// byte); halves that do share bytes are rejected with both names.
TEST_F(SeededTest, CombinedCacheHalvesOverlapExactly) {
  for (PoolLayout pool : {PoolLayout::CombinedVllm, PoolLayout::CombinedFlashInfer})
    for (KvLayout layout : {KvLayout::NHD, KvLayout::HND}) {
      Shape s = small_shape();
      s.kv_layout = layout;
      s.page_size = 16;
      s.pool_dtype = DType::Float8E4M3FN;
      Case c(s, Layout{QkvLayout::Contiguous, pool});
      c.randomize(rng);
      EXPECT_NO_THROW(validate_rope_pool(c.tensors, c.params));
      // v_pool moved one element towards k_pool: the halves now share bytes
      c.tensors.v_pool.data = static_cast<uint8_t*>(c.tensors.v_pool.data) - 1;
      expect_rejected(c,
                      "rope_pool_fused: k_pool and v_pool overlap in memory (they share at least "
                      "one byte); the result would depend on the order of reads and writes");
    }
}

// A 4-D pool whose strides make two slots share memory is rejected (the writes would clobber
// each other).
TEST_F(SeededTest, SelfOverlappingPagedPool) {
  Shape s = small_shape();
  s.kv_layout = KvLayout::NHD;
  s.page_size = 4;
  Case c(s);
  c.randomize(rng);
  c.tensors.k_pool.strides[1] = 8;  // rows of a page 8 apart, but a row spans 2 * 16
  c.tensors.v_pool.strides[1] = 8;
  expect_rejected(c,
                  "rope_pool_fused: k_pool has overlapping or negative strides (128, 8, 16, 1); "
                  "every element it receives needs its own memory");
}

}  // namespace
}  // namespace ropepool::test
