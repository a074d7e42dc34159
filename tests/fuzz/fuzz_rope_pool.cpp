// Coverage-guided fuzzer of ropepool::rope_pool_fused (CPU backend), issue #9.
//
// One input decodes into a whole call: shapes, dtypes, strides, keywords and index values,
// with every tensor a view carved from ONE arena, so arguments can alias. The property:
//   - the call throws ropepool::Error and every byte of the arena (and of inv_freq) is
//     unchanged; or
//   - the call returns, no output shares a byte with another argument (SPEC §3) except the
//     exact in-place views q_out == q / k_out == k, q_out/k_out are within the SPEC §1
//     bound of the float64 reference (computed from the arena as it was), every pool row
//     named by a slot holds one writer's complete row bit for bit (with k_out left empty,
//     SPEC §4's return_k_rot=False, one writer's rotation within the bound), and every other
//     byte of the arena is unchanged.
// Anything else (another exception, a wrong byte, a sanitizer report) aborts.
//
// Built two ways (tests/fuzz/CMakeLists.txt): with clang's libFuzzer (ROPEPOOL_FUZZ=ON), and
// as a plain replay driver (any compiler) that runs the files named on its command line, so
// ctest replays the seed corpus and the regression inputs.
//
// ROPEPOOL_FUZZ_ALIASING=0 in the environment keeps every view in its own part of the arena
// (no aliasing generated), for runs that look for other defects only.
// ROPEPOOL_FUZZ_ANGLE_LIMIT=<radians> skips the accuracy check of accepted calls with an
// angle |position * inv_freq| beyond it (a library without SPEC §1's angle limit accepts
// them); unset, every accepted call must be accurate.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../../src/cpu/cpu_kernels.hpp"
#include "ropepool/error.hpp"
#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"

namespace {

using namespace ropepool;

struct Call;
void describe(const Call& c);
const Call* g_current = nullptr;  // the call being checked, described on failure

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "ropepool fuzz: %s\n", what.c_str());
  if (g_current) describe(*g_current);
  std::fflush(stderr);
  std::abort();
}

// Reads the input front to back; past its end every read is 0 (inputs stay meaningful when
// libFuzzer truncates them).
struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(u8()) << (8 * i);
    return v;
  }
  int64_t range(int64_t lo, int64_t hi) { return lo + int64_t(u32() % uint64_t(hi - lo + 1)); }
  bool one_in(int k) { return u8() % k == 0; }
  template <class T, size_t N>
  T pick(const T (&options)[N]) {
    return options[u8() % N];
  }
};

constexpr int64_t kArenaBytes = 32768;
constexpr int64_t kMaxTokens = 6;

enum Slot : int { Q, K, V, POS, SLOTS, KPOOL, VPOOL, QOUT, KOUT, kNumArgs };
const char* const kArgName[kNumArgs] = {"q",      "k",      "v",     "positions", "slots",
                                        "k_pool", "v_pool", "q_out", "k_out"};

// Lowest and highest element offset a view addresses (0, 0 for an empty view).
void extent(const TensorView& v, int64_t& lo, int64_t& hi) {
  lo = hi = 0;
  for (int i = 0; i < v.ndim; ++i) {
    if (v.shape[i] == 0) {
      lo = hi = 0;
      return;
    }
    const int64_t step = v.strides[i] * (v.shape[i] - 1);
    (step < 0 ? lo : hi) += step;
  }
}

struct Call {
  alignas(64) uint8_t arena[kArenaBytes];
  alignas(64) uint8_t before[kArenaBytes];
  float inv_freq_buf[64];
  float inv_freq_before[64];
  TensorView view[kNumArgs];
  RopePoolTensors tensors;
  RopePoolParams params;
  CallOptions options;
  int threads = 1;
};

