// kernel_hwy-inl.h (and mla_hwy-inl.h) once per Highway target (foreach_target.h), then for
// the static target. Included by kernel_hwy.cpp, which sees the declarations and dispatches,
// and by kernel_hwy_part0.cpp .. kernel_hwy_part3.cpp, each with ROPEPOOL_HWY_PART set, which
// define the functions of their targets: the build compiles the targets in parallel instead
// of one after the other in a single file.
// No include guard: a file includes it once, as its last include.

// Which part defines which targets, so that each is defined exactly once in the library and
// the costly ones go to different files: x86's AVX-512 targets in part 0, AVX2 in 1, SSE4 and
// below in 2, every other target (EMU128 or SCALAR, the static baseline, and those of other
// architectures) in 3. A name this Highway does not define counts as no target. Evaluated in
// each pass (`#if ROPEPOOL_HWY_HERE`), for the HWY_TARGET of that pass; 0 outside the parts.
#define ROPEPOOL_HWY_PART0 (HWY_AVX3_SPR | HWY_AVX3_ZEN4 | HWY_AVX3_DL | HWY_AVX3)
#define ROPEPOOL_HWY_PART1 (HWY_AVX2)
#define ROPEPOOL_HWY_PART2 (HWY_SSE4 | HWY_SSSE3 | HWY_SSE2)
#if !defined(ROPEPOOL_HWY_PART)
#define ROPEPOOL_HWY_HERE 0
#elif ROPEPOOL_HWY_PART == 0
#define ROPEPOOL_HWY_HERE ((HWY_TARGET & ROPEPOOL_HWY_PART0) != 0)
#elif ROPEPOOL_HWY_PART == 1
#define ROPEPOOL_HWY_HERE ((HWY_TARGET & ROPEPOOL_HWY_PART1) != 0)
#elif ROPEPOOL_HWY_PART == 2
#define ROPEPOOL_HWY_HERE ((HWY_TARGET & ROPEPOOL_HWY_PART2) != 0)
#else
#define ROPEPOOL_HWY_HERE ((HWY_TARGET & (ROPEPOOL_HWY_PART0 | ROPEPOOL_HWY_PART1 | ROPEPOOL_HWY_PART2)) == 0)
#endif

// The path is relative to include/ (on the include path of every file of the library)
// because foreach_target.h resolves it.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "../src/cpu/kernel_hwy-inl.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "kernel_hwy-inl.h"
