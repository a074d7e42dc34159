// Exact memory-overlap test of two strided views (SPEC §3), decided on the host from
// addresses, shapes and strides only.
//
// A strided view (after dropping unit and broadcast dimensions and merging the dimensions
// that continue a contiguous run, innermost first) is a set of byte runs: run length L at
// base + i*s_i + (j*s_j + ...) for i < n_i, j < n_j, ... Two such views share a byte iff some
// run of one meets some run of the other, i.e. there are indices with
//     (x0 + i*a + J) - (y0 + k*b + L)  in  [-(Lx - 1), Ly - 1]
// where J, L are the offsets of the other dimensions. We take the dimension of largest extent
// of each view (rows, or pages of a paged pool) as the one to solve, enumerate the offsets of
// the others (heads, rows of a page; usually none after merging), skipping every enumerated
// sub-view whose byte span misses the other view, and solve the pair of large dimensions
// exactly: the set of i*a - k*b is the multiples of g = gcd(a, b), and for each multiple
// m*g in the window the solutions form one arithmetic progression, found with the extended
// Euclidean algorithm. Per enumerated pair the cost is min(n_i, n_k, window / g) steps; real
// layouts (fused QKV columns, a layer of a stacked cache, the K/V halves of vLLM's and
// FlashInfer's combined caches, NHD or HND) enumerate one or two pairs and solve in one or
// two steps.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numeric>

#include "ropepool/tensor.hpp"

namespace ropepool {
namespace {

using i128 = __int128;

struct Dim {
  int64_t n = 1;       // extent
  int64_t stride = 0;  // bytes, >= 0
};

// A view as runs: `run` bytes at base + i*big.stride + (offset of the small dimensions).
struct Runs {
  int64_t base = 0;  // byte address
  int64_t run = 0;   // bytes per run
  Dim big;           // the solved dimension (largest extent)
  Dim small[TensorView::kMaxDims];  // the enumerated ones
  int num_small = 0;
  int64_t lo = 0, hi = 0;  // first byte, one past the last byte
  bool empty = true;
};

Runs as_runs(const TensorView& v) {
  Runs r;
  if (v.data == nullptr || v.numel() == 0) return r;
  r.empty = false;
  const int64_t es = int64_t(dtype_size(v.dtype) ? dtype_size(v.dtype) : 1);
  int64_t base = int64_t(reinterpret_cast<intptr_t>(v.data));
  // Dimensions of extent > 1, strides made non-negative (flipping a dimension keeps the
  // set of addresses: the base moves to its lowest element).
  Dim dims[TensorView::kMaxDims];
  int nd = 0;
  for (int i = 0; i < v.ndim; ++i) {
    if (v.shape[i] <= 1) continue;
    int64_t s = v.strides[i] * es;
    if (s < 0) {
      base += s * (v.shape[i] - 1);
      s = -s;
    }
    if (s == 0) continue;  // a broadcast dimension adds no bytes
    dims[nd++] = {v.shape[i], s};
  }
  // Byte span.
  int64_t span = es;
  for (int i = 0; i < nd; ++i) span += dims[i].stride * (dims[i].n - 1);
  r.lo = base;
  r.hi = base + span;
  r.base = base;
  // Merge: the innermost run is es bytes; a dimension whose stride equals the run so far
  // extends it. Sort by stride so merging sees the innermost first.
  std::sort(dims, dims + nd, [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t run = es;
  int first = 0;
  while (first < nd && dims[first].stride <= run) {
    // stride < run would mean the view overlaps itself; the bytes are still a contiguous
    // run of stride * (n - 1) + run.
    run = dims[first].stride * (dims[first].n - 1) + run;
    ++first;
  }
  r.run = run;
  int big = -1;
  for (int i = first; i < nd; ++i)
    if (big < 0 || dims[i].n > dims[big].n) big = i;
  if (big >= 0) r.big = dims[big];
  for (int i = first; i < nd; ++i)
    if (i != big) r.small[r.num_small++] = dims[i];
  return r;
}

// Calls f(offset) for the byte offset of every combination of r's small dimensions, until f
// returns true (then returns true).
template <class F>
bool any_offset(const Runs& r, F f) {
  int64_t index[TensorView::kMaxDims] = {};
  for (;;) {
    int64_t offset = 0;
    for (int i = 0; i < r.num_small; ++i) offset += index[i] * r.small[i].stride;
    if (f(offset)) return true;
    int i = 0;
    for (; i < r.num_small; ++i) {
      if (++index[i] < r.small[i].n) break;
      index[i] = 0;
    }
    if (i == r.num_small) return false;
  }
}

int64_t floor_div(i128 a, i128 b) {  // b > 0
  i128 q = a / b;
  if ((a % b != 0) && (a < 0)) --q;
  return int64_t(q);
}
int64_t ceil_div(i128 a, i128 b) { return -floor_div(-a, b); }

// Extended Euclid: returns g = gcd(a, b) and x with a*x == g (mod b). a, b > 0.
int64_t inverse_part(int64_t a, int64_t b, int64_t* g) {
  int64_t old_r = a, r = b, old_s = 1, s = 0;
  while (r != 0) {
    const int64_t q = old_r / r;
    int64_t t = old_r - q * r;
    old_r = r, r = t;
    t = old_s - q * s;
    old_s = s, s = t;
  }
  *g = old_r;
  return old_s;
}

// Is there i in [0, n), k in [0, m) with lo <= i*a - k*b <= hi? (a, b >= 0; a stride of an
// extent-1 dimension is treated as 0.)
bool solve_rows(int64_t n, int64_t a, int64_t m, int64_t b, i128 lo, i128 hi) {
  if (n <= 1) a = 0, n = 1;
  if (m <= 1) b = 0, m = 1;
  if (lo > hi) return false;
  if (a == 0 && b == 0) return lo <= 0 && 0 <= hi;
  if (b == 0) {  // i*a in [lo, hi]
    const int64_t i0 = std::max<int64_t>(0, ceil_div(lo, a));
    const int64_t i1 = std::min<int64_t>(n - 1, floor_div(hi, a));
    return i0 <= i1;
  }
  if (a == 0) {  // k*b in [-hi, -lo]
    const int64_t k0 = std::max<int64_t>(0, ceil_div(-hi, b));
    const int64_t k1 = std::min<int64_t>(m - 1, floor_div(-lo, b));
    return k0 <= k1;
  }
  // Clip the window to what the ranges can reach.
  lo = std::max<i128>(lo, -i128(m - 1) * b);
  hi = std::min<i128>(hi, i128(n - 1) * a);
  if (lo > hi) return false;
  int64_t g = 0;
  const int64_t x = inverse_part(a, b, &g);
  const int64_t ap = a / g, bp = b / g;
  const int64_t m0 = ceil_div(lo, g), m1 = floor_div(hi, g);
  if (m0 > m1) return false;
  // Enumerate whichever is fewest: multiples in the window, or rows of either view.
  const i128 multiples = i128(m1) - m0 + 1;
  if (multiples <= n && multiples <= m) {
    for (int64_t t = m0; t <= m1; ++t) {
      // i*ap - k*bp = t: smallest i >= 0 is (t * x) mod bp (x = ap^-1 mod bp).
      int64_t i = bp == 1 ? 0 : int64_t(((i128(t) * x) % bp + bp) % bp);
      if (i >= n) continue;
      const i128 k = (i128(i) * ap - t) / bp;  // exact
      // Solutions: (i + s*bp, k + s*ap), s >= 0 (i is already the smallest i >= 0).
      i128 s0 = 0;
      if (k < 0) s0 = (-k + ap - 1) / ap;
      const i128 ii = i + s0 * bp, kk = k + s0 * ap;
      if (ii < n && kk < m) return true;
    }
    return false;
  }
  if (n <= m) {
    for (int64_t i = 0; i < n; ++i) {  // k*b in [i*a - hi, i*a - lo]
      const i128 c = i128(i) * a;
      const int64_t k0 = std::max<int64_t>(0, ceil_div(c - hi, b));
      const int64_t k1 = std::min<int64_t>(m - 1, floor_div(c - lo, b));
      if (k0 <= k1) return true;
    }
    return false;
  }
  for (int64_t k = 0; k < m; ++k) {  // i*a in [lo + k*b, hi + k*b]
    const i128 c = i128(k) * b;
    const int64_t i0 = std::max<int64_t>(0, ceil_div(lo + c, a));
    const int64_t i1 = std::min<int64_t>(n - 1, floor_div(hi + c, a));
    if (i0 <= i1) return true;
  }
  return false;
}

}  // namespace

bool views_overlap(const TensorView& x, const TensorView& y) {
  const ByteSpan sx = byte_span(x), sy = byte_span(y);
  if (sx.empty() || sy.empty() || sx.hi <= sy.lo || sy.hi <= sx.lo) return false;
  const Runs a = as_runs(x), b = as_runs(y);
  // the bytes [lo, hi) of the runs along the big dimension from `start`
  auto extent = [](const Runs& r) { return r.big.stride * (r.big.n - 1) + r.run; };
  const int64_t a_extent = extent(a), b_extent = extent(b);
  return any_offset(a, [&](int64_t ja) {
    const int64_t a_lo = a.base + ja, a_hi = a_lo + a_extent;
    if (a_hi <= b.lo || b.hi <= a_lo) return false;
    return any_offset(b, [&](int64_t lb) {
      const int64_t b_lo = b.base + lb;
      if (a_hi <= b_lo || b_lo + b_extent <= a_lo) return false;
      const i128 c = i128(a_lo) - b_lo;
      // run starts: c + i*A - k*B must lie in [-(La - 1), Lb - 1]
      return solve_rows(a.big.n, a.big.stride, b.big.n, b.big.stride, -i128(a.run - 1) - c,
                        i128(b.run - 1) - c);
    });
  });
}

}  // namespace ropepool
