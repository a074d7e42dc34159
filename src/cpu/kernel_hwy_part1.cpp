// The CPU kernel's functions for part 1 of its Highway targets (kernel_hwy_targets.h says which).
#define ROPEPOOL_HWY_PART 1
#include "kernel_hwy_targets.h"
