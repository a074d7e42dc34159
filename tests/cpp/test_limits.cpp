// SPEC §1's angle limit (2^32 rad) on the CPU backend: accurate up to it against an exact
// (long double) reference, rejected just above it and for the huge angles of issue #9
// (inv_freq 1e25, rope_base 1e-30 / 5e-324), with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool {
namespace {

constexpr int64_t kHq = 1, kHk = 1, kD = 8, kP = 4;

struct Call {
  int64_t T;
  std::vector<float> q, k, v, k_pool, v_pool, q_out, k_out;
  std::vector<int64_t> positions, slots;
  std::vector<float> inv_freq;
  RopePoolTensors t;
  RopePoolParams p;

  explicit Call(std::vector<int64_t> pos, std::vector<float> freqs = {})
      : T(int64_t(pos.size())), positions(std::move(pos)), inv_freq(std::move(freqs)) {
    q.resize(size_t(T * kHq * kD));
    k.resize(size_t(T * kHk * kD));
    v.resize(k.size());
    q_out.assign(q.size(), -7.f);
    k_out.assign(k.size(), -7.f);
    k_pool.assign(size_t(kP * kHk * kD), -9.f);
    v_pool.assign(k_pool.size(), -9.f);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(float(i) + 0.25f);
    for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(float(i) * 1.7f), v[i] = float(i);
    slots.resize(size_t(T));
    for (int64_t i = 0; i < T; ++i) slots[size_t(i)] = i < kP ? i : -1;
    t.q = TensorView::contiguous(q.data(), DType::Float32, {T, kHq, kD});
    t.k = TensorView::contiguous(k.data(), DType::Float32, {T, kHk, kD});
    t.v = TensorView::contiguous(v.data(), DType::Float32, {T, kHk, kD});
    t.q_out = TensorView::contiguous(q_out.data(), DType::Float32, {T, kHq, kD});
    t.k_out = TensorView::contiguous(k_out.data(), DType::Float32, {T, kHk, kD});
    t.k_pool = TensorView::contiguous(k_pool.data(), DType::Float32, {kP, kHk, kD});
    t.v_pool = TensorView::contiguous(v_pool.data(), DType::Float32, {kP, kHk, kD});
    t.positions = TensorView::contiguous(positions.data(), DType::Int64, {T});
    t.slots = TensorView::contiguous(slots.data(), DType::Int64, {T});
    p.head_dim = kD, p.num_qo_heads = kHq, p.num_kv_heads = kHk, p.rope_base = 10000;
    if (!inv_freq.empty())
      p.inv_freq = TensorView::contiguous(inv_freq.data(), DType::Float32, {int64_t(inv_freq.size())});
  }

