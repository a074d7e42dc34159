// Strided tensor views: the one currency every front end hands to the op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ropepool {

enum class DType : uint8_t { Float32, Float16, BFloat16, Int32, Int64, Other };

/// "float32", "float16", "bfloat16", "int32", "int64" or "other".
const char* dtype_name(DType dtype);
/// Size of one element in bytes (0 for DType::Other).
size_t dtype_size(DType dtype);
inline bool is_float(DType d) {
  return d == DType::Float32 || d == DType::Float16 || d == DType::BFloat16;
}

enum class DeviceType : uint8_t { CPU, CUDA, Other };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};
/// "cpu", "cuda:0", ...
std::string device_name(Device device);

/// A non-owning view of strided memory. Shape and strides are in elements, not bytes.
struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  DType dtype = DType::Other;
  Device device = {};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  /// A row-major (C-contiguous) view of `shape` over `data`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});

  int64_t numel() const;
  int64_t dim(int i) const { return shape[i]; }
  int64_t stride(int i) const { return strides[i]; }
};

/// "[2, 8, 128]": how the C++ API prints shapes in messages.
std::string format_shape(const TensorView& t);

}  // namespace ropepool
