// The CPU kernel's run-time dispatch (HWY_DYNAMIC_DISPATCH): the best target that is both
// compiled and supported by this CPU. The kernel itself is kernel_hwy-inl.h, whose per-target
// functions kernel_hwy_part0.cpp .. kernel_hwy_part3.cpp define; this file sees their
// declarations.
#include "kernel_hwy_targets.h"

#if HWY_ONCE
namespace ropepool::detail::cpu {

HWY_EXPORT(RunBlock);
HWY_EXPORT(SinCosTable);
HWY_EXPORT(DemoteRow);
HWY_EXPORT(PromoteRow);
HWY_EXPORT(QuantizeE4M3Row);
HWY_EXPORT(QuantizeE4M3BF16Row);
HWY_EXPORT(MlaRunTokens);

void quantize_e4m3_row_hwy(const float* in, uint8_t* out, int64_t n, float scale) {
  HWY_DYNAMIC_DISPATCH(QuantizeE4M3Row)(in, out, n, scale);
}

void quantize_e4m3_bf16_row_hwy(const uint16_t* in, uint8_t* out, int64_t n, float scale) {
  HWY_DYNAMIC_DISPATCH(QuantizeE4M3BF16Row)(in, out, n, scale);
}

void run_block_hwy(const CallPlan& plan, const Block& block) {
  HWY_DYNAMIC_DISPATCH(RunBlock)(plan, block);
}

void sincos_table(const double* inv_freq, int64_t n, int64_t pos, float scale, float* cos_out,
                  float* sin_out) {
  HWY_DYNAMIC_DISPATCH(SinCosTable)(inv_freq, n, pos, scale, cos_out, sin_out, nullptr);
}

void demote_row_hwy(DType dtype, const float* in, void* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(DemoteRow)(dtype, in, out, n);
}

void promote_row_hwy(DType dtype, const void* in, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(PromoteRow)(dtype, in, out, n);
}

void mla_run_tokens_hwy(const MlaPlan& plan, int64_t token_begin, int64_t token_end) {
  HWY_DYNAMIC_DISPATCH(MlaRunTokens)(plan, token_begin, token_end);
}

const char* hwy_target_name() {
  // Dispatch picks the best (lowest-bit on x86) target that is both compiled and supported.
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(usable & -usable);
}

}  // namespace ropepool::detail::cpu
#endif  // HWY_ONCE
