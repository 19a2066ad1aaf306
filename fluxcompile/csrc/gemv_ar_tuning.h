// The decode GEMV kernel's tuning (gemv_ar.cu): each setting is a macro holding the product's value, which a lab
// build overrides with an nvcc flag (lab/gemv_lab.py's variants, e.g. `nohint=cur@-DGEMV_WG_HINT=0`); the
// product's build passes none. What each setting measured is in BENCHMARKS.md (decode).
#pragma once

// The wgmma loader's stage-ring depth cap (3 or 4 stages run alike), its k per stage (128 and 512 are no faster
// than 256), and the weight's L2 evict-first hint (on: faster, the weight is read once).
#ifndef GEMV_WG_MAX_STAGES
#define GEMV_WG_MAX_STAGES 8
#endif
#ifndef GEMV_WG_HINT
#define GEMV_WG_HINT 1
#endif
#ifndef GEMV_WG_STAGE_K
#define GEMV_WG_STAGE_K 256
#endif
// GEMV_WG_HALF: on the wgmma loader, units of 32 columns (wgmma's weight rows past them are zeros) where units
// of 64 would leave half the SMs idle (n <= 64 * SMs / 2, e.g. n = 4096 on an H100), so twice the CTAs stream
// the weight (on; 0 keeps 64-column units everywhere).
#ifndef GEMV_WG_HALF
#define GEMV_WG_HALF 1
#endif
// GEMV_WG_MIN_M: the smallest m on the wgmma loader (at m <= 16 with one m16 of A; 17: only m > 16).
#ifndef GEMV_WG_MIN_M
#define GEMV_WG_MIN_M 9
#endif
// The CUDA-core loader takes m <= GEMV_ROW_MAX_M; at m > 2 with GEMV_ROW_RW rows per warp and GEMV_ROW_CH
// loads in flight (m = 3: 8 x 4 and 8 x 8 beat the fragment loader, 4 x 4 does not, 16 rows spill; m = 4:
// the fragment loader is faster than either).
#ifndef GEMV_ROW_MAX_M
#define GEMV_ROW_MAX_M 3
#endif
#ifndef GEMV_ROW_RW
#define GEMV_ROW_RW 8
#endif
#ifndef GEMV_ROW_CH
#define GEMV_ROW_CH 4
#endif