void describe(const Call& c) {
  for (int a = 0; a < kNumArgs; ++a) {
    const TensorView& v = c.view[a];
    std::string line = std::string(kArgName[a]) + ": " + dtype_name(v.dtype) + " shape [";
    for (int i = 0; i < v.ndim; ++i) line += (i ? ", " : "") + std::to_string(v.shape[i]);
    line += "] strides [";
    for (int i = 0; i < v.ndim; ++i) line += (i ? ", " : "") + std::to_string(v.strides[i]);
    if (v.data == nullptr) {
      std::fprintf(stderr, "  %s: none (empty view)\n", kArgName[a]);
      continue;
    }
    line += "] at arena byte " + std::to_string(static_cast<const uint8_t*>(v.data) - c.arena);
    if ((a == POS || a == SLOTS) && v.ndim == 1 && (v.dtype == DType::Int32 || v.dtype == DType::Int64)) {
      line += " values";
      TensorView was = v;
      was.data = const_cast<uint8_t*>(c.before) + (static_cast<const uint8_t*>(v.data) - c.arena);
      for (int64_t t = 0; t < v.shape[0]; ++t) line += " " + std::to_string(reference::load_index(was, t));
    }
    std::fprintf(stderr, "  %s\n", line.c_str());
  }
  const RopePoolParams& p = c.params;
  std::fprintf(stderr,
               "  head_dim %lld num_qo_heads %lld num_kv_heads %lld rope_base %g rotary_dim %lld "
               "interleaved %d rope_type %s factor %g inv_freq %s attention_scaling %s check_slots %d "
               "threads %d\n",
               (long long)p.head_dim, (long long)p.num_qo_heads, (long long)p.num_kv_heads, p.rope_base,
               (long long)p.rotary_dim, int(p.interleaved), rope_type_name(p.rope_scaling.type),
               p.rope_scaling.factor, p.inv_freq.data ? "given" : "none",
               p.attention_scaling ? std::to_string(*p.attention_scaling).c_str() : "none",
               int(c.options.check_slots), c.threads);
}

// Strides for a [d0, d1, d2] view; `mode` picks contiguous, padded, heads-outer, or raw
// (any strides, including 0 and negative ones, and a last stride other than 1).
void make_strides(Reader& r, TensorView& v, bool allow_raw) {
  const int nd = v.ndim;
  int64_t inner = 1;
  for (int i = nd - 1; i >= 0; --i) {
    v.strides[i] = inner;
    inner *= std::max<int64_t>(1, v.shape[i]);
  }
  switch (r.u8() % 6) {
    case 0:
    case 1:
    case 2:
      break;  // contiguous
    case 3:   // padded rows
      if (nd >= 2) {
        const int64_t pad = r.range(0, 5);
        int64_t stride = v.shape[nd - 1] + pad;
        for (int i = nd - 2; i >= 0; --i) {
          v.strides[i] = stride;
          stride *= std::max<int64_t>(1, v.shape[i]) + (i ? 0 : 0);
        }
      }
      break;
    case 4:  // [T, H, D] with the head axis outermost (a transposed [H, T, D] buffer)
      if (nd == 3) {
        v.strides[1] = v.shape[2] * std::max<int64_t>(1, v.shape[0]);
        v.strides[0] = v.shape[2];
      }
      break;
    default:
      if (allow_raw)
        for (int i = 0; i < nd; ++i) v.strides[i] = r.range(-40, 40) * (r.one_in(3) ? 0 : 1);
      if (allow_raw && !r.one_in(4) && nd > 0) v.strides[nd - 1] = 1;
      break;
  }
}

