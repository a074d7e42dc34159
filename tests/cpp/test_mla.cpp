// mla_rope_pool_fused (SPEC §8) on the CPU: every element against the float64 reference,
// whole-buffer contracts (poisoned outputs, guards, untouched rows and row padding), the
// fp8 rule, paged caches, strided views, int64 indices, and every validation message. Every
// call that succeeds is made again without k_pe_rot (an empty k_out, return_k_rot=False),
// which must write the very bytes of the call with it, k_out aside.
#include <cmath>
#include <string>
#include <tuple>

#include "ropepool_mla_kit.hpp"
#include "../../src/mla_backend.hpp"
#include "../../src/test_hooks.hpp"
#include "test_support.hpp"

namespace ropepool::test {
namespace {

class Mla : public SeededTest {
 protected:
  // The call against the reference, then the same call without k_pe_rot against it
  // (MlaCase::check_without_k_rot: q_out and the whole cache, guards included, bit for bit;
  // the k_out buffer, or k_pe in place, untouched).
  void run_and_check(MlaCase& c, int threads = 1, const MlaCallOptions& o = {}) {
    c.poison_outputs(rng);
    const MlaCase::Snapshot before = c.snapshot();
    ASSERT_NO_THROW(mla_rope_pool_fused(c.tensors, c.params, o));
    for (const std::string& p : c.check(before, threads)) ADD_FAILURE() << p;
    for (const std::string& p : c.check_without_k_rot(before, o, threads)) ADD_FAILURE() << p;
  }
  // The call is rejected with exactly `message`, and nothing at all is written.
  void expect_rejected(MlaCase& c, const std::string& message) {
    const MlaCase::Snapshot before = c.snapshot();
    const Thrown t = thrown_by([&] { mla_rope_pool_fused(c.tensors, c.params); });
    EXPECT_TRUE(t.error) << t.other;
    EXPECT_EQ(t.what, message);
    const Thrown v = thrown_by([&] { validate_mla_rope_pool(c.tensors, c.params); });
    EXPECT_EQ(v.what, message) << "validate_mla_rope_pool must raise what the op raises";
    for (const std::string& change : c.changes_since(before)) ADD_FAILURE() << change;
  }
};

// DeepSeek-V3 (config.json: qk_rope_head_dim 64, kv_lora_rank 512, rope_theta 10000, yarn
// factor 40 from 4096, beta 32/1, mscale = mscale_all_dim = 1.0) at 16 heads per rank,
// every dtype, both pair styles, token and paged caches, both index widths.
using GridParam = std::tuple<DType, bool, int64_t, DType>;
class MlaGrid : public Mla, public ::testing::WithParamInterface<GridParam> {};

TEST_P(MlaGrid, DeepSeekV3MatchesReference) {
  const auto [dtype, interleaved, page_size, index_dtype] = GetParam();
  MlaShape s;
  s.dtype = s.cache_dtype = dtype;
  s.interleaved = interleaved;
  s.page_size = page_size;
  s.position_dtype = s.slot_dtype = index_dtype;
  s.num_tokens = 37;
  s.num_heads = 16;
  s.pool_size = 128;
  s.rope_scaling = deepseek_v3_yarn();
  MlaCase c(s);
  c.randomize(rng);
  run_and_check(c);
}

std::string grid_name(const ::testing::TestParamInfo<GridParam>& info) {
  const auto [dtype, interleaved, page_size, index_dtype] = info.param;
  return std::string(dtype_name(dtype)) + (interleaved ? "_gptj" : "_neox") +
         (page_size ? "_nhd" + std::to_string(page_size) : "_token") + "_" +
         dtype_name(index_dtype);
}

INSTANTIATE_TEST_SUITE_P(
    All, MlaGrid,
    ::testing::Combine(::testing::Values(DType::Float32, DType::Float16, DType::BFloat16),
                       ::testing::Bool(), ::testing::Values(0, 1, 16, 64),
                       ::testing::Values(DType::Int32, DType::Int64)),
    grid_name);

TEST_F(Mla, OneHundredTwentyEightHeads) {
  MlaShape s;
  s.num_heads = 128;
  s.num_tokens = 5;
  s.rope_scaling = deepseek_v3_yarn();
  MlaCase c(s);
  c.randomize(rng);
  run_and_check(c);
}

// DeepSeek-V2-Lite: 16 heads, yarn with mscale = mscale_all_dim = 0.707 (attention factor 1).
TEST_F(Mla, DeepSeekV2Lite) {
  MlaShape s;
  s.num_heads = 16;
  s.num_tokens = 9;
  s.rope_scaling = deepseek_v3_yarn();
  s.rope_scaling.mscale = 0.707;
  s.rope_scaling.mscale_all_dim = 0.707;
  MlaCase c(s);
  c.randomize(rng);
  run_and_check(c);
}

// mscale != mscale_all_dim gives an attention factor != 1 that multiplies cos and sin.
TEST_F(Mla, YarnAttentionFactorApplies) {
  MlaShape s;
  s.dtype = s.cache_dtype = DType::Float32;
  s.rope_scaling = deepseek_v3_yarn();
  s.rope_scaling.mscale = 1.0;
  s.rope_scaling.mscale_all_dim = 0.0;
  MlaCase c(s);
  EXPECT_NE(mla_schedule(c.params, 64).attention_scaling, 1.0);
  c.randomize(rng);
  run_and_check(c);
}

TEST_F(Mla, EveryScheduleType) {
  for (RopeType type : kAllRopeTypes) {
    SCOPED_TRACE(rope_type_name(type));
    MlaShape s;
    s.num_heads = 4;
    s.rope_scaling = scaling_preset(type, 64);
    MlaCase c(s);
    c.randomize(rng);
    run_and_check(c);
  }
}

TEST_F(Mla, Fp8CacheEveryScaleForm) {
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16})
    for (int form = 0; form < 3; ++form) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " scale form " + std::to_string(form));
      MlaShape s;
      s.dtype = dtype;
      s.cache_dtype = DType::Float8E4M3FN;
      s.page_size = form == 2 ? 16 : 0;
      if (form == 1) s.kv_scale = 0.03125;  // large values saturate to 448
      if (form == 2) s.kv_scale_tensor = true;
      s.rope_scaling = deepseek_v3_yarn();
      MlaCase c(s);
      c.randomize(rng);
      run_and_check(c);
    }
}

