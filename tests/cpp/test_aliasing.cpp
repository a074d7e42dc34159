// SPEC §3 overlapping arguments: ropepool::views_overlap against a brute-force byte-set
// oracle on random views carved from one arena, and the named cases of issue #9 through the
// op and validate_rope_pool (rejected with both names, nothing written; interleaved views
// such as fused QKV columns accepted).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"

namespace ropepool {
namespace {

// ---- views_overlap vs the oracle ---------------------------------------------------------

constexpr int64_t kArena = 4096;

struct RandomView {
  TensorView view;
  std::vector<bool> bytes;  // which arena bytes it addresses
};

RandomView random_view(std::mt19937_64& rng, unsigned char* arena) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  static const DType kTypes[] = {DType::Float32, DType::Float16, DType::Int64, DType::Int32};
  const DType dtype = kTypes[pick(0, 3)];
  const int64_t es = int64_t(dtype_size(dtype));
  RandomView r;
  TensorView& v = r.view;
  v.dtype = dtype;
  // Ranks up to 5 (4-D paged pools, 5-D combined caches); exact for any strides.
  v.ndim = int(pick(1, 5));
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = pick(0, 10) == 0 ? 1 : pick(1, v.ndim >= 4 ? 4 : 6);
    // Mostly a unit last stride (what the op accepts), sometimes any.
    const bool unit = v.ndim >= 3 && d == v.ndim - 1 && pick(0, 3) != 0;
    int64_t s = unit ? (pick(0, 5) == 0 ? -1 : 1) : pick(-40, 40);
    if (!unit && pick(0, 6) == 0) s = 0;  // broadcast
    v.strides[d] = s;
  }
  // Place the view so its lowest and highest element stay inside the arena.
  int64_t lo = 0, hi = 0;  // element offsets relative to data
  for (int d = 0; d < v.ndim; ++d) {
    const int64_t e = v.strides[d] * (v.shape[d] - 1);
    (e < 0 ? lo : hi) += e;
  }
  const int64_t span = (hi - lo + 1) * es;
  if (span > kArena) return random_view(rng, arena);
  // Mostly aligned placements (element boundaries), sometimes any byte.
  int64_t start = pick(0, kArena - span);
  if (pick(0, 3) != 0) start -= start % es;
  v.data = arena + start - lo * es;
  r.bytes.assign(size_t(kArena), false);
  int64_t idx[5] = {0, 0, 0, 0, 0};
  const int64_t n = v.numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t rem = flat, off = 0;
    for (int d = v.ndim - 1; d >= 0; --d) {
      idx[d] = rem % v.shape[d];
      rem /= v.shape[d];
      off += idx[d] * v.strides[d];
    }
    const int64_t b = (static_cast<unsigned char*>(v.data) - arena) + off * es;
    for (int64_t k = 0; k < es; ++k) r.bytes[size_t(b + k)] = true;
  }
  return r;
}

bool oracle(const RandomView& a, const RandomView& b) {
  for (int64_t i = 0; i < kArena; ++i)
    if (a.bytes[size_t(i)] && b.bytes[size_t(i)]) return true;
  return false;
}

std::string describe(const TensorView& v, const unsigned char* arena) {
  std::string s = std::string(dtype_name(v.dtype)) + " at " +
                  std::to_string(static_cast<const unsigned char*>(v.data) - arena) + " shape " +
                  format_shape(v) + " strides (";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.strides[i]);
  return s + ")";
}

TEST(ViewsOverlap, MatchesByteSetOracleOnRandomViews) {
  std::vector<unsigned char> arena(kArena);
  std::mt19937_64 rng(20261201);
  int64_t overlapping = 0, disjoint_but_span_overlap = 0;
  for (int iter = 0; iter < 40000; ++iter) {
    const RandomView a = random_view(rng, arena.data()), b = random_view(rng, arena.data());
    const bool expected = oracle(a, b);
    const ByteSpan sa = byte_span(a.view), sb = byte_span(b.view);
    if (!expected && sa.lo < sb.hi && sb.lo < sa.hi) ++disjoint_but_span_overlap;
    overlapping += expected;
    ASSERT_EQ(views_overlap(a.view, b.view), expected)
        << describe(a.view, arena.data()) << " vs " << describe(b.view, arena.data());
    ASSERT_EQ(views_overlap(b.view, a.view), expected);
  }
  // The draw must exercise both answers and the exact (non-span) path.
  EXPECT_GT(overlapping, 1000);
  EXPECT_GT(disjoint_but_span_overlap, 1000);
}