// Places view `v` (dtype already set) in the arena: its own region from `next` onward, or,
// with aliasing, at an offset read from the input or at the very place of an earlier view.
bool place(Reader& r, Call& c, TensorView& v, int64_t& next, bool aliasing, int index) {
  const int64_t es = std::max<int64_t>(1, int64_t(dtype_size(v.dtype)));
  int64_t lo, hi;
  extent(v, lo, hi);
  const int64_t span = (hi - lo + 1) * es;
  if (span > kArenaBytes) return false;
  int64_t start;  // byte offset of the lowest element
  const int mode = aliasing ? r.u8() % 8 : 0;
  if (mode == 1 && index > 0) {
    const TensorView& other = c.view[r.u8() % index];
    int64_t olo, ohi;
    extent(other, olo, ohi);
    start = (static_cast<uint8_t*>(other.data) - c.arena) + olo * int64_t(dtype_size(other.dtype));
  } else if (mode == 2) {
    start = r.range(0, kArenaBytes - 1);
  } else {
    start = next;
    next += span + es * r.range(0, 3);
  }
  start = start / es * es;
  if (start + span > kArenaBytes) {
    if (mode != 1 && mode != 2) return false;  // out of room: this input decodes to nothing
    start = (kArenaBytes - span) / es * es;
  }
  if (start < 0) return false;
  v.data = c.arena + start - lo * es;
  return true;
}

float small_value(uint32_t bits) { return (float(int32_t(bits % 2001) - 1000)) / 250.0f; }

void store_float(DType dtype, void* at, float x) {
  if (dtype == DType::Float32) std::memcpy(at, &x, 4);
  if (dtype == DType::Float16) {
    const uint16_t h = float_to_half(x);
    std::memcpy(at, &h, 2);
  }
  if (dtype == DType::BFloat16) {
    const uint16_t b = float_to_bf16(x);
    std::memcpy(at, &b, 2);
  }
}