TEST_F(Mla, InPlaceAnd3DKeyAndContiguousQ) {
  for (int variant = 0; variant < 3; ++variant) {
    MlaShape s;
    s.inplace = variant != 1;
    s.k_pe_3d = variant != 0;
    s.nope_dim = variant == 2 ? 0 : 128;
    MlaCase c(s);
    c.randomize(rng);
    run_and_check(c);
  }
}

TEST_F(Mla, NegativeSlotsSkipEmptyCallWritesNothing) {
  MlaShape s;
  s.num_tokens = 8;
  MlaCase c(s);
  c.randomize(rng, 1.0);  // every slot negative
  run_and_check(c);

  MlaShape e;
  e.num_tokens = 0;
  MlaCase empty(e);
  empty.randomize(rng);
  const MlaCase::Snapshot before = empty.snapshot();
  ASSERT_NO_THROW(mla_rope_pool_fused(empty.tensors, empty.params));
  for (const std::string& change : empty.changes_since(before)) ADD_FAILURE() << change;
}

TEST_F(Mla, ThreadsAndRepeatedSlots) {
  ThreadCountGuard guard;
  set_cpu_num_threads(4);
  const int64_t saved = detail::cpu::parallel_min_bytes();
  detail::cpu::set_parallel_min_bytes(1);
  MlaShape s;
  s.num_tokens = 300;
  s.num_heads = 8;
  s.pool_size = 512;
  s.page_size = 16;
  MlaCase c(s);
  c.randomize(rng);
  for (int64_t t = 0; t < 40; ++t) c.set_slot(t, 7);  // one row named by 40 tokens
  run_and_check(c, 2);
  detail::cpu::set_parallel_min_bytes(saved);
}

