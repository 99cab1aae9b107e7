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
 * thread rounds them, where a launch would cost more.
 *
 * Where the CPU has AMX-BF16 (Intel's tile unit: Sapphire Rapids and later) and Linux grants the process its tile
 * state, from AMX_MIN_ROWS rows the panels go through AMX instead (amx_panel): tdpbf16ps computes the same exact
 * products, 16 x 16 x 32 of them an instruction, summed in fp32. Returns 0, or -1 with TVM's last error set
 * (memory).
 *
 * The file also holds the exact build's kernel, k3_f32_gemm (at the end: fp32 activations times the widened bf16
 * panels, the bits of TVM's loops), which every CPU library written to disk on an AVX-512 CPU links in. */
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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
#define AMX_ROWS 32     /* rows per AMX block: two A tiles of 16 rows */
#define AMX_PAIRS 16    /* k pairs per AMX tile step: a tile row of 64 bytes */
#define AMX_BLOCK 128   /* k pairs per pass over a panel's rows: 32 KiB of the interleaved panel, kept in L1 */
#define AMX_MIN_ROWS 4  /* from this many rows the kernel multiplies with AMX where the CPU has it */
#ifndef PREFETCH
#define PREFETCH 8192   /* bytes ahead of the pair being read that pair_vectors asks the memory for */
#endif

typedef struct {
  const float *x;
  const uint16_t *wp;
  float *y;
  uint32_t *xb; /* [rows, ldx]: x's bf16 values, two of k a word (the low half the even k), 0 past k */
  int64_t rows, k, k2, groups;
  int64_t ldx;  /* xb's row stride in words: k2, rounded up to AMX_PAIRS for AMX (which also pads its rows) */
  int amx;      /* the panels go through AMX (panels_amx) */
  int failed;
} Job;

/* Rows [r0, r1) of x rounded into xb; an odd K's last word has 0 in its high half, and the words past it are 0. */
static int round_rows(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t r0 = job->rows * task / env->num_task, r1 = job->rows * (task + 1) / env->num_task;
  for (int64_t r = r0; r < r1; r++) {
    const float *src = job->x + r * job->k;
    uint16_t *dst = (uint16_t *)(job->xb + r * job->ldx);
    int64_t i = 0;
    for (; i + 16 <= job->k; i += 16)
      _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < job->k) {
      __mmask16 m = (__mmask16)((1u << (job->k - i)) - 1);
      _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
    memset(dst + job->k, 0, (size_t)(2 * job->ldx - job->k) * sizeof(uint16_t));
  }
  return 0;
}

/* The four vectors of k pair p of a raw panel w ([K, 64] bf16 bits) in the layout vdpbf16ps reads: lane c of
 * vector i holds w[2p, 16i + c] in its low half and w[2p + 1, 16i + c] (0 past an odd K's end) in its high half.
 * One vpermt2w a vector picks the 16 pairs from the two rows' 32 columns. The four cache lines PREFETCH bytes
 * ahead are asked for as it goes: the weights stream from memory, and the hardware's prefetch alone left a 1-row
 * decode matmul at ~2/3 of the read bandwidth (docs/toolchain.md). */
static inline __attribute__((always_inline)) void pair_vectors(const uint16_t *w, int64_t p, int64_t k,
                                                              __m512bh v[4]) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const uint16_t *even = w + 2 * p * PANEL;
  for (int line = 0; line < 4; line++) /* a prefetch past the matrix's end is dropped, never a fault */
    _mm_prefetch((const char *)even + PREFETCH + 64 * line, _MM_HINT_T0);
  for (int h = 0; h < 2; h++) {
    __m512i e = _mm512_loadu_si512(even + 32 * h);
    __m512i o = 2 * p + 1 < k ? _mm512_loadu_si512(even + PANEL + 32 * h) : _mm512_setzero_si512();
    v[2 * h] = (__m512bh)_mm512_permutex2var_epi16(e, lo, o);
    v[2 * h + 1] = (__m512bh)_mm512_permutex2var_epi16(e, hi, o);
  }
}

/* Pairs [p0, p1) of the raw panel w interleaved into wv from its first row: wv[p - p0, c] = w[2p, c] |
 * w[2p + 1, c] << 16, zero pairs past k2 (AMX's padding to whole tiles). */
static void interleave(const Job *job, const uint16_t *w, int64_t p0, int64_t p1, uint32_t *wv) {
  for (int64_t p = p0; p < p1; p++) {
    __m512bh v[4];
    if (p < job->k2)
      pair_vectors(w, p, job->k, v);
    else
      v[0] = v[1] = v[2] = v[3] = (__m512bh)_mm512_setzero_si512();
    for (int c = 0; c < 4; c++)
      _mm512_storeu_si512(wv + (p - p0) * PANEL + 16 * c, (__m512i)v[c]);
  }
}