bool decode(Reader& r, Call& c) {
  static const bool aliasing_allowed = [] {
    const char* env = std::getenv("ROPEPOOL_FUZZ_ALIASING");
    return !(env && std::string(env) == "0");
  }();
  // The byte is read either way, so an input decodes the same with aliasing switched off
  // (apart from where its views go).
  const bool aliasing_byte = r.one_in(3);
  const bool aliasing = aliasing_allowed && aliasing_byte;

  static const DType kFloat[] = {DType::Float32, DType::Float16, DType::BFloat16};
  static const int64_t kHeadDims[] = {2, 4, 6, 8, 8, 10, 16, 32, 34, 64, 3, 0};
  const DType dtype = r.pick(kFloat);
  const int64_t T = r.range(0, kMaxTokens), Hq = r.range(1, 4), Hk = r.range(1, 3);
  const int64_t D = r.pick(kHeadDims), P = r.range(0, 8);
  const DType pos_dtype = r.one_in(16) ? DType::Float32 : (r.u8() & 1) ? DType::Int64 : DType::Int32;
  const DType slot_dtype = r.one_in(16) ? DType::Int32 : (r.u8() & 1) ? DType::Int64 : DType::Int32;

  c.params = RopePoolParams{};
  c.params.head_dim = r.one_in(16) ? r.range(-2, 70) : D;
  c.params.num_qo_heads = r.one_in(16) ? r.range(-1, 5) : Hq;
  c.params.num_kv_heads = r.one_in(16) ? r.range(-1, 4) : Hk;

  // Shapes: mostly the contract's, sometimes one dimension off or a wrong rank.
  const int64_t shapes[kNumArgs][3] = {{T, Hq, D}, {T, Hk, D}, {T, Hk, D}, {T, 0, 0},  {T, 0, 0},
                                       {P, Hk, D}, {P, Hk, D}, {T, Hq, D}, {T, Hk, D}};
  int64_t next = 0;
  for (int a = 0; a < kNumArgs; ++a) {
    TensorView& v = c.view[a];
    v = TensorView{};
    v.dtype = a == POS ? pos_dtype : a == SLOTS ? slot_dtype : dtype;
    if (a != POS && a != SLOTS && r.one_in(24)) v.dtype = r.pick(kFloat);
    v.ndim = a == POS || a == SLOTS ? 1 : 3;
    if (r.one_in(24)) v.ndim = int(r.range(0, 4));
    for (int i = 0; i < v.ndim; ++i) v.shape[i] = i < 3 ? shapes[a][i] : 1;
    if (r.one_in(24) && v.ndim > 0) v.shape[r.u8() % v.ndim] = r.range(0, 9);
    make_strides(r, v, a != QOUT && a != KOUT && a != KPOOL && a != VPOOL ? true : r.one_in(4));
    if (!place(r, c, v, next, aliasing, a)) return false;
  }

  // Contents: small values of the float dtype everywhere, then the indices where they live.
  uint32_t seed = r.u32() | 1;
  const int64_t es = int64_t(dtype_size(dtype));
  for (int64_t off = 0; off + es <= kArenaBytes; off += es) {
    seed ^= seed << 13;
    seed ^= seed >> 17;
    seed ^= seed << 5;
    store_float(dtype, c.arena + off, small_value(seed));
  }
  if (r.one_in(4)) {  // a few non-finite or large values
    static const float kSpecial[] = {NAN, INFINITY, -INFINITY, 1e30f, -65504.0f, 3e38f, 1e-40f};
    for (int i = r.range(1, 4); i > 0; --i)
      store_float(dtype, c.arena + r.range(0, kArenaBytes / es - 1) * es, r.pick(kSpecial));
  }
  for (int a : {POS, SLOTS}) {
    const TensorView& v = c.view[a];
    if (v.ndim != 1 || (v.dtype != DType::Int32 && v.dtype != DType::Int64)) continue;
    for (int64_t t = 0; t < v.shape[0]; ++t) {
      int64_t value;
      if (a == POS) {
        static const int64_t kBig[] = {-1, -4096, 1 << 20, (1 << 20) - 1, 1 << 24, int64_t(1) << 31,
                                       -(int64_t(1) << 31), int64_t(1) << 40, INT64_MAX, INT64_MIN};
        value = r.one_in(5) ? r.pick(kBig) : r.range(0, 200);
      } else {
        static const int64_t kBad[] = {-1, -2, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, 1 << 20};
        value = r.one_in(8) ? r.pick(kBad) : r.range(-1, std::max<int64_t>(0, P + (r.one_in(6) ? 1 : -1)));
      }
      uint8_t* at = static_cast<uint8_t*>(v.data) + t * v.strides[0] * int64_t(dtype_size(v.dtype));
      if (v.dtype == DType::Int32) {
        const int32_t narrow = int32_t(value);
        std::memcpy(at, &narrow, 4);
      } else {
        std::memcpy(at, &value, 8);
      }
    }
  }

  // Keywords.
  if (r.one_in(3)) c.params.rotary_dim = r.range(0, D + 2);
  c.params.interleaved = r.u8() & 1;
  static const double kBases[] = {10000, 10000, 10000, 500000, 1.0001, 2, 1e6, 1e-30, 0, -1, NAN, INFINITY};
  c.params.rope_base = r.pick(kBases);
  RopeScaling& s = c.params.rope_scaling;
  const int64_t R = c.params.rotary_dim ? c.params.rotary_dim : D;
  switch (r.u8() % 10) {
    case 1: s.type = RopeType::Linear; s.factor = r.pick({2.0, 0.5, 8.0, 0.0, -1.0}); break;
    case 2:
      s.type = RopeType::Dynamic;
      s.factor = r.pick({2.0, 4.0, 0.0});
      s.max_position_embeddings = r.pick({int64_t(64), int64_t(2048), int64_t(0)});
      if (!r.one_in(6)) s.seq_len = r.range(0, 300);
      break;
    case 3:
      s.type = RopeType::Yarn;
      s.factor = r.pick({4.0, 40.0, 1.0, 0.5});
      if (r.one_in(2)) s.original_max_position_embeddings = r.pick({int64_t(4096), int64_t(64), int64_t(0)});
      if (r.one_in(3)) s.beta_fast = r.pick({32.0, 8.0, 0.0});
      if (r.one_in(3)) s.beta_slow = r.pick({1.0, 2.0, 64.0});
      if (r.one_in(3)) s.mscale = r.pick({1.0, 0.707});
      if (r.one_in(3)) s.mscale_all_dim = r.pick({1.0, 0.707, 0.0});
      if (r.one_in(3)) s.attention_factor = r.pick({1.0, 0.1, -1.0});
      s.truncate = r.u8() & 1;
      break;
    case 4:
      s.type = RopeType::Llama3;
      s.factor = r.pick({8.0, 32.0, 1.0});
      s.low_freq_factor = r.pick({1.0, 2.0, 4.0});
      s.high_freq_factor = r.pick({4.0, 1.0, 8.0});
      if (!r.one_in(6)) s.original_max_position_embeddings = r.pick({int64_t(8192), int64_t(64), int64_t(0)});
      break;
    case 5: {
      s.type = RopeType::LongRope;
      const int64_t n = std::max<int64_t>(0, R / 2 + (r.one_in(8) ? 1 : 0));
      for (int64_t i = 0; i < n; ++i) {
        s.short_factor.push_back(1.0 + 0.25 * double(r.u8() % 8));
        s.long_factor.push_back(r.one_in(32) ? 0.0 : 1.0 + double(r.u8() % 16));
      }
      if (!r.one_in(8)) s.original_max_position_embeddings = r.pick({int64_t(64), int64_t(4096)});
      if (r.one_in(2)) s.max_position_embeddings = r.pick({int64_t(256), int64_t(131072)});
      if (!r.one_in(8)) s.seq_len = r.range(0, 300);
      if (r.one_in(3)) s.attention_factor = r.pick({1.0, 1.19});
      s.factor = r.one_in(4) ? 4.0 : 1.0;
      break;
    }
    default: break;
  }
  if (r.one_in(6)) {  // a custom schedule
    const int64_t n = std::clamp<int64_t>(R / 2 + (r.one_in(8) ? 1 : 0), 0, 64);
    static const float kScale[] = {1.0f, 1.0f, 1e-3f, 1e3f, 1e25f, -1.0f, NAN};
    const float scale = r.pick(kScale);
    for (int64_t i = 0; i < n; ++i)
      c.inv_freq_buf[i] = scale * std::pow(10000.0f, -2.0f * float(i) / float(std::max<int64_t>(2, R)));
    c.params.inv_freq = TensorView::contiguous(c.inv_freq_buf, r.one_in(16) ? DType::Float16 : DType::Float32, {n});
  }
  if (r.one_in(6)) c.params.attention_scaling = r.pick({1.0, 0.5, 2.0, 0.0, -1.0, double(NAN), 1e30});
  c.options.check_slots = r.u8() & 1;
  c.threads = r.one_in(2) ? 2 : 1;
  // SPEC §4 return_k_rot=False: k_out left empty, one input in four. Read last, and a byte of
  // 0 (past an input's end) keeps k_out, so inputs written before decode as they did.
  if (r.u8() % 4 == 3) c.view[KOUT] = TensorView{};

  c.tensors = RopePoolTensors{c.view[Q],     c.view[K],     c.view[V],    c.view[POS], c.view[SLOTS],
                              c.view[KPOOL], c.view[VPOOL], c.view[QOUT], c.view[KOUT]};
  return true;
}

