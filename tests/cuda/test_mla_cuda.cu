// mla_rope_pool_fused on a GPU (label `gpu`): every buffer of a kit case (tests/kit/
// ropepool_mla_kit.hpp) is mirrored to the device between guard bytes, the op runs there,
// and the results come back into the host buffers for the kit's whole-contract check
// (every element against the float64 reference, cache rows bit for bit or by the fp8 rule,
// every other byte unchanged); the device guards are checked too. Every case runs again
// without k_pe_rot (an empty k_out), which must leave every buffer but k_out's as the call
// with it did. Also: both kernel paths
// (16-byte units and the scalar fallback), the launch shapes (the launcher's CTAs for small
// calls and beyond, and every shape of 1 to 4 warps per CTA forced on small and large calls;
// the inv_freq blocks of rope_dim <= 64 and beyond), repeated slots
// under each guard (one token, the scan with the last writer checked, the row locks), and a
// bad slot that is never written and is reported by cuda_check_slot_errors.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ropepool/cuda.hpp"
#include "ropepool_kit_cuda.hpp"
#include "ropepool_mla_kit.hpp"
#include "test_hooks.hpp"

namespace ropepool::test {
namespace {

constexpr size_t kGuard = 4096;
constexpr unsigned char kGuardByte = 0xa5;

int failures = 0;

void fail(const std::string& what, const std::string& problem) {
  if (++failures <= 20) std::printf("FAIL %s: %s\n", what.c_str(), problem.c_str());
}

// Device copies of a case's buffers, and the case's tensors re-pointed at them.
struct Mirror {
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  const MlaCase& c;