/* y[R rows, 64 columns] = the job's R rows from xb . one panel, R <= ROWS and `stream` constants after inlining.
 * The panel is `wv`, interleaved already (wv[p, c] = w[2p, c] | w[2p + 1, c] << 16), or with `stream` the raw
 * panel `w` ([K, 64] bf16 bits), each pair interleaved in registers as it streams in: a decode step's few rows, for
 * which interleaving the panel into memory first would cost a second pass over it. */
static inline __attribute__((always_inline)) void tile(const int R, const int stream, const Job *job,
                                                       const uint32_t *xb, const uint32_t *wv, const uint16_t *w,
                                                       float *y, int64_t ldy) {
  __m512 acc[ROWS][4];
  __m512bh v[4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < job->k2; p++) {
    if (stream)
      pair_vectors(w, p, job->k, v);
    else
      for (int c = 0; c < 4; c++)
        v[c] = (__m512bh)_mm512_loadu_si512(wv + p * PANEL + 16 * c);
    for (int r = 0; r < R; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[r * job->ldx + p]);
      for (int c = 0; c < 4; c++)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, v[c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

/* One panel's 64 columns of y for every row of the job, ROWS at a time (tile's arguments). */
static inline __attribute__((always_inline)) void panel_rows(const int stream, const Job *job,
                                                             const uint32_t *wv, const uint16_t *w, float *out) {
  int64_t ldy = job->groups * PANEL;
  for (int64_t m = 0; m < job->rows; m += ROWS) {
    const uint32_t *xb = job->xb + m * job->ldx;
    float *ym = out + m * ldy;
    switch (job->rows - m < ROWS ? job->rows - m : ROWS) {
      case 6: tile(6, stream, job, xb, wv, w, ym, ldy); break;
      case 5: tile(5, stream, job, xb, wv, w, ym, ldy); break;
      case 4: tile(4, stream, job, xb, wv, w, ym, ldy); break;
      case 3: tile(3, stream, job, xb, wv, w, ym, ldy); break;
      case 2: tile(2, stream, job, xb, wv, w, ym, ldy); break;
      default: tile(1, stream, job, xb, wv, w, ym, ldy); break;
    }
  }
}

/* Panels [g0, g1) of the job for at most STREAM_ROWS rows: each panel streamed once per ROWS rows (later passes
 * find it in L2), nothing written but y. */
static int panels_streamed(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t g0 = job->groups * task / env->num_task, g1 = job->groups * (task + 1) / env->num_task;
  for (int64_t g = g0; g < g1; g++)
    panel_rows(1, job, NULL, job->wp + g * job->k * PANEL, job->y + g * PANEL);
  return 0;
}

/* AMX (Intel's tile matrix unit, where the CPU has AMX-BF16 and the kernel grants this process its tile state).
 * A tile is 16 rows of 64 bytes; tdpbf16ps multiplies a 16 x 16-pair tile of bf16 pairs (A: rows of x, in xb's
 * layout) by a 16-pair x 16 column tile in the layout vdpbf16ps reads too (B: a slice of the interleaved panel wv)
 * into a 16 x 16 fp32 tile, 512 products per row of C summed in fp32. Tiles 0-3 hold 32 rows x 32 columns of y,
 * 4-5 the two A tiles, 6-7 the two B tiles. */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((aligned(64))) TileConfig;

/* 1 when this process may use AMX: the CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24, 22) and Linux grants
 * the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once a process); 0 else, or when
 * K3_BF16_GEMM_AMX=0 (docs/toolchain.md: to measure or test the AVX-512 path on such a CPU). */
static int amx_usable(void) {
  static int granted; /* 0 not asked yet, 1 granted, -1 refused */
  const char *off = getenv("K3_BF16_GEMM_AMX");
  if (off != NULL && strcmp(off, "0") == 0)
    return 0;
  int state = __atomic_load_n(&granted, __ATOMIC_ACQUIRE);
  if (state == 0) {
    unsigned a, b, c, d;
    state = -1;
#ifdef SYS_arch_prctl
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1) &&
        syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0)
      state = 1;
#endif
    __atomic_store_n(&granted, state, __ATOMIC_RELEASE);
  }
  return state > 0;
}

/* Every tile 16 rows of 64 bytes. A constant in memory: one built on the stack faulted under GCC 12 (-O1: ldtilecfg,
 * unaligned; -O3: the first tile instruction, as if never configured). */
static const TileConfig AMX_CONFIG = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

__attribute__((target("amx-tile"))) static void amx_begin(void) { _tile_loadconfig(&AMX_CONFIG); }

__attribute__((target("amx-tile"))) static void amx_end(void) { _tile_release(); }

/* C tiles 0-1 (with `two`: 0-3) += 16 rows of a (with `two`: 32; xb's layout, from the block's first pair) . `pairs`
 * pairs of 32 columns of the interleaved block b; zeroed first with `zero`, else loaded from c; stored to c
 * (leading dimension ldc floats). */
__attribute__((target("amx-tile,amx-bf16"))) static inline __attribute__((always_inline)) void amx_block(
    const int two, const Job *job, const uint32_t *a, const uint32_t *b, int64_t pairs, int zero, float *c,
    int64_t ldc) {
  if (zero) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c, ldc * 4);
    _tile_loadd(1, c + 16, ldc * 4);
    if (two) {
      _tile_loadd(2, c + 16 * ldc, ldc * 4);
      _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
    }
  }
  for (int64_t p = 0; p < pairs; p += AMX_PAIRS) {
    _tile_loadd(4, a + p, job->ldx * 4);
    _tile_loadd(6, b + p * PANEL, PANEL * 4);
    _tile_loadd(7, b + p * PANEL + 16, PANEL * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * job->ldx + p, job->ldx * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  if (two) {
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
  }
}

/* One panel's 64 columns of y for every row, by AMX. For each AMX_BLOCK pairs of k the block of the raw panel w is
 * interleaved into wv (32 KiB, which stays in L1; zero pairs past k2 up to a whole tile) and every 32-row block of
 * both 32-column halves is multiplied by it, its four C tiles zeroed at the first block, else loaded from where the
 * previous one left them: y, or for a last block of fewer than 32 rows a scratch (`tail`, 32 x 64) whose valid rows
 * go to y at the end (xb holds zero rows up to the block's end). */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_panel(const Job *job, const uint16_t *w, uint32_t *wv,
                                                                    float *tail, float *out) {
  int64_t ldy = job->groups * PANEL, full = job->rows - job->rows % AMX_ROWS;
  for (int64_t p0 = 0; p0 < job->ldx; p0 += AMX_BLOCK) {
    int64_t p1 = p0 + AMX_BLOCK < job->ldx ? p0 + AMX_BLOCK : job->ldx;
    interleave(job, w, p0, p1, wv);
    for (int h = 0; h < PANEL; h += 32) {
      for (int64_t m = 0; m < job->rows; m += AMX_ROWS) {
        const uint32_t *a = job->xb + m * job->ldx + p0;
        float *c = m < full ? out + m * ldy + h : tail + h;
        int64_t ldc = m < full ? ldy : PANEL;
        if (job->rows - m > 16)
          amx_block(1, job, a, wv + h, p1 - p0, p0 == 0, c, ldc);
        else /* a last block of at most 16 rows (a decode step's): one A tile, two C tiles */
          amx_block(0, job, a, wv + h, p1 - p0, p0 == 0, c, ldc);
      }
    }
  }
  for (int64_t r = full; r < job->rows; r++)
    memcpy(out + r * ldy, tail + (r - full) * PANEL, PANEL * sizeof(float));
}

/* Panels [g0, g1) of the job by AMX (job->amx): amx_panel over a block buffer and a tail scratch of the thread's. */
static int panels_amx(int task, TVMParallelGroupEnv *env, void *data) {
  Job *job = (Job *)data;
  int64_t g0 = job->groups * task / env->num_task, g1 = job->groups * (task + 1) / env->num_task;
  if (g0 == g1)
    return 0;
  uint32_t *wv = (uint32_t *)aligned_alloc(64, (AMX_BLOCK + AMX_ROWS) * PANEL * sizeof(uint32_t));
  if (wv == NULL) {
    job->failed = 1;
    return -1;
  }
  amx_begin();
  for (int64_t g = g0; g < g1; g++)
    amx_panel(job, job->wp + g * job->k * PANEL, wv, (float *)(wv + AMX_BLOCK * PANEL), job->y + g * PANEL);
  amx_end();
  free(wv);
  return 0;
}

/* Panels [g0, g1) of the job, each interleaved once into wv: wv[p, c] = wp[g, 2p, c] | wp[g, 2p + 1, c] << 16, then
 * multiplied by every row. */
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
  for (int64_t g = g0; g < g1; g++) {
    interleave(job, job->wp + g * job->k * PANEL, 0, job->k2, wv);
    panel_rows(0, job, wv, NULL, job->y + g * PANEL);
  }
  free(wv);
  return 0;
}