// Every byte a view covers, as a mask over the arena.
std::vector<uint8_t> bytes_of(const Call& c, const TensorView& v) {
  std::vector<uint8_t> mask(kArenaBytes, 0);
  if (v.ndim < 1 || v.ndim > 3) return mask;
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] <= 0) return mask;
  const int64_t es = int64_t(dtype_size(v.dtype));
  const int64_t n0 = v.shape[0], n1 = v.ndim > 1 ? v.shape[1] : 1, n2 = v.ndim > 2 ? v.shape[2] : 1;
  const int64_t s1 = v.ndim > 1 ? v.strides[1] : 0, s2 = v.ndim > 2 ? v.strides[2] : 0;
  for (int64_t i = 0; i < n0; ++i)
    for (int64_t j = 0; j < n1; ++j)
      for (int64_t k = 0; k < n2; ++k) {
        const int64_t off = (static_cast<const uint8_t*>(v.data) - c.arena) +
                            (i * v.strides[0] + j * s1 + k * s2) * es;
        for (int64_t b = 0; b < es; ++b) mask[size_t(off + b)] = 1;
      }
  return mask;
}

// [lo, hi) bytes of the arena that hold the view's elements (empty for an empty view).
void byte_range(const Call& c, const TensorView& v, int64_t& lo, int64_t& hi) {
  lo = hi = 0;
  if (v.ndim < 1 || v.ndim > 3 || v.numel() <= 0) return;
  int64_t elo, ehi;
  extent(v, elo, ehi);
  const int64_t es = int64_t(dtype_size(v.dtype)), base = static_cast<const uint8_t*>(v.data) - c.arena;
  lo = base + elo * es;
  hi = base + (ehi + 1) * es;
}

