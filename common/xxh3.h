// XXH3 for checksums of checkpoint and snapshot bytes. On x86-64 the calls go through xxHash's
// runtime dispatch: the library's plain entry points are built for the SSE2 baseline (8 GB/s on
// this project's VM), the dispatched ones use AVX2 or AVX-512 where the CPU has them (20+ GB/s),
// and both give the same hashes. Include it from .cc files only (xxHash is a private dependency).
// SHARD_XXH3_NO_DISPATCH: the plain entry points (Debian's static libxxhash.a has only those).
#pragma once

#if defined(__x86_64__) && !defined(SHARD_XXH3_NO_DISPATCH)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif
