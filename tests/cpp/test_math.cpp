// SPEC §1 math: every output element within the accuracy bound of the float64 reference,
// over dtype x head size x head layout x token count, positions up to 2^20, NaN/Inf; and
// SPEC §4 over pairs (NeoX, GPT-J) x rotary_dim (full, partial) x every rope_scaling type.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "test_support.hpp"

namespace ropepool::test {
namespace {

using Heads = std::pair<int64_t, int64_t>;  // (num_qo_heads, num_kv_heads)

std::string heads_name(Heads h) {
  return (h.first == h.second ? "MHA" : "GQA") + std::to_string(h.first) + "x" + std::to_string(h.second);
}

// The schedule itself against the SPEC formula, computed independently in long double: the
// reference and every backend take their inv_freq from it.
TEST(Schedule, InvFreqFollowsSpecFormula) {
  for (int64_t D : {2, 64, 96, 128, 256})
    for (double base : {10000.0, 500000.0, 1e6, 2.5}) {
      SCOPED_TRACE("head_dim " + std::to_string(D) + ", rope_base " + std::to_string(base));
      RopePoolParams params;
      params.head_dim = D;
      params.num_qo_heads = params.num_kv_heads = 8;
      params.rope_base = base;
      const RopeSchedule s = make_rope_schedule(params);
      EXPECT_EQ(s.rotary_dim, D);
      EXPECT_EQ(s.attention_scaling, 1.0);
      ASSERT_EQ(int64_t(s.inv_freq.size()), D / 2);
      for (int64_t i = 0; i < D / 2; ++i) {
        const long double want = std::pow((long double)base, -2.0L * i / D);
        // 2^-48 relative: at |position| < 2^20 the angle is off by < 2^-28 rad, far inside
        // the SPEC bound (double pow of a rounded exponent is not correctly rounded).
        EXPECT_NEAR(double(s.inv_freq[size_t(i)] / want), 1.0, 0x1p-48) << "i = " << i;
      }
    }
}

// --- the grid ----------------------------------------------------------------------------

using GridParam = std::tuple<DType, int64_t, Heads, int64_t>;  // dtype, head_dim, heads, T

class MathGrid : public SeededTest, public ::testing::WithParamInterface<GridParam> {};

TEST_P(MathGrid, MatchesReferenceAndWritesPool) {
  const auto [dtype, head_dim, heads, T] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.num_qo_heads = heads.first;
  s.num_kv_heads = heads.second;
  s.num_tokens = T;
  s.pool_size = T + T / 4 + 3;  // some rows are never written
  Case c(s);
  c.randomize(rng);
  run_and_check(c);
}

std::string grid_name(const ::testing::TestParamInfo<GridParam>& info) {
  const auto [dtype, head_dim, heads, T] = info.param;
  return dtype_str(dtype) + "_D" + std::to_string(head_dim) + "_" + heads_name(heads) + "_T" + std::to_string(T);
}

const auto kDtypes = ::testing::Values(DType::Float32, DType::Float16, DType::BFloat16);
const auto kHeads = ::testing::Values(Heads{32, 8}, Heads{8, 8});

INSTANTIATE_TEST_SUITE_P(Small, MathGrid,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(2, 64, 80, 96, 128, 200, 256), kHeads,
                                            ::testing::Values<int64_t>(0, 1, 7, 300)),
                         grid_name);

// Enough tokens to cross any multithreading threshold of the CPU backend (its work is
// split by tokens and heads); odd so that no split comes out even. Fewer head shapes than
// the small grid: these dominate the run time under the sanitizers.
INSTANTIATE_TEST_SUITE_P(ManyTokens, MathGrid,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(2, 96), ::testing::Values(Heads{32, 8}),
                                            ::testing::Values<int64_t>(4999)),
                         grid_name);
INSTANTIATE_TEST_SUITE_P(ManyTokensMHA, MathGrid,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(128), ::testing::Values(Heads{8, 8}),
                                            ::testing::Values<int64_t>(4999)),
                         grid_name);

// --- SPEC §4: pairs x rotary_dim x rope_scaling --------------------------------------------

enum class Pairs { NeoX, GPTJ };
enum class Rotary { Full, Partial };  // partial: rotary_dim = head_dim / 2 (rounded to even)
using VariantParam = std::tuple<DType, int64_t, Pairs, Rotary, RopeType, int64_t>;  // ..., T

class MathVariants : public SeededTest, public ::testing::WithParamInterface<VariantParam> {};

TEST_P(MathVariants, MatchesReferenceAndWritesPool) {
  const auto [dtype, head_dim, pairs, rotary, type, T] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.num_qo_heads = 8;
  s.num_kv_heads = 2;
  s.num_tokens = T;
  s.pool_size = T + T / 4 + 3;
  s.interleaved = pairs == Pairs::GPTJ;
  s.rotary_dim = rotary == Rotary::Full ? head_dim : head_dim / 4 * 2;
  s.rope_scaling = scaling_preset(type, rotary == Rotary::Full ? head_dim : head_dim / 4 * 2);
  Case c(s);
  c.randomize(rng);
  run_and_check(c);
}

std::string variant_name(const ::testing::TestParamInfo<VariantParam>& info) {
  const auto [dtype, head_dim, pairs, rotary, type, T] = info.param;
  return dtype_str(dtype) + "_D" + std::to_string(head_dim) + (pairs == Pairs::GPTJ ? "_gptj" : "_neox") +
         (rotary == Rotary::Full ? "_full" : "_partial") + "_" + rope_type_name(type) + "_T" + std::to_string(T);
}

INSTANTIATE_TEST_SUITE_P(Spec4, MathVariants,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(80, 128),
                                            ::testing::Values(Pairs::NeoX, Pairs::GPTJ),
                                            ::testing::Values(Rotary::Full, Rotary::Partial),
                                            ::testing::ValuesIn(kAllRopeTypes), ::testing::Values<int64_t>(67)),
                         variant_name);
// The threaded path with the SPEC §4 extras.
INSTANTIATE_TEST_SUITE_P(Spec4ManyTokens, MathVariants,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(128), ::testing::Values(Pairs::GPTJ),
                                            ::testing::Values(Rotary::Partial),
                                            ::testing::Values(RopeType::Yarn, RopeType::Llama3),
                                            ::testing::Values<int64_t>(4999)),
                         variant_name);

// --- rounding -------------------------------------------------------------------------------

using RoundingParam = std::tuple<DType, int64_t>;  // dtype, head_dim
class Rounding : public SeededTest, public ::testing::WithParamInterface<RoundingParam> {};

// float16/bfloat16 results are rounded to nearest, not truncated (Highway's bfloat16
// DemoteTo truncates, so this guards the vector conversions of the CPU backend).
TEST_P(Rounding, SixteenBitOutputsRoundToNearest) {
  const auto [dtype, head_dim] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.num_tokens = 300;
  s.num_qo_heads = 16;
  s.num_kv_heads = 4;
  s.pool_size = 320;
  Case c(s);
  c.randomize(rng);
  ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params));
  EXPECT_EQ(check_rotation("q_out", c.tensors.q, c.tensors.q_out, c.tensors.positions, c.params, true), 0);
  EXPECT_EQ(check_rotation("k_out", c.tensors.k, c.tensors.k_out, c.tensors.positions, c.params, true), 0);
}

INSTANTIATE_TEST_SUITE_P(HalfDtypes, Rounding,
                         ::testing::Combine(::testing::Values(DType::Float16, DType::BFloat16),
                                            ::testing::Values<int64_t>(2, 80, 128)),
                         [](const ::testing::TestParamInfo<RoundingParam>& info) {
                           return dtype_str(std::get<0>(info.param)) + "_D" + std::to_string(std::get<1>(info.param));
                         });

// --- rope_base, negative positions ---------------------------------------------------------

using BaseParam = std::tuple<DType, double>;
class RopeBase : public SeededTest, public ::testing::WithParamInterface<BaseParam> {};

TEST_P(RopeBase, MatchesReference) {
  const auto [dtype, base] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = 300;
  s.num_qo_heads = 16;
  s.num_kv_heads = 4;
  s.pool_size = 400;
  s.rope_base = base;
  Case c(s);
  c.randomize(rng);
  run_and_check(c);
}

