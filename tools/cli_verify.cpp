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
#include "ropepool_kit.hpp"

namespace ropepool::cli {
namespace {

enum class VerifyLayout { Contiguous, FusedQkv, StackedPool, VllmCache, FlashInferCache };
enum class Kind { Normal, SlotOutOfRange, DuplicateChecked, DuplicateUnchecked };

const char* layout_name(VerifyLayout l) {
  switch (l) {
    case VerifyLayout::Contiguous:
      return "contiguous";
    case VerifyLayout::FusedQkv:
      return "q/k/v views of a fused qkv [T, (Hq+2Hk)*D]";
    case VerifyLayout::StackedPool:
      return "pools are layer 1 of a [3, ...] stack";
    case VerifyLayout::VllmCache:
      return "pools are the halves of a vLLM cache [2, pages, ...]";
    case VerifyLayout::FlashInferCache:
      return "pools are the halves of a FlashInfer cache [pages, 2, ...]";
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

struct VerifyCase {
  DType dtype = DType::BFloat16;
  DType index_dtype = DType::Int32;
  int64_t head_dim = 0, num_qo_heads = 0, num_kv_heads = 0, tokens = 0;
  int64_t rotary_dim = 0;  // 0: head_dim (SPEC §4 partial rotary otherwise)
  bool interleaved = false;
  RopeType scaling = RopeType::Default;
  VerifyLayout layout = VerifyLayout::Contiguous;
  Kind kind = Kind::Normal;
  bool check_slots = false;
  int threads = 1;
  uint64_t seed = 0;
  // SPEC §6
  KvLayout kv_layout = KvLayout::None;
  int64_t page_size = 1;
  bool fp8_pool = false, fp8_q = false;
  bool k_rot = true;  // false: SPEC §4 return_k_rot=False (an empty k_out)

  std::string describe() const {
    char buf[640];
    std::snprintf(
        buf, sizeof buf,
        "%s D=%lld Hq=%lld Hk=%lld T=%lld, rotary_dim %lld, %s pairs, rope_scaling %s, "
        "%s positions/slots, %s, kv_layout %s, page_size %lld, %s pools, %s q_rot, %s, "
        "check_slots=%d, %d thread(s), seed %llu%s",
        dtype_name(dtype), (long long)head_dim, (long long)num_qo_heads, (long long)num_kv_heads,
        (long long)tokens, (long long)(rotary_dim ? rotary_dim : head_dim),
        interleaved ? "interleaved" : "half-split", rope_type_name(scaling),
        dtype_name(index_dtype), layout_name(layout), kv_layout_name(kv_layout),
        (long long)page_size, fp8_pool ? "float8_e4m3fn" : "q's dtype",
        fp8_q ? "float8_e4m3fn" : "q's dtype", k_rot ? "k_rot" : "no k_rot", int(check_slots),
        threads,
        (unsigned long long)seed, kind_name(kind));
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

/// Runs one case; returns "" when it passes, else what went wrong.
std::string run_case(const VerifyCase& vc) {
  const int64_t T = vc.tokens;
  const int check_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  Rng rng(vc.seed);

  Shape s;
  s.dtype = vc.dtype;
  s.num_tokens = T;
  s.num_qo_heads = vc.num_qo_heads;
  s.num_kv_heads = vc.num_kv_heads;
  s.head_dim = vc.head_dim;
  s.pool_size = 2 * T + 1 + int64_t(rng.below(8));
  s.position_dtype = s.slot_dtype = vc.index_dtype;
  s.rope_base = vc.head_dim == 2 ? 10000.0 : 500000.0;
  s.rotary_dim = vc.rotary_dim;
  s.interleaved = vc.interleaved;
  s.rope_scaling = scaling_preset(vc.scaling, vc.rotary_dim ? vc.rotary_dim : vc.head_dim);
  s.kv_layout = vc.kv_layout;
  s.page_size = vc.page_size;
  if (vc.fp8_pool) {
    s.pool_dtype = DType::Float8E4M3FN;
    s.k_scale = 0.01 + rng.unit();
    s.v_scale = 0.01 + rng.unit();
    s.tensor_scales = rng.chance(0.5);
  }
  if (vc.fp8_q) {
    s.q_out_dtype = DType::Float8E4M3FN;
    s.q_scale = 0.01 + rng.unit();
  }
  Layout layout;
  if (vc.layout == VerifyLayout::FusedQkv) layout.qkv = QkvLayout::Fused;
  if (vc.layout == VerifyLayout::StackedPool) layout.pool = PoolLayout::LayerOfStack;
  if (vc.layout == VerifyLayout::VllmCache) layout.pool = PoolLayout::CombinedVllm;
  if (vc.layout == VerifyLayout::FlashInferCache) layout.pool = PoolLayout::CombinedFlashInfer;
  Case c(s, layout);
  // Everything poisoned, random q/k/v, distinct slots with about a quarter negative.
  c.randomize(rng, 0.25);
  if (!vc.k_rot) c.tensors.k_out = TensorView{};  // its buffer must stay as it is
  for (int64_t t = 0; t < T; ++t) c.set_position(t, pick_position(rng));

  const int64_t P = c.shape.pool_size;  // whole pages with kv_layout
  int64_t bad_token = -1;
  if (vc.kind == Kind::SlotOutOfRange) {
    bad_token = int64_t(rng.below(uint64_t(T)));
    c.set_slot(bad_token, P + int64_t(rng.below(3)));
  } else if (vc.kind == Kind::DuplicateChecked || vc.kind == Kind::DuplicateUnchecked) {
    // two distinct tokens share a non-negative slot
    const int64_t a = int64_t(rng.below(uint64_t(T)));
    int64_t b = int64_t(rng.below(uint64_t(T - 1)));
    if (b >= a) ++b;
    c.set_slot(a, int64_t(rng.below(uint64_t(P))));
    c.set_slot(b, c.slot(a));
  }
  CallOptions options;
  options.check_slots = vc.check_slots;

  set_cpu_num_threads(vc.threads);
  const bool expect_error = vc.kind == Kind::SlotOutOfRange || vc.kind == Kind::DuplicateChecked;
  const Snapshot before = c.snapshot();
  std::string error;
  try {
    rope_pool_fused(c.tensors, c.params, options);
  } catch (const Error& e) {
    error = e.what();
  } catch (const std::exception& e) {
    return std::string("unexpected exception: ") + e.what();
  }

  if (expect_error) {
    if (error.empty()) return "the call was not rejected";
    if (vc.kind == Kind::SlotOutOfRange &&
        (error.find("slots[" + std::to_string(bad_token) + "]") == std::string::npos ||
         error.find(std::to_string(P)) == std::string::npos))
      return "the rejection does not name token " + std::to_string(bad_token) + " and pool size " +
             std::to_string(P) + ": " + error;
    const std::vector<std::string> changes = changes_since(c, before);
    if (!changes.empty()) return "rejected call wrote something: " + changes.front() + " (" + error + ")";
    return "";
  }
  if (!error.empty()) return "rejected a valid call: " + error;
  // q_rot/k_rot against the float64 reference, pool rows bit for bit, every other byte
  // (inputs, unwritten pool rows, other cache layers, guards) unchanged.
  const std::vector<std::string> problems = check_call(c, before, check_threads);
  if (!problems.empty())
    return problems.front() + (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) +
                                                         " more problems)"
                                                   : "");
  return "";
}

}  // namespace

const char* verify_help() {
  return R"(usage: ropepool verify [options]

A quick randomized self-check of rope_pool_fused on the CPU against the float64 reference:
float32/float16/bfloat16 x head_dim 2, 64, 96, 128, 256 x (num_qo_heads, num_kv_heads)
(1, 1), (4, 2), (32, 8) x T 0, 1, 7, 64, 300; positions near +-2^20, int32 and int64
indices, negative slots, q/k/v as views of a fused qkv buffer, pools as a layer of a
stacked cache or the K/V halves of a vLLM / FlashInfer combined cache, partial rotary_dim,
interleaved pairs and every rope_scaling type on a share of the cases, paged pools
(kv_layout NHD/HND, page sizes 1, 5, 16, 64), float8_e4m3fn pools (float and tensor
scales) and fp8 q_rot (SPEC §6), calls without k_rot (SPEC §4 return_k_rot=False) on a
quarter of the cases, several thread counts. Each case (the test kit's call contract): every
q_rot/k_rot element within the SPEC §1 bound (reference::tolerance), written pool rows
bit-identical to k_rot/v (without k_rot: k rows within that bound; fp8: v bit-exact
e4m3(v / v_scale), k and fp8 q_rot within one e4m3 step of e4m3(exact / scale)), every other
byte of every buffer unchanged. Plus, per dtype: an out-of-range slot and a repeated
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

  std::vector<VerifyCase> cases;
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
          VerifyCase c;
          c.dtype = dt;
          c.head_dim = D;
          c.num_qo_heads = Hq;
          c.num_kv_heads = Hk;
          c.tokens = T;
          c.index_dtype = rng.chance(0.5) ? DType::Int64 : DType::Int32;
          c.layout = VerifyLayout(rng.below(5));
          c.check_slots = rng.chance(0.5);
          // SPEC §6 on a share of the cases: paged pools, fp8 pools, fp8 q_rot
          if (rng.chance(0.5)) {
            c.kv_layout = rng.chance(0.5) ? KvLayout::NHD : KvLayout::HND;
            const int64_t sizes[] = {1, 5, 16, 64};
            c.page_size = sizes[rng.below(4)];
          }
          c.fp8_pool = rng.chance(0.3);
          c.fp8_q = rng.chance(0.2);
          c.k_rot = !rng.chance(0.25);
          // SPEC §4 extras on a share of the cases: partial rotary, GPT-J pairs
          if (D > 2 && rng.chance(0.25)) c.rotary_dim = 2 * rng.integer(1, D / 2 - 1);
          c.interleaved = rng.chance(0.25);
          // and every rope_scaling type (dynamic needs rotary_dim > 2)
          if (D > 2 && c.rotary_dim != 2 && rng.chance(0.25))
            c.scaling = kAllRopeTypes[1 + rng.below(std::size(kAllRopeTypes) - 1)];
          c.threads = next_threads();
          c.seed = rng.bits();
          cases.push_back(c);
        }
  for (DType dt : dtypes)
    for (Kind kind : {Kind::SlotOutOfRange, Kind::DuplicateChecked, Kind::DuplicateUnchecked}) {
      VerifyCase c;
      c.dtype = dt;
      c.head_dim = 128;
      c.num_qo_heads = 4;
      c.num_kv_heads = 2;
      c.tokens = 2 + int64_t(rng.below(40));
      c.index_dtype = rng.chance(0.5) ? DType::Int64 : DType::Int32;
      c.layout = VerifyLayout(rng.below(5));
      c.kind = kind;
      if (rng.chance(0.5)) {
        c.kv_layout = rng.chance(0.5) ? KvLayout::NHD : KvLayout::HND;
        c.page_size = 16;
      }
      c.fp8_pool = rng.chance(0.5);
      c.k_rot = !rng.chance(0.25);
      c.check_slots =
          kind == Kind::DuplicateChecked || (kind == Kind::SlotOutOfRange && rng.chance(0.5));
      c.threads = next_threads();
      c.seed = rng.bits();
      cases.push_back(c);
    }

  const auto t0 = std::chrono::steady_clock::now();
  const bool tty = isatty(fileno(stderr));
  int passed = 0, failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const VerifyCase& c = cases[i];
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
