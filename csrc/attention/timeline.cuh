// A CTA's timeline, for experiments only (perf/tools/timeline.py): compiled in with -DFI_TIMELINE, which the tool
// passes through FI_BACKEND_NVCC_FLAGS (so such modules have an identity of their own); in every other module the
// stamps are nothing. Writer 0 is the compute warps' thread 0, writer 1 the producer's first thread; each stamp is
// (globaltimer ns, clock64 with the tag in its top byte), FI_TIMELINE_EVENTS a writer and CTA.
#pragma once

#ifdef FI_TIMELINE
#define FI_TIMELINE_EVENTS 512
#define FI_TIMELINE_CTAS 1024

namespace fi {
namespace timeline {

__device__ unsigned long long events[FI_TIMELINE_CTAS * 2 * FI_TIMELINE_EVENTS * 2];

__device__ __forceinline__ void stamp(int writer, int& n, int tag) {
  if (n < FI_TIMELINE_EVENTS && blockIdx.x < FI_TIMELINE_CTAS) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    const unsigned long long clk = (unsigned long long)clock64() & ((1ull << 56) - 1);
    unsigned long long* e = events + (((size_t)blockIdx.x * 2 + writer) * FI_TIMELINE_EVENTS + n) * 2;
    e[0] = ns;
    e[1] = clk | ((unsigned long long)tag << 56);
  }
  ++n;
}

}  // namespace timeline
}  // namespace fi

#define FI_TIMELINE_COUNTER(n) int n = 0
#define FI_STAMP(writer, n, tag) ::fi::timeline::stamp(writer, n, tag)
#else
#define FI_TIMELINE_COUNTER(n)
#define FI_STAMP(writer, n, tag) ((void)0)
#endif