std::string base_name(const ::testing::TestParamInfo<BaseParam>& info) {
  const auto [dtype, base] = info.param;
  char printed[32];
  std::snprintf(printed, sizeof printed, "%g", base);
  std::string n = dtype_str(dtype) + "_base";
  for (const char* p = printed; *p; ++p) {
    if (std::isalnum(static_cast<unsigned char>(*p))) n += *p;
    else if (*p == '.') n += 'p';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Bases, RopeBase, ::testing::Combine(kDtypes, ::testing::Values(500000.0, 1e6, 2.5)),
                         base_name);

class Positions : public SeededTest, public ::testing::WithParamInterface<DType> {};

// SPEC §1 bounds |positions| < 2^20, so negative positions follow the same formula.
TEST_P(Positions, NegativePositionsFollowTheFormula) {
  Shape s;
  s.dtype = GetParam();
  s.num_tokens = 300;
  s.pool_size = 300;
  s.position_dtype = DType::Int64;
  Case c(s);
  c.randomize(rng);
  for (int64_t t = 0; t < 300; ++t) c.set_position(t, rng.integer(-(1 << 20) + 1, (1 << 20) - 1));
  c.set_position(0, -(1 << 20) + 1);
  c.set_position(1, -1000003);
  c.set_position(2, -1);
  run_and_check(c);
}

// Every token at the far end of the range, where float32 pos * inv_freq is off by 0.03 rad.
TEST_P(Positions, AllNearTwoToTheTwenty) {
  Shape s;
  s.dtype = GetParam();
  s.num_tokens = 257;
  s.pool_size = 300;
  s.head_dim = 256;
  Case c(s);
  c.randomize(rng);
  for (int64_t t = 0; t < 257; ++t) c.set_position(t, (1 << 20) - 1 - rng.integer(0, 4096));
  run_and_check(c);
}

// --- non-finite inputs (SPEC §3) -----------------------------------------------------------

using NonFiniteParam = std::tuple<DType, int64_t>;  // dtype, head_dim
class NonFinite : public SeededTest, public ::testing::WithParamInterface<NonFiniteParam> {};

// NaN/Inf in q/k/v propagate as in the float64 math (a NaN reaches exactly the two elements
// of its pair), and never change which pool rows are written; v rows, NaN payloads
// included, reach the pool bit for bit.
TEST_P(NonFinite, NanAndInfPropagateAndDoNotChangeWrittenRows) {
  const auto [dtype, head_dim] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = 300;
  s.num_qo_heads = 8;
  s.num_kv_heads = 4;
  s.head_dim = head_dim;
  s.pool_size = 350;
  Case c(s);
  c.randomize(rng);
  for (int64_t t = 0; t < 300; t += 7) c.set_position(t, 0);  // Inf * sin(0) = NaN
  int64_t specials = 0;
  for (const TensorView* x : {&c.tensors.q, &c.tensors.k, &c.tensors.v})
    for (int64_t t = 0; t < x->shape[0]; ++t)
      for (int64_t h = 0; h < x->shape[1]; ++h)
        for (int64_t d = 0; d < x->shape[2]; ++d) {
          const int64_t kind = rng.integer(0, 99);
          if (kind < 2) store_bits(*x, t, h, d, nan_pattern(dtype, rng.bits()));
          else if (kind < 3) store_bits(*x, t, h, d, inf_pattern(dtype, rng.bits()));
          else continue;
          ++specials;
        }
  ASSERT_GT(specials, 0);
  run_and_check(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Positions, kDtypes, [](const auto& info) { return dtype_str(info.param); });

// Head sizes whose half is and is not a whole number of SIMD vectors (scalar tails).
INSTANTIATE_TEST_SUITE_P(Dtypes, NonFinite,
                         ::testing::Combine(kDtypes, ::testing::Values<int64_t>(2, 64, 80, 200)),
                         [](const ::testing::TestParamInfo<NonFiniteParam>& info) {
                           return dtype_str(std::get<0>(info.param)) + "_D" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace ropepool::test
