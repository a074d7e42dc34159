// The CPU kernel's functions for part 0 of its Highway targets (kernel_hwy_targets.h says which).
#define ROPEPOOL_HWY_PART 0
#include "kernel_hwy_targets.h"
