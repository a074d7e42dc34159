// The MLA part of the test kit (ropepool_mla_kit.hpp).
#include "ropepool_mla_kit.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>

namespace ropepool::test {

RopeScaling deepseek_v3_yarn() {
  RopeScaling s;
  s.type = RopeType::Yarn;
  s.factor = 40;
  s.original_max_position_embeddings = 4096;
  s.beta_fast = 32;
  s.beta_slow = 1;
  s.mscale = 1.0;
  s.mscale_all_dim = 1.0;
  return s;
}

RopeSchedule mla_schedule(const MlaParams& params, int64_t rope_dim) {
  if (params.schedule) return *params.schedule;
  RopePoolParams p;
  p.head_dim = rope_dim;
  p.rope_base = params.rope_base;
  p.rope_scaling = params.rope_scaling;
  p.inv_freq = params.inv_freq;
  p.attention_scaling = params.attention_scaling;
  return make_rope_schedule(p);
}

namespace {

constexpr float kTensorScale = 0.75f;

// A view with the layout of `v` at the same element offset in another buffer.
TensorView moved(const TensorView& v, const HostBuffer& from, const HostBuffer& to) {
  TensorView w = v;
  w.data = static_cast<uint8_t*>(to.data()) +
           (static_cast<const uint8_t*>(v.data) - static_cast<const uint8_t*>(from.data()));
  return w;
}

TensorView as_3d(const TensorView& v) {  // [T, R] -> [T, 1, R]
  if (v.ndim == 3) return v;
  TensorView w = v;
  w.ndim = 3;
  w.shape[2] = v.shape[1], w.strides[2] = v.strides[1];
  w.shape[1] = 1, w.strides[1] = v.shape[1];
  return w;
}

int64_t offset_in(const HostBuffer& b, const void* p) {
  return (static_cast<const uint8_t*>(p) - static_cast<const uint8_t*>(b.data())) /
         int64_t(dtype_size(b.dtype()));
}

// e4m3 codes a and b are the same or neighbours on the number line.
bool within_one_e4m3_step(uint8_t a, uint8_t b) {
  if (a == b) return true;
  auto ordinal = [](uint8_t x) { return (x & 0x80) ? -int(x & 0x7f) : int(x & 0x7f); };
  return std::abs(ordinal(a) - ordinal(b)) <= 1;
}

}  // namespace

MlaCase::MlaCase(const MlaShape& s) : shape(s) {
  const int64_t T = s.num_tokens, H = s.num_heads, R = s.rope_dim, L = s.latent_dim;
  const int64_t q_row = s.nope_dim + R;
  auto own = [this](const char* name, DType dtype, int64_t numel) {
    buffers_.push_back(std::make_unique<HostBuffer>(name, dtype, std::max<int64_t>(numel, 1)));
    return buffers_.back().get();
  };
  q_ = own("q", s.dtype, T * H * q_row + 5);
  kv_ = own("kv", s.dtype, T * (L + R) + 7);  // [T, L + R]: kv_c | k_pe, one projection output
  pos_ = own("positions", s.position_dtype, 2 * T + 1);  // stride 2
  slots_ = own("slots", s.slot_dtype, T + 1);
  const int64_t row = L + R + s.row_pad;
  const int64_t cache_numel = s.pool_size * row + 9;
  cache_ = own("kv_cache", s.cache_dtype, cache_numel);
  if (!s.inplace) {
    q_out_ = own("q_out", s.dtype, T * H * R + 3);
    k_out_ = own("k_out", s.dtype, T * R + 3);
  }
  scale_ = own("kv_scale", DType::Float32, 1);

  MlaTensors& t = tensors;
  t.q_pe = q_->view({T, H, R}, {H * q_row, q_row, 1}, s.nope_dim);
  t.kv_c = kv_->view({T, L}, {L + R, 1}, 0);
  t.k_pe = s.k_pe_3d ? kv_->view({T, 1, R}, {L + R, R, 1}, L) : kv_->view({T, R}, {L + R, 1}, L);
  t.positions = pos_->view({T}, {2}, 1);
  t.slots = slots_->view({T}, {1}, 0);
  if (s.page_size > 0) {
    const int64_t pages = s.pool_size / s.page_size;
    if (pages * s.page_size != s.pool_size) throw std::logic_error("pool_size % page_size");
    t.kv_cache = cache_->view({pages, s.page_size, L + R}, {s.page_size * row, row, 1}, 0);
    params.kv_layout = MlaCacheLayout::NHD;
  } else {
    t.kv_cache = cache_->view({s.pool_size, L + R}, {row, 1}, 0);
  }
  if (s.inplace) {
    t.q_out = t.q_pe;
    t.k_out = t.k_pe;
  } else {
    t.q_out = q_out_->view({T, H, R}, {H * R, R, 1}, 1);
    t.k_out = s.k_pe_3d ? k_out_->view({T, 1, R}, {R, R, 1}, 1) : k_out_->view({T, R}, {R, 1}, 1);
  }
  if (s.kv_scale_tensor) t.kv_scale = scale_->view({1}, {1}, 0);
  params.rope_base = s.rope_base;
  params.interleaved = s.interleaved;
  params.rope_scaling = s.rope_scaling;
  params.kv_scale = s.kv_scale;
}

float MlaCase::scale_value() const {
  if (shape.kv_scale_tensor) return kTensorScale;
  return shape.kv_scale ? float(*shape.kv_scale) : 1.0f;
}

void MlaCase::randomize(Rng& rng, double negative_fraction) {
  for (auto& b : buffers_) b->poison(rng);
  const int64_t T = shape.num_tokens;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < shape.num_heads; ++h)
      for (int64_t d = 0; d < shape.rope_dim; ++d)
        store(tensors.q_pe, t, h, d, random_value(rng, shape.dtype));
    for (int64_t d = 0; d < shape.latent_dim + shape.rope_dim; ++d)
      store(kv_->view({T, shape.latent_dim + shape.rope_dim},
                      {shape.latent_dim + shape.rope_dim, 1}, 0),
            t, d, 0, random_value(rng, shape.dtype));
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = t == 0 ? (1 << 20) - 1 : t == 1 ? 0 : rng.integer(0, (1 << 20) - 1);
    set_position(t, p);
  }
  std::vector<int64_t> free(static_cast<size_t>(shape.pool_size));
  for (size_t i = 0; i < free.size(); ++i) free[i] = int64_t(i);
  rng.shuffle(free.begin(), free.end());
  size_t next = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (next >= free.size() || rng.chance(negative_fraction))
      set_slot(t, rng.chance(0.5) ? -1 : (shape.slot_dtype == DType::Int64 ? INT64_MIN : INT32_MIN));
    else
      set_slot(t, free[next++]);
  }
  const float scale = kTensorScale;
  std::memcpy(scale_->data(), &scale, 4);
}

