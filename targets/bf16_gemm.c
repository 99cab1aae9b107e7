/* The bf16 GEMM that a CPU library compiled with `--matmul-precision bf16` links in (docs/toolchain.md, "CPU
 * schedules": the bf16 GEMM). Its dense matmuls over bf16 panels call it from their kernels (targets/llvm.py) in
 * place of their own loops, at every row count (prefill and decode, the decode library's static batch 1 too):
 *
 *     y[m, g * 64 + c] = sum_k bf16(x[m, k]) * wp[g, k, c]
 *
 * x fp32 [rows, K], wp the panels' bf16 bits [G, K, 64], y fp32 [rows, G * 64], all compact. Each activation is
 * rounded to bf16 (vcvtneps2bf16: round to nearest even, NaN kept, subnormals to zero), as llama.cpp's bf16 matmul
 * and oneDNN's bf16 math mode do; the products of two bf16 values are exact in fp32 and summed in fp32 by
 * vdpbf16ps (AVX512_BF16), two values of k an instruction, 32 products against 16 of an fp32 FMA. TVM 0.27 cannot
 * emit that instruction (its bf16 legalization widens the operands to fp32; without it its LLVM codegen crashes),
 * so k3compile compiles this file with the system's C compiler when it builds the library and links the object in.
 *
 * Two parallel launches on TVM's own thread pool (TVMBackendParallelLaunch, as TVM's parallel loops use it):
 * the rows of x rounded to bf16 pairs, then the panels split between the threads; a thread interleaves each of its
 * panels' k pairs once (the layout vdpbf16ps reads: two k values per 32-bit lane) and multiplies every row by it, 6
 * rows x 64 columns in 24 registers at a time. Up to STREAM_ROWS rows (a decode step, a short prompt) there is no
 * interleaved copy: each pair is interleaved in registers as the panel streams in (a vpermt2w per 16 pairs), one
 * pass per 6 rows, the later ones finding the panel in L2 (measured: docs/toolchain.md); up to 12 rows the caller's
 * thread rounds them, where a launch would cost more. Returns 0, or -1 with TVM's last error set (memory). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  void *sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv *penv, void *cdata);
extern int TVMBackendParallelLaunch(FTVMParallelLambda flambda, void *cdata, int num_task);
extern void TVMFFIErrorSetRaisedFromCStr(const char *kind, const char *message);

#define PANEL 64 /* columns per panel: targets/llvm.py PANEL */
#define ROWS 6   /* rows per register tile: 6 x 4 accumulators, 4 panel vectors, 1 broadcast of 32 registers */
#define STREAM_ROWS 128 /* up to this many rows no interleaved copy of a panel: each pair interleaved as it streams */

typedef struct {
  const float *x;
  const uint16_t *wp;
  float *y;
  uint32_t *xb; /* [rows, k2]: x's bf16 values, two of k a word (the low half the even k) */
  int64_t rows, k, k2, groups;
  int failed;
} Job;

/* Rows [r0, r1) of x rounded into xb; an odd K's last word has 0 in its high half. */
static int round_rows(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t r0 = job->rows * task / env->num_task, r1 = job->rows * (task + 1) / env->num_task;
  for (int64_t r = r0; r < r1; r++) {
    const float *src = job->x + r * job->k;
    uint16_t *dst = (uint16_t *)(job->xb + r * job->k2);
    int64_t i = 0;
    for (; i + 16 <= job->k; i += 16)
      _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < job->k) {
      __mmask16 m = (__mmask16)((1u << (job->k - i)) - 1);
      _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
    if (job->k & 1)
      dst[job->k] = 0;
  }
  return 0;
}

