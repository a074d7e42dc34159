// SPEC §1/§3/§4 pool semantics and layouts: which rows are written and with what, strided
// views (bit-identical to contiguous ones), index dtypes, T = 0, duplicate slots, threads.
#include <atomic>
#include <thread>
#include <tuple>

#include "test_support.hpp"

namespace ropepool::test {
namespace {

const auto kDtypes = ::testing::Values(DType::Float32, DType::Float16, DType::BFloat16);

/// A dense copy of `c` (same inputs, same pool contents, freshly poisoned outputs).
std::unique_ptr<Case> dense_twin(const Case& c, Rng& rng) {
  auto twin = std::make_unique<Case>(c.shape, Layout{});
  twin->randomize(rng);  // poisons everything; the inputs are overwritten below
  const RopePoolTensors &from = c.tensors, &to = twin->tensors;
  for (auto [a, b] : {std::pair{&from.q, &to.q}, {&from.k, &to.k}, {&from.v, &to.v},
                      {&from.positions, &to.positions}, {&from.slots, &to.slots},
                      {&from.k_pool, &to.k_pool}, {&from.v_pool, &to.v_pool}})
    copy_elements(*a, *b);
  return twin;
}

/// Runs `c` and its dense twin; `c` must meet the contract and match the twin bit for bit.
void expect_same_as_dense(Case& c, Rng& rng) {
  auto twin = dense_twin(c, rng);
  run_and_check(c);
  ASSERT_NO_THROW(rope_pool_fused(twin->tensors, twin->params));
  const RopePoolTensors &a = c.tensors, &b = twin->tensors;
  EXPECT_EQ(count_bit_differences(a.q_out, b.q_out), 0) << "q_out differs from the dense call";
  EXPECT_EQ(count_bit_differences(a.k_out, b.k_out), 0) << "k_out differs from the dense call";
  EXPECT_EQ(count_bit_differences(a.k_pool, b.k_pool), 0) << "k_pool differs from the dense call";
  EXPECT_EQ(count_bit_differences(a.v_pool, b.v_pool), 0) << "v_pool differs from the dense call";
}

// --- layouts -------------------------------------------------------------------------------

using LayoutParam = std::tuple<DType, QkvLayout, PoolLayout, OutLayout, IndexLayout, int64_t>;

class Layouts : public SeededTest, public ::testing::WithParamInterface<LayoutParam> {};

// Views into a fused QKV projection, padded heads/rows with an unaligned origin, one layer
// of a stacked cache, a head-major pool, padded outputs, strided positions/slots: each
// gives exactly the dense result, and the gaps between (and after) views stay untouched.
TEST_P(Layouts, SameBitsAsDenseAndGapsUntouched) {
  const auto [dtype, qkv, pool, out, index, T] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = T;
  s.num_qo_heads = 6;
  s.num_kv_heads = 2;
  s.head_dim = 96;
  s.pool_size = T + 23;
  s.position_dtype = DType::Int64;
  Case c(s, Layout{qkv, pool, out, index});
  c.randomize(rng);
  expect_same_as_dense(c, rng);
}

std::string layout_name(const ::testing::TestParamInfo<LayoutParam>& info) {
  const auto [dtype, qkv, pool, out, index, T] = info.param;
  return dtype_str(dtype) + "_" + name(qkv) + "_" + name(pool) + "_" + name(out) + "_" + name(index) + "_T" +
         std::to_string(T);
}

INSTANTIATE_TEST_SUITE_P(
    All, Layouts,
    ::testing::Combine(kDtypes, ::testing::Values(QkvLayout::Contiguous, QkvLayout::Fused, QkvLayout::Padded),
                       ::testing::Values(PoolLayout::Contiguous, PoolLayout::LayerOfStack, PoolLayout::HeadMajor),
                       ::testing::Values(OutLayout::Contiguous, OutLayout::Padded),
                       ::testing::Values(IndexLayout::Contiguous, IndexLayout::Strided), ::testing::Values<int64_t>(77)),
    layout_name);

// The strided paths with enough tokens for the threaded path.
INSTANTIATE_TEST_SUITE_P(ManyTokens, Layouts,
                         ::testing::Combine(kDtypes, ::testing::Values(QkvLayout::Fused, QkvLayout::Padded),
                                            ::testing::Values(PoolLayout::LayerOfStack, PoolLayout::HeadMajor),
                                            ::testing::Values(OutLayout::Padded),
                                            ::testing::Values(IndexLayout::Strided), ::testing::Values<int64_t>(3001)),
                         layout_name);

// SPEC §4 extras on strided views: GPT-J pairs, partial rotary, yarn's attention factor.
enum class Pairs { NeoX, GPTJ };
using VariantParam = std::tuple<DType, Pairs, int64_t, RopeType>;  // dtype, pairs, rotary_dim, scaling
class LayoutVariants : public SeededTest, public ::testing::WithParamInterface<VariantParam> {};

TEST_P(LayoutVariants, SameBitsAsDenseAndGapsUntouched) {
  const auto [dtype, pairs, rotary_dim, type] = GetParam();
  Shape s;
  s.dtype = dtype;
  s.num_tokens = 77;
  s.num_qo_heads = 6;
  s.num_kv_heads = 2;
  s.head_dim = 96;
  s.pool_size = 100;
  s.interleaved = pairs == Pairs::GPTJ;
  s.rotary_dim = rotary_dim;
  s.rope_scaling = scaling_preset(type, rotary_dim);
  Case c(s, Layout{QkvLayout::Fused, PoolLayout::HeadMajor, OutLayout::Padded, IndexLayout::Strided});
  c.randomize(rng);
  expect_same_as_dense(c, rng);
}

std::string variant_name(const ::testing::TestParamInfo<VariantParam>& info) {
  const auto [dtype, pairs, rotary_dim, type] = info.param;
  return dtype_str(dtype) + (pairs == Pairs::GPTJ ? "_gptj" : "_neox") + "_R" + std::to_string(rotary_dim) + "_" +
         rope_type_name(type);
}

INSTANTIATE_TEST_SUITE_P(Spec4, LayoutVariants,
                         ::testing::Combine(kDtypes, ::testing::Values(Pairs::NeoX, Pairs::GPTJ),
                                            ::testing::Values<int64_t>(96, 32),
                                            ::testing::Values(RopeType::Default, RopeType::Yarn)),
                         variant_name);

// Size-1 dimensions may carry any stride (frameworks do not normalise them).
TEST(UnitDims, AnyStrideOnSizeOneDimensions) {
  Rng rng(fresh_seed());
  SCOPED_TRACE("seed " + std::to_string(rng.seed()));
  Shape s;
  s.num_tokens = 1;
  s.num_qo_heads = 4;
  s.num_kv_heads = 1;
  s.head_dim = 64;
  s.pool_size = 9;
  Case c(s);
  c.randomize(rng);
  c.tensors.q.strides[0] = 123457;
  c.tensors.q_out.strides[0] = 0;
  c.tensors.k.strides[1] = 0;
  c.tensors.k_out.strides[1] = 999;
  c.tensors.k_pool.strides[1] = 7;
  c.tensors.positions.strides[0] = 5;
  c.set_slot(0, 8);
  run_and_check(c);
}

// --- index dtypes --------------------------------------------------------------------------

using IndexParam = std::tuple<DType, DType, IndexLayout>;  // positions, slots, layout
class IndexDtypes : public SeededTest, public ::testing::WithParamInterface<IndexParam> {};

TEST_P(IndexDtypes, AnyMixGivesTheSameBits) {
  const auto [position_dtype, slot_dtype, index] = GetParam();
  Shape s;
  s.dtype = DType::Float16;
  s.num_tokens = 300;
  s.pool_size = 333;
  s.position_dtype = position_dtype;
  s.slot_dtype = slot_dtype;
  Layout l;
  l.index = index;
  Case c(s, l);
  c.randomize(rng);
  // The twin uses int32 for both (values fit); the outputs must not depend on the dtype.
  Shape s32 = s;
  s32.position_dtype = s32.slot_dtype = DType::Int32;
  Case twin(s32);
  twin.randomize(rng);
  for (auto [a, b] : {std::pair{&c.tensors.q, &twin.tensors.q}, {&c.tensors.k, &twin.tensors.k},
                      {&c.tensors.v, &twin.tensors.v}, {&c.tensors.k_pool, &twin.tensors.k_pool},
                      {&c.tensors.v_pool, &twin.tensors.v_pool}})
    copy_elements(*a, *b);
  for (int64_t t = 0; t < 300; ++t) {
    twin.set_position(t, c.position(t));
    // INT64_MIN does not fit int32; any negative slot means the same.
    twin.set_slot(t, c.slot(t) < 0 ? -1 : c.slot(t));
  }
  run_and_check(c);
  ASSERT_NO_THROW(rope_pool_fused(twin.tensors, twin.params));
  EXPECT_EQ(count_bit_differences(c.tensors.q_out, twin.tensors.q_out), 0);
  EXPECT_EQ(count_bit_differences(c.tensors.k_out, twin.tensors.k_out), 0);
  EXPECT_EQ(count_bit_differences(c.tensors.k_pool, twin.tensors.k_pool), 0);
  EXPECT_EQ(count_bit_differences(c.tensors.v_pool, twin.tensors.v_pool), 0);
}

std::string index_name(const ::testing::TestParamInfo<IndexParam>& info) {
  const auto [positions, slots, layout] = info.param;
  return "positions_" + dtype_str(positions) + "_slots_" + dtype_str(slots) + "_" + name(layout);
}

INSTANTIATE_TEST_SUITE_P(Mix, IndexDtypes,
                         ::testing::Combine(::testing::Values(DType::Int32, DType::Int64),
                                            ::testing::Values(DType::Int32, DType::Int64),
                                            ::testing::Values(IndexLayout::Contiguous, IndexLayout::Strided)),
                         index_name);

// --- which rows are written ---------------------------------------------------------------

class PoolWrites : public SeededTest, public ::testing::WithParamInterface<DType> {
 protected:
  Shape shape(int64_t T, int64_t P) const {
    Shape s;
    s.dtype = GetParam();
    s.num_tokens = T;
    s.num_qo_heads = 8;
    s.num_kv_heads = 4;
    s.head_dim = 64;
    s.pool_size = P;
    s.slot_dtype = DType::Int64;
    return s;
  }
};

TEST_P(PoolWrites, NegativeSlotsWriteNothingButTokensAreRotated) {
  Case c(shape(300, 64));
  c.randomize(rng, /*negative_fraction=*/1.0);
  run_and_check(c);  // the pools must come out bit-identical
}

TEST_P(PoolWrites, FirstAndLastRow) {
  Case c(shape(7, 50));
  c.randomize(rng);
  c.set_slot(2, 49);
  c.set_slot(5, 0);
  c.set_slot(6, -1);
  c.set_slot(0, 25);
  run_and_check(c);
}

TEST_P(PoolWrites, EmptyBatchWritesNothing) {
  Case c(shape(0, 40));
  c.randomize(rng);
  run_and_check(c);
  // Empty tensors from a framework may have no storage at all.
  for (TensorView* v : {&c.tensors.q, &c.tensors.k, &c.tensors.v, &c.tensors.positions, &c.tensors.slots,
                        &c.tensors.q_out, &c.tensors.k_out})
    v->data = nullptr;
  const Snapshot before = c.snapshot();
  CallOptions options;
  options.check_slots = true;
  ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params, options));
  expect_unchanged(c, before);
}

