// PTX building blocks of the attention kernels: asynchronous copies, ldmatrix, mma.sync, conversions
// and an integer divider for run-time page sizes. Framework-free; sm_80+ instructions, fp8 conversion
// needs sm_89+ (the modules are built for sm_90a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fi {
namespace ptx {

// threadIdx.x read where it is used: the compiler may not hoist what derives from it out of a loop and
// keep it in registers across the loop body (for code that runs rarely inside a register-bound loop).
__device__ __forceinline__ int thread_index_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (KV is streamed once). valid = false writes 16 zero
// bytes and reads nothing, so padding rows of a tile never hold stale data (0 * NaN would poison P.V).
// The L2 fetches the 128 bytes around the access.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

// cp_async_16's effect by two predicated copies instead of a computed source size: fewer instructions where the
// copy is the loop's work (the CuTe member's gathering producer). src is not read when !valid (still 16-byte
// aligned).
__device__ __forceinline__ void cp_async_16_or_zero(uint32_t dst, const void* src, bool valid) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n"
      "@p cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n"
      "@!p cp.async.cg.shared.global [%0], [%1], 16, 0;\n}\n" ::"r"(dst), "l"(src), "r"((int)valid)
      : "memory");
}

// A KV row's two 16-byte chunks, K's and V's, at byte offset `off` from k_src and v_src (k_src + off, v_src + off),
// both zero-filled where off < 0 (the row is not loaded): the source ignored by predicate (PTX's ignore-src), so a
// copy is one predicated instruction, where a computed source size costs a few integer instructions. The unread
// sources must still be 16-byte aligned.
__device__ __forceinline__ void cp_async_16_kv(uint32_t k_dst, uint32_t v_dst, const void* k_src, const void* v_src,
                                               int64_t off) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 k, v;\nsetp.lt.s64 p, %4, 0;\nadd.s64 k, %2, %4;\nadd.s64 v, %3, %4;\n"
      "cp.async.cg.shared.global.L2::128B [%0], [k], 16, p;\ncp.async.cg.shared.global.L2::128B [%1], [v], 16, p;\n}\n"
      ::"r"(k_dst), "r"(v_dst), "l"(k_src), "l"(v_src), "l"(off) : "memory");
}

// Fetch the line holding `p` into L2 (no register result, nothing waits on it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarriers (shared-memory barriers with phases) for the warp-specialised prefill: a producer's copies
// complete a stage's "full" barrier, the compute warps' arrivals complete its "empty" barrier.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed (counted in the init).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed (a fresh barrier counts its phase -1, parity 1,
// as completed: a producer's first wait on an empty stage passes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The phase of `bar` also waits for `bytes` more transaction bytes (a TMA copy's complete_tx); no arrival.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// TMA: the box at coordinates (c0, c1, c2) of the 3-d tensor map `map` (a __grid_constant__ kernel
// parameter, so its generic address is in parameter space) into shared memory at dst, completing
// transaction bytes on mbarrier `bar` as it lands (sm_90).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Named barrier over `threads` threads (a multiple of 32) of the CTA.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrive at named barrier `id` without waiting (the barrier completes when `threads` have arrived or synced).
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Per-warpgroup register budget (sm_90a; every warp of the warpgroup runs it).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A * B + D, m16n8k16, fp32 accumulators. kBf16 selects bf16 inputs, else fp16.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- packed conversions (element 0 in the low half) ---------------------------------------------

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <bool kBf16>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (kBf16) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  } else {
    __half2 h = *reinterpret_cast<__half2*>(&u);
    return __half22float2(h);
  }
}

// Two fp8 values in the low 16 bits of `x` -> fp16x2 (exact: every e4m3 / e5m2 value is an fp16).
template <bool kE5m2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t x) {
  uint32_t out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  // No fp8 cvt before sm_89 (Ampere): e5m2 is fp16's high byte; e4m3's exponent and mantissa bits land in
  // fp16's at 2^-8 of the value (subnormals included), a multiply by 256 is exact. (e4m3's NaN reads 480.)
  const uint32_t b = (x & 0xFFu) | ((x & 0xFF00u) << 8);  // byte i at bits 16 i
  if constexpr (kE5m2) {
    out = b << 8;
  } else {
    const uint32_t h = ((b & 0x007F007Fu) << 7) | ((b & 0x00800080u) << 8);
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(h), "r"(0x5C005C00u));
  }
#else
  const uint16_t lo = static_cast<uint16_t>(x);
  if constexpr (kE5m2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(out) : "h"(lo));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(lo));
  }
#endif
  return out;
}

// ---- division by a run-time invariant (the page size) --------------------------------------------

// n / d = (umulhi(n, m) + n) >> s for 0 <= n < 2^31 (Granlund-Montgomery); the host fills it.
struct FastDiv {
  uint32_t d, m, s;
};

inline FastDiv make_fastdiv(uint32_t d) {
  FastDiv f{d, 0u, 0u};
  uint32_t s = 0;
  while ((1ull << s) < d) ++s;
  f.s = s;
  f.m = static_cast<uint32_t>(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  return f;
}

__device__ __forceinline__ void divmod(const FastDiv& f, int n, int& q, int& r) {
  q = static_cast<int>((__umulhi(static_cast<uint32_t>(n), f.m) + static_cast<uint32_t>(n)) >> f.s);
  r = n - q * static_cast<int>(f.d);
}

}  // namespace ptx
}  // namespace fi