/* y[row0 .. row0 + R, 64 columns] = xb rows . wv (the interleaved panel), R a constant after inlining. */
static inline __attribute__((always_inline)) void tile(const int R, const uint32_t *xb, int64_t k2,
                                                       const uint32_t *wv, float *y, int64_t ldy) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k2; p++) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wv + p * PANEL);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(wv + p * PANEL + 16);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(wv + p * PANEL + 32);
    __m512bh w3 = (__m512bh)_mm512_loadu_si512(wv + p * PANEL + 48);
    for (int r = 0; r < R; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[r * k2 + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

/* The four vectors of k pair p of a raw panel w ([K, 64] bf16 bits) in the layout vdpbf16ps reads: lane c of
 * vector i holds w[2p, 16i + c] in its low half and w[2p + 1, 16i + c] (0 past an odd K's end) in its high half.
 * One vpermt2w a vector picks the 16 pairs from the two rows' 32 columns. */
static inline __attribute__((always_inline)) void pair_vectors(const uint16_t *w, int64_t p, int64_t k,
                                                              __m512bh v[4]) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const uint16_t *even = w + 2 * p * PANEL;
  for (int h = 0; h < 2; h++) {
    __m512i e = _mm512_loadu_si512(even + 32 * h);
    __m512i o = 2 * p + 1 < k ? _mm512_loadu_si512(even + PANEL + 32 * h) : _mm512_setzero_si512();
    v[2 * h] = (__m512bh)_mm512_permutex2var_epi16(e, lo, o);
    v[2 * h + 1] = (__m512bh)_mm512_permutex2var_epi16(e, hi, o);
  }
}

/* tile() for R <= ROWS rows reading the raw panel w, each pair interleaved in registers as it streams in: a
 * decode step's few rows, for which interleaving the panel into memory first would cost a second pass over it. */
static inline __attribute__((always_inline)) void tile_stream(const int R, const uint32_t *xb, int64_t k2,
                                                              const uint16_t *w, int64_t k, float *y, int64_t ldy) {
  __m512 acc[ROWS][4];
  __m512bh v[4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k2; p++) {
    pair_vectors(w, p, k, v);
    for (int r = 0; r < R; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[r * k2 + p]);
      for (int c = 0; c < 4; c++)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, v[c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

/* Panels [g0, g1) of the job for at most STREAM_ROWS rows: each panel streamed once per ROWS rows (later passes
 * find it in L2), nothing written but y. */
static int panels_streamed(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t g0 = job->groups * task / env->num_task, g1 = job->groups * (task + 1) / env->num_task;
  int64_t ldy = job->groups * PANEL;
  for (int64_t g = g0; g < g1; g++) {
    const uint16_t *w = job->wp + g * job->k * PANEL;
    float *out = job->y + g * PANEL;
    for (int64_t m = 0; m < job->rows; m += ROWS) {
      const uint32_t *xb = job->xb + m * job->k2;
      float *ym = out + m * ldy;
      switch (job->rows - m < ROWS ? job->rows - m : ROWS) {
        case 6: tile_stream(6, xb, job->k2, w, job->k, ym, ldy); break;
        case 5: tile_stream(5, xb, job->k2, w, job->k, ym, ldy); break;
        case 4: tile_stream(4, xb, job->k2, w, job->k, ym, ldy); break;
        case 3: tile_stream(3, xb, job->k2, w, job->k, ym, ldy); break;
        case 2: tile_stream(2, xb, job->k2, w, job->k, ym, ldy); break;
        default: tile_stream(1, xb, job->k2, w, job->k, ym, ldy); break;
      }
    }
  }
  return 0;
}

/* Panels [g0, g1) of the job, each interleaved once into wv: wv[p, c] = wp[g, 2p, c] | wp[g, 2p + 1, c] << 16. */
static int panels(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t g0 = job->groups * task / env->num_task, g1 = job->groups * (task + 1) / env->num_task;
  if (g0 == g1)
    return 0;
  uint32_t *wv = (uint32_t *)aligned_alloc(64, (size_t)job->k2 * PANEL * sizeof(uint32_t));
  if (wv == NULL) {
    job->failed = 1;
    return -1;
  }
  int64_t ldy = job->groups * PANEL;
  for (int64_t g = g0; g < g1; g++) {
    const uint16_t *w = job->wp + g * job->k * PANEL;
    for (int64_t p = 0; p < job->k2; p++) {
      __m512bh v[4];
      pair_vectors(w, p, job->k, v);
      for (int c = 0; c < 4; c++)
        _mm512_storeu_si512(wv + p * PANEL + 16 * c, (__m512i)v[c]);
    }
    float *out = job->y + g * PANEL;
    int64_t m = 0;
    for (; m + ROWS <= job->rows; m += ROWS)
      tile(ROWS, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy);
    switch (job->rows - m) {
      case 5: tile(5, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy); break;
      case 4: tile(4, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy); break;
      case 3: tile(3, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy); break;
      case 2: tile(2, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy); break;
      case 1: tile(1, job->xb + m * job->k2, job->k2, wv, out + m * ldy, ldy); break;
      default: break;
    }
  }
  free(wv);
  return 0;
}

int32_t k3_bf16_gemm(const float *x, const uint16_t *wp, float *y, int64_t rows, int64_t k, int64_t groups) {
  if (rows <= 0 || groups <= 0)
    return 0;
  Job job = {x, wp, y, NULL, rows, k, (k + 1) / 2, groups, 0};
  job.xb = (uint32_t *)aligned_alloc(64, (size_t)((rows * job.k2 * sizeof(uint32_t) + 63) / 64 * 64));
  if (job.xb == NULL) {
    TVMFFIErrorSetRaisedFromCStr("MemoryError", "k3_bf16_gemm: no memory for the rounded activations");
    return -1;
  }
  if (rows <= 2 * ROWS) { /* a decode step's few rows: rounded here, where a launch would cost more */
    TVMParallelGroupEnv one = {NULL, 1};
    round_rows(0, &one, &job);
  } else {
    TVMBackendParallelLaunch(round_rows, &job, 0);
  }
  TVMBackendParallelLaunch(rows <= STREAM_ROWS ? panels_streamed : panels, &job, 0);
  free(job.xb);
  if (job.failed) {
    TVMFFIErrorSetRaisedFromCStr("MemoryError", "k3_bf16_gemm: no memory for a panel's interleaved copy");
    return -1;
  }
  return 0;
}
