// Attention-state merge (FlashInfer paper, section 2.2): partial results (O, LSE) of attention over
// disjoint KV subsets combine exactly by
//     LSE = log(sum_i e^{s_i}),   O = sum_i e^{s_i - LSE} O_i
// with s_i the natural-log LSE of state i. Template parameter (rendered by fi_backend/kernels):
//     DTYPE  storage type of O: float, __half or __nv_bfloat16 (one module per dtype)
//
// Layouts (element strides; row strides are arguments so row-sliced views work, the rest of a row
// is contiguous):
//   fi_merge_state:  v_* [seq, heads, D],             s_* [seq, heads] float32
//   fi_merge_states: v   [seq, num_states, heads, D], s   [seq, num_states, heads] float32
//                    -> v_out [seq, heads, D], s_out [seq, heads]
// Pointers and row strides of v must be 16-byte aligned (Python checks). D: multiple of 8, <= 512.
//
// A state with LSE = -inf is empty: it contributes nothing and its O is never read (it may hold
// garbage). If every state is empty the result is O = 0, LSE = -inf.
#include "common.h"

namespace {

using DType = {{DTYPE}};
using Vec = fi::Vec16<DType>;
constexpr int kVec = Vec::kSize;  // elements per 16-byte load: 8 (bf16, fp16) or 4 (fp32)
constexpr int kMaxHeadDim = 512;
constexpr int kThreadsPerBlock = 256;

// Thread layout: threadIdx.x = which 16-byte vector of the head (D / kVec lanes),
// threadIdx.y = which (row, head) of the block. One thread loads one vector of each state.
struct RowHead {
  int64_t row;
  int64_t head;
  bool valid;
};

__device__ __forceinline__ RowHead row_head(int64_t seq, int64_t heads) {
  const int64_t rh = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  RowHead r;
  r.valid = rh < seq * heads;
  r.row = rh / heads;
  r.head = rh - r.row * heads;
  return r;
}

__device__ __forceinline__ void store_scaled(DType* out, const float* acc, float scale) {
  Vec v;
#pragma unroll
  for (int k = 0; k < kVec; ++k) v.data[k] = fi::from_float<DType>(acc[k] * scale);
  v.store(out);
}

__global__ void merge_state_kernel(const DType* __restrict__ v_a, const float* __restrict__ s_a,
                                   const DType* __restrict__ v_b, const float* __restrict__ s_b,
                                   DType* __restrict__ v_out, float* __restrict__ s_out, int64_t seq,
                                   int64_t heads, int64_t head_dim, int64_t v_a_rs, int64_t s_a_rs,
                                   int64_t v_b_rs, int64_t s_b_rs, int64_t v_out_rs, int64_t s_out_rs) {
  const RowHead p = row_head(seq, heads);
  if (!p.valid) return;
  const int64_t col = p.head * head_dim + (int64_t)threadIdx.x * kVec;
  const float a = s_a[p.row * s_a_rs + p.head];
  const float b = s_b[p.row * s_b_rs + p.head];
  const float m = fmaxf(a, b);
  DType* out = v_out + p.row * v_out_rs + col;
  float lse;
  float acc[kVec];
  if (m == -INFINITY) {  // both empty
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
    store_scaled(out, acc, 0.f);
    lse = -INFINITY;
  } else if (b == -INFINITY || a == -INFINITY) {  // one side empty: the other side, bit for bit
    Vec v;
    v.load(b == -INFINITY ? v_a + p.row * v_a_rs + col : v_b + p.row * v_b_rs + col);
    v.store(out);
    lse = m;
  } else {
    // Subtract the max so one weight is exactly 1 and nothing overflows.
    const float w_a = expf(a - m), w_b = expf(b - m);
    const float d = w_a + w_b;
    Vec va, vb;
    va.load(v_a + p.row * v_a_rs + col);
    vb.load(v_b + p.row * v_b_rs + col);
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = w_a * fi::to_float(va.data[k]) + w_b * fi::to_float(vb.data[k]);
    store_scaled(out, acc, 1.f / d);
    lse = m + logf(d);
  }
  if (threadIdx.x == 0) s_out[p.row * s_out_rs + p.head] = lse;
}

__global__ void merge_states_kernel(const DType* __restrict__ v, const float* __restrict__ s,
                                    DType* __restrict__ v_out, float* __restrict__ s_out, int64_t seq,
                                    int64_t num_states, int64_t heads, int64_t head_dim, int64_t v_rs,
                                    int64_t s_rs, int64_t v_out_rs, int64_t s_out_rs) {
  const RowHead p = row_head(seq, heads);
  if (!p.valid) return;
  const int64_t col = p.head * head_dim + (int64_t)threadIdx.x * kVec;
  const float* s_row = s + p.row * s_rs + p.head;  // state i at s_row[i * heads]
  const DType* v_row = v + p.row * v_rs + col;     // state i at v_row[i * heads * head_dim]
  const int64_t v_state_stride = heads * head_dim;

  float m = -INFINITY;
  for (int64_t i = 0; i < num_states; ++i) m = fmaxf(m, s_row[i * heads]);

  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
  float lse = -INFINITY, scale = 0.f;
  if (m != -INFINITY) {
    float d = 0.f;
#pragma unroll 4
    for (int64_t i = 0; i < num_states; ++i) {
      const float w = expf(s_row[i * heads] - m);
      if (w == 0.f) continue;  // empty (or negligible) state: its O is not read
      d += w;
      Vec vi;
      vi.load(v_row + i * v_state_stride);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += w * fi::to_float(vi.data[k]);
    }
    scale = 1.f / d;  // d >= 1: the max state has weight exactly 1
    lse = m + logf(d);
  }
  store_scaled(v_out + p.row * v_out_rs + col, acc, scale);
  if (threadIdx.x == 0) s_out[p.row * s_out_rs + p.head] = lse;
}

// Blocks of kThreadsPerBlock threads (at least one (row, head) each): D / kVec lanes x groups.
inline bool launch_shape(int64_t seq, int64_t heads, int64_t head_dim, dim3* grid, dim3* block) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim) return false;
  const int lanes = (int)(head_dim / kVec);
  const int groups = lanes >= kThreadsPerBlock ? 1 : kThreadsPerBlock / lanes;
  const int64_t blocks = (seq * heads + groups - 1) / groups;
  if (blocks > 0x7fffffff) return false;
  *block = dim3(lanes, groups);
  *grid = dim3((unsigned)blocks);
  return true;
}

}  // namespace

