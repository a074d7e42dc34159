// The C++ test kit: one random generator, one host buffer type (poisoned, guard regions,
// snapshots), one complete call laid out in those buffers, and one checker against the
// float64 reference (include/ropepool/reference.hpp) that knows NeoX and GPT-J pairs,
// partial rotary and every schedule. Used by the GoogleTest suites (tests/cpp), the
// per-target CPU test (tests/cpu), the CUDA test (tests/cuda) and `ropepool verify`.
// No GoogleTest here: checks return what went wrong; tests/cpp/test_support.hpp turns
// that into test failures.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ropepool/half.hpp"
#include "ropepool/reference.hpp"
#include "ropepool/ropepool.hpp"

namespace ropepool::test {

// ---------------------------------------------------------------------------------------
// Randomness

/// splitmix64's finaliser: every output bit depends on every input bit.
uint64_t mix64(uint64_t x);

/// A fresh seed every run; ROPEPOOL_TEST_SEED replays a failing one.
uint64_t fresh_seed();

/// Value i of stream `seed`, independent of the order values are drawn in, so a buffer can
/// be filled in parallel and regenerated to compare.
inline uint64_t counter_bits(uint64_t seed, uint64_t i) {
  return mix64(seed + (i + 1) * 0x9e3779b97f4a7c15ull);
}

/// xoshiro256** seeded through splitmix64: the tests draw hundreds of millions of values,
/// and std::mt19937_64 dominated their run time. A UniformRandomBitGenerator, so the
/// std:: distributions and std::shuffle take it.
class Rng {
 public:
  using result_type = uint64_t;
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t(0); }

  explicit Rng(uint64_t seed);
  uint64_t seed() const { return seed_; }
  uint64_t operator()() { return bits(); }
  uint64_t bits() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }
  /// Uniform in [lo, hi], both inclusive.
  int64_t integer(int64_t lo, int64_t hi);
  /// Uniform in [0, n) (0 when n is 0).
  uint64_t below(uint64_t n) { return n ? uint64_t(integer(0, int64_t(n - 1))) : 0; }
  /// Uniform in [0, 1).
  double unit() { return double(bits() >> 11) * 0x1p-53; }
  bool chance(double p) { return unit() < p; }
  template <class It>
  void shuffle(It first, It last) {
    for (auto n = last - first; n > 1; --n) std::swap(first[n - 1], first[below(uint64_t(n))]);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t seed_;
  uint64_t state_[4];
};

// ---------------------------------------------------------------------------------------
// Elements

inline std::string dtype_str(DType d) { return dtype_name(d); }

/// "[2, 8, 128]", written here independently of the library's format_shape.
std::string shape_str(const TensorView& v);

/// Address of element (t, h, d) of a 1-, 2- or 3-D view.
void* element(const TensorView& v, int64_t t, int64_t h = 0, int64_t d = 0);

/// The value of one float element as double (exact for all three dtypes).
double load(const TensorView& v, int64_t t, int64_t h, int64_t d);
/// `value` rounded once (to nearest even) to the view's float dtype.
void store(const TensorView& v, int64_t t, int64_t h, int64_t d, float value);
/// Writes the low dtype_size bytes of `bits` into one element.
void store_bits(const TensorView& v, int64_t t, int64_t h, int64_t d, uint64_t bits);
bool same_bits(const TensorView& a, int64_t ta, int64_t ha, int64_t da, const TensorView& b,
               int64_t tb, int64_t hb, int64_t db);
int64_t index_at(const TensorView& v, int64_t t);
void set_index(const TensorView& v, int64_t t, int64_t value);

/// A view of tokens [t0, t0 + n) of a tensor whose first dimension is tokens.
TensorView token_slice(TensorView v, int64_t t0, int64_t n);

/// A random finite value with a spread of exponents (2^-6 .. 2^3), random sign and all
/// mantissa bits random, exactly representable in `dtype`.
float random_value(Rng& rng, DType dtype);
/// A NaN of `dtype` (low bytes of the result) with sign and payload from `r`: quiet or
/// signalling, never the canonical pattern only.
uint64_t nan_pattern(DType dtype, uint64_t r);
/// +Inf or -Inf of `dtype` (low bytes), the sign from `r`.
uint64_t inf_pattern(DType dtype, uint64_t r);

