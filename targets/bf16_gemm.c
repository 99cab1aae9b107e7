/* The bf16 GEMM that a CPU library compiled with `--matmul-precision bf16` links in (docs/toolchain.md, "CPU
 * schedules": the bf16 GEMM). Its prefill matmuls (HOST_GEMM_ROWS rows or more, bf16 dense panels) call it from
 * their kernels (targets/llvm.py) in place of the host GEMM:
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
 * rows x 64 columns in 24 registers at a time. Returns 0, or -1 with TVM's last error set (memory). */
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
      const uint16_t *even = w + 2 * p * PANEL;
      for (int c = 0; c < PANEL; c += 16) {
        __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + c)));
        __m512i hi = 2 * p + 1 < job->k
                         ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + PANEL + c)))
                         : _mm512_setzero_si512();
        _mm512_storeu_si512(wv + p * PANEL + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
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
  TVMBackendParallelLaunch(round_rows, &job, 0);
  TVMBackendParallelLaunch(panels, &job, 0);
  free(job.xb);
  if (job.failed) {
    TVMFFIErrorSetRaisedFromCStr("MemoryError", "k3_bf16_gemm: no memory for a panel's interleaved copy");
    return -1;
  }
  return 0;
}