// Without check_slots, a row written by several tokens holds one of their complete rows
// (no heads mixed from different tokens), also when threads share the work.
TEST_P(PoolWrites, DuplicateSlotsWithoutCheckingHoldOneTokensRow) {
  ThreadCountGuard guard;
  for (int threads : {1, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    set_cpu_num_threads(threads);
    Case c(shape(4999, 5100));
    c.randomize(rng);
    // A third of the tokens pile onto 3 rows; the others keep their distinct rows.
    for (int64_t t = 0; t < 4999; ++t)
      if (rng.chance(1.0 / 3)) c.set_slot(t, 5097 + rng.integer(0, 2));
    run_and_check(c);
  }
}

// A decode batch: few tokens, many heads, so the CPU backend may split one token's heads
// across threads; tokens sharing a slot must still leave one token's complete row.
TEST_P(PoolWrites, DuplicateSlotsInDecodeBatchHoldOneTokensRow) {
  ThreadCountGuard guard;
  for (int threads : {2, 8}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    set_cpu_num_threads(threads);
    for (int repeat = 0; repeat < 16; ++repeat) {
      Shape s = shape(2 + repeat % 3, 3);
      s.num_qo_heads = 64;
      s.num_kv_heads = 16;
      s.head_dim = 256;
      Case c(s);
      c.randomize(rng);
      for (int64_t t = 0; t < c.num_tokens(); ++t) c.set_slot(t, 1);
      run_and_check(c);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST_P(PoolWrites, AllTokensOnOneRow) {
  Case c(shape(7, 4));
  c.randomize(rng);
  for (int64_t t = 0; t < 7; ++t) c.set_slot(t, 2);
  run_and_check(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PoolWrites, kDtypes, [](const auto& info) { return dtype_str(info.param); });

// --- in place -------------------------------------------------------------------------------

// SPEC §4 inplace=True: q_out/k_out are q/k themselves (here views into a fused QKV
// buffer). The result is the same, bit for bit, as with separate outputs.
TEST_P(PoolWrites, InPlaceMatchesSeparateOutputs) {
  ThreadCountGuard guard;
  for (int threads : {1, 2}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    set_cpu_num_threads(threads);
    Shape s = shape(1000, 1100);
    Layout l;
    l.qkv = QkvLayout::Fused;
    Case c(s, l);
    c.randomize(rng);
    auto twin = dense_twin(c, rng);
    c.tensors.q_out = c.tensors.q;
    c.tensors.k_out = c.tensors.k;
    run_and_check(*twin);
    ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params));
    EXPECT_EQ(count_bit_differences(c.tensors.q, twin->tensors.q_out), 0) << "q rotated in place";
    EXPECT_EQ(count_bit_differences(c.tensors.k, twin->tensors.k_out), 0) << "k rotated in place";
    EXPECT_EQ(count_bit_differences(c.tensors.v, twin->tensors.v), 0) << "v must not change";
    EXPECT_EQ(count_bit_differences(c.tensors.k_pool, twin->tensors.k_pool), 0);
    EXPECT_EQ(count_bit_differences(c.tensors.v_pool, twin->tensors.v_pool), 0);
  }
}

// --- threads -------------------------------------------------------------------------------

class Threads : public SeededTest, public ::testing::WithParamInterface<DType> {};

// The result does not depend on the number of CPU threads, bit for bit.
TEST_P(Threads, BitIdenticalForAnyThreadCount) {
  ThreadCountGuard guard;
  Shape s;
  s.dtype = GetParam();
  s.num_tokens = 4999;
  s.num_qo_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 128;
  s.pool_size = 6000;
  Case c(s);
  c.randomize(rng);
  const Snapshot initial = c.snapshot();
  std::vector<std::vector<uint8_t>> first;
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    set_cpu_num_threads(threads);
    ASSERT_EQ(cpu_num_threads(), threads);
    c.restore(initial);
    c.poison_outputs(rng);
    const Snapshot before = c.snapshot();
    ASSERT_NO_THROW(rope_pool_fused(c.tensors, c.params));
    if (threads == 1) expect_call_result(c, before);
    std::vector<std::vector<uint8_t>> now;
    for (const TensorView* v : {&c.tensors.q_out, &c.tensors.k_out, &c.tensors.k_pool, &c.tensors.v_pool})
      now.push_back(view_bytes(*v));
    if (first.empty()) first = now;
    const char* names[] = {"q_out", "k_out", "k_pool", "v_pool"};
    for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(now[i] == first[i]) << names[i] << " differs from 1 thread";
  }
}

// Two callers at once (an engine's worker threads) each get their own correct result.
TEST_P(Threads, ConcurrentCallers) {
  Shape s;
  s.dtype = GetParam();
  s.num_tokens = 1000;
  s.num_qo_heads = 16;
  s.num_kv_heads = 4;
  s.head_dim = 128;
  s.pool_size = 1100;
  constexpr int kCallers = 3;
  std::vector<std::unique_ptr<Case>> cases;
  std::vector<Snapshot> before;
  for (int i = 0; i < kCallers; ++i) {
    cases.push_back(std::make_unique<Case>(s));
    cases.back()->randomize(rng);
    before.push_back(cases.back()->snapshot());
  }
  std::vector<std::string> failures(kCallers);
  std::atomic<int> ready{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&, i] {
      ++ready;
      while (ready.load() < kCallers) std::this_thread::yield();
      try {
        rope_pool_fused(cases[size_t(i)]->tensors, cases[size_t(i)]->params);
      } catch (const std::exception& e) {
        failures[size_t(i)] = e.what();
      }
    });
  for (auto& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    SCOPED_TRACE("caller " + std::to_string(i));
    EXPECT_EQ(failures[size_t(i)], "");
    expect_call_result(*cases[size_t(i)], before[size_t(i)]);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Threads, kDtypes, [](const auto& info) { return dtype_str(info.param); });

}  // namespace
}  // namespace ropepool::test