void MlaCase::poison_outputs(Rng& rng) {
  if (q_out_) q_out_->poison(rng);
  if (k_out_) k_out_->poison(rng);
}

MlaCase::Snapshot MlaCase::snapshot() const {
  Snapshot s;
  for (auto& b : buffers_) s.bytes.push_back(b->snapshot());
  return s;
}

std::vector<std::string> MlaCase::changes_since(const Snapshot& before) const {
  std::vector<std::string> out;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const auto changed = buffers_[i]->changed_elements(before.bytes[i], 1);
    if (!changed.empty())
      out.push_back("buffer " + buffers_[i]->name() + " changed at " +
                    (changed[0] < 0 ? std::string("a guard byte")
                                    : "element " + std::to_string(changed[0])));
  }
  return out;
}

std::vector<std::string> MlaCase::check(const Snapshot& before, int threads) const {
  std::vector<std::string> problems;
  const MlaShape& s = shape;
  const int64_t T = s.num_tokens, R = s.rope_dim, L = s.latent_dim;
  const RopeSchedule schedule = mla_schedule(params, R);

  // The inputs as they were before the call (in place, the call overwrote them).
  HostBuffer q_in("q (before)", q_->dtype(), q_->numel()), kv_in("kv (before)", kv_->dtype(), kv_->numel());
  q_in.restore(before.bytes[0]);
  kv_in.restore(before.bytes[1]);
  const TensorView q_pe = moved(tensors.q_pe, *q_, q_in);
  const TensorView k_pe = as_3d(moved(tensors.k_pe, *kv_, kv_in));
  const TensorView kv_c = moved(tensors.kv_c, *kv_, kv_in);
  // An empty k_out: no k_pe_rot (SPEC §8 return_k_rot=False); the cache rows' k_pe_rot parts
  // are then checked against the float64 rotation below.
  const bool k_rot = tensors.k_out.data != nullptr || tensors.k_out.ndim != 0;
  const TensorView k_out = k_rot ? as_3d(tensors.k_out) : TensorView{};

  RotationCheck how;
  how.threads = threads;
  for (auto [name, x, out] : {std::tuple{"q_pe_rot", q_pe, tensors.q_out}, {"k_pe_rot", k_pe, k_out}}) {
    if (!k_rot && out.ndim == 0) continue;
    const CheckStats st = check_rotation(name, x, out, tensors.positions, schedule, s.interleaved, how);
    for (auto& f : st.first) problems.push_back(f.second);
    if (st.failures > int64_t(st.first.size()))
      problems.push_back(std::string(name) + ": " + std::to_string(st.failures) + " elements out of bound");
  }

  // Which token (of those naming it) each cache row must come from.
  const bool fp8 = s.cache_dtype == DType::Float8E4M3FN;
  const float scale = scale_value();
  std::vector<double> k_exact;
  if (fp8) k_exact = reference::rotate(k_pe, tensors.positions, schedule, s.interleaved);
  std::map<int64_t, std::vector<int64_t>> writers;
  for (int64_t t = 0; t < T; ++t)
    if (index_at(tensors.slots, t) >= 0 && index_at(tensors.slots, t) < s.pool_size)  // CUDA skips the others
      writers[index_at(tensors.slots, t)].push_back(t);
  const TensorView& c = tensors.kv_cache;
  const bool paged = c.ndim == 3;
  auto row_ptr = [&](int64_t slot) {
    return paged ? element(c, slot / s.page_size, slot % s.page_size, 0) : element(c, slot, 0, 0);
  };
  // Without k_pe_rot, the k part of a row in q_pe's dtype is the float64 rotation of the
  // token's k_pe within reference::tolerance (check_rotation on it as a [1, 1, R] view).
  auto rotated_k_part_is = [&](const uint8_t* row, int64_t t) {
    TensorView part = tensors.kv_cache;
    part.data = const_cast<uint8_t*>(row) + L * int64_t(dtype_size(s.cache_dtype));
    part.ndim = 3;
    part.shape[0] = 1, part.shape[1] = 1, part.shape[2] = R;
    part.strides[0] = R, part.strides[1] = R, part.strides[2] = 1;
    return check_rotation("k_pe_rot in the cache", token_slice(k_pe, t, 1), part,
                          token_slice(tensors.positions, t, 1), schedule, s.interleaved, how)
        .ok();
  };
  auto row_matches = [&](int64_t slot, int64_t t, std::string* why) {
    const uint8_t* row = static_cast<const uint8_t*>(row_ptr(slot));
    const size_t es = dtype_size(s.cache_dtype);
    if (!fp8 && !k_rot && !rotated_k_part_is(row, t)) {
      if (why) *why = "its k_pe_rot part is not token " + std::to_string(t) + "'s rotated k_pe";
      return false;
    }
    for (int64_t d = 0; d < L + R; ++d) {
      const uint8_t* got = row + d * es;
      if (!fp8 && !k_rot && d >= L) break;  // checked above
      if (!fp8) {
        const void* want = d < L ? element(kv_c, t, d) : element(k_out, t, 0, d - L);
        if (std::memcmp(got, want, es) != 0) {
          if (why) *why = "element " + std::to_string(d) + " differs from token " + std::to_string(t) + "'s " + (d < L ? "kv_c" : "k_pe_rot");
          return false;
        }
      } else if (d < L) {
        const uint8_t want = float_to_e4m3(float(load(kv_c, t, d, 0)) / scale);
        if (*got != want) {
          if (why) *why = "kv_c element " + std::to_string(d) + " = e4m3 " + std::to_string(*got) + ", expected " + std::to_string(want);
          return false;
        }
      } else {
        const double exact = k_exact[size_t(t * R + (d - L))];
        const uint8_t want = float_to_e4m3(float(exact / scale));
        if (!within_one_e4m3_step(*got, want)) {
          if (why) *why = "k_pe_rot element " + std::to_string(d - L) + " = e4m3 " + std::to_string(*got) + ", expected " + std::to_string(want) + " (one step allowed)";
          return false;
        }
      }
    }
    return true;
  };
  for (auto& [slot, tokens] : writers) {
    bool ok = false;
    std::string why;
    for (int64_t t : tokens) ok = ok || row_matches(slot, t, tokens.size() == 1 ? &why : nullptr);
    if (!ok) problems.push_back("kv_cache row " + std::to_string(slot) + ": " + (why.empty() ? "holds no complete row of its tokens" : why));
  }

  // Every other byte unchanged: what each buffer may receive.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const HostBuffer& b = *buffers_[i];
    std::vector<uint8_t> may(size_t(b.numel()), 0);
    auto allow_rows = [&](const TensorView& v) {  // a 2-D or 3-D view with unit last stride
      if (v.numel() == 0) return;
      const TensorView w = v.ndim == 2 ? as_3d(v) : v;
      for (int64_t a = 0; a < w.shape[0]; ++a)
        for (int64_t h = 0; h < w.shape[1]; ++h) {
          const int64_t o = offset_in(b, element(w, a, h, 0));
          for (int64_t d = 0; d < w.shape[2]; ++d) may[size_t(o + d)] = 1;
        }
    };
    if (b.data() == buffers_[i]->data() && &b == cache_)
      for (auto& [slot, tokens] : writers) {
        const int64_t o = offset_in(b, row_ptr(slot));
        for (int64_t d = 0; d < L + R; ++d) may[size_t(o + d)] = 1;
      }
    if ((&b == q_out_ || (s.inplace && &b == q_))) allow_rows(tensors.q_out);
    if (k_rot && (&b == k_out_ || (s.inplace && &b == kv_))) allow_rows(tensors.k_out);
    int changed = 0;
    for (int64_t e : b.changed_elements(before.bytes[i], size_t(-1))) {
      if (e >= 0 && may[size_t(e)]) continue;
      if (++changed <= 3)
        problems.push_back((e < 0 ? std::string("a guard byte") : "element " + std::to_string(e)) +
                           " of buffer " + b.name() + " changed but the call may not write it");
    }
  }
  return problems;
}

std::vector<std::string> MlaCase::check_without_k_rot(const Snapshot& before,
                                                      const MlaCallOptions& options, int threads,
                                                      const std::function<void()>& run,
                                                      bool same_bits) {
  const Snapshot with = snapshot();
  const TensorView k_out = tensors.k_out;
  const HostBuffer* k_buffer = shape.inplace ? kv_ : k_out_;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i]->restore(before.bytes[i]);
  tensors.k_out = TensorView{};
  std::vector<std::string> problems;
  try {
    if (run)
      run();
    else
      mla_rope_pool_fused(tensors, params, options);
    for (const std::string& p : check(before, threads)) problems.push_back("without k_pe_rot: " + p);
  } catch (const std::exception& e) {
    problems.push_back(std::string("without k_pe_rot: the call threw: ") + e.what());
  }
  tensors.k_out = k_out;
  if (!same_bits) return problems;
  const Snapshot without = snapshot();
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (buffers_[i].get() != k_buffer && with.bytes[i] != without.bytes[i])
      problems.push_back("without k_pe_rot, buffer " + buffers_[i]->name() +
                         " differs from the same call with k_pe_rot");
  return problems;
}

}  // namespace ropepool::test