FI_EXPORT int fi_merge_state(const void* v_a, const float* s_a, const void* v_b, const float* s_b,
                             void* v_out, float* s_out, int64_t seq, int64_t heads, int64_t head_dim,
                             int64_t v_a_rs, int64_t s_a_rs, int64_t v_b_rs, int64_t s_b_rs,
                             int64_t v_out_rs, int64_t s_out_rs, void* stream) {
  FI_REQUIRE(seq >= 0 && heads >= 0);
  if (seq == 0 || heads == 0) return 0;
  dim3 grid, block;
  FI_REQUIRE(launch_shape(seq, heads, head_dim, &grid, &block));
  FI_LAUNCH(merge_state_kernel, grid, block, 0, stream, (const DType*)v_a, s_a, (const DType*)v_b, s_b,
            (DType*)v_out, s_out, seq, heads, head_dim, v_a_rs, s_a_rs, v_b_rs, s_b_rs, v_out_rs,
            s_out_rs);
}

FI_EXPORT int fi_merge_states(const void* v, const float* s, void* v_out, float* s_out, int64_t seq,
                              int64_t num_states, int64_t heads, int64_t head_dim, int64_t v_rs,
                              int64_t s_rs, int64_t v_out_rs, int64_t s_out_rs, void* stream) {
  FI_REQUIRE(seq >= 0 && heads >= 0 && num_states >= 1);
  if (seq == 0 || heads == 0) return 0;
  dim3 grid, block;
  FI_REQUIRE(launch_shape(seq, heads, head_dim, &grid, &block));
  FI_LAUNCH(merge_states_kernel, grid, block, 0, stream, (const DType*)v, s, (DType*)v_out, s_out, seq,
            num_states, heads, head_dim, v_rs, s_rs, v_out_rs, s_out_rs);
}