bool identical(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  return true;
}

// A view of the same elements in the `before` copy of the arena.
TensorView in_before(const Call& c, TensorView v) {
  v.data = const_cast<uint8_t*>(c.before) + (static_cast<uint8_t*>(v.data) - c.arena);
  return v;
}

double max_finite(DType d) { return d == DType::Float32 ? 3.4028234663852886e38 : d == DType::Float16 ? 65504.0 : 3.3895313892515355e38; }

// Checks `out` against the float64 rotation of `in_arg` (as it was): every token's rows, or
// with `only_token` >= 0 that token's rotation against row `out_row` of `out` (a pool row),
// returning false instead of failing.
bool check_rotation(const Call& c, int in_arg, const TensorView& out, const char* out_name,
                    const RopeSchedule& schedule, int64_t only_token = -1, int64_t out_row = 0) {
  const TensorView in = in_before(c, c.view[in_arg]);
  const TensorView pos = in_before(c, c.view[POS]);
  const std::vector<double> exact = reference::rotate(in, pos, schedule, c.params.interleaved);
  const int64_t T = in.shape[0], H = in.shape[1], D = in.shape[2], R = schedule.rotary_dim;
  const double gain = std::max(1.0, std::abs(schedule.attention_scaling));
  for (int64_t t = only_token < 0 ? 0 : only_token; t < (only_token < 0 ? T : only_token + 1); ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const double want = exact[size_t((t * H + h) * D + d)];
        const double got = reference::load(out, only_token < 0 ? t : out_row, h, d);
        bool ok;
        double tol = 0;
        if (std::isnan(want)) {
          ok = std::isnan(got);
        } else if (std::isinf(want)) {
          ok = got == want;
        } else {
          double pair = 0;
          if (d < R) {
            const int64_t a = c.params.interleaved ? d & ~int64_t(1) : d < R / 2 ? d : d - R / 2;
            const int64_t b = c.params.interleaved ? a + 1 : a + R / 2;
            pair = std::abs(reference::load(in, t, h, a)) + std::abs(reference::load(in, t, h, b));
          }
          tol = reference::tolerance(out.dtype, want, pair * gain);
          ok = std::abs(got - want) <= tol;
          // an exact value beyond the dtype's range may round to infinity (SPEC §1)
          if (!ok && std::isinf(got) && (got > 0) == (want > 0) && std::abs(want) + tol >= max_finite(out.dtype))
            ok = true;
        }
        if (!ok && only_token >= 0) return false;
        if (!ok) {
          char msg[512];
          std::snprintf(msg, sizeof msg,
                        "%s[%lld, %lld, %lld] = %.9g, exact %.9g (tolerance %.3g); position %lld, "
                        "rotary_dim %lld, interleaved %d, dtype %s, inv_freq[0] %.6g, attention %.6g",
                        out_name, (long long)t, (long long)h, (long long)d, got, want, tol,
                        (long long)reference::load_index(pos, t), (long long)R, int(c.params.interleaved),
                        dtype_name(out.dtype), schedule.inv_freq.empty() ? 0.0 : schedule.inv_freq[0],
                        schedule.attention_scaling);
          fail(msg);
        }
      }
  return true;
}