/// Copies every element of a 1-D or 3-D view into another of the same shape and dtype.
void copy_elements(const TensorView& from, const TensorView& to);
/// The bytes of every element of a 3-D view, in row-major element order.
std::vector<uint8_t> view_bytes(const TensorView& v);
/// Number of elements of two same-shaped 3-D views whose bits differ.
int64_t count_bit_differences(const TensorView& a, const TensorView& b);
/// Whether row `row` (all heads) of [rows, H, D] view `a` and row `b_row` of `b` hold the
/// same bits.
bool rows_identical(const TensorView& a, int64_t row, const TensorView& b, int64_t b_row);

/// Runs body(begin, end) over [0, n) split into `threads` contiguous chunks (the calling
/// thread takes one). For filling and checking, never inside a timed region.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& body);

/// Element i of `data` (a float dtype, float8_e4m3fn too) = value i of counter stream `seed`, uniform in
/// [lo, hi) and rounded to the dtype; parallel.
void fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, double lo, double hi,
                  int threads);
/// Whether element i still holds what fill_uniform(seed) wrote.
bool holds_uniform(const void* data, DType dtype, int64_t i, uint64_t seed, double lo, double hi);

// ---------------------------------------------------------------------------------------
// Host memory

/// Owns `numel` elements of `dtype` at a page-aligned base, between two guard regions that
/// hold a fixed pattern: a write before or after the elements shows in snapshot
/// comparisons. The elements start uninitialised (a benchmark's parallel fill places the
/// pages); poison() fills them with garbage.
class HostBuffer {
 public:
  static constexpr size_t kPage = 4096;

  /// `guard_pages` pages on each side (benchmarks with thousands of small buffers pass 0).
  HostBuffer(std::string name, DType dtype, int64_t numel, int guard_pages = 1);
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  const std::string& name() const { return name_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  size_t bytes() const { return size_t(numel_) * dtype_size(dtype_); }
  uint8_t* base() const { return base_; }
  void* data() const { return base_; }

  /// A view of `shape` with `strides` (in elements) starting `offset` elements in.
  TensorView view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides,
                  int64_t offset = 0, Device device = {}) const;
  /// A row-major view of `shape` starting `offset` elements in.
  TensorView contiguous(std::initializer_list<int64_t> shape, int64_t offset = 0,
                        Device device = {}) const;
  /// view() with shape and strides of any rank.
  TensorView strided(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                     int64_t offset = 0, Device device = {}) const {
    return make_view(shape, strides, offset, device);
  }

  /// Element offset of a view's origin in this buffer, or -1 if it lives elsewhere.
  int64_t offset_of(const TensorView& v) const;

  /// The elements and both guards.
  std::vector<uint8_t> snapshot() const;
  void restore(const std::vector<uint8_t>& snapshot);
  /// Element indices (-1: a guard byte) that differ from `snapshot`, the first `most`.
  std::vector<int64_t> changed_elements(const std::vector<uint8_t>& snapshot, size_t most) const;

  /// Random garbage in every element: NaN patterns with random payloads, infinities and
  /// random bits for float buffers, random bits for index buffers. Never zeros.
  void poison(Rng& rng);

 private:
  TensorView make_view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                       int64_t offset, Device device) const;
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::string name_;
  DType dtype_;
  int64_t numel_;
  size_t guard_bytes_ = 0;
  size_t alloc_bytes_ = 0;
  std::unique_ptr<uint8_t, Free> storage_;
  uint8_t* base_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// A complete call: buffers, views, params

enum class QkvLayout { Contiguous, Fused, Padded };
/// Pools: their own buffers (contiguous; layer 1 of a 3-layer stack; the other head/row
/// order seen through strides), or the K and V halves of one combined cache as vLLM
/// ([2, pages, ...]: kv_cache[0], kv_cache[1]) and FlashInfer ([pages, 2, ...]:
/// kv_cache[:, 0], kv_cache[:, 1]) lay it out; "..." is [Hk, D], [page_size, Hk, D] (NHD) or
/// [Hk, page_size, D] (HND).
enum class PoolLayout { Contiguous, LayerOfStack, HeadMajor, CombinedVllm, CombinedFlashInfer };
enum class OutLayout { Contiguous, Padded };
enum class IndexLayout { Contiguous, Strided };