// Views shaped like the op's arguments: fused QKV columns, K/V halves, pool rows.
TEST(ViewsOverlap, InterleavedRealLayouts) {
  std::vector<uint16_t> buf(64 * 1024);
  const int64_t T = 7, Hq = 4, Hk = 2, D = 16, W = (Hq + 2 * Hk) * D;
  auto view3 = [&](int64_t offset, int64_t rows, int64_t heads, int64_t row_stride) {
    TensorView v;
    v.data = buf.data() + offset;
    v.dtype = DType::BFloat16;
    v.ndim = 3;
    v.shape[0] = rows, v.shape[1] = heads, v.shape[2] = D;
    v.strides[0] = row_stride, v.strides[1] = D, v.strides[2] = 1;
    return v;
  };
  const TensorView q = view3(0, T, Hq, W), k = view3(Hq * D, T, Hk, W),
                   v = view3((Hq + Hk) * D, T, Hk, W);
  EXPECT_FALSE(views_overlap(q, k));
  EXPECT_FALSE(views_overlap(k, v));
  EXPECT_FALSE(views_overlap(q, v));
  EXPECT_TRUE(views_overlap(q, view3(Hq * D - 1, T, Hk, W)));  // one element into q's last head
  // K and V halves of one [P, 2, Hk, D] cache; then pools offset by one row.
  const int64_t P = 100;
  const TensorView kp = view3(0, P, Hk, 2 * Hk * D), vp = view3(Hk * D, P, Hk, 2 * Hk * D);
  EXPECT_FALSE(views_overlap(kp, vp));
  EXPECT_TRUE(views_overlap(view3(0, P, Hk, Hk * D), view3(Hk * D, P, Hk, Hk * D)));
  // A huge pool against a token-sized view far inside it: exact, and cheap.
  TensorView big = view3(0, 3000, Hk, Hk * D);
  EXPECT_TRUE(views_overlap(big, view3(1234 * Hk * D + 5, 1, 1, D)));
}

// ---- the op ---------------------------------------------------------------------------

// A float32 call (T = 2, Hq = 2, Hk = 1, D = 8, P = 4) whose tensors all live in one arena,
// so a test can point any argument anywhere.
struct ArenaCall {
  static constexpr int64_t T = 2, Hq = 2, Hk = 1, D = 8, P = 4;
  std::vector<float> arena = std::vector<float>(4096);
  std::vector<int32_t> index = {3, 5, 0, 2};  // positions 3, 5; slots 0, 2
  RopePoolTensors t;
  RopePoolParams p;

  TensorView view(int64_t offset, int64_t rows, int64_t heads, int64_t row_stride = -1) {
    TensorView v;
    v.data = arena.data() + offset;
    v.dtype = DType::Float32;
    v.ndim = 3;
    v.shape[0] = rows, v.shape[1] = heads, v.shape[2] = D;
    v.strides[0] = row_stride < 0 ? heads * D : row_stride, v.strides[1] = D, v.strides[2] = 1;
    return v;
  }

  ArenaCall() {
    for (size_t i = 0; i < arena.size(); ++i) arena[i] = float(i % 97) * 0.01f;
    // Separate regions of 256 floats each.
    t.q = view(0, T, Hq);
    t.k = view(256, T, Hk);
    t.v = view(512, T, Hk);
    t.k_pool = view(768, P, Hk);
    t.v_pool = view(1024, P, Hk);
    t.q_out = view(1280, T, Hq);
    t.k_out = view(1536, T, Hk);
    t.positions = TensorView::contiguous(index.data(), DType::Int32, {T});
    t.slots = TensorView::contiguous(index.data() + 2, DType::Int32, {T});
    p.head_dim = D, p.num_qo_heads = Hq, p.num_kv_heads = Hk, p.rope_base = 10000;
  }

