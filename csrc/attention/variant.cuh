// The variant interface (DESIGN.md, idea 3): what an attention variant sees at each hook of the fixed
// online-softmax loop. A variant is a struct rendered by fi_backend/variants.py:
//
//   struct Variant {
//     static constexpr bool kUseSoftmax;            // false: sum_j p_j v_j with p = LogitsTransform
//     static constexpr bool kHasQueryTransform, kHasKeyTransform, kHasLogitsTransform,
//                           kHasLogitsMask, kHasOutputTransform, kHasKvRange;
//     static constexpr bool kRotaryInterleave;      // how Query/KeyTransform pair dimensions
//     static constexpr bool kMaskIsKvRange;         // logits_mask == kv_pos in kv_range(q_pos, q_pos),
//                                                   // monotone in q_pos (a sliding window)
//     // x0, x1: dimensions (d, d + D/2) (or (2i, 2i + 1) when kRotaryInterleave), i = pair index.
//     static void query_transform(const VariantParams&, float& x0, float& x1, int i, const RotaryCtx&);
//     static void key_transform(const VariantParams&, float& x0, float& x1, int i, const RotaryCtx&);
//     // logits = q.k * sm_scale (* k_scale for fp8 KV), natural units.
//     static float logits_transform(const VariantParams&, float logits, const LogitsCtx&);
//     static bool logits_mask(const VariantParams&, const LogitsCtx&);   // true = attend
//     static float output_transform(const VariantParams&, float o, const OutputCtx&);
//     // Shrinks the KV positions [lo, hi) a query-row range can attend to (tiles outside are skipped).
//     static void kv_range(const VariantParams&, int q_pos_min, int q_pos_max, int& lo, int& hi);
//   };
//
// Every hook is __device__ __forceinline__ static; context fields a hook does not read cost nothing.
#pragma once

#include <stdint.h>

namespace fi {

struct LogitsCtx {
  int request;  // row block (request) of the query
  int q_row;    // row of the query tensor
  int q_idx;    // query index within its request, 0-based
  int q_pos;    // logical position of the query
  int kv_idx;   // KV token index within its request, 0-based
  int kv_pos;   // logical position of the KV token
  int qo_head;
  int kv_head;
  int q_len;    // query rows of the request
  int kv_len;   // KV tokens of the request
  // kv_pos - q_pos as a float (exact below 2^24): the kernels add the element's constant column offset
  // to a row's value, where (float)(kv_pos - q_pos) would be an int-to-float conversion per element on
  // the pipe the softmax's exponentials use.
  float rel_pos;
  // rel_pos = rel_row + rel_col: rel_row the same for a row's elements in this call site, rel_col a
  // compile-time constant in the prefill kernel (the element's column in its step). A hook linear in
  // rel_pos can then take one multiply-add an element: fmaf(a, rel_col, logits + a * rel_row), the second
  // term once a row (ALiBi: three FP instructions an element to two).
  float rel_row;
  float rel_col;
};

// Position of the vector being transformed: the query's position for QueryTransform, the KV token's
// for KeyTransform. head is the query head or the KV head respectively.
struct RotaryCtx {
  int pos;
  int head;
  int request;
};

struct OutputCtx {
  int q_row;
  int qo_head;
  int dim;
};

// Rotary embedding of one pair by angle pos * inv_freq[i]. rev_freq[i] = inv_freq[i] / (2 pi * scale)
// in float64 (revolutions per position): the fractional revolution is taken in float64, so the angle
// stays accurate to ~1e-6 rad at any position, and the sine/cosine of [-pi, pi] are the fast ones.
__device__ __forceinline__ void rope_rotate(const double* __restrict__ rev_freq, int pos, int i, float& x0,
                                            float& x1) {
  double rev = static_cast<double>(pos) * __ldg(rev_freq + i);
  rev -= rint(rev);
  float s, c;
  __sincosf(static_cast<float>(rev) * 6.28318530717958647692f, &s, &c);
  const float y0 = x0 * c - x1 * s;
  const float y1 = x1 * c + x0 * s;
  x0 = y0;
  x1 = y1;
}

// tanh on the special-function unit (tanh.approx.f32): relative error about 2^-11, below the rounding
// of bf16 / fp16 inputs, and one instruction where tanhf is a dozen; for logit soft-capping.
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Bit `bit` of a little-endian bit-packed boolean mask (numpy.packbits(..., bitorder="little")).
__device__ __forceinline__ bool packed_mask_bit(const uint8_t* __restrict__ bits, int64_t bit) {
  return (__ldg(bits + (bit >> 3)) >> (bit & 7)) & 1;
}

}  // namespace fi