// Non-temporal stores (forced for any size), staged or in place, into both cache dtypes:
// the call without k_pe_rot takes the same store paths for q_out and the cache rows.
TEST_F(Mla, StreamingStores) {
  const int64_t saved = detail::cpu::stream_min_bytes();
  detail::cpu::set_stream_min_bytes(0);
  for (DType cache_dtype : {DType::BFloat16, DType::Float8E4M3FN})
    for (bool inplace : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + (inplace ? " in place" : ""));
      MlaShape s;
      s.cache_dtype = cache_dtype;
      s.inplace = inplace;
      s.num_tokens = 33;
      s.page_size = 16;
      s.rope_scaling = deepseek_v3_yarn();
      MlaCase c(s);
      c.randomize(rng);
      run_and_check(c);
    }
  detail::cpu::set_stream_min_bytes(saved);
}

// Without k_pe_rot only q_out and the named rows are written: with every slot negative, q_out
// alone (check_without_k_rot also compares that with the call with k_pe_rot).
TEST_F(Mla, WithoutKRotAndNoCacheRowsWritesOnlyQ) {
  for (DType cache_dtype : {DType::Float16, DType::Float8E4M3FN}) {
    MlaShape s;
    s.dtype = DType::Float16;
    s.cache_dtype = cache_dtype;
    s.num_tokens = 7;
    MlaCase c(s);
    c.randomize(rng, 1.0);
    c.poison_outputs(rng);
    const MlaCase::Snapshot before = c.snapshot();
    c.tensors.k_out = TensorView{};
    ASSERT_NO_THROW(mla_rope_pool_fused(c.tensors, c.params));
    for (const std::string& p : c.check(before)) ADD_FAILURE() << p;
    const std::vector<std::string> changed = c.changes_since(before);
    ASSERT_EQ(changed.size(), 1u);
    EXPECT_EQ(changed[0].rfind("buffer q_out changed", 0), 0u) << changed[0];
  }
}

TEST_F(Mla, OutOfRangeSlotsWriteNothing) {
  for (int64_t page_size : {0, 16}) {
    MlaShape s;
    s.page_size = page_size;
    s.num_tokens = 6;
    MlaCase c(s);
    c.randomize(rng);
    c.set_slot(3, 64);
    expect_rejected(c, "mla_rope_pool_fused: slots[3] = 64 is out of range for a kv_cache of 64 slots");
  }
  MlaShape s;
  MlaCase c(s);
  c.randomize(rng, 0);
  for (int64_t t = 0; t < s.num_tokens; ++t) c.set_slot(t, 20 + t);
  c.set_slot(2, 9), c.set_slot(3, 9);
  MlaCallOptions strict;
  strict.check_slots = true;
  const MlaCase::Snapshot before = c.snapshot();
  const Thrown t = thrown_by([&] { mla_rope_pool_fused(c.tensors, c.params, strict); });
  EXPECT_EQ(t.what, "mla_rope_pool_fused: slots[3] = 9 repeats slots[2]; with check_slots each slot may be written once per call");
  for (const std::string& change : c.changes_since(before)) ADD_FAILURE() << change;
}

TEST_F(Mla, AngleLimit) {
  MlaShape s;
  s.position_dtype = DType::Int64;
  MlaCase c(s);
  c.randomize(rng);
  c.set_position(1, int64_t(1) << 33);
  expect_rejected(c, "mla_rope_pool_fused: positions[1] = 8589934592 times inv_freq[0] = 1.0 is an "
                     "angle of 8589934592.0 rad, beyond the limit of 2^32 = 4294967296 rad that "
                     "the angle reduction handles");
}

// The CPU kernel's e4m3 conversion is SPEC §6's rule (float_to_e4m3): every float whose
// exponent reaches the e4m3 range (2^-11 .. 2^9, where both rounding regimes and every tie
// live), both signs, all mantissas; a stride through all the other bit patterns.
TEST(MlaE4m3, EqualsTheRuleForEveryFloat) {
  int64_t bad = 0;
  auto one = [&](uint32_t u) {
    const float f = bits_float(u);
    if (detail::e4m3_bits(f) != float_to_e4m3(f) && ++bad <= 5)
      ADD_FAILURE() << "bits 0x" << std::hex << u << ": " << int(detail::e4m3_bits(f)) << " vs "
                    << int(float_to_e4m3(f));
  };
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t e = 127 - 11; e <= 127 + 9; ++e)
      for (uint32_t m = 0; m < (1u << 23); ++m) one(sign | (e << 23) | m);
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4093) one(uint32_t(u));
  for (uint32_t u : {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 1u, 0x80000001u})
    one(u);
  EXPECT_EQ(bad, 0);
}

