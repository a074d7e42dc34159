// kernel_hwy-inl.h (and mla_hwy-inl.h) once per Highway target (foreach_target.h), then for
// the static target. Included by kernel_hwy.cpp, which sees the declarations and dispatches,
// and by kernel_hwy_part0.cpp .. kernel_hwy_part3.cpp, each with ROPEPOOL_HWY_PART set, which
// define the functions of a quarter of the targets: the build compiles the targets in
// parallel instead of one after the other in a single file.
// No include guard: a file includes it once, as its last include.

// The path is relative to include/ (on the include path of every file of the library)
// because foreach_target.h resolves it.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "../src/cpu/kernel_hwy-inl.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "kernel_hwy-inl.h"