bool row_bits_equal(const TensorView& pool, int64_t row, const TensorView& src, int64_t t) {
  const size_t es = dtype_size(pool.dtype);
  for (int64_t h = 0; h < pool.shape[1]; ++h)
    for (int64_t d = 0; d < pool.shape[2]; ++d) {
      const auto* a = static_cast<const uint8_t*>(pool.data) +
                      (row * pool.strides[0] + h * pool.strides[1] + d * pool.strides[2]) * int64_t(es);
      const auto* b = static_cast<const uint8_t*>(src.data) +
                      (t * src.strides[0] + h * src.strides[1] + d * src.strides[2]) * int64_t(es);
      if (std::memcmp(a, b, es) != 0) return false;
    }
  return true;
}

void check_success(const Call& c) {
  // SPEC §3: an accepted call has no output sharing a byte with another argument, except
  // the in-place views q_out == q and k_out == k.
  std::vector<uint8_t> mask[kNumArgs];
  for (int a = 0; a < kNumArgs; ++a) mask[a] = bytes_of(c, c.view[a]);
  for (int out : {QOUT, KOUT, KPOOL, VPOOL})
    for (int other = 0; other < kNumArgs; ++other) {
      if (other == out) continue;
      if ((out == QOUT && other == Q) || (out == KOUT && other == K))
        if (identical(c.view[out], c.view[other])) continue;
      int64_t lo_a, hi_a, lo_b, hi_b;  // byte ranges first: most pairs are far apart
      byte_range(c, c.view[out], lo_a, hi_a);
      byte_range(c, c.view[other], lo_b, hi_b);
      for (int64_t b = std::max(lo_a, lo_b); b < std::min(hi_a, hi_b); ++b)
        if (mask[out][size_t(b)] && mask[other][size_t(b)])
          fail(std::string("accepted a call where ") + kArgName[out] + " and " + kArgName[other] +
               " share memory (arena byte " + std::to_string(b) + ")");
    }

  const int64_t T = c.view[Q].shape[0], P = c.view[KPOOL].shape[0];
  const TensorView slots = in_before(c, c.view[SLOTS]);
  std::vector<std::vector<int64_t>> writers(size_t(std::max<int64_t>(P, 0)));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = reference::load_index(slots, t);
    if (s >= P) fail("accepted slots[" + std::to_string(t) + "] = " + std::to_string(s) + " >= pool size " + std::to_string(P));
    if (s >= 0) writers[size_t(s)].push_back(t);
  }
  if (c.options.check_slots)
    for (const auto& w : writers)
      if (w.size() > 1) fail("check_slots accepted a repeated slot");

  // Bytes the call may write: the outputs, and the pool rows named by a slot.
  std::vector<uint8_t> may_write(kArenaBytes, 0);
  for (int a : {QOUT, KOUT})
    for (int64_t b = 0; b < kArenaBytes; ++b) may_write[size_t(b)] |= mask[a][size_t(b)];
  for (int a : {KPOOL, VPOOL})
    for (int64_t s = 0; s < P; ++s) {
      if (writers[size_t(s)].empty()) continue;
      TensorView row = c.view[a];
      row.data = static_cast<uint8_t*>(row.data) + s * row.strides[0] * int64_t(dtype_size(row.dtype));
      row.shape[0] = 1;
      const std::vector<uint8_t> m = bytes_of(c, row);
      for (int64_t b = 0; b < kArenaBytes; ++b) may_write[size_t(b)] |= m[size_t(b)];
    }
  for (int64_t b = 0; b < kArenaBytes; ++b)
    if (!may_write[size_t(b)] && c.arena[b] != c.before[b])
      fail("arena byte " + std::to_string(b) + " changed outside the outputs and written pool rows");
  if (std::memcmp(c.inv_freq_buf, c.inv_freq_before, sizeof c.inv_freq_buf) != 0) fail("inv_freq changed");
  if (T == 0) return;

  static const double angle_limit = [] {
    const char* env = std::getenv("ROPEPOOL_FUZZ_ANGLE_LIMIT");
    return env ? std::atof(env) : std::numeric_limits<double>::infinity();
  }();
  const RopeSchedule schedule = make_rope_schedule(c.params);
  double max_angle = 0;
  const TensorView positions = in_before(c, c.view[POS]);
  for (int64_t t = 0; t < T; ++t)
    for (double f : schedule.inv_freq)
      max_angle = std::max(max_angle, std::abs(double(reference::load_index(positions, t)) * f));
  const bool k_rot = c.view[KOUT].data != nullptr;  // else return_k_rot=False
  const bool accurate = !(max_angle > angle_limit);
  if (accurate) {
    check_rotation(c, Q, c.view[QOUT], "q_out", schedule);
    if (k_rot) check_rotation(c, K, c.view[KOUT], "k_out", schedule);
  }
  const TensorView v_before = in_before(c, c.view[V]);
  for (int64_t s = 0; s < P; ++s) {
    const auto& w = writers[size_t(s)];
    if (w.empty()) continue;
    // without k_rot there is nothing to compare the k row with bit for bit: the rotation
    const bool k_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) {
      return k_rot ? row_bits_equal(c.view[KPOOL], s, c.view[KOUT], t)
                   : !accurate || check_rotation(c, K, c.view[KPOOL], "k_pool", schedule, t, s);
    });
    const bool v_ok = std::any_of(w.begin(), w.end(), [&](int64_t t) { return row_bits_equal(c.view[VPOOL], s, v_before, t); });
    if (!k_ok)
      fail("k_pool row " + std::to_string(s) +
           (k_rot ? " is not a complete k_rot row of a token that writes it"
                  : " is not within the bound of the rotated k row of a token that writes it"));
    if (!v_ok) fail("v_pool row " + std::to_string(s) + " is not a complete v row of a token that writes it");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Call* call = new Call;  // one arena, reused (32 KiB; no allocation per input)
  Call& c = *call;
  std::memset(c.arena, 0, sizeof c.arena);
  std::memset(c.inv_freq_buf, 0, sizeof c.inv_freq_buf);
  c.options = CallOptions{};
  Reader r{data, size};
  if (!decode(r, c)) return 0;
  std::memcpy(c.before, c.arena, sizeof c.arena);
  std::memcpy(c.inv_freq_before, c.inv_freq_buf, sizeof c.inv_freq_buf);

  // Two threads on tiny calls: the pool's parallel path (and its duplicate-slot handling)
  // runs too, not only the single-threaded one.
  static const bool describe_first = std::getenv("ROPEPOOL_FUZZ_DESCRIBE") != nullptr;
  if (describe_first) describe(c);  // for triage of a crash a sanitizer reports
  set_cpu_num_threads(c.threads);
  detail::cpu::set_parallel_min_bytes(c.threads > 1 ? 1 : int64_t(1) << 20);
  try {
    rope_pool_fused(c.tensors, c.params, c.options);
  } catch (const Error&) {
    if (std::memcmp(c.arena, c.before, sizeof c.arena) != 0) {
      for (int64_t b = 0; b < kArenaBytes; ++b)
        if (c.arena[b] != c.before[b]) fail("rejected call changed arena byte " + std::to_string(b));
    }
    if (std::memcmp(c.inv_freq_buf, c.inv_freq_before, sizeof c.inv_freq_buf) != 0) fail("rejected call changed inv_freq");
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("unexpected exception: ") + e.what());
  }
  g_current = &c;
  check_success(c);
  g_current = nullptr;
  return 0;
}

#ifdef ROPEPOOL_FUZZ_REPLAY
// The replay driver: runs each file named on the command line once (no libFuzzer needed).
#include <fstream>
#include <iterator>
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read %s\n", argv[i]);
      return 2;
    }
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "replay %s (%zu bytes)\n", argv[i], bytes.size());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  return 0;
}
#endif
