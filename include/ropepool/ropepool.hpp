// ropepool: fused RoPE + KV-cache pool write. Include this one header.
#pragma once

#include "ropepool/error.hpp"
#include "ropepool/rope_pool.hpp"
#include "ropepool/schedule.hpp"
#include "ropepool/tensor.hpp"

namespace ropepool {
inline constexpr const char* kVersion = "0.1.0";
}