const char* name(QkvLayout l);
const char* name(PoolLayout l);
const char* name(OutLayout l);
const char* name(IndexLayout l);

struct Shape {
  DType dtype = DType::Float32;
  int64_t num_tokens = 2;
  int64_t num_qo_heads = 8;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 128;
  int64_t pool_size = 16;
  DType position_dtype = DType::Int32;
  DType slot_dtype = DType::Int32;
  double rope_base = 10000;
  int64_t rotary_dim = 0;   ///< 0: head_dim
  bool interleaved = false; ///< GPT-J pairs
  RopeScaling rope_scaling;
  // SPEC §6
  KvLayout kv_layout = KvLayout::None;
  int64_t page_size = 1;        ///< NHD / HND; pool_size is rounded up to whole pages
  DType pool_dtype = DType::Other;   ///< Other: dtype; or Float8E4M3FN
  DType q_out_dtype = DType::Other;  ///< Other: dtype; or Float8E4M3FN
  double k_scale = 0, v_scale = 0, q_scale = 0;  ///< 0: not passed
  bool tensor_scales = false;  ///< pass the scales as one-element float32 tensors
};

/// A representative rope_scaling of each type, for a head rotating `rotary_dim` elements
/// (longrope's factor lists have rotary_dim/2 entries); positions up to 2^20 take the long
/// branch of the length-dependent types.
RopeScaling scaling_preset(RopeType type, int64_t rotary_dim);
/// Every rope_scaling type (Default first).
inline constexpr RopeType kAllRopeTypes[] = {RopeType::Default, RopeType::Linear, RopeType::Dynamic,
                                             RopeType::Yarn, RopeType::Llama3, RopeType::LongRope};

struct Layout {
  QkvLayout qkv = QkvLayout::Contiguous;
  PoolLayout pool = PoolLayout::Contiguous;
  OutLayout out = OutLayout::Contiguous;
  IndexLayout index = IndexLayout::Contiguous;
  /// Elements after every view: writes past a view's end land there and are caught.
  int64_t tail_slack = 67;
};

struct Snapshot {
  std::vector<std::vector<uint8_t>> bytes;  // per buffer, in Case::buffers() order
};

/// Owns every tensor of one rope_pool_fused call, laid out as `layout` says.
class Case {
 public:
  explicit Case(const Shape& s, const Layout& l = {});
  Case(const Case&) = delete;
  Case& operator=(const Case&) = delete;

  Shape shape;
  Layout layout;
  RopePoolTensors tensors;
  RopePoolParams params;

  const std::vector<std::unique_ptr<HostBuffer>>& buffers() const { return buffers_; }

  int64_t num_tokens() const { return shape.num_tokens; }
  int64_t slot(int64_t t) const { return index_at(tensors.slots, t); }
  int64_t position(int64_t t) const { return index_at(tensors.positions, t); }
  void set_slot(int64_t t, int64_t s) { set_index(tensors.slots, t, s); }
  void set_position(int64_t t, int64_t p) { set_index(tensors.positions, t, p); }

  /// Fresh random call: every buffer poisoned, then random finite q/k/v, positions in
  /// [0, 2^20) including the extremes, and distinct slots with about `negative_fraction`
  /// negative ones.
  void randomize(Rng& rng, double negative_fraction = 0.125);
  void randomize_positions(Rng& rng);
  /// Distinct non-negative slots; negative ones (-1, INT32_MIN, ...) for about
  /// `negative_fraction` of the tokens, or for the tokens the pool has no room for.
  void randomize_slots(Rng& rng, double negative_fraction);

  Snapshot snapshot() const;
  /// Puts every buffer back to a snapshot of this case.
  void restore(const Snapshot& s);
  /// Poisons the buffers of q_out and k_out (fresh garbage before a call).
  void poison_outputs(Rng& rng);
  /// The buffer a view lives in.
  const HostBuffer& buffer_of(const TensorView& v) const;

 private:
  HostBuffer& own(const char* n, DType dtype, int64_t numel);
  std::vector<std::unique_ptr<HostBuffer>> buffers_;
};

// ---------------------------------------------------------------------------------------
// Checks

