// The CPU kernel's functions for part 3 of its Highway targets (kernel_hwy_targets.h says which).
#define ROPEPOOL_HWY_PART 3
#include "kernel_hwy_targets.h"