int32_t k3_bf16_gemm(const float *x, const uint16_t *wp, float *y, int64_t rows, int64_t k, int64_t groups) {
  if (rows <= 0 || groups <= 0)
    return 0;
  int64_t k2 = (k + 1) / 2;
  int amx = rows >= AMX_MIN_ROWS && amx_usable();
  Job job = {x, wp, y, NULL, rows, k, k2, groups, amx ? (k2 + AMX_PAIRS - 1) / AMX_PAIRS * AMX_PAIRS : k2, amx, 0};
  int64_t padded = amx ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows; /* AMX reads whole 32-row blocks */
  job.xb = (uint32_t *)aligned_alloc(64, (size_t)((padded * job.ldx * sizeof(uint32_t) + 63) / 64 * 64));
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
  memset(job.xb + rows * job.ldx, 0, (size_t)(padded - rows) * job.ldx * sizeof(uint32_t));
  TVMBackendParallelLaunch(amx ? panels_amx : rows <= STREAM_ROWS ? panels_streamed : panels, &job, 0);
  free(job.xb);
  if (job.failed) {
    TVMFFIErrorSetRaisedFromCStr("MemoryError", "k3_bf16_gemm: no memory for a panel's interleaved copy");
    return -1;
  }
  return 0;
}

/* The exact build's matmul over bf16 panels (`compile` at fp32 precision; docs/toolchain.md, "CPU schedules": the
 * fp32 GEMM): y[m, g * 64 + c] = sum_k x[m, k] * wp[g, k, c], x fp32 as it is, each bf16 weight widened exactly to
 * fp32 (its bits moved to the high half), products and sums in fp32 by FMA, k in order. One 64-byte load holds 32
 * weights: shifting each 32-bit lane left by 16 gives the even columns' fp32 values, masking its high half the odd
 * ones, two instructions for 16 weights; the four accumulators of a row are put back in column order once at the
 * end (vpermt2ps). The panels stream from memory once per ROWS rows with the same prefetch as pair_vectors'. */