/// What a comparison found: counts, the worst error relative to the bound, and the first
/// few failures (lowest token/row first).
struct CheckStats {
  static constexpr size_t kKept = 5;
  int64_t elements = 0;
  int64_t failures = 0;
  double worst = 0;  // max over elements of |error| / bound
  std::vector<std::pair<int64_t, std::string>> first;  // (token or row, description)
  bool ok() const { return failures == 0; }
  void merge(const CheckStats& other);
  /// Counts a failure at token/row `at`; `describe` runs only if it is kept.
  void fail(int64_t at, const std::function<std::string()>& describe);
  std::string first_failure() const { return first.empty() ? "" : first.front().second; }
};

struct RotationCheck {
  /// float16/bfloat16 outputs must also be the float32 result rounded to nearest (SPEC §1
  /// "rounded once"): within half an ulp plus the float32 term, which truncation misses.
  bool round_to_nearest = false;
  int threads = 1;
  int64_t t_begin = 0, t_end = -1;  // -1: every token
  /// SPEC §7: x is normalised with this [D] weight before the rotation (nullptr: no norm).
  const TensorView* norm_weight = nullptr;
  double norm_eps = 1e-6;
  bool norm_gemma = false;
};

/// Checks every element of `out` against the float64 rotation of `x` (the op's input) under
/// `schedule` with NeoX (i, i + R/2) or GPT-J (2i, 2i + 1) pairs: within
/// reference::tolerance for the rotated part, bit-exact copies past rotary_dim; non-finite
/// exact values must come out the same (NaN stays NaN, +-Inf stays itself).
CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopeSchedule& schedule,
                          bool interleaved, const RotationCheck& how = {});
/// The same with the schedule of `params` (its own `schedule`, else make_rope_schedule).
CheckStats check_rotation(const char* name, const TensorView& x, const TensorView& out,
                          const TensorView& positions, const RopePoolParams& params,
                          const RotationCheck& how = {});

/// The ordinal of an e4m3fn code: neighbouring values differ by one (+0 and -0 are both 0).
inline int e4m3_ordinal(uint8_t b) { return (b & 0x80) ? -int(b & 0x7f) : int(b & 0x7f); }
inline bool e4m3_is_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }

/// SPEC §6 for a float8_e4m3fn q_rot `out` of the rotation of `x`: every element within one
/// e4m3 step of e4m3(exact / scale) (NaN stays NaN), the pass-through elements past
/// rotary_dim bit-exact (e4m3(x / scale), the division in float32). With a norm weight in
/// `how` (SPEC §7) `x` is normalised first (reference::normalize) and the pass-through
/// elements, normalised values, may also be one e4m3 step off.
CheckStats check_quantized(const char* name, const TensorView& x, const TensorView& out,
                           const TensorView& positions, const RopeSchedule& schedule,
                           bool interleaved, float scale, const RotationCheck* how = nullptr);

/// Every buffer bit-identical to `before` (after a rejected call); one line per change.
std::vector<std::string> changes_since(const Case& c, const Snapshot& before);

/// The whole contract of a successful call, given the buffers before it; one line per
/// problem (empty: it holds):
/// - q_out/k_out within the SPEC §1 bound of the float64 reference, every element;
/// - each pool row named by a non-negative slot holds, bit for bit, the k_out / v row of a
///   token that wrote it (the only token, or one of the tokens when slots repeat);
/// - every other byte of every buffer (inputs, pool rows not written, gaps between and
///   after views, other layers of a stacked cache, the guards) is unchanged.
/// An empty k_out (SPEC §4 return_k_rot=False): no k_out check, the k_out buffer unchanged,
/// and each k pool row in q's dtype within the SPEC §1 bound of the float64 rotation.
std::vector<std::string> check_call(const Case& c, const Snapshot& before, int threads = 1);

/// SPEC §4 return_k_rot=False against the call just made (`before`: the buffers before it):
/// the same call again from `before` with an empty k_out passes check_call and leaves every
/// buffer but k_out's bit-identical to the first call's (q_out and the pools exactly as with
/// k_rot). Leaves the case as the call without k_rot left it, k_out view restored.
std::vector<std::string> check_without_k_rot(Case& c, const Snapshot& before,
                                             const CallOptions& options = {});

}  // namespace ropepool::test