  // Both entry points reject with the same text naming `a` and `b`; nothing is written.
  void expect_overlap(const std::string& a, const std::string& b) {
    const std::vector<float> before = arena;
    const std::vector<int32_t> index_before = index;
    for (int entry = 0; entry < 2; ++entry) {
      try {
        if (entry == 0)
          validate_rope_pool(t, p);
        else
          rope_pool_fused(t, p);
        ADD_FAILURE() << (entry ? "rope_pool_fused" : "validate_rope_pool") << " accepted it";
      } catch (const Error& e) {
        const std::string want = "rope_pool_fused: " + a + " and " + b +
                                 " overlap in memory (they share at least one byte); the result "
                                 "would depend on the order of reads and writes";
        EXPECT_EQ(e.what(), want);
        EXPECT_FALSE(e.hint().empty());
      }
    }
    EXPECT_TRUE(arena == before) << "a rejected call wrote";
    EXPECT_TRUE(index == index_before);
  }

  void expect_accepted() {
    EXPECT_NO_THROW(validate_rope_pool(t, p));
    EXPECT_NO_THROW(rope_pool_fused(t, p));
  }
};

TEST(Aliasing, KPoolIsVPool) {
  ArenaCall c;
  c.t.v_pool = c.t.k_pool;
  c.expect_overlap("k_pool", "v_pool");
}

TEST(Aliasing, PoolsOffsetByOneRow) {
  ArenaCall c;
  c.t.v_pool = c.view(768 + ArenaCall::Hk * ArenaCall::D, ArenaCall::P, ArenaCall::Hk);
  c.expect_overlap("k_pool", "v_pool");
}

TEST(Aliasing, QIsAViewIntoKPool) {
  ArenaCall c;
  c.t.q = c.view(768 + 8, ArenaCall::T, ArenaCall::Hq, 8);  // rows 1.. of k_pool, heads spread
  c.t.q.strides[0] = 16;
  c.expect_overlap("k_pool", "q");
}

TEST(Aliasing, InplaceQAndKShareMemory) {
  ArenaCall c;
  c.t.k = c.view(8, ArenaCall::T, ArenaCall::Hk, 16);  // q's second head
  c.t.q_out = c.t.q;
  c.t.k_out = c.t.k;
  c.expect_overlap("q (rotated in place)", "k");
}

TEST(Aliasing, InplaceKAndVShareMemory) {
  ArenaCall c;
  c.t.v = c.t.k;
  c.t.q_out = c.t.q;
  c.t.k_out = c.t.k;
  c.expect_overlap("k (rotated in place)", "v");
}

TEST(Aliasing, OutputsOverlapIndexOrEachOther) {
  {
    ArenaCall c;
    c.t.positions = TensorView::contiguous(c.arena.data() + 768, DType::Int32, {ArenaCall::T});
    c.arena[768] = 0, c.arena[769] = 0;  // (the op never runs: bit patterns do not matter)
    c.expect_overlap("k_pool", "positions");
  }
  {
    ArenaCall c;
    c.t.k_out = c.view(1280 + 4, ArenaCall::T, ArenaCall::Hk);
    c.expect_overlap("q_out", "k_out");
  }
}

TEST(Aliasing, ReadingOneTensorTwiceIsAllowed) {
  ArenaCall c;
  c.t.v = c.t.k;  // k is v, no in-place rotation
  c.expect_accepted();
}

TEST(Aliasing, FusedQkvInPlaceIsAccepted) {
  ArenaCall c;
  const int64_t W = (ArenaCall::Hq + 2 * ArenaCall::Hk) * ArenaCall::D;
  c.t.q = c.view(0, ArenaCall::T, ArenaCall::Hq, W);
  c.t.k = c.view(ArenaCall::Hq * ArenaCall::D, ArenaCall::T, ArenaCall::Hk, W);
  c.t.v = c.view((ArenaCall::Hq + ArenaCall::Hk) * ArenaCall::D, ArenaCall::T, ArenaCall::Hk, W);
  c.t.q_out = c.t.q;
  c.t.k_out = c.t.k;
  c.expect_accepted();
  // K/V halves of one cache row as the pools.
  c.t.k_pool = c.view(768, ArenaCall::P, ArenaCall::Hk, 2 * ArenaCall::D);
  c.t.v_pool = c.view(768 + ArenaCall::D, ArenaCall::P, ArenaCall::Hk, 2 * ArenaCall::D);
  c.expect_accepted();
}

}  // namespace
}  // namespace ropepool