static inline __attribute__((always_inline)) void tile_f32(const int R, const float *x, int64_t k,
                                                           const uint16_t *w, float *y, int64_t ldy) {
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[ROWS][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++)
      acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i++) {
    const uint16_t *line = w + i * PANEL;
    _mm_prefetch((const char *)line + PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char *)line + PREFETCH + 64, _MM_HINT_T0);
    __m512i lo = _mm512_loadu_si512(line), hi = _mm512_loadu_si512(line + 32);
    __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), _mm512_castsi512_ps(_mm512_and_si512(lo, high)),
                   _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), _mm512_castsi512_ps(_mm512_and_si512(hi, high))};
    for (int r = 0; r < R; r++) {
      __m512 a = _mm512_set1_ps(x[r * k + i]);
      for (int c = 0; c < 4; c++)
        acc[r][c] = _mm512_fmadd_ps(a, v[c], acc[r][c]);
    }
  }
  /* acc[r][2h] lane l holds column 32h + 2l, acc[r][2h + 1] lane l column 32h + 2l + 1 */
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) {
      _mm512_storeu_ps(y + r * ldy + 32 * h, _mm512_permutex2var_ps(acc[r][2 * h], first, acc[r][2 * h + 1]));
      _mm512_storeu_ps(y + r * ldy + 32 * h + 16, _mm512_permutex2var_ps(acc[r][2 * h], second, acc[r][2 * h + 1]));
    }
}

typedef struct {
  const float *x;
  const uint16_t *wp;
  float *y;
  int64_t rows, k, groups;
} F32Job;

/* Panels [g0, g1) of an fp32 job: every row of y's 64 columns, ROWS rows a pass over the panel. */
static int panels_f32(int task, TVMParallelGroupEnv *env, void *data) {
  F32Job *job = (F32Job *)data;
  int64_t g0 = job->groups * task / env->num_task, g1 = job->groups * (task + 1) / env->num_task;
  int64_t ldy = job->groups * PANEL;
  for (int64_t g = g0; g < g1; g++) {
    const uint16_t *w = job->wp + g * job->k * PANEL;
    for (int64_t m = 0; m < job->rows; m += ROWS) {
      const float *xm = job->x + m * job->k;
      float *ym = job->y + m * ldy + g * PANEL;
      switch (job->rows - m < ROWS ? job->rows - m : ROWS) {
        case 6: tile_f32(6, xm, job->k, w, ym, ldy); break;
        case 5: tile_f32(5, xm, job->k, w, ym, ldy); break;
        case 4: tile_f32(4, xm, job->k, w, ym, ldy); break;
        case 3: tile_f32(3, xm, job->k, w, ym, ldy); break;
        case 2: tile_f32(2, xm, job->k, w, ym, ldy); break;
        default: tile_f32(1, xm, job->k, w, ym, ldy); break;
      }
    }
  }
  return 0;
}

int32_t k3_f32_gemm(const float *x, const uint16_t *wp, float *y, int64_t rows, int64_t k, int64_t groups) {
  if (rows <= 0 || groups <= 0)
    return 0;
  F32Job job = {x, wp, y, rows, k, groups};
  TVMBackendParallelLaunch(panels_f32, &job, 0);
  return 0;
}