// Every validation message, in SPEC §2's order, each with nothing written.
// Shapes-only validation (what the JAX and MLX front ends run while a call is traced): views
// without memory pass it, while validation with readable data rejects them, and the op itself
// refuses the option, writing nothing.
TEST_F(Mla, ShapesOnlyValidationTakesNullData) {
  MlaShape s;
  s.num_tokens = 4;
  s.num_heads = 2;
  MlaCase c(s);
  c.randomize(rng);
  MlaTensors nulls = c.tensors;
  for (TensorView* v : {&nulls.q_pe, &nulls.k_pe, &nulls.kv_c, &nulls.kv_cache, &nulls.q_out,
                        &nulls.k_out})
    v->data = nullptr;
  MlaCallOptions shapes_only;
  shapes_only.data_readable = false;
  EXPECT_NO_THROW(validate_mla_rope_pool(nulls, c.params, shapes_only));
  const Thrown e = thrown_by([&] { validate_mla_rope_pool(nulls, c.params); });
  EXPECT_TRUE(e.error) << e.other;
  EXPECT_EQ(e.what, "mla_rope_pool_fused: q_pe [4, 2, 64] has a null data pointer");
  const MlaCase::Snapshot before = c.snapshot();
  EXPECT_THROW(mla_rope_pool_fused(c.tensors, c.params, shapes_only), std::invalid_argument);
  EXPECT_TRUE(c.changes_since(before).empty());
}