  // Rejected by both entry points with a message containing `part`; nothing written.
  void expect_rejected(const std::string& part) {
    const auto before = std::vector<std::vector<float>>{q_out, k_out, k_pool, v_pool};
    for (int entry = 0; entry < 2; ++entry) {
      try {
        entry ? rope_pool_fused(t, p) : validate_rope_pool(t, p);
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    }
    EXPECT_TRUE((std::vector<std::vector<float>>{q_out, k_out, k_pool, v_pool}) == before);
  }
};

const std::string kLimit = "beyond the limit of 2^32 = 4294967296 rad that the angle reduction handles";

// x rotated by theta = pos * f, exactly: the product in long double (64-bit significand:
// exact for a 33-bit position times a 24-bit float), reduced by a long double 2*pi.
long double exact_angle(int64_t pos, float f) {
  const long double two_pi = 6.283185307179586476925286766559L;
  const long double theta = (long double)pos * (long double)f;
  return theta - std::nearbyintl(theta / two_pi) * two_pi;
}

TEST(AngleLimit, AccurateUpToTheLimit) {
  // Angles in (2^31, 2^32], both signs, several frequencies (all exactly representable).
  const std::vector<float> freqs = {1.0f, 0.75f, 0.5009765625f, 1.0f / 3.0f};
  std::vector<int64_t> pos;
  for (float f : freqs) {
    const int64_t top = int64_t(std::floor(4294967296.0 / double(f)));
    for (int64_t d : {0, 1, 7, 12345, 99999999}) pos.push_back((d % 2 ? -1 : 1) * (top - d));
  }
  // Each token uses all four frequencies (one per pair); the largest, 1.0, bounds the angle.
  std::vector<int64_t> clipped;
  for (int64_t x : pos) clipped.push_back(std::llabs(x) > 4294967296LL ? (x > 0 ? 4294967296LL : -4294967296LL) : x);
  Call c(clipped, freqs);
  ASSERT_NO_THROW(rope_pool_fused(c.t, c.p));
  const int64_t half = kD / 2;
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const long double r = exact_angle(c.positions[size_t(t)], freqs[size_t(i)]);
      const double co = double(std::cos(r)), si = double(std::sin(r));
      const double a = c.q[size_t(t * kD + i)], b = c.q[size_t(t * kD + i + half)];
      const double x0 = a * co - b * si, x1 = a * si + b * co;
      const double got0 = c.q_out[size_t(t * kD + i)], got1 = c.q_out[size_t(t * kD + i + half)];
      // SPEC §1: one float32 ulp of the exact value plus 2^-18 (|a| + |b|).
      auto tol = [&](double exact) {
        return std::ldexp(1.0, std::ilogb(std::max(std::fabs(exact), 1e-38)) - 23) +
               std::ldexp(std::fabs(a) + std::fabs(b), -18);
      };
      EXPECT_LE(std::fabs(got0 - x0), tol(x0)) << "pos " << c.positions[size_t(t)] << " i " << i;
      EXPECT_LE(std::fabs(got1 - x1), tol(x1)) << "pos " << c.positions[size_t(t)] << " i " << i;
    }
}

TEST(AngleLimit, RejectedJustAboveIt) {
  Call c({5, 4294967297LL}, {1.0f, 0.5f, 0.25f, 0.125f});
  c.expect_rejected("rope_pool_fused: positions[1] = 4294967297 times inv_freq[0] = 1.0 is an "
                    "angle of 4294967297.0 rad, " + kLimit);
  Call n({-4294967297LL}, {1.0f, 0.5f, 0.25f, 0.125f});
  n.expect_rejected("positions[0] = -4294967297");
  // The default schedule's largest inv_freq is 1: 2^32 itself is accepted.
  Call ok({4294967296LL, -4294967296LL});
  EXPECT_NO_THROW(rope_pool_fused(ok.t, ok.p));
}

TEST(AngleLimit, HugeFrequenciesOfIssue9) {
  Call f({0, 1}, {1e25f, 1.0f, 1.0f, 1.0f});
  f.expect_rejected("positions[1] = 1 times inv_freq[0] = 9.999999562023526e+24 is an angle");
  Call tiny({0, 2});
  tiny.p.rope_base = 1e-30;
  tiny.expect_rejected(kLimit);
  Call denormal({0, 2});
  denormal.p.rope_base = 5e-324;
  denormal.expect_rejected("rope_pool_fused: ");  // non-finite inv_freq, or the angle limit
  // With every position 0 the angle is 0 whatever the frequency: accepted, exact.
  Call zero({0, 0}, {1e25f, 1.0f, 1.0f, 1.0f});
  ASSERT_NO_THROW(rope_pool_fused(zero.t, zero.p));
  for (size_t i = 0; i < zero.q.size(); ++i) EXPECT_EQ(zero.q_out[i], zero.q[i]);
}

// Issue #9.5: messages name what was received; §2's exact texts keep their wording and the
// received values go to the hint.
TEST(Messages, DtypesAreNamedAndHintsNameReceivedValues) {
  auto message_and_hint = [](Call& c) {
    try {
      validate_rope_pool(c.t, c.p);
    } catch (const Error& e) {
      return std::string(e.what()) + " | " + e.hint();
    }
    return std::string("accepted");
  };
  Call f64({1, 2});
  for (TensorView* v : {&f64.t.q, &f64.t.k, &f64.t.v, &f64.t.k_pool, &f64.t.v_pool, &f64.t.q_out,
                        &f64.t.k_out})
    v->dtype = DType::Float64;  // (never read: rejected first)
  EXPECT_EQ(message_and_hint(f64),
            "rope_pool_fused: unsupported dtype float64 for q/k/v/pools; expected float32, "
            "float16 or bfloat16 | ");
  Call idx({1, 2});
  idx.t.slots.dtype = DType::UInt32;
  EXPECT_EQ(message_and_hint(idx), "rope_pool_fused: slots must be int32 or int64, got uint32 | ");
  Call heads({1, 2});
  heads.p.num_kv_heads = 3;
  EXPECT_EQ(message_and_hint(heads),
            "k shape must be [num_tokens, num_kv_heads, head_dim], got [2, 1, 8] | "
            "num_kv_heads = 3 but k.shape[1] = 1");
  Call mixed({1, 2});
  mixed.t.v.dtype = DType::Float16;
  EXPECT_EQ(message_and_hint(mixed), "q/k/v dtypes must match | got q float32, k float32, v float16");
}

// CallOptions::data_readable = false (a graph framework validating at trace time): every
// shape/dtype/keyword check runs on views whose data pointers are null; the checks that
// read positions and slots are left to the op, which refuses to run without readable data.
TEST(DataNotReadable, ValidatesShapesWithoutReadingValues) {
  CallOptions unreadable;
  unreadable.data_readable = false;
  auto without_data = [](Call& c) {
    for (TensorView* v : {&c.t.q, &c.t.k, &c.t.v, &c.t.positions, &c.t.slots, &c.t.k_pool,
                          &c.t.v_pool, &c.t.q_out, &c.t.k_out})
      v->data = nullptr;
  };
  // int64 positions beyond the angle limit and an out-of-range slot: values, not checked.
  Call values({4294967297LL, 1});
  values.slots[0] = kP + 5;
  without_data(values);
  EXPECT_NO_THROW(validate_rope_pool(values.t, values.p, unreadable));
  // Shapes, dtypes and keywords still are, with the SPEC §2 messages.
  Call heads({1, 2});
  heads.p.num_kv_heads = 3;
  without_data(heads);
  try {
    validate_rope_pool(heads.t, heads.p, unreadable);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "k shape must be [num_tokens, num_kv_heads, head_dim], got [2, 1, 8]");
  }
  Call base({1, 2});
  base.p.rope_base = -1;
  without_data(base);
  EXPECT_THROW(validate_rope_pool(base.t, base.p, unreadable), Error);
  // The op itself needs the values.
  Call op({1, 2});
  EXPECT_THROW(rope_pool_fused(op.t, op.p, unreadable), std::logic_error);
  EXPECT_EQ(op.q_out, std::vector<float>(op.q_out.size(), -7.f));
}

}  // namespace
}  // namespace ropepool
