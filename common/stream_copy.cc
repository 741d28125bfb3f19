#include "common/stream_copy.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace shard {

// memcpy streams only copies larger than a share of the last-level cache (glibc: 3/4 of it), and
// below that it reads every destination line into the cache before overwriting it, a third
// memory pass. Snapshots and restores copy piece by piece, each below that size: streamed, the
// snapshot's pause went from 1.6-1.9x to 1.0-1.1x a memcpy of the whole snapshot on the 2-core VM
// (AMD EPYC; docs/checkpoints.md, "Benchmark"). Linearly: glibc's own pattern, four pages
// interleaved, ran 3.5x slower there. And with vector loads and stores rather than `rep movsb`,
// which AMD EPYC ran at 0.4x its speed when the destination was 1 to 31 bytes past the source
// modulo a page (common/files.h).
void StreamCopy(char* to, const char* from, size_t bytes) {
#if defined(__SSE2__)
  constexpr size_t kLine = 64;
  const size_t head = std::min(bytes, (kLine - reinterpret_cast<uintptr_t>(to) % kLine) % kLine);
  std::memcpy(to, from, head);
  from += head;
  to += head;
  bytes -= head;
  for (; bytes >= kLine; bytes -= kLine, from += kLine, to += kLine) {
    const __m128i* in = reinterpret_cast<const __m128i*>(from);
    __m128i* stream = reinterpret_cast<__m128i*>(to);
    const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2), d = _mm_loadu_si128(in + 3);
    _mm_stream_si128(stream, a);
    _mm_stream_si128(stream + 1, b);
    _mm_stream_si128(stream + 2, c);
    _mm_stream_si128(stream + 3, d);
  }
  _mm_sfence();  // streamed stores are weakly ordered: another thread may read the copy next
#endif
  std::memcpy(to, from, bytes);
}

}  // namespace shard