TEST_F(Mla, ValidationMessages) {
  MlaShape s;
  s.num_tokens = 4;
  s.num_heads = 2;
  s.latent_dim = 32;
  s.rope_dim = 16;
  s.nope_dim = 8;
  s.pool_size = 16;
  auto fresh = [&](auto&& edit, const std::string& message, MlaShape shape) {
    MlaCase c(shape);
    c.randomize(rng);
    edit(c);
    SCOPED_TRACE(message);
    expect_rejected(c, message);
  };
  const std::string P = "mla_rope_pool_fused: ";
  fresh([](MlaCase& c) { c.tensors.q_pe.ndim = 2; },
        P + "q_pe must be 3-D [num_tokens, num_heads, rope_dim], got [4, 2]", s);
  fresh([](MlaCase& c) { c.tensors.k_pe.ndim = 1; },
        P + "k_pe must be [num_tokens, rope_dim] or [num_tokens, 1, rope_dim], got [4]", s);
  fresh([](MlaCase& c) { c.tensors.kv_c.ndim = 1; },
        P + "kv_c must be 2-D [num_tokens, kv_lora_rank], got [4]", s);
  fresh([](MlaCase& c) { c.tensors.slots.ndim = 2, c.tensors.slots.shape[1] = 1; },
        P + "positions/slots must be 1-D [num_tokens], got positions [4] and slots [4, 1]", s);
  fresh([](MlaCase& c) { c.params.kv_layout = MlaCacheLayout::NHD; },
        P + "kv_cache must be 3-D [pages, page_size, kv_lora_rank + rope_dim] with "
            "kv_layout=\"NHD\", got [16, 48]", s);
  MlaShape paged = s;
  paged.page_size = 4;
  fresh([](MlaCase& c) { c.params.kv_layout = MlaCacheLayout::Token; },
        P + "kv_cache must be 2-D [num_slots, kv_lora_rank + rope_dim] without kv_layout, got "
            "[4, 4, 48]", paged);
  fresh([](MlaCase& c) { c.tensors.k_pe.shape[1] = 8, c.tensors.k_out.shape[1] = 8; },
        P + "k_pe shape must be [num_tokens, rope_dim] = [4, 16] (or [4, 1, 16]) for q_pe "
            "[4, 2, 16], got [4, 8]", s);
  fresh([](MlaCase& c) { c.tensors.kv_c.shape[0] = 3; },
        P + "kv_c shape must be [num_tokens, kv_lora_rank] with num_tokens = 4 (from q_pe), got [3, 32]", s);
  fresh([](MlaCase& c) { c.tensors.positions.shape[0] = 3; },
        P + "positions/slots must have one entry per token (4), got positions [3] and slots [4]", s);
  fresh([](MlaCase& c) { c.tensors.kv_cache.shape[1] = 40; },
        P + "kv_cache shape must be [num_slots, kv_lora_rank + rope_dim] with kv_lora_rank + "
            "rope_dim = 32 + 16 = 48, got [16, 40]", s);
  fresh([](MlaCase& c) { c.tensors.kv_c.dtype = DType::Float16; },
        P + "q_pe/k_pe/kv_c dtypes must match, got q_pe bfloat16, k_pe bfloat16, kv_c float16", s);
  fresh([](MlaCase& c) { c.tensors.kv_cache.dtype = DType::Float16; },
        P + "kv_cache dtype must be q_pe's (bfloat16) or float8_e4m3fn, got float16", s);
  fresh([](MlaCase& c) { c.tensors.slots.dtype = DType::UInt32; },
        P + "slots must be int32 or int64, got uint32", s);
  MlaShape odd = s;
  odd.rope_dim = 15;
  fresh([](MlaCase&) {}, P + "rope_dim (q_pe.shape[2]) must be even and > 0, got 15", odd);
  fresh([](MlaCase& c) { c.params.rope_base = -1; },
        P + "rope_base must be finite and > 0, got -1.000000", s);
  fresh([](MlaCase& c) { c.params.rope_scaling.type = RopeType::Linear, c.params.rope_scaling.factor = 0; },
        P + "rope_scaling 'linear' needs factor > 0, got 0", s);
  // A multimodal schedule (SPEC §7), from rope_scaling or made beforehand: its sections would
  // be ignored (one position per token here).
  const std::string multimodal =
      P + "the schedule is multimodal (mrope_section = [2, 3, 3]); positions here are one per token "
          "and the sections would be ignored";
  fresh([](MlaCase& c) { c.params.rope_scaling.mrope_section = std::vector<int64_t>{2, 3, 3}; },
        multimodal, s);
  RopePoolParams made_for;
  made_for.head_dim = 16;
  made_for.rope_base = 10000;
  made_for.rope_scaling.mrope_section = std::vector<int64_t>{2, 3, 3};
  const RopeSchedule multimodal_schedule = make_rope_schedule(made_for);
  fresh([&](MlaCase& c) { c.params.rope_base = 10000, c.params.schedule = &multimodal_schedule; },
        multimodal, s);
  fresh([](MlaCase& c) {
          for (TensorView* v : {&c.tensors.q_pe, &c.tensors.k_pe, &c.tensors.kv_c, &c.tensors.kv_cache,
                                &c.tensors.q_out, &c.tensors.k_out})
            v->dtype = DType::Float64;
        },
        P + "unsupported dtype float64 for q_pe/k_pe/kv_c; expected float32, float16 or bfloat16", s);
  fresh([](MlaCase& c) { c.params.kv_scale = 2.0; },
        P + "kv_scale is only used with a float8_e4m3fn kv_cache, got a bfloat16 cache", s);
  MlaShape fp8 = s;
  fp8.cache_dtype = DType::Float8E4M3FN;
  fp8.kv_scale = 0.0;
  fresh([](MlaCase&) {}, P + "kv_scale must be finite and > 0, got 0.0", fp8);
  fp8.kv_scale = 2.0;
  fp8.kv_scale_tensor = true;
  fresh([](MlaCase&) {}, P + "kv_scale is given twice (a number and a tensor); pass one", fp8);
  fp8.kv_scale.reset();
  fresh([](MlaCase& c) { c.tensors.kv_scale.dtype = DType::Float16; },
        P + "kv_scale must be a one-element float32 tensor, got float16 [1]", fp8);
  fresh([](MlaCase& c) { *static_cast<float*>(c.tensors.kv_scale.data) = -1; },
        P + "kv_scale must be finite and > 0, got -1.0", fp8);
  fresh([](MlaCase& c) { c.tensors.kv_cache.device = {DeviceType::CUDA, 0}; },
        P + "all tensors must be on one device, got q_pe on cpu and kv_cache on cuda:0", s);
  fresh([](MlaCase& c) { c.tensors.q_out.dtype = DType::Float32; },
        P + "q_out must have the shape and dtype of q_pe ([4, 2, 16] bfloat16), got [4, 2, 16] float32", s);
  fresh([](MlaCase& c) { c.tensors.kv_c.strides[1] = 2; },
        P + "kv_c must have a contiguous last dimension (stride 1), got strides (48, 2)", s);
  // A view with elements and no memory; a k_out with a shape and no memory is not "no
  // k_pe_rot" (only an empty k_out is).
  fresh([](MlaCase& c) { c.tensors.kv_cache.data = nullptr; },
        P + "kv_cache [16, 48] has a null data pointer", s);
  fresh([](MlaCase& c) { c.tensors.k_out.data = nullptr; },
        P + "k_out [4, 16] has a null data pointer", s);
  fresh([](MlaCase& c) { c.tensors.kv_cache.strides[0] = 8; },
        P + "kv_cache has overlapping or negative strides (8, 1); every element it receives needs its own memory", s);
  // Overlaps (SPEC §3): the cache over an input, an output over the cache, q_pe and k_pe
  // sharing memory when rotated in place.
  fresh([](MlaCase& c) { c.tensors.kv_cache.data = c.tensors.kv_c.data, c.tensors.kv_cache.shape[0] = 4; },
        P + "kv_cache and k_pe overlap in memory (they share at least one byte); the result would "
            "depend on the order of reads and writes", s);
  fresh([](MlaCase& c) {
          c.tensors.q_out = c.tensors.kv_cache;
          c.tensors.q_out.ndim = 3, c.tensors.q_out.shape[0] = 4, c.tensors.q_out.shape[1] = 2;
          c.tensors.q_out.shape[2] = 16, c.tensors.q_out.strides[0] = 48, c.tensors.q_out.strides[1] = 16;
          c.tensors.q_out.strides[2] = 1;
        },
        P + "q_out and kv_cache overlap in memory (they share at least one byte); the result "
            "would depend on the order of reads and writes", s);
  // No k_pe_rot (an empty k_out): only a default TensorView asks for none; the other checks
  // still run (here: the first fault of the call).
  fresh([](MlaCase& c) { c.tensors.k_out = TensorView{}, c.tensors.q_out.dtype = DType::Float32; },
        P + "q_out must have the shape and dtype of q_pe ([4, 2, 16] bfloat16), got [4, 2, 16] float32", s);
  fresh([](MlaCase& c) { c.tensors.k_out = TensorView{}, c.tensors.kv_cache.device = {DeviceType::CUDA, 0}; },
        P + "all tensors must be on one device, got q_pe on cpu and kv_cache on cuda:0", s);
  fresh([](MlaCase& c) { c.tensors.k_out.ndim = 0; },
        P + "k_out must have the shape and dtype of k_pe ([4, 16] bfloat16), got [] bfloat16", s);
  fresh([](MlaCase& c) {
          c.tensors.k_out = TensorView{};
          c.tensors.kv_cache.data = c.tensors.kv_c.data, c.tensors.kv_cache.shape[0] = 4;
        },
        P + "kv_cache and k_pe overlap in memory (they share at least one byte); the result would "
            "depend on the order of reads and writes", s);
  MlaShape inplace = s;
  inplace.inplace = true;
  fresh([](MlaCase& c) {
          c.tensors.k_pe.data = c.tensors.q_pe.data;
          c.tensors.k_pe.strides[0] = c.tensors.q_pe.strides[0];
          c.tensors.k_out = c.tensors.k_pe;
        },
        P + "q_pe (rotated in place) and k_pe overlap in memory (they share at "
            "least one byte); the result would depend on the order of reads and writes", inplace);
}

}  // namespace
}  // namespace ropepool::test
