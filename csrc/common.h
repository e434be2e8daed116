// Shared by every JIT module: the C ABI convention, error reporting, and small device helpers.
//
// Convention (fi_backend/kernels/__init__.py documents the Python side):
//   * A module is one rendered .cu file = one translation unit = one .so, built with plain nvcc and a
//     static cudart, so this header's non-inline definitions (fi_error_string) appear once per .so.
//   * Every launcher is `FI_EXPORT int fi_<name>(..., void* stream)`: raw pointers and integers in,
//     the stream as an opaque handle (torch's cuda_stream), a cudaError_t value out (0 = success).
//   * Modules are built with -fvisibility=hidden and --exclude-libs,ALL: only FI_EXPORT symbols leave
//     the .so, so a module's static cudart never interposes on (or is interposed by) the process's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define FI_EXPORT extern "C" __attribute__((visibility("default")))

// Return the error code of a runtime call from a launcher if it failed.
#define FI_CUDA_TRY(expr)                       \
  do {                                          \
    cudaError_t fi_err_ = (expr);               \
    if (fi_err_ != cudaSuccess) return (int)fi_err_; \
  } while (0)

// Launch a kernel on a stream and return the launch's error code from the launcher. cudaGetLastError
// is legal during stream capture, so launchers stay graph-capturable.
#define FI_LAUNCH(kernel, grid, block, smem, stream, ...)                               \
  do {                                                                                  \
    kernel<<<(grid), (block), (smem), (cudaStream_t)(stream)>>>(__VA_ARGS__);           \
    return (int)cudaGetLastError();                                                     \
  } while (0)

// Arguments a launcher rejects (Python validates first; this is the backstop) come back as
// cudaErrorInvalidValue, whose string is "invalid argument".
#define FI_REQUIRE(cond)                                         \
  do {                                                           \
    if (!(cond)) return (int)cudaErrorInvalidValue;              \
  } while (0)

FI_EXPORT const char* fi_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

namespace fi {

// 16 bytes of T: the unit of every global load/store in memory-bound kernels.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T data[kSize];
  __device__ __forceinline__ void load(const T* ptr) { *reinterpret_cast<uint4*>(data) = *reinterpret_cast<const uint4*>(ptr); }
  __device__ __forceinline__ void store(T* ptr) const { *reinterpret_cast<uint4*>(ptr) = *reinterpret_cast<const uint4*>(data); }
};

// fp32 <-> storage type; all arithmetic happens in fp32.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace fi
