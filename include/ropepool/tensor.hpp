// Strided tensor views: the one currency every front end hands to the op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ropepool {

/// The op computes on Float32/Float16/BFloat16 and indexes with Int32/Int64; the other
/// names exist so that a message can say what was passed ("got float64", not "got other").
enum class DType : uint8_t {
  Float32, Float16, BFloat16, Int32, Int64,
  Float64, Int8, Int16, UInt8, UInt16, UInt32, UInt64, Bool, Complex64, Complex128,
  Float8E4M3FN, Float8E5M2,
  Other  ///< anything else (a message prints "other")
};

/// "float32", "float16", "bfloat16", "int32", "int64", "float64", ... or "other".
const char* dtype_name(DType dtype);
/// Size of one element in bytes (0 for DType::Other).
constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: case DType::Int32: case DType::UInt32: return 4;
    case DType::Float16: case DType::BFloat16: case DType::Int16: case DType::UInt16: return 2;
    case DType::Int64: case DType::Float64: case DType::UInt64: case DType::Complex64: return 8;
    case DType::Int8: case DType::UInt8: case DType::Bool: case DType::Float8E4M3FN:
    case DType::Float8E5M2: return 1;
    case DType::Complex128: return 16;
    case DType::Other: break;
  }
  return 0;
}
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

/// The bytes [lo, hi) from the lowest to one past the highest byte a view addresses
/// (lo == hi for an empty view).
struct ByteSpan {
  int64_t lo = 0, hi = 0;
  bool empty() const { return lo == hi; }
};
inline ByteSpan byte_span(const TensorView& v) {
  int64_t n = 1;
  for (int i = 0; i < v.ndim; ++i) n *= v.shape[i];
  if (v.data == nullptr || n == 0) return {};
  const int64_t es = dtype_size(v.dtype) ? int64_t(dtype_size(v.dtype)) : 1;
  int64_t lo = int64_t(reinterpret_cast<intptr_t>(v.data)), hi = lo + es;
  for (int i = 0; i < v.ndim; ++i) {
    const int64_t extent = v.strides[i] * es * (v.shape[i] - 1);
    (extent < 0 ? lo : hi) += extent;
  }
  return {lo, hi};
}

/// True when two views share at least one byte, decided exactly from data pointers,
/// shapes, strides and element sizes (no memory is read), for views of any rank (4-D paged
/// pools included). Disjoint spans cost a few comparisons; otherwise the cost is bounded by
/// the product of the extents of every dimension but the largest of each view (after
/// merging the dimensions that form contiguous runs) times the smaller of the two largest
/// extents (one or two steps for real layouts: fused QKV columns, a layer of a stacked
/// cache, the K/V halves of vLLM's and FlashInfer's combined caches).
bool views_overlap(const TensorView& a, const TensorView& b);

/// "[2, 8, 128]": how the C++ API prints shapes in messages.
std::string format_shape(const TensorView& t);

}  // namespace ropepool
