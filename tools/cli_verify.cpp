// `ropepool verify`: a quick randomized self-check of the CPU backend against the float64
// reference over dtypes x head sizes x head counts x token counts, plus the SPEC §3 rules
// (bad slots never write anything, duplicate slots never mix tokens).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "cli_common.hpp"

namespace ropepool::cli {
namespace {

enum class Layout { Contiguous, FusedQkv, StackedPool };
enum class Kind { Normal, SlotOutOfRange, DuplicateChecked, DuplicateUnchecked };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Contiguous:
      return "contiguous";
    case Layout::FusedQkv:
      return "q/k/v views of a fused qkv [T, (Hq+2Hk)*D]";
    case Layout::StackedPool:
      return "pools are layer 1 of [2, P, Hk, D]";
  }
  return "?";
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Normal:
      return "";
    case Kind::SlotOutOfRange:
      return ", one slot >= pool size (must be rejected, nothing written)";
    case Kind::DuplicateChecked:
      return ", repeated slot with check_slots (must be rejected)";
    case Kind::DuplicateUnchecked:
      return ", repeated slot without check_slots";
  }
  return "";
}

struct Case {
  DType dtype = DType::BFloat16;
  DType index_dtype = DType::Int32;
  int64_t head_dim = 0, num_qo_heads = 0, num_kv_heads = 0, tokens = 0;
  int64_t rotary_dim = 0;  // 0: head_dim (SPEC §4 partial rotary otherwise)
  bool interleaved = false;
  Layout layout = Layout::Contiguous;
  Kind kind = Kind::Normal;
  bool check_slots = false;
  int threads = 1;
  uint64_t seed = 0;

  std::string describe() const {
    char buf[384];
    std::snprintf(
        buf, sizeof buf,
        "%s D=%lld Hq=%lld Hk=%lld T=%lld, rotary_dim %lld, %s pairs, %s positions/slots, "
        "%s, check_slots=%d, %d thread(s), seed %llu%s",
        dtype_name(dtype), (long long)head_dim, (long long)num_qo_heads, (long long)num_kv_heads,
        (long long)tokens, (long long)(rotary_dim ? rotary_dim : head_dim),
        interleaved ? "interleaved" : "half-split", dtype_name(index_dtype), layout_name(layout),
        int(check_slots), threads, (unsigned long long)seed, kind_name(kind));
    return buf;
  }
};

int64_t pick_position(Rng& rng) {
  constexpr int64_t kNear = int64_t(1) << 20;  // SPEC §1 promises accuracy below 2^20
  switch (rng.below(8)) {
    case 0:
      return 0;
    case 1:
      return int64_t(rng.below(16));
    case 2:
    case 3:
      return kNear - 1 - int64_t(rng.below(64));
    case 4:
      return -(kNear - 1 - int64_t(rng.below(64)));
    default:
      return int64_t(rng.below(uint64_t(kNear)));
  }
}

int64_t pick_negative_slot(Rng& rng, DType index_dtype) {
  switch (rng.below(4)) {
    case 0:
      return index_dtype == DType::Int64 ? INT64_MIN : INT32_MIN;
    case 1:
      return -1 - int64_t(rng.below(1000));
    default:
      return -1;
  }
}

