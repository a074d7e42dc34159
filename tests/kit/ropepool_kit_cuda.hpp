// The CUDA part of the test kit (nvcc only): error checking and an owned device buffer,
// for the CUDA test (tests/cuda) and benchmark (bench/cuda).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#define ROPEPOOL_CUDA_OK(call)                                                              \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, cudaGetErrorString(e_));                                       \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

namespace ropepool::test {

/// `bytes` of device memory (at least 16 allocated), freed with the object.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    ROPEPOOL_CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(n, 16)));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* bytes_at(size_t off) const { return static_cast<char*>(ptr) + off; }
};

/// Prints device 0 (name, SMs, L2) as the first line of a test or benchmark log.
inline void print_device() {
  cudaDeviceProp prop{};
  ROPEPOOL_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6);
}

}  // namespace ropepool::test