  explicit Mirror(const MlaCase& mc) : c(mc) {
    for (const auto& b : c.buffers()) {
      device.push_back(std::make_unique<DeviceBuffer>(b->bytes() + 2 * kGuard));
      ROPEPOOL_CUDA_OK(cudaMemset(device.back()->ptr, kGuardByte, b->bytes() + 2 * kGuard));
      ROPEPOOL_CUDA_OK(cudaMemcpy(device.back()->bytes_at(kGuard), b->data(), b->bytes(),
                                  cudaMemcpyHostToDevice));
    }
  }
  TensorView on_device(TensorView v) const {
    if (v.data == nullptr) return v;
    for (size_t i = 0; i < c.buffers().size(); ++i) {
      const HostBuffer& b = *c.buffers()[i];
      const auto* p = static_cast<const char*>(v.data);
      const auto* base = static_cast<const char*>(b.data());
      if (p >= base && p <= base + b.bytes()) {
        v.data = device[i]->bytes_at(kGuard + size_t(p - base));
        v.device = {DeviceType::CUDA, 0};
        return v;
      }
    }
    std::printf("view outside every buffer\n");
    std::exit(2);
  }
  MlaTensors tensors() const {
    MlaTensors t = c.tensors;
    for (TensorView* v : {&t.q_pe, &t.k_pe, &t.kv_c, &t.positions, &t.slots, &t.kv_cache,
                          &t.q_out, &t.k_out, &t.kv_scale})
      *v = on_device(*v);
    return t;
  }
  // Results back into the host buffers; the device guards must be untouched.
  void copy_back(const std::string& what) const {
    ROPEPOOL_CUDA_OK(cudaDeviceSynchronize());
    for (size_t i = 0; i < c.buffers().size(); ++i) {
      const HostBuffer& b = *c.buffers()[i];
      std::vector<unsigned char> all(b.bytes() + 2 * kGuard);
      ROPEPOOL_CUDA_OK(cudaMemcpy(all.data(), device[i]->ptr, all.size(), cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < kGuard; ++j)
        if (all[j] != kGuardByte || all[kGuard + b.bytes() + j] != kGuardByte) {
          fail(what, "a device guard byte of " + b.name() + " changed");
          break;
        }
      std::memcpy(b.data(), all.data() + kGuard, b.bytes());
    }
  }
};

// Repeated slots (SPEC §3): the first `dup_tokens` tokens name slot 3, and beyond them every
// seventh token slot 5 and every eleventh slot 6 (so the writers of one row are spread over
// the call, the last of them far from the first). Whatever the kernel's guard (none at T = 1,
// the scan up to 256 tokens, the row locks beyond), each row must be one token's row.
void repeat_slots(MlaCase& c, int64_t T, int dup_tokens) {
  if (dup_tokens <= 0) return;
  for (int64_t t = 0; t < T; ++t)
    if (t < dup_tokens)
      c.set_slot(t, 3);
    else if (t % 7 == 2)
      c.set_slot(t, 5);
    else if (t % 11 == 4)
      c.set_slot(t, 6);
}

// With the scan (T <= 256 tokens) the last token that names a row writes it, as on the CPU:
// the row of each repeated slot must be exactly the last such token's kv_c and k_pe_rot (token
// caches in q's dtype, where the row is bit for bit the inputs and k_out).
void check_last_writer(const MlaCase& c, const std::string& what) {
  const MlaShape& s = c.shape;
  if (s.num_tokens < 2 || s.num_tokens > 256 || s.cache_dtype != s.dtype || s.page_size != 0)
    return;
  const size_t es = dtype_size(s.dtype);
  for (int64_t slot : {3, 5, 6}) {
    int64_t last = -1;
    for (int64_t t = 0; t < s.num_tokens; ++t)
      if (index_at(c.tensors.slots, t) == slot) last = t;
    if (last < 0) continue;
    const auto* row = static_cast<const unsigned char*>(element(c.tensors.kv_cache, slot, 0, 0));
    const TensorView& k = c.tensors.k_out;
    const bool same =
        std::memcmp(row, element(c.tensors.kv_c, last, 0, 0), size_t(s.latent_dim) * es) == 0 &&
        std::memcmp(row + s.latent_dim * es,
                    k.ndim == 3 ? element(k, last, 0, 0) : element(k, last, 0),
                    size_t(s.rope_dim) * es) == 0;
    if (!same)
      fail(what, "kv_cache row " + std::to_string(slot) + " is not the last writer's (token " +
                     std::to_string(last) + ")");
  }
}

// SPEC §8 return_k_rot=False on the device, after the call with k_pe_rot that left `c` as it
// is (`before`: the buffers before that call): the kit's check, with the call made on device
// copies; every buffer but k_out's must be as the first call left it, where that call is
// deterministic (the row locks of repeated slots beyond 256 tokens let either writer win, so
// there only the contract check applies).
void check_without_k_rot(MlaCase& c, const MlaCase::Snapshot& before, bool deterministic,
                         const std::string& what) {
  const auto on_device = [&] {
    Mirror m(c);
    mla_rope_pool_fused(m.tensors(), c.params);
    cuda_check_slot_errors(0);
    m.copy_back(what + " without k_pe_rot");
  };
  for (const std::string& p : c.check_without_k_rot(before, {}, 4, on_device, deterministic))
    fail(what, p);
}

void run_case(Rng& rng, const MlaShape& s, const std::string& what, int dup_tokens = 0) {
  MlaCase c(s);
  c.randomize(rng);
  repeat_slots(c, s.num_tokens, dup_tokens);
  c.poison_outputs(rng);
  const MlaCase::Snapshot before = c.snapshot();
  Mirror m(c);
  try {
    mla_rope_pool_fused(m.tensors(), c.params);
    cuda_check_slot_errors(0);
  } catch (const std::exception& e) {
    fail(what, std::string("threw: ") + e.what());
    return;
  }
  m.copy_back(what);
  for (const std::string& p : c.check(before, 4)) fail(what, p);
  if (dup_tokens > 0) check_last_writer(c, what);
  check_without_k_rot(c, before, dup_tokens == 0 || s.num_tokens <= 256, what);
}

void bad_slot(Rng& rng) {
  MlaShape s;
  s.num_tokens = 9;
  s.pool_size = 32;
  MlaCase c(s);
  c.randomize(rng, 0);
  c.set_slot(6, 32);
  c.poison_outputs(rng);
  const MlaCase::Snapshot before = c.snapshot();
  Mirror m(c);
  mla_rope_pool_fused(m.tensors(), c.params);  // no sync: the kernel skips the row
  std::string message;
  try {
    cuda_check_slot_errors(0);
  } catch (const BackendError& e) {
    message = e.what();
  }
  if (message.find("slots[6] = 32 out of range for a pool of 32 slots") == std::string::npos)
    fail("bad slot", "cuda_check_slot_errors said: '" + message + "'");
  m.copy_back("bad slot");
  for (const std::string& p : c.check(before, 4)) fail("bad slot", p);  // slot 32: no row
  // check_slots: the CPU's message, nothing launched
  MlaCallOptions strict;
  strict.check_slots = true;
  try {
    mla_rope_pool_fused(m.tensors(), c.params, strict);
    fail("check_slots", "nothing thrown");
  } catch (const Error& e) {
    if (std::string(e.what()) != "mla_rope_pool_fused: slots[6] = 32 is out of range for a kv_cache of 32 slots")
      fail("check_slots", e.what());
  }
}

}  // namespace
}  // namespace ropepool::test

int main() {
  using namespace ropepool;
  using namespace ropepool::test;
  print_device();
  Rng rng(fresh_seed());
  std::printf("seed %llu (replay: ROPEPOOL_TEST_SEED)\n", (unsigned long long)rng.seed());
  int cases = 0;
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16})
    for (bool gptj : {true, false})
      for (int64_t page_size : {0, 16})
        for (bool fp8 : {false, true})
          for (int64_t nope : {128, 1})  // 1: q_pe one element off 16 bytes (scalar path)
            for (auto [T, H] : {std::pair<int64_t, int64_t>{1, 128}, {37, 16}, {300, 16}}) {
              MlaShape s;
              s.dtype = dtype;
              s.cache_dtype = fp8 ? DType::Float8E4M3FN : dtype;
              s.interleaved = gptj;
              s.page_size = page_size;
              s.nope_dim = nope;
              s.num_tokens = T;
              s.num_heads = H;
              s.pool_size = 512;
              s.position_dtype = s.slot_dtype = T == 37 ? DType::Int64 : DType::Int32;
              s.kv_scale_tensor = fp8 && page_size;
              if (fp8 && !page_size) s.kv_scale = 0.0625;
              s.rope_scaling = deepseek_v3_yarn();
              const std::string what = std::string(dtype_name(dtype)) + (gptj ? " gptj" : " neox") +
                                       (page_size ? " nhd16" : " token") + (fp8 ? " fp8" : "") +
                                       " nope " + std::to_string(nope) + " T " +
                                       std::to_string(T) + " H " + std::to_string(H);
              run_case(rng, s, what, T == 1 ? 0 : T == 37 ? 3 : 60);
              ++cases;
            }
  // Geometries beyond DeepSeek's: rope_dim with a unit count that is not a power of two (48,
  // 80: idle lanes in a head's lane group), beyond 64 (the kernels with the full inv_freq
  // block; 512: two slots of units per lane and two k rounds), kv_lora_rank that needs several
  // rounds of the kv warp (2048) or is small (96), one and three heads, a page size that is
  // not a power of two (the row's division), and calls large enough for 4-warp CTAs and the
  // row locks (among them few heads at many tokens: 3 and 16 heads, 600 and 700 tokens);
  // float32 and bfloat16, both pair styles, both caches, the vector and scalar paths.
  struct Geometry {
    int64_t R, L, H, T, page_size, nope;
  };
  const Geometry geometries[] = {
      {48, 512, 16, 40, 0, 128},   {80, 96, 3, 300, 5, 0},   {128, 512, 128, 3, 0, 64},
      {512, 2048, 2, 260, 16, 0},  {64, 2048, 1, 1, 0, 128}, {64, 512, 128, 2048, 0, 128},
      {96, 512, 16, 1, 5, 1},      {512, 96, 4, 17, 0, 1},   {64, 512, 3, 600, 0, 0},
      {48, 512, 16, 700, 16, 128},
  };
  for (const Geometry& g : geometries)
    for (DType dtype : {DType::Float32, DType::BFloat16})
      for (bool gptj : {true, false})
        for (bool fp8 : {false, true}) {
          if (g.T >= 2048 && (dtype != DType::BFloat16 || fp8))
            continue;  // one large call each style
          MlaShape s;
          s.dtype = dtype;
          s.cache_dtype = fp8 ? DType::Float8E4M3FN : dtype;
          s.interleaved = gptj;
          s.rope_dim = g.R;
          s.latent_dim = g.L;
          s.num_heads = g.H;
          s.num_tokens = g.T;
          s.page_size = g.page_size;
          s.nope_dim = g.nope;
          s.pool_size = g.page_size ? 80 * g.page_size : std::max<int64_t>(512, 2 * g.T);
          s.slot_dtype = g.T % 2 ? DType::Int64 : DType::Int32;
          if (fp8) s.kv_scale = 0.375;
          const std::string what = std::string(dtype_name(dtype)) + (gptj ? " gptj" : " neox") +
                                   (fp8 ? " fp8" : "") + " R " + std::to_string(g.R) + " L " +
                                   std::to_string(g.L) + " H " + std::to_string(g.H) + " T " +
                                   std::to_string(g.T) + " page " + std::to_string(g.page_size) +
                                   " nope " + std::to_string(g.nope);
          run_case(rng, s, what, g.T == 1 ? 0 : int(std::min<int64_t>(g.T / 4, 20)));
          ++cases;
        }
  // Every CTA shape forced (detail::cuda_launch::set_mla_warps_per_cta), on DeepSeek-V3's
  // shape at T = 1 (17 warp items at H = 128, 3 at H = 16), 37 tokens at H = 128 (185 items,
  // where the launcher takes one-warp CTAs) and 300 at H = 16 (600 items, beyond that range),
  // both caches, both pair styles, repeated slots under the scan and the locks.
  const auto deepseek = [](int64_t T, int64_t H, bool gptj, bool fp8) {
    // DeepSeek-V3's rotary part in bfloat16, T tokens of H heads, a 512-row cache.
    MlaShape s;
    s.dtype = DType::BFloat16;
    s.cache_dtype = fp8 ? DType::Float8E4M3FN : s.dtype;
    s.interleaved = gptj;
    s.num_tokens = T;
    s.num_heads = H;
    s.pool_size = 512;
    if (fp8) s.kv_scale = 0.0625;
    s.rope_scaling = deepseek_v3_yarn();
    return s;
  };
  for (int warps : {1, 2, 3, 4}) {
    detail::cuda_launch::set_mla_warps_per_cta(warps);
    for (bool gptj : {true, false})
      for (bool fp8 : {false, true})
        for (auto [T, H] : {std::pair<int64_t, int64_t>{1, 128}, {1, 16}, {37, 128}, {300, 16}}) {
          MlaShape s = deepseek(T, H, gptj, fp8);
          s.page_size = T == 37 ? 16 : 0;
          const std::string what = "forced " + std::to_string(warps) + " warps per CTA, bfloat16" +
                                   (gptj ? " gptj" : " neox") + (fp8 ? " fp8" : "") + " T " +
                                   std::to_string(T) + " H " + std::to_string(H);
          run_case(rng, s, what, T == 1 ? 0 : T == 37 ? 3 : 60);
          ++cases;
        }
  }
  // Every q-unit count forced (set_mla_q_units_per_lane) with one-warp and 4-warp CTAs, on
  // small calls where the launcher takes 2 units per lane (T = 8 and 16 at H = 128, T = 64 at
  // H = 16) or 8 (T = 32 at H = 128): q items of 4 to 32 heads, a partial last item at 16 heads.
  for (int units : {1, 2, 4, 8})
    for (int warps : {1, 4}) {
      detail::cuda_launch::set_mla_q_units_per_lane(units);
      detail::cuda_launch::set_mla_warps_per_cta(warps);
      for (bool gptj : {true, false})
        for (bool fp8 : {false, true})
          for (auto [T, H] : {std::pair<int64_t, int64_t>{8, 128}, {16, 128}, {32, 128}, {64, 16}}) {
            const MlaShape s = deepseek(T, H, gptj, fp8);
            const std::string what = "forced " + std::to_string(units) + " q units per lane, " +
                                     std::to_string(warps) + " warps per CTA, bfloat16" +
                                     (gptj ? " gptj" : " neox") + (fp8 ? " fp8" : "") + " T " +
                                     std::to_string(T) + " H " + std::to_string(H);
            run_case(rng, s, what, 3);
            ++cases;
          }
    }
  detail::cuda_launch::set_mla_q_units_per_lane(0);
  detail::cuda_launch::set_mla_warps_per_cta(0);
  MlaShape inplace;
  inplace.inplace = true;
  inplace.k_pe_3d = true;
  run_case(rng, inplace, "in place");
  bad_slot(rng);
  std::printf("%d cases, %d failures\n", cases + 2, failures);
  return failures ? 1 : 0;
}