/// Runs one case; returns "" when it passes, else what went wrong.
std::string run_case(const Case& c) {
  const int64_t T = c.tokens, Hq = c.num_qo_heads, Hk = c.num_kv_heads, D = c.head_dim;
  const DType dt = c.dtype;
  const size_t es = dtype_size(dt), is = dtype_size(c.index_dtype);
  const int check_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  Rng rng(c.seed);

  // Inputs: either three tensors or three views into one fused projection output.
  const int64_t qkv_width = (Hq + 2 * Hk) * D;
  Buffer qkv(size_t(std::max<int64_t>(1, T * qkv_width)) * es);
  fill_random(qkv.data(), dt, T * qkv_width, c.seed ^ 0x51, check_threads);
  TensorView q, k, v;
  if (c.layout == Layout::FusedQkv) {
    auto view = [&](int64_t first_col, int64_t heads) {
      TensorView x = TensorView::contiguous(static_cast<char*>(qkv.data()) + size_t(first_col) * es,
                                            dt, {T, heads, D});
      x.strides[0] = qkv_width;
      return x;
    };
    q = view(0, Hq);
    k = view(Hq * D, Hk);
    v = view((Hq + Hk) * D, Hk);
  } else {
    char* base = static_cast<char*>(qkv.data());
    q = TensorView::contiguous(base, dt, {T, Hq, D});
    k = TensorView::contiguous(base + size_t(T * Hq * D) * es, dt, {T, Hk, D});
    v = TensorView::contiguous(base + size_t(T * (Hq + Hk) * D) * es, dt, {T, Hk, D});
  }
  const std::vector<char> qkv_before(static_cast<char*>(qkv.data()),
                                     static_cast<char*>(qkv.data()) + size_t(T * qkv_width) * es);

  // Pools, possibly one layer of a stacked cache; the whole allocation is compared after.
  const int64_t P = 2 * T + 1 + int64_t(rng.below(8));
  const int64_t layers = c.layout == Layout::StackedPool ? 2 : 1;
  const int64_t pool_elems = layers * P * Hk * D;
  Buffer k_pool_buf(size_t(pool_elems) * es), v_pool_buf(size_t(pool_elems) * es);
  fill_random(k_pool_buf.data(), dt, pool_elems, c.seed ^ 0x4b, check_threads);
  fill_random(v_pool_buf.data(), dt, pool_elems, c.seed ^ 0x56, check_threads);
  const std::vector<char> k_pool_before(
      static_cast<char*>(k_pool_buf.data()),
      static_cast<char*>(k_pool_buf.data()) + size_t(pool_elems) * es);
  const std::vector<char> v_pool_before(
      static_cast<char*>(v_pool_buf.data()),
      static_cast<char*>(v_pool_buf.data()) + size_t(pool_elems) * es);
  const int64_t layer = layers - 1;
  const TensorView k_pool = TensorView::contiguous(
      static_cast<char*>(k_pool_buf.data()) + size_t(layer * P * Hk * D) * es, dt, {P, Hk, D});
  const TensorView v_pool = TensorView::contiguous(
      static_cast<char*>(v_pool_buf.data()) + size_t(layer * P * Hk * D) * es, dt, {P, Hk, D});

  // Outputs poisoned with NaN so an element the op skips fails the check.
  Buffer q_out_buf(size_t(std::max<int64_t>(1, T * Hq * D)) * es);
  Buffer k_out_buf(size_t(std::max<int64_t>(1, T * Hk * D)) * es);
  poison(q_out_buf.data(), dt, T * Hq * D, 1);
  poison(k_out_buf.data(), dt, T * Hk * D, 1);
  const TensorView q_out = TensorView::contiguous(q_out_buf.data(), dt, {T, Hq, D});
  const TensorView k_out = TensorView::contiguous(k_out_buf.data(), dt, {T, Hk, D});

  // Positions and slots: distinct slots, about a quarter negative (several negative values).
  std::vector<int64_t> pos(static_cast<size_t>(T)), slot(static_cast<size_t>(T));
  std::vector<int64_t> free_rows(static_cast<size_t>(P));
  for (int64_t i = 0; i < P; ++i) free_rows[size_t(i)] = i;
  for (int64_t t = 0; t < T; ++t) {
    pos[size_t(t)] = pick_position(rng);
    if (rng.chance(0.25)) {
      slot[size_t(t)] = pick_negative_slot(rng, c.index_dtype);
    } else {
      const size_t j = size_t(rng.below(free_rows.size()));
      slot[size_t(t)] = free_rows[j];
      free_rows[j] = free_rows.back();
      free_rows.pop_back();
    }
  }
  int64_t bad_token = -1;
  if (c.kind == Kind::SlotOutOfRange) {
    bad_token = int64_t(rng.below(uint64_t(T)));
    slot[size_t(bad_token)] = P + int64_t(rng.below(3));
  } else if (c.kind == Kind::DuplicateChecked || c.kind == Kind::DuplicateUnchecked) {
    // two distinct tokens share a non-negative slot
    const int64_t a = int64_t(rng.below(uint64_t(T)));
    int64_t b = int64_t(rng.below(uint64_t(T - 1)));
    if (b >= a) ++b;
    slot[size_t(a)] = int64_t(rng.below(uint64_t(P)));
    slot[size_t(b)] = slot[size_t(a)];
  }
  Buffer positions_buf(size_t(std::max<int64_t>(1, T)) * is),
      slots_buf(size_t(std::max<int64_t>(1, T)) * is);
  for (int64_t t = 0; t < T; ++t) {
    if (is == 8) {
      static_cast<int64_t*>(positions_buf.data())[t] = pos[size_t(t)];
      static_cast<int64_t*>(slots_buf.data())[t] = slot[size_t(t)];
    } else {
      static_cast<int32_t*>(positions_buf.data())[t] = int32_t(pos[size_t(t)]);
      static_cast<int32_t*>(slots_buf.data())[t] = int32_t(slot[size_t(t)]);
    }
  }

  RopePoolTensors tv;
  tv.q = q;
  tv.k = k;
  tv.v = v;
  tv.positions = TensorView::contiguous(positions_buf.data(), c.index_dtype, {T});
  tv.slots = TensorView::contiguous(slots_buf.data(), c.index_dtype, {T});
  tv.k_pool = k_pool;
  tv.v_pool = v_pool;
  tv.q_out = q_out;
  tv.k_out = k_out;
  RopePoolParams params;
  params.head_dim = D;
  params.num_qo_heads = Hq;
  params.num_kv_heads = Hk;
  params.rope_base = D == 2 ? 10000.0 : 500000.0;
  params.rotary_dim = c.rotary_dim;
  params.interleaved = c.interleaved;
  CallOptions options;
  options.check_slots = c.check_slots;

  set_cpu_num_threads(c.threads);
  const bool expect_error = c.kind == Kind::SlotOutOfRange || c.kind == Kind::DuplicateChecked;
  std::string error;
  try {
    rope_pool_fused(tv, params, options);
  } catch (const Error& e) {
    error = e.what();
  } catch (const std::exception& e) {
    return std::string("unexpected exception: ") + e.what();
  }

  const bool inputs_same =
      qkv_before.empty() || std::memcmp(qkv.data(), qkv_before.data(), qkv_before.size()) == 0;
  if (!inputs_same) return "q/k/v were modified";

  if (expect_error) {
    if (error.empty()) return "the call was not rejected";
    if (c.kind == Kind::SlotOutOfRange &&
        (error.find("slots[" + std::to_string(bad_token) + "]") == std::string::npos ||
         error.find(std::to_string(P)) == std::string::npos))
      return "the rejection does not name token " + std::to_string(bad_token) + " and pool size " +
             std::to_string(P) + ": " + error;
    auto all_ones = [](const void* p, size_t n) {
      const unsigned char* b = static_cast<const unsigned char*>(p);
      return std::all_of(b, b + n, [](unsigned char x) { return x == 0xff; });
    };
    if (!all_ones(q_out_buf.data(), size_t(T * Hq * D) * es) ||
        !all_ones(k_out_buf.data(), size_t(T * Hk * D) * es))
      return "rejected call wrote q_rot/k_rot (" + error + ")";
    if (std::memcmp(k_pool_buf.data(), k_pool_before.data(), k_pool_before.size()) ||
        std::memcmp(v_pool_buf.data(), v_pool_before.data(), v_pool_before.size()))
      return "rejected call wrote the pools (" + error + ")";
    return "";
  }
  if (!error.empty()) return "rejected a valid call: " + error;

  const RopeSchedule schedule = make_rope_schedule(params);
  for (auto [name, x, out] : {std::tuple{"q_out", &q, &q_out}, {"k_out", &k, &k_out}}) {
    const CheckStats s =
        check_rotation(name, *x, *out, tv.positions, schedule, 0, T, check_threads, c.interleaved);
    if (!s.ok())
      return std::to_string(s.failures) + " of " + std::to_string(s.elements) +
             " elements outside the SPEC bound; first: " + s.first_failure;
  }

  // Every row of the whole pool allocation: its writer's row (any writer if repeated), else
  // the bits it had before.
  std::map<int64_t, std::vector<int64_t>> writers;
  for (int64_t t = 0; t < T; ++t)
    if (slot[size_t(t)] >= 0) writers[slot[size_t(t)]].push_back(t);
  const TensorView k_all = TensorView::contiguous(k_pool_buf.data(), dt, {layers * P, Hk, D});
  const TensorView v_all = TensorView::contiguous(v_pool_buf.data(), dt, {layers * P, Hk, D});
  const TensorView k_init =
      TensorView::contiguous(const_cast<char*>(k_pool_before.data()), dt, {layers * P, Hk, D});
  const TensorView v_init =
      TensorView::contiguous(const_cast<char*>(v_pool_before.data()), dt, {layers * P, Hk, D});
  for (int64_t row = 0; row < layers * P; ++row) {
    const int64_t pool_row = row - layer * P;
    const auto it = pool_row >= 0 ? writers.find(pool_row) : writers.end();
    if (it == writers.end()) {
      if (!rows_identical(k_all, row, k_init, row) || !rows_identical(v_all, row, v_init, row))
        return "pool row " + std::to_string(row) +
               " of the allocation is no slot of this call but changed";
      continue;
    }
    const auto& tokens = it->second;
    const bool k_ok = std::any_of(tokens.begin(), tokens.end(), [&](int64_t t) {
      return rows_identical(k_pool, pool_row, k_out, t);
    });
    const bool v_ok = std::any_of(tokens.begin(), tokens.end(), [&](int64_t t) {
      return rows_identical(v_pool, pool_row, v, t);
    });
    if (!k_ok || !v_ok)
      return std::string(k_ok ? "v_pool" : "k_pool") + " row " + std::to_string(pool_row) +
             " is not bit-identical to " + (k_ok ? "v" : "k_rot") + " of token " +
             std::to_string(tokens.front()) +
             (tokens.size() > 1 ? " (or any token sharing the slot)" : "");
  }
  return "";
}

}  // namespace

