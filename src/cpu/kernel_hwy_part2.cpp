// The CPU kernel's functions for part 2 of its Highway targets (kernel_hwy_targets.h says which).
#define ROPEPOOL_HWY_PART 2
#include "kernel_hwy_targets.h"