const char* verify_help() {
  return R"(usage: ropepool verify [options]

A quick randomized self-check of rope_pool_fused on the CPU against the float64 reference:
float32/float16/bfloat16 x head_dim 2, 64, 96, 128, 256 x (num_qo_heads, num_kv_heads)
(1, 1), (4, 2), (32, 8) x T 0, 1, 7, 64, 300; positions near +-2^20, int32 and int64
indices, negative slots, q/k/v as views of a fused qkv buffer, pools as a layer of a
stacked cache, partial rotary_dim and interleaved pairs on a share of the cases, several
thread counts. Each case: every q_rot/k_rot element within the
SPEC §1 bound (reference::tolerance), written pool rows bit-identical to k_rot/v, every
other pool row and q/k/v unchanged. Plus, per dtype: an out-of-range slot and a repeated
slot with check_slots must be rejected with nothing written; a repeated slot without it
must leave one token's complete row.

Prints "N passed, M failed" and exits 1 if anything failed.

options:
  --threads N   run every case with N threads (default: cycle through 1, 2, 3 and all
                hardware threads)
  --seed N      random seed (default: 1)
  --verbose     print every case
  -h, --help    this text
)";
}

int run_verify(Args& args) {
  int fixed_threads = 0;
  uint64_t seed = 1;
  bool verbose = false;
  while (!args.done()) {
    const std::string o = args.next_option();
    if (o == "-h" || o == "--help") {
      std::fputs(verify_help(), stdout);
      return 0;
    } else if (o == "--threads") {
      fixed_threads = int(parse_int(o, args.value(o), 1));
    } else if (o == "--seed") {
      seed = uint64_t(parse_int(o, args.value(o), 0));
    } else if (o == "--verbose" || o == "-v") {
      verbose = true;
    } else {
      args.unknown(o);
    }
  }
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  const int thread_cycle[] = {1, 2, 3, hw};

  std::vector<Case> cases;
  Rng rng(seed);
  auto next_threads = [&] {
    return fixed_threads ? fixed_threads : thread_cycle[cases.size() % 4];
  };
  const DType dtypes[] = {DType::Float32, DType::Float16, DType::BFloat16};
  const int64_t head_dims[] = {2, 64, 96, 128, 256};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 2}, {32, 8}};
  const int64_t token_counts[] = {0, 1, 7, 64, 300};
  for (DType dt : dtypes)
    for (int64_t D : head_dims)
      for (auto [Hq, Hk] : heads)
        for (int64_t T : token_counts) {
          Case c;
          c.dtype = dt;
          c.head_dim = D;
          c.num_qo_heads = Hq;
          c.num_kv_heads = Hk;
          c.tokens = T;
          c.index_dtype = rng.chance(0.5) ? DType::Int64 : DType::Int32;
          c.layout = Layout(rng.below(3));
          c.check_slots = rng.chance(0.5);
          // SPEC §4 extras on a share of the cases: partial rotary, GPT-J pairs
          if (D > 2 && rng.chance(0.25)) c.rotary_dim = 2 * rng.range(1, D / 2 - 1);
          c.interleaved = rng.chance(0.25);
          c.threads = next_threads();
          c.seed = rng.next();
          cases.push_back(c);
        }
  for (DType dt : dtypes)
    for (Kind kind : {Kind::SlotOutOfRange, Kind::DuplicateChecked, Kind::DuplicateUnchecked}) {
      Case c;
      c.dtype = dt;
      c.head_dim = 128;
      c.num_qo_heads = 4;
      c.num_kv_heads = 2;
      c.tokens = 2 + int64_t(rng.below(40));
      c.index_dtype = rng.chance(0.5) ? DType::Int64 : DType::Int32;
      c.layout = Layout(rng.below(3));
      c.kind = kind;
      c.check_slots =
          kind == Kind::DuplicateChecked || (kind == Kind::SlotOutOfRange && rng.chance(0.5));
      c.threads = next_threads();
      c.seed = rng.next();
      cases.push_back(c);
    }

  const auto t0 = std::chrono::steady_clock::now();
  const bool tty = isatty(fileno(stderr));
  int passed = 0, failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (tty) std::fprintf(stderr, "\r[ropepool verify] case %zu/%zu", i + 1, cases.size());
    const std::string problem = run_case(c);
    if (problem.empty()) {
      ++passed;
      if (verbose) std::fprintf(stderr, "%sok    %s\n", tty ? "\r" : "", c.describe().c_str());
    } else {
      ++failed;
      if (tty) std::fprintf(stderr, "\r%60s\r", "");
      std::printf("FAIL  %s\n      %s\n", c.describe().c_str(), problem.c_str());
      std::fflush(stdout);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tty) std::fprintf(stderr, "\r%60s\r", "");
  std::fprintf(stderr, "[ropepool verify] %zu cases in %.1f s\n", cases.size(), secs);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

}  // namespace ropepool::cli
