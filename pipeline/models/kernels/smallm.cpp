// Small-M float32 GEMM for CPU decoding: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = 1..~16 rows.
//
// The weight is packed once into panels of 16 output columns, [ceil(N/16), K, 16], so that one pass
// streams each weight byte from memory exactly once for all M rows: per k, two 8-wide loads of the
// panel and, per row, one broadcast of x[m, k] and two FMAs. Rows are processed in tiles of up to 6
// (12 accumulators); a second tile re-reads the panel from L1/L2, not from memory. Every output
// y[m, n] is one sequential FMA chain over k = 0..K-1, whatever M or the tiling: a row's result is
// bit-identical whether it is computed alone (an autoregressive step) or with others (a verify).
//
// Weights that are exactly representable in fewer bits are streamed in that form and expanded in
// registers to the very same float32 values (linear_exact): bf16 (w = bits << 16), q8 (blocks of 32 along K,
// w = d * q, q int8: GGUF Q8_0) and q4 (w = d * q + m, q in 0..15, two roundings: GGUF Q4_1). Each k's 16
// weights of a panel are expanded in registers and used at once by every row of a tile of up to 6 (fused_rows;
// M rows take the fewest balanced tiles: 8 = 4 + 4), so a 2-6 row verify expands the weights once, as a 1-row
// step does, and pays only for the extra FMAs; every output is the same FMA chain as the float32 kernel's. Calls of
// more than 8 rows (a batched step) expand each group of 32 k once into an L1 buffer that all their row tiles read
// (buffered_panel), the running sums kept between groups: the same values, the same chains.
// Compiled with -ffp-contract=off, so that d * q + m is not fused into one rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;

// fn(begin, end) over rows [0, R): on every thread for calls of kRowsParallel rows or more (a prefill chunk, a large
// batched step), else on the caller's; each row's result is its own either way (the same bits).
constexpr int64_t kRowsParallel = 16;
template <typename F>
inline void row_blocks(int64_t R, const F& fn) {
  if (R < kRowsParallel) {
    fn(int64_t(0), R);
    return;
  }
  at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

// Rows [m0, m0 + MT) of one panel: y[m, n0 .. n0 + ncols) = x[m, 0..K) . panel, one FMA per k in order; with ACC the
// chains continue from y's values (ncols == kPanel: the running sums of earlier k, as buffered_panel keeps them).
template <int MT, bool ACC = false>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
          float* __restrict y, int64_t ldy, int64_t n0, int64_t ncols, int64_t m0) {
  __m256 acc[MT][2];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    const float* start = y + (m0 + i) * ldy + n0;
    acc[i][0] = ACC ? _mm256_loadu_ps(start) : _mm256_setzero_ps();
    acc[i][1] = ACC ? _mm256_loadu_ps(start + 8) : _mm256_setzero_ps();
  }
  const float* xr[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) xr[i] = x + (m0 + i) * ldx;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr[i] + k);
      acc[i][0] = _mm256_fmadd_ps(w0, xb, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, xb, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    float* out = y + (m0 + i) * ldy + n0;
    if (ncols == kPanel) {
      _mm256_storeu_ps(out, acc[i][0]);
      _mm256_storeu_ps(out + 8, acc[i][1]);
    } else {
      alignas(32) float tmp[kPanel];
      _mm256_store_ps(tmp, acc[i][0]);
      _mm256_store_ps(tmp + 8, acc[i][1]);
      for (int64_t j = 0; j < ncols; ++j) out[j] = tmp[j];
    }
  }
}

// tile<MT, ACC> with MT = mt in 1..6 chosen at run time.
template <bool ACC = false>
void tile_rows(int64_t mt, const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy, int64_t n0,
               int64_t ncols, int64_t m0) {
  switch (mt) {
    case 6: tile<6, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
    case 5: tile<5, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
    case 4: tile<4, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
    case 3: tile<3, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
    case 2: tile<2, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
    default: tile<1, ACC>(x, ldx, panel, K, y, ldy, n0, ncols, m0); break;
  }
}

constexpr int64_t kGroup = 32;
enum Format : int64_t { kBF16 = 1, kQ8 = 2, kQ4 = 3 };

// Expands group g of one panel into buf[kGroup][kPanel] float32 (the exact weight values).
inline void expand(int64_t fmt, const uint8_t* __restrict q, const float* __restrict d, const float* __restrict mn,
                   int64_t g, float* __restrict buf) {
  if (fmt == kBF16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(q) + g * kGroup * kPanel;
    for (int64_t k = 0; k < kGroup; ++k) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kPanel));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kPanel + 8));
      _mm256_store_ps(buf + k * kPanel, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)));
      _mm256_store_ps(buf + k * kPanel + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
    }
    return;
  }
  const __m256 d0 = _mm256_loadu_ps(d + g * kPanel), d1 = _mm256_loadu_ps(d + g * kPanel + 8);
  if (fmt == kQ8) {
    const int8_t* src = reinterpret_cast<const int8_t*>(q) + g * kGroup * kPanel;
    for (int64_t k = 0; k < kGroup; ++k) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kPanel));
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
      _mm256_store_ps(buf + k * kPanel, _mm256_mul_ps(d0, q0));
      _mm256_store_ps(buf + k * kPanel + 8, _mm256_mul_ps(d1, q1));
    }
    return;
  }
  // kQ4: per k, 8 bytes; byte j holds column j (low nibble) and column j + 8 (high nibble)
  const __m256 m0 = _mm256_loadu_ps(mn + g * kPanel), m1 = _mm256_loadu_ps(mn + g * kPanel + 8);
  const __m128i low = _mm_set1_epi8(0x0F);
  const uint8_t* src = q + g * kGroup * (kPanel / 2);
  for (int64_t k = 0; k < kGroup; ++k) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k * (kPanel / 2)));
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    _mm256_store_ps(buf + k * kPanel, _mm256_add_ps(_mm256_mul_ps(d0, q0), m0));
    _mm256_store_ps(buf + k * kPanel + 8, _mm256_add_ps(_mm256_mul_ps(d1, q1), m1));
  }
}

// Panel j's 16 weights at (group g, k), expanded in registers to the same float32 values as expand().
template <int FMT>
inline void load_w(const uint8_t* __restrict src, int64_t k, __m256 d0, __m256 d1, __m256 m0, __m256 m1,
                   __m256& w0, __m256& w1) {
  if (FMT == kQ4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k * (kPanel / 2)));
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    w0 = _mm256_add_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))), m0);
    w1 = _mm256_add_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))), m1);
  } else if (FMT == kQ8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kPanel));
    w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
  } else {  // kBF16
    const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src) + k * kPanel;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + 8));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
}

// Bytes of one group of 32 k of one panel, per format.
constexpr int64_t group_bytes(int FMT) { return FMT == kQ4 ? kGroup * kPanel / 2 : FMT == kQ8 ? kGroup * kPanel : kGroup * kPanel * 2; }

// MT rows (MT <= 6) of NP consecutive panels from p0, every weight expanded in registers once per k and used at
// once by every row: y[m0 + i, panel columns] = x[m0 + i] . W, one FMA per k in order from 0 (the same chain as
// the float32 kernel).
template <int FMT, int MT, int NP>
void fused_rows(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t pbytes, int64_t G,
                const float* __restrict x, int64_t ldx, int64_t m0, float* __restrict y, int64_t n) {
  __m256 a[NP][MT][2];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) { a[j][i][0] = _mm256_setzero_ps(); a[j][i][1] = _mm256_setzero_ps(); }
  const float* xr[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) xr[i] = x + (m0 + i) * ldx;
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 d[NP][2], mn[NP][2];
    const uint8_t* src[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const int64_t p = p0 + j;
      if (FMT != kBF16) {
        const float* pd = dp + (p * G + g) * kPanel;
        d[j][0] = _mm256_loadu_ps(pd); d[j][1] = _mm256_loadu_ps(pd + 8);
      } else { d[j][0] = zero; d[j][1] = zero; }
      if (FMT == kQ4) {
        const float* pm = mp + (p * G + g) * kPanel;
        mn[j][0] = _mm256_loadu_ps(pm); mn[j][1] = _mm256_loadu_ps(pm + 8);
      } else { mn[j][0] = zero; mn[j][1] = zero; }
      src[j] = qp + p * pbytes + g * group_bytes(FMT);
    }
    for (int64_t k = 0; k < kGroup; ++k) {
      __m256 xb[MT];
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) xb[i] = _mm256_broadcast_ss(xr[i] + g * kGroup + k);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        __m256 w0, w1;
        load_w<FMT>(src[j], k, d[j][0], d[j][1], mn[j][0], mn[j][1], w0, w1);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          a[j][i][0] = _mm256_fmadd_ps(w0, xb[i], a[j][i][0]);
          a[j][i][1] = _mm256_fmadd_ps(w1, xb[i], a[j][i][1]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * kPanel, ncols = std::min(kPanel, n - n0);
    if (ncols <= 0) break;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      float* out = y + (m0 + i) * n + n0;
      if (ncols == kPanel) {
        _mm256_storeu_ps(out, a[j][i][0]);
        _mm256_storeu_ps(out + 8, a[j][i][1]);
      } else {
        alignas(32) float tmp[kPanel];
        _mm256_store_ps(tmp, a[j][i][0]);
        _mm256_store_ps(tmp + 8, a[j][i][1]);
        for (int64_t c = 0; c < ncols; ++c) out[c] = tmp[c];
      }
    }
  }
}

// Rows [m0, m0 + MT) of panels [p0, p0 + np), np <= NP: NP panels a pass where all exist, else one at a time.
template <int FMT, int MT, int NP>
void fused_unit(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t np, int64_t pbytes,
                int64_t G, const float* x, int64_t ldx, int64_t m0, float* y, int64_t n) {
  if (np == NP) fused_rows<FMT, MT, NP>(qp, dp, mp, p0, pbytes, G, x, ldx, m0, y, n);
  else for (int64_t j = 0; j < np; ++j) fused_rows<FMT, MT, 1>(qp, dp, mp, p0 + j, pbytes, G, x, ldx, m0, y, n);
}

// Rows [m0, m0 + mt) of panels [p0, p0 + np), mt in 1..6 (the tile's MT chosen at run time).
template <int FMT>
void fused_tile(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t np, int64_t pbytes,
                int64_t G, const float* x, int64_t K, int64_t m0, int64_t mt, float* y, int64_t n) {
  switch (mt) {
    case 6: fused_unit<FMT, 6, 1>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
    case 5: fused_unit<FMT, 5, 1>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
    case 4: fused_unit<FMT, 4, 1>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
    case 3: fused_unit<FMT, 3, 1>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
    case 2: fused_unit<FMT, 2, 2>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
    default: fused_unit<FMT, 1, 4>(qp, dp, mp, p0, np, pbytes, G, x, K, m0, y, n); break;
  }
}

// All M rows of panels [p0, p0 + np) in the fewest row tiles of at most kFusedTile rows, balanced (8 rows: 4 + 4;
// 16: 6 + 5 + 5): every tile expands each weight once in registers, so fewer tiles expand less.
constexpr int64_t kFusedTile = 6;
template <int FMT>
void fused_all(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t np, int64_t pbytes,
               int64_t G, const float* x, int64_t M, int64_t K, float* y, int64_t n) {
  if (M <= 0) return;
  const int64_t tiles = (M + kFusedTile - 1) / kFusedTile, base = M / tiles, extra = M % tiles;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = base + (t < extra ? 1 : 0);
    fused_tile<FMT>(qp, dp, mp, p0, np, pbytes, G, x, K, r, mt, y, n);
    r += mt;
  }
}

// All M rows (M <= kMaxBufferedRows) of panel p: each group expanded ONCE into an L1 buffer (expand(), the same
// values as load_w) and used by every row tile of up to 6 rows (balanced), so wide calls expand no more than a
// 1-row step does; each output is still one FMA chain over k = 0..K-1 in order (sums kept in acc between groups).
constexpr int64_t kMaxBufferedRows = 32;
// calls of more rows than this take buffered_panel: on a 2-core AMD EPYC (2026-12-03, 30 layers of SmolLM2's q4 shapes,
// 69 MB) it beat the register-fused tiles from 9 rows (0.78x at 9, 0.62x at 16, 0.46x at 32) and tied at 8
constexpr int64_t kBufferedFrom = 8;
void buffered_panel(int64_t fmt, const uint8_t* qp, const float* dp, const float* mp, int64_t p, int64_t pbytes,
                    int64_t G, const float* x, int64_t M, int64_t K, float* y, int64_t n) {
  alignas(32) float buf[kGroup * kPanel];
  alignas(32) float acc[kMaxBufferedRows * kPanel];
  for (int64_t i = 0; i < M * kPanel; ++i) acc[i] = 0.0f;
  const int64_t tiles = (M + kFusedTile - 1) / kFusedTile, base = M / tiles, extra = M % tiles;
  const uint8_t* q = qp + p * pbytes;
  const float* d = fmt == kBF16 ? nullptr : dp + p * G * kPanel;
  const float* mn = fmt == kQ4 ? mp + p * G * kPanel : nullptr;
  for (int64_t g = 0; g < G; ++g) {
    expand(fmt, q, d, mn, g, buf);
    int64_t r = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t mt = base + (t < extra ? 1 : 0);
      tile_rows<true>(mt, x + g * kGroup, K, buf, kGroup, acc, kPanel, 0, kPanel, r);  // sums continue in acc
      r += mt;
    }
  }
  const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < ncols; ++c) y[i * n + n0 + c] = acc[i * kPanel + c];
}

int64_t panel_bytes(int64_t fmt, int64_t K) {
  return fmt == kBF16 ? K * kPanel * 2 : fmt == kQ8 ? K * kPanel : K * kPanel / 2;
}

#ifdef __AVX512F__
// ---- AVX-512: a 16-column panel is one zmm register, so a tile holds up to 16 rows (16 accumulators) and every
// weight is expanded ONCE per call of up to 16 rows. Each output is the same FMA chain over k = 0..K-1 in order as
// the AVX2 code's (the same expansion d * q (+ m) in two roundings, one fmadd per k), so both builds give the same bits.
template <int FMT>
inline __m512 load_w16(const uint8_t* __restrict src, int64_t k, __m512 d, __m512 m) {
  if (FMT == kQ4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k * (kPanel / 2)));
    const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
    return _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both))), m);
  } else if (FMT == kQ8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kPanel));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
  } else if (FMT == kBF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * kPanel * 2));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  } else {  // float32 panels
    return _mm512_loadu_ps(reinterpret_cast<const float*>(src) + k * kPanel);
  }
}

constexpr int kF32 = 0;  // float32 panels [P, K, 16] (any K)

// A tile's sums a[j][i] (panel p0 + j, row m0 + i) into y [M, n], the columns past n left out.
template <int MT, int NP>
inline void store_tile(const __m512 (&a)[NP][MT], int64_t p0, int64_t m0, float* __restrict y, int64_t n) {
#pragma GCC unroll 16
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * kPanel, ncols = std::min(kPanel, n - n0);
    if (ncols <= 0) break;
    const __mmask16 keep = ncols >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * n + n0, keep, a[j][i]);
  }
}

// MT rows (<= 16) x NP consecutive panels from p0: y[m0 + i, panel columns] = x[m0 + i] . W.
template <int FMT, int MT, int NP>
void tile16(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t pbytes, int64_t K,
            const float* __restrict x, int64_t m0, float* __restrict y, int64_t n) {
  __m512 a[NP][MT];
#pragma GCC unroll 16
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) a[j][i] = _mm512_setzero_ps();
  // x: this tile's rows interleaved, x[k * MT + i] = row m0 + i at k (one pointer, constant offsets)
  const int64_t G = K / kGroup;
  for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
    const int64_t g = k0 / kGroup, kend = std::min(K, k0 + kGroup);
    __m512 d[NP], mn[NP];
    const uint8_t* src[NP];
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) {
      const int64_t p = p0 + j;
      d[j] = (FMT == kQ4 || FMT == kQ8) ? _mm512_loadu_ps(dp + (p * G + g) * kPanel) : _mm512_setzero_ps();
      mn[j] = FMT == kQ4 ? _mm512_loadu_ps(mp + (p * G + g) * kPanel) : _mm512_setzero_ps();
      src[j] = qp + p * pbytes;
      // many short streams (NP panels' weights, scales and offsets): fetch the groups ahead by hand
      constexpr int64_t gb = FMT == kQ4 ? kGroup * kPanel / 2 : FMT == kQ8 ? kGroup * kPanel : FMT == kBF16 ? kGroup * kPanel * 2 : kGroup * kPanel * 4;
      const char* ahead = reinterpret_cast<const char*>(src[j] + (g + 2) * gb);
      for (int64_t b = 0; b < gb; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      if (FMT == kQ4 || FMT == kQ8) _mm_prefetch(reinterpret_cast<const char*>(dp + (p * G + g + 2) * kPanel), _MM_HINT_T0);
      if (FMT == kQ4) _mm_prefetch(reinterpret_cast<const char*>(mp + (p * G + g + 2) * kPanel), _MM_HINT_T0);
    }
    if (FMT == kQ4) {  // two k per 16-byte load: one shift and two masks unpack both (a group has 32 k)
      const __m128i low = _mm_set1_epi8(0x0F);
      for (int64_t k = k0; k < kend; k += 2) {
#pragma GCC unroll 16
        for (int j = 0; j < NP; ++j) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[j] + k * (kPanel / 2)));
          const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(d[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
              _mm_unpacklo_epi64(lo, hi)))), mn[j]);
          const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(d[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
              _mm_unpackhi_epi64(lo, hi)))), mn[j]);
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) a[j][i] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[k * MT + i]), a[j][i]);
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) a[j][i] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[(k + 1) * MT + i]), a[j][i]);
        }
      }
      continue;
    }
    for (int64_t k = k0; k < kend; ++k) {
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) {
        const __m512 w = load_w16<FMT>(src[j], k, d[j], mn[j]);
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) a[j][i] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[k * MT + i]), a[j][i]);
      }
    }
  }
  store_tile<MT, NP>(a, p0, m0, y, n);
}

template <int FMT, int MT, int NP>
void unit16(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t np, int64_t pbytes, int64_t K,
            const float* x, int64_t m0, float* y, int64_t n) {
  if (np == NP) tile16<FMT, MT, NP>(qp, dp, mp, p0, pbytes, K, x, m0, y, n);
  else for (int64_t j = 0; j < np; ++j) tile16<FMT, MT, 1>(qp, dp, mp, p0 + j, pbytes, K, x, m0, y, n);
}

// A tile of mt rows over np (<= kUnit16) panels: more panels side by side for few rows (independent FMA chains).
constexpr int64_t kUnit16 = 4;
template <int FMT>
void rows16(const uint8_t* qp, const float* dp, const float* mp, int64_t p0, int64_t np, int64_t pbytes, int64_t K,
            const float* x, int64_t m0, int64_t mt, float* y, int64_t n) {
#define BP_T(MT, NP) case MT: unit16<FMT, MT, NP>(qp, dp, mp, p0, np, pbytes, K, x, m0, y, n); break;
  switch (mt) {
    BP_T(16, 1) BP_T(15, 1) BP_T(14, 1) BP_T(13, 1) BP_T(12, 1) BP_T(11, 1) BP_T(10, 1) BP_T(9, 1)
    BP_T(8, 2) BP_T(7, 2) BP_T(6, 2) BP_T(5, 2) BP_T(4, 4) BP_T(3, 4) BP_T(2, 4)
    default: unit16<FMT, 1, 4>(qp, dp, mp, p0, np, pbytes, K, x, m0, y, n); break;
  }
#undef BP_T
}
constexpr int64_t kTile16 = 16;

// An M-row call over P panels in the fewest balanced row tiles of at most 16 rows: fn(p0, np, r, mt) for every unit
// of np panels from p0 (the panels one tile pass takes side by side, rows16's NP, so the threads' shares stay even)
// and every tile of mt rows from r, the units shared by the threads.
template <typename F>
void tiles16(int64_t M, int64_t P, const F& fn) {
  const int64_t tiles = (M + kTile16 - 1) / kTile16, base = M / tiles, extra = M % tiles;
  const int64_t first = base + (extra > 0 ? 1 : 0);
  const int64_t unit = first <= 4 ? 4 : first <= 8 ? 2 : 1;
  const int64_t units = (P + unit - 1) / unit;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p0 = u * unit, np = std::min<int64_t>(unit, P - p0);
      int64_t r = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t mt = base + (t < extra ? 1 : 0);
        fn(p0, np, r, mt);
        r += mt;
      }
    }
  });
}
#endif

// y [M, n] = x [M, K] @ W^T for W in fmt (0: float32 panels from pack(); kBF16 / kQ8 / kQ4: the exact forms), P
// panels. The one product of the extension: linear, linear_exact and the native stack call it. An AVX-512 build
// expands each weight once for every call of up to 16 rows (tiles of <= 16 rows, balanced); an AVX2 build uses the
// register-fused tiles of <= 6 rows, or for 9-32 rows one expansion per group into an L1 buffer.
void matmul(int64_t fmt, const uint8_t* qp, const float* dp, const float* mp, int64_t P, int64_t K, const float* xp,
            int64_t M, float* yp, int64_t n) {
  if (M <= 0) return;
  const int64_t pbytes = fmt == 0 ? K * kPanel * 4 : panel_bytes(fmt, K);
#ifdef __AVX512F__
  const int64_t tiles = (M + kTile16 - 1) / kTile16, base = M / tiles, extra = M % tiles;
  // each tile's rows interleaved by k (xt + r * K: x[k * mt + i]), so a tile reads its rows' k-th values side by side
  std::vector<float> interleaved;
  const float* xt = xp;
  if (M > 1) {
    interleaved.resize(M * K);
    int64_t r = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t mt = base + (t < extra ? 1 : 0);
      float* dst = interleaved.data() + r * K;
      for (int64_t i = 0; i < mt; ++i)
        for (int64_t k = 0; k < K; ++k) dst[k * mt + i] = xp[(r + i) * K + k];
      r += mt;
    }
    xt = interleaved.data();
  }
  tiles16(M, P, [&](int64_t p0, int64_t np, int64_t r, int64_t mt) {
    const float* xtile = xt + r * K;
    if (fmt == kQ4) rows16<kQ4>(qp, dp, mp, p0, np, pbytes, K, xtile, r, mt, yp, n);
    else if (fmt == kQ8) rows16<kQ8>(qp, dp, mp, p0, np, pbytes, K, xtile, r, mt, yp, n);
    else if (fmt == kBF16) rows16<kBF16>(qp, dp, mp, p0, np, pbytes, K, xtile, r, mt, yp, n);
    else rows16<kF32>(qp, dp, mp, p0, np, pbytes, K, xtile, r, mt, yp, n);
  });
#else
  if (fmt == 0) {
    const float* pp = reinterpret_cast<const float*>(qp);
    at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = pp + p * K * kPanel;
        const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
        // the fewest balanced row tiles of at most 6 (8 rows: 4 + 4), each reading the panel once
        const int64_t tiles = (M + 5) / 6, base = M / tiles, extra = M % tiles;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t mt = base + (t < extra ? 1 : 0);
          tile_rows(mt, xp, K, panel, K, yp, n, n0, ncols, m);
          m += mt;
        }
      }
    });
    return;
  }
  const int64_t G = K / kGroup;
  if (M > kBufferedFrom && M <= kMaxBufferedRows) {  // several row tiles: expand each group once for all of them
    at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) buffered_panel(fmt, qp, dp, mp, p, pbytes, G, xp, M, K, yp, n);
    });
    return;
  }
  const int64_t units = (P + 3) / 4;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p0 = u * 4, np = std::min<int64_t>(4, P - p0);
      if (fmt == kQ4) fused_all<kQ4>(qp, dp, mp, p0, np, pbytes, G, xp, M, K, yp, n);
      else if (fmt == kQ8) fused_all<kQ8>(qp, dp, mp, p0, np, pbytes, G, xp, M, K, yp, n);
      else fused_all<kBF16>(qp, dp, mp, p0, np, pbytes, G, xp, M, K, yp, n);
    }
  });
#endif
}

}  // namespace

// w [N, K] float32 -> panels [ceil(N/16), K, 16] (zero-padded past N).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack: weight must be float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 (rows contiguous), panels from pack(), n = N -> y [M, N].
torch::Tensor linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear: x must be float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.size(1) == x.size(1), "linear: panels do not match x");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = torch::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  matmul(0, reinterpret_cast<const uint8_t*>(pp), nullptr, nullptr, P, K, xp, M, yp, n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// x [M, K] float32, q: [P, K, 16] uint16 (bf16) | [P, K, 16] int8 (q8) | [P, K, 8] uint8 (q4, two nibbles a
// byte); d, m: [P, K / 32, 16] float32 (q8: d; q4: d and m; unused ones may be empty) -> y [M, n].
torch::Tensor linear_exact(torch::Tensor x, int64_t fmt, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t n,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear_exact: x must be float32 [M, K]");
  TORCH_CHECK(fmt == kBF16 || fmt == kQ8 || fmt == kQ4, "linear_exact: unknown format ", fmt);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = q.size(0);
  TORCH_CHECK(K % kGroup == 0 && q.is_contiguous() && q.size(1) == K, "linear_exact: panels do not match x");
  TORCH_CHECK(q.numel() * q.element_size() == P * panel_bytes(fmt, K), "linear_exact: panel size does not match format");
  if (fmt != kBF16) TORCH_CHECK(d.is_contiguous() && d.numel() == P * (K / kGroup) * kPanel, "linear_exact: bad scales");
  if (fmt == kQ4) TORCH_CHECK(m.is_contiguous() && m.numel() == P * (K / kGroup) * kPanel, "linear_exact: bad minima");
  auto y = torch::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* dp = fmt == kBF16 ? nullptr : d.data_ptr<float>();
  const float* mp = fmt == kQ4 ? m.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  matmul(fmt, qp, dp, mp, P, K, xp, M, yp, n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// The float32 weight [P * 16, K] that linear_exact computes with (the same expansion), for checking a packing.
torch::Tensor unpack_exact(int64_t fmt, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t K) {
  TORCH_CHECK(K % kGroup == 0 && q.is_contiguous(), "unpack_exact: K must be a multiple of 32");
  const int64_t P = q.size(0), G = K / kGroup, pbytes = panel_bytes(fmt, K);
  TORCH_CHECK(q.numel() * q.element_size() == P * pbytes, "unpack_exact: panel size does not match format");
  auto w = torch::empty({P * kPanel, K}, torch::dtype(torch::kFloat32));
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* dp = fmt == kBF16 ? nullptr : d.data_ptr<float>();
  const float* mp = fmt == kQ4 ? m.data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  alignas(32) float buf[kGroup * kPanel];
  for (int64_t p = 0; p < P; ++p)
    for (int64_t g = 0; g < G; ++g) {
      expand(fmt, qp + p * pbytes, dp ? dp + p * G * kPanel : nullptr, mp ? mp + p * G * kPanel : nullptr, g, buf);
      for (int64_t k = 0; k < kGroup; ++k)
        for (int64_t j = 0; j < kPanel; ++j) wp[(p * kPanel + j) * K + g * kGroup + k] = buf[k * kPanel + j];
    }
  return w;
}


// ---------------------------------------------------------------------------------------------------------------
// Causal attention of many requests' query rows over each request's own KV cache, one call for a whole batch.
//
// q [R, Hq, D] float32: the rows of N requests, request i's r_i rows consecutive (rows[i] = r_i); keys[i], values[i]
// [Hkv, C_i, D] float32 or bfloat16, every request's alike (any strides, the last dim contiguous): request i's cache
// buffer, of which the first lengths[i] = L_i positions hold its keys/values with its new rows', so request i's row j
// (position L_i - r_i + j) sees keys 0 .. L_i - r_i + j. With k_new / v_new [R, Hkv, D] float32 (any strides, the last
// dim contiguous) the new rows' keys/values are first written into the buffers at positions L_i - r_i .. L_i - 1 (the
// cache append, in the same call; rounded to nearest even into a bfloat16 cache); without them the buffers already
// hold them. Query head h reads kv head h / (Hq / Hkv). Returns
// [R, Hq * D] (the heads of a row side by side, as the o projection reads them).
//
// Each (row, head) output is a fixed computation of that row's own inputs: every score is one FMA chain over D in
// 8-wide lanes summed in a fixed order, the softmax max and sum run sequentially over the visible keys, and the
// output is one FMA chain per lane over the keys. So a row's result is bit-identical whatever other rows or
// requests share the call (a decoding step alone, a verify, a batched step of many requests).
namespace {

inline float hsum8(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// exp(x) for 8 floats, 1-2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r, times
// 2^n); below -87.3 (where expf is denormal or 0) it returns ~1.2e-38; a NaN stays NaN. Every lane is the same
// computation of its own input, so a score's exponential does not depend on the lanes beside it.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3365447505531f), x);  // NaN in x is returned as is
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// scores[0..n) -> exp(scores - max), in place, 8 at a time (exp8; the last < 8 padded). The max is taken 8 lanes at a
// time (the same value in any order).
inline void softmax_exps(float* __restrict scores, int64_t n) {
  int64_t t = 0;
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(scores + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float m = -INFINITY;
  for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; t < n; ++t) m = std::max(m, scores[t]);
  const __m256 mv = _mm256_set1_ps(m);
  t = 0;
  for (; t + 8 <= n; t += 8) _mm256_storeu_ps(scores + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv)));
  if (t < n) {
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = t + j < n ? scores[t + j] : m;
    _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
    for (int64_t j = 0; t + j < n; ++j) scores[t + j] = tail[j];
  }
}

// softmax_exps, then their sum, added sequentially from t = 0.
inline float softmax_numerators(float* __restrict scores, int64_t n) {
  softmax_exps(scores, n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += scores[i];
  return sum;
}

// 8 / 16 lanes of a key or value row from a float32 cache, or from a bfloat16 one (half the bytes a step reads: at 16
// requests of ~200 tokens a step's attention was bound by reading their float32 caches), widened exactly (a bfloat16
// is a float32's high half), so the arithmetic after the load is the same on either; to_f: one element.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
#ifdef __AVX512F__
// Rows [0, n) of D (a multiple of 16) values s apart, widened into float32 rows of D (a block the paired queries read
// from L1, each value widened once instead of once per pair).
inline void widen_rows(const c10::BFloat16* src, int64_t s, int64_t n, int64_t D, float* dst) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + t * D + d, load16(src + t * s + d));
}
#endif

// Which cache slot a row's t-th visible key sits in: slots 0..ctx-1 in order, then tail[t - ctx] (a draft tree's
// ancestors, root first, then the row itself). A chain or causal row reads tail = nullptr and ctx = n: every key in
// order. A tree row reads the same keys, in the same order, as the causal row of the same path: the same bits.
struct KeySlots {
  int64_t ctx;
  const int64_t* tail;
  inline int64_t operator()(int64_t t) const { return t < ctx ? t : tail[t - ctx]; }
};

// One query row of one head: out[D] = softmax(scale * q . K[0..n)) @ V[0..n).
template <typename KV>
void attend_row(const float* __restrict q, const KV* __restrict k, int64_t ks, const KV* __restrict v,
                int64_t vs, int64_t n, int64_t D, float scale, float* __restrict scores, float* __restrict out,
                KeySlots slot) {
  const int64_t lanes = D / 8 * 8;
  for (int64_t t = 0; t < n; ++t) {
    const KV* kt = k + slot(t) * ks;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < lanes; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kt + d), acc);
    float s = hsum8(acc);
    for (int64_t d = lanes; d < D; ++d) s += q[d] * to_f(kt[d]);
    scores[t] = s * scale;
  }
  const float sum = softmax_numerators(scores, n);
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    const KV* vt = v + slot(t) * vs;
    const __m256 p = _mm256_set1_ps(scores[t]);
    for (int64_t d = 0; d < lanes; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, load8(vt + d), _mm256_loadu_ps(out + d)));
    for (int64_t d = lanes; d < D; ++d) out[d] += scores[t] * to_f(vt[d]);
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// 8 or 16 float lanes a register (the output loops'): each lane's arithmetic is the same at either width. load reads a
// float32 cache's values, or a bfloat16 cache's widened exactly (load8 / load16).
#define BLOCKPILOT_LANES(NAME, VEC, N, P)                                                                   \
  struct NAME {                                                                                             \
    using T = VEC;                                                                                          \
    static constexpr int n = N;                                                                             \
    static T zero() { return P##_setzero_ps(); }                                                            \
    static T load(const float* p) { return P##_loadu_ps(p); }                                               \
    static T load(const c10::BFloat16* p) { return load##N(p); }                                            \
    static T set1(float x) { return P##_set1_ps(x); }                                                       \
    static T fma(T a, T b, T c) { return P##_fmadd_ps(a, b, c); }                                           \
    static void store_scaled(float* p, T x, float s) { P##_storeu_ps(p, P##_mul_ps(x, P##_set1_ps(s))); }   \
  };
BLOCKPILOT_LANES(Lanes8, __m256, 8, _mm256)
#ifdef __AVX512F__
BLOCKPILOT_LANES(Lanes16, __m512, 16, _mm512)
using Wide = Lanes16;
#else
using Wide = Lanes8;
#endif

// One query's output out[D] = (x + sum over keys from .. n - 1 of sj[i] V[slot(i)]) / (sum + those sj[i]): each lane
// one FMA chain over the keys in order and the sum added in the same order beside them (its latency hidden), from a
// running state (x: D floats, nullptr = zeros; sum) over keys 0 .. from - 1. Its values are re-read per query from
// L1/L2, not kept in memory per key (an accumulator loaded and stored per key cost ~3x the dot products: 2026-12-06,
// 2 rows at context 1024).
template <int D, typename KV>
inline void finish_output(const float* x, float sum, const float* sj, int64_t from, int64_t n, const KeySlots& slot,
                          const KV* __restrict v, int64_t vs, float* out) {
  using L = Wide;
  constexpr int W = D / L::n;
  typename L::T o[W];
#pragma GCC unroll 16
  for (int w = 0; w < W; ++w) o[w] = x ? L::load(x + L::n * w) : L::zero();
  for (int64_t i = from; i < n; ++i) {
    const KV* vt = v + slot(i) * vs;
    sum += sj[i];
    const typename L::T p = L::set1(sj[i]);
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) o[w] = L::fma(p, L::load(vt + L::n * w), o[w]);
  }
  const float inv = 1.f / sum;
#pragma GCC unroll 16
  for (int w = 0; w < W; ++w) L::store_scaled(out + L::n * w, o[w], inv);
}

// One query row of one head: out[D] = softmax(scale * q . K[0..n)) @ V[0..n), D = 8 * NV. The same arithmetic as
// attend_row below, with more in flight: four keys' dot products side by side (each its own FMA chain over d) and
// the output kept in registers across the keys (each lane one FMA chain over t): the same bits.
template <int NV, typename KV>
void attend_row_fixed(const float* __restrict q, const KV* __restrict k, int64_t ks, const KV* __restrict v,
                      int64_t vs, int64_t n, float scale, float* __restrict scores, float* __restrict out,
                      KeySlots slot) {
  __m256 qv[NV];
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const KV* k0 = k + slot(t) * ks;
    const KV* k1 = k + slot(t + 1) * ks;
    const KV* k2 = k + slot(t + 2) * ks;
    const KV* k3 = k + slot(t + 3) * ks;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      a0 = _mm256_fmadd_ps(qv[j], load8(k0 + 8 * j), a0);
      a1 = _mm256_fmadd_ps(qv[j], load8(k1 + 8 * j), a1);
      a2 = _mm256_fmadd_ps(qv[j], load8(k2 + 8 * j), a2);
      a3 = _mm256_fmadd_ps(qv[j], load8(k3 + 8 * j), a3);
    }
    // the four sums at once, each in hsum8's order ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(scores + t, _mm_mul_ps(s4, _mm_set1_ps(scale)));
  }
  for (; t < n; ++t) {
    const KV* kt = k + slot(t) * ks;
    __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc = _mm256_fmadd_ps(qv[j], load8(kt + 8 * j), acc);
    scores[t] = hsum8(acc) * scale;
  }
  softmax_exps(scores, n);
  finish_output<8 * NV>(nullptr, 0.f, scores, 0, n, slot, v, vs, out);
}



#ifdef __AVX512F__
// Keys per block of the paired queries' passes: a block's keys (or values) stay in L1 while every pair reads them (a
// pass per pair over the whole context streamed it from L2 once per pair: the values' loads bound the pass).
constexpr int64_t kKeyBlockBytes = 16384;
// Rows of a prompt's chunk that share one pass of its attention (attend_rows): their queries in pairs over the keys
// the block's first row sees, each key block read (and a bfloat16 one widened) once for all of them
constexpr int64_t kChunkRows = 16;

// Two queries' scores over keys [t0, t1) (multiples of 4), side by side in 512-bit registers: the low half query a's
// 8 lanes, the high half b's, each lane the same FMA chain over d as attend_row_fixed's, and each block of four keys'
// sums reduced as attend_queries_fixed reduces them (the shuffle pairs below add exactly what _mm256_hadd_ps adds, in
// each 128-bit lane, and a query's two 128-bit halves are then added low + high): the same bits, with half the FMAs.
template <int NV, typename KV>
inline void pair_scores(const float* qa, const float* qb, const KV* __restrict k, int64_t ks, int64_t t0, int64_t t1,
                        float scale, float* __restrict sa, float* __restrict sb) {
  __m512 qv[NV];
#pragma GCC unroll 16
  for (int u = 0; u < NV; ++u)
    qv[u] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + 8 * u)), _mm256_loadu_ps(qb + 8 * u), 1);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t t = t0; t < t1; t += 4) {
    const KV* k0 = k + t * ks;
    const KV* k1 = k0 + ks;
    const KV* k2 = k1 + ks;
    const KV* k3 = k2 + ks;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) {
      a0 = _mm512_fmadd_ps(qv[u], _mm512_broadcast_f32x8(load8(k0 + 8 * u)), a0);
      a1 = _mm512_fmadd_ps(qv[u], _mm512_broadcast_f32x8(load8(k1 + 8 * u)), a1);
      a2 = _mm512_fmadd_ps(qv[u], _mm512_broadcast_f32x8(load8(k2 + 8 * u)), a2);
      a3 = _mm512_fmadd_ps(qv[u], _mm512_broadcast_f32x8(load8(k3 + 8 * u)), a3);
    }
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_ps(a0, a1, 0x88), _mm512_shuffle_ps(a0, a1, 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_ps(a2, a3, 0x88), _mm512_shuffle_ps(a2, a3, 0xDD));
    const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(h01, h23, 0x88), _mm512_shuffle_ps(h01, h23, 0xDD));
    const __m512 s = _mm512_mul_ps(_mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1))), sv);
    _mm_storeu_ps(sa + t, _mm512_extractf32x4_ps(s, 0));
    _mm_storeu_ps(sb + t, _mm512_extractf32x4_ps(s, 2));
  }
}

// Two queries' outputs over keys [i0, i1) of the context both see (finish_output's arithmetic for each: the same chain
// per lane over the keys, 16 lanes a register, and its sum added in the same order), continued from and back into
// their running outputs xa, xb (D floats each) and sums: a block's values read once for both.
template <int NV, typename KV>
inline void pair_values(const float* sa, const float* sb, const KV* __restrict v, int64_t vs, int64_t i0,
                        int64_t i1, float* xa, float* xb, float& suma, float& sumb) {
  constexpr int W = NV / 2;
  __m512 oa[W], ob[W];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) oa[w] = _mm512_loadu_ps(xa + 16 * w), ob[w] = _mm512_loadu_ps(xb + 16 * w);
  float a = suma, b = sumb;
  for (int64_t i = i0; i < i1; ++i) {
    const KV* vt = v + i * vs;
    a += sa[i];
    b += sb[i];
    const __m512 pa = _mm512_set1_ps(sa[i]), pb = _mm512_set1_ps(sb[i]);
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const __m512 x = load16(vt + 16 * w);
      oa[w] = _mm512_fmadd_ps(pa, x, oa[w]);
      ob[w] = _mm512_fmadd_ps(pb, x, ob[w]);
    }
  }
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) _mm512_storeu_ps(xa + 16 * w, oa[w]), _mm512_storeu_ps(xb + 16 * w, ob[w]);
  suma = a, sumb = b;
}

#endif

// Several query rows over one request's cache and one key/value head (a verify's rows, a draft block's rows, the
// query heads of a GQA group): each query's scores, softmax and output are attend_row_fixed's arithmetic, key by key
// and lane by lane in the same order (the same bits), but the keys all of them see (slots 0..shared-1: the cached
// context) are read once for all of them instead of once per row, so a verify of q rows streams the context's keys
// once, not q times (its values from memory once, then per row from L1/L2). On AVX-512 the queries go in pairs, 16
// lanes a register, over blocks of keys that stay in L1 while every pair reads them (pair_scores, pair_values).
template <int NV, typename KV>
void attend_queries_fixed(const float* const* qs, int64_t nq, const KV* __restrict k, int64_t ks,
                          const KV* __restrict v, int64_t vs, int64_t shared, const int64_t* ns, const KeySlots* slots,
                          float scale, float* __restrict scores, int64_t stride, float* const* outs) {
  const __m256 sv = _mm256_set1_ps(scale);
  const int64_t blocks = shared / 4 * 4;
  int64_t paired = 0;  // queries 0 .. paired - 1 go in pairs
#ifdef __AVX512F__
  paired = nq / 2 * 2;
  const int64_t kb = std::max<int64_t>(4, kKeyBlockBytes / (NV * 32) / 4 * 4);  // keys a block (NV * 32 bytes a key)
  constexpr bool bf16 = std::is_same_v<KV, c10::BFloat16>;
  thread_local std::vector<float> wide;  // a bfloat16 block widened once for two pairs or more (widen_rows)
  const bool widen = bf16 && paired >= 4;
  if (widen) wide.resize(kb * NV * 8);
  for (int64_t t0 = 0; t0 < blocks && paired; t0 += kb) {
    const int64_t t1 = std::min(blocks, t0 + kb);
    if constexpr (bf16) {
      if (widen) {
        widen_rows(k + t0 * ks, ks, t1 - t0, NV * 8, wide.data());
        for (int64_t j = 0; j < paired; j += 2)
          pair_scores<NV>(qs[j], qs[j + 1], wide.data(), NV * 8, 0, t1 - t0, scale, scores + j * stride + t0,
                          scores + (j + 1) * stride + t0);
        continue;
      }
    }
    for (int64_t j = 0; j < paired; j += 2)
      pair_scores<NV>(qs[j], qs[j + 1], k, ks, t0, t1, scale, scores + j * stride, scores + (j + 1) * stride);
  }
#endif
  for (int64_t t = 0; t < blocks && paired < nq; t += 4) {
    const KV* k0 = k + t * ks;
    const KV* k1 = k0 + ks;
    const KV* k2 = k1 + ks;
    const KV* k3 = k2 + ks;
    for (int64_t j = paired; j < nq; ++j) {
      const float* q = qs[j];
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * u);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + 8 * u), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k1 + 8 * u), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k2 + 8 * u), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k3 + 8 * u), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(scores + j * stride + t, _mm_mul_ps(s4, _mm256_castps256_ps128(sv)));
    }
  }
  for (int64_t j = 0; j < nq; ++j) {  // the rest of each query's keys, one at a time (hsum8: the same order)
    const float* q = qs[j];
    for (int64_t u = blocks; u < ns[j]; ++u) {
      const KV* kt = k + slots[j](u) * ks;
      __m256 a = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int w = 0; w < NV; ++w) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * w), load8(kt + 8 * w), a);
      scores[j * stride + u] = hsum8(a) * scale;
    }
  }
  for (int64_t j = 0; j < nq; ++j) softmax_exps(scores + j * stride, ns[j]);
#ifdef __AVX512F__
  if (paired) {
    int64_t common = shared;  // the keys every paired query sees, in slot order 0 .. common - 1
    for (int64_t j = 0; j < paired; ++j) common = std::min(common, ns[j]);
    thread_local std::vector<float> x, sums;  // the pairs' running outputs and sums (no allocation per pass)
    x.assign(paired * NV * 8, 0.f);
    sums.assign(paired, 0.f);
    for (int64_t i0 = 0; i0 < common; i0 += kb) {
      const int64_t i1 = std::min(common, i0 + kb);
      if constexpr (bf16) {
        if (widen) {
          widen_rows(v + i0 * vs, vs, i1 - i0, NV * 8, wide.data());
          for (int64_t j = 0; j < paired; j += 2)
            pair_values<NV>(scores + j * stride + i0, scores + (j + 1) * stride + i0, wide.data(), NV * 8, 0, i1 - i0,
                            x.data() + j * NV * 8, x.data() + (j + 1) * NV * 8, sums[j], sums[j + 1]);
          continue;
        }
      }
      for (int64_t j = 0; j < paired; j += 2)
        pair_values<NV>(scores + j * stride, scores + (j + 1) * stride, v, vs, i0, i1, x.data() + j * NV * 8,
                        x.data() + (j + 1) * NV * 8, sums[j], sums[j + 1]);
    }
    for (int64_t j = 0; j < paired; ++j)
      finish_output<8 * NV>(x.data() + j * NV * 8, sums[j], scores + j * stride, common, ns[j], slots[j], v, vs, outs[j]);
  }
#endif
  for (int64_t j = paired; j < nq; ++j)
    finish_output<8 * NV>(nullptr, 0.f, scores + j * stride, 0, ns[j], slots[j], v, vs, outs[j]);
}

}  // namespace

// One new row's D floats into a cache row: float32 as they are, bfloat16 rounded to nearest even (c10::BFloat16's).
inline void store_row(const float* src, int64_t D, const torch::Tensor& cache, int64_t offset) {
  if (cache.scalar_type() == torch::kBFloat16) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache.data_ptr()) + offset;
    for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d]).x;
  } else {
    std::copy_n(src, D, cache.data_ptr<float>() + offset);
  }
}

// causal = false: every row of request i sees all lengths[i] keys (the drafter's full attention over its context and
// block); the rest is the same computation. parents (empty, or one per row; causal only): a draft tree's rows, each
// row's parent as an index among its request's rows (-1: none, the row after the cached context); such a row sees the
// cached context, its ancestors root first and itself, in that order (the keys the causal row of its path sees).
torch::Tensor attend_rows(torch::Tensor q, c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                          std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> rows,
                          std::vector<int64_t> lengths, double scale, bool causal,
                          const std::vector<int64_t>& parents = {}) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "attend: q must be float32 [R, Hq, D]");
  const int64_t N = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == N && static_cast<int64_t>(values.size()) == N &&
              static_cast<int64_t>(lengths.size()) == N, "attend: one keys, values and length per request");
  q = q.contiguous();
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
  const bool append = k_new.has_value() && k_new->defined();
  std::vector<int64_t> req_of(R), first(N + 1, 0);
  for (int64_t i = 0; i < N; ++i) {
    const auto& k = keys[i];
    const auto& v = values[i];
    TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.scalar_type() == keys[0].scalar_type() &&
                v.scalar_type() == keys[0].scalar_type() &&
                (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16),
                "attend: keys and values must be float32 or bfloat16 [Hkv, L, D], every request's alike");
    TORCH_CHECK(k.size(2) == D && v.size(2) == D && k.stride(2) == 1 && v.stride(2) == 1 && k.size(0) == v.size(0) &&
                k.size(1) == v.size(1) && Hq % k.size(0) == 0, "attend: keys/values do not match q");
    TORCH_CHECK(lengths[i] >= 0 && lengths[i] <= k.size(1), "attend: a length exceeds its keys' capacity");
    TORCH_CHECK(rows[i] >= 0 && rows[i] <= lengths[i], "attend: a request has more query rows than keys");
    first[i + 1] = first[i] + rows[i];
  }
  TORCH_CHECK(first[N] == R, "attend: rows do not add up to q's rows");
  for (int64_t i = 0; i < N; ++i)
    for (int64_t r = first[i]; r < first[i + 1]; ++r) req_of[r] = i;
  // a tree row's visible new rows (slots), root first: path[path0[r] .. path0[r + 1])
  const bool tree = !parents.empty();
  std::vector<int64_t> path, path0(R + 1, 0);
  if (tree) {
    TORCH_CHECK(causal && static_cast<int64_t>(parents.size()) == R, "attend: one parent per row (causal rows only)");
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = req_of[r], base = lengths[i] - rows[i], at = static_cast<int64_t>(path.size());
      for (int64_t a = r - first[i]; a >= 0; a = parents[first[i] + a]) {
        TORCH_CHECK(parents[first[i] + a] < a, "attend: a row's parent must come before it in its request");
        path.push_back(base + a);
      }
      std::reverse(path.begin() + at, path.end());
      path0[r + 1] = static_cast<int64_t>(path.size());
    }
  }
  if (append) {  // request i's new rows' keys/values go to positions lengths[i] - rows[i] .. lengths[i] - 1
    TORCH_CHECK(v_new.has_value() && v_new->defined(), "attend: k_new without v_new");
    const auto& kn = *k_new;
    const auto& vn = *v_new;
    TORCH_CHECK(kn.dim() == 3 && vn.dim() == 3 && kn.size(0) == R && vn.size(0) == R && kn.size(2) == D &&
                vn.size(2) == D && kn.stride(2) == 1 && vn.stride(2) == 1 && kn.scalar_type() == torch::kFloat32 &&
                vn.scalar_type() == torch::kFloat32, "attend: k_new/v_new must be float32 [R, Hkv, D]");
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = req_of[r], pos = lengths[i] - rows[i] + (r - first[i]);
      const auto& k = keys[i];
      const auto& v = values[i];
      TORCH_CHECK(kn.size(1) == k.size(0) && vn.size(1) == v.size(0), "attend: k_new/v_new heads do not match the cache");
      for (int64_t h = 0; h < k.size(0); ++h) {
        store_row(kn.data_ptr<float>() + r * kn.stride(0) + h * kn.stride(1), D, k, h * k.stride(0) + pos * k.stride(1));
        store_row(vn.data_ptr<float>() + r * vn.stride(0) + h * vn.stride(1), D, v, h * v.stride(0) + pos * v.stride(1));
      }
    }
  }
  auto out = torch::empty({R, Hq * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // a bfloat16 cache is read by the same passes, each key and value widened exactly as it is loaded (load8, load16)
  const bool bf16 = N > 0 && keys[0].scalar_type() == torch::kBFloat16;
  const auto head_of = [](const torch::Tensor& t, int64_t h) { return static_cast<const char*>(t.data_ptr()) +
                                                                     h * t.stride(0) * t.element_size(); };
  // one pass: m query rows (qs, ns, slots -> outs) over key/value head kh of k / v, the first `shared` keys read once
  // for all of them (attend_queries_fixed); a pass of one row keeps its query and output in registers
  // (attend_row_fixed): the same bits either way
  const auto run_pass = [&](const torch::Tensor& k, const torch::Tensor& v, int64_t kh, int64_t m, int64_t shared,
                            int64_t longest, std::vector<float>& scores, const std::vector<const float*>& qs,
                            const std::vector<float*>& outs, const std::vector<int64_t>& ns,
                            const std::vector<KeySlots>& slots) {
    if (static_cast<int64_t>(scores.size()) < m * longest) scores.resize(m * longest);
    const auto pass = [&](auto kp, auto vp) {
      if (m == 1) {
        if (D == 64) attend_row_fixed<8>(qs[0], kp, k.stride(1), vp, v.stride(1), ns[0], sc, scores.data(), outs[0], slots[0]);
        else attend_row_fixed<16>(qs[0], kp, k.stride(1), vp, v.stride(1), ns[0], sc, scores.data(), outs[0], slots[0]);
      } else if (D == 64)
        attend_queries_fixed<8>(qs.data(), m, kp, k.stride(1), vp, v.stride(1), shared, ns.data(), slots.data(), sc,
                                scores.data(), longest, outs.data());
      else
        attend_queries_fixed<16>(qs.data(), m, kp, k.stride(1), vp, v.stride(1), shared, ns.data(), slots.data(), sc,
                                 scores.data(), longest, outs.data());
    };
    if (bf16)
      pass(reinterpret_cast<const c10::BFloat16*>(head_of(k, kh)), reinterpret_cast<const c10::BFloat16*>(head_of(v, kh)));
    else
      pass(reinterpret_cast<const float*>(head_of(k, kh)), reinterpret_cast<const float*>(head_of(v, kh)));
  };
  // one unit per query row and head where each request's rows share a cached context at least twice their number (a
  // verify, a draft block, a decode row), ordered by request, key/value head, query head, row: a thread's consecutive
  // units of one request and one key/value head (rows of the query heads of a GQA group) run as one pass, whose rows
  // read the context's keys once and its values once from memory (three query heads per key/value head re-read them
  // three times: at context 2,048 a one-row forward's attention was bound by those reads). Units are rows, not heads,
  // so that the threads' shares are equal (by head, 9 query heads on 2 threads split 5 / 4; a verify of 8 rows, bf16,
  // AMD EPYC Zen 4, 2026-12-07: 45.4 -> 41.8 us a layer at context 264, 158.8 -> 148.5 at 1,000). Each row's
  // arithmetic is its own (attend_queries_fixed), whichever rows share its pass. Else (a prompt's chunk) the units below
  bool grouped = D == 64 || D == 128;
  for (int64_t i = 0; i < N && grouped; ++i)
    grouped = rows[i] <= 1 || (causal ? lengths[i] - rows[i] : lengths[i]) >= 2 * rows[i];
  if (grouped) {
    at::parallel_for(0, Hq * R, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const float*> qs;
      std::vector<float*> outs;
      std::vector<int64_t> ns;
      std::vector<KeySlots> slots;
      int64_t i = 0;
      while (Hq * first[i + 1] <= begin) ++i;  // the request of unit begin
      for (int64_t w = begin; w < end;) {
        while (Hq * first[i + 1] <= w) ++i;
        const int64_t nq = rows[i], u0 = Hq * first[i];  // request i's units: u0 + h * nq + j
        const auto& k = keys[i];
        const auto& v = values[i];
        const int64_t group = Hq / k.size(0), kh = (w - u0) / nq / group;
        const int64_t stop = std::min(end, u0 + (kh + 1) * group * nq);  // this pass: units w .. stop - 1
        const int64_t base = lengths[i] - rows[i], m = stop - w;
        qs.resize(m), outs.resize(m), ns.resize(m), slots.resize(m);
        int64_t longest = 0;
        for (int64_t x = 0; x < m; ++x) {
          const int64_t h = (w + x - u0) / nq, j = (w + x - u0) % nq, r = first[i] + j;
          ns[x] = tree ? base + path0[r + 1] - path0[r] : causal ? base + j + 1 : lengths[i];
          slots[x] = KeySlots{tree ? base : ns[x], tree ? path.data() + path0[r] : nullptr};
          qs[x] = qp + (r * Hq + h) * D;
          outs[x] = op + r * Hq * D + h * D;
          longest = std::max(longest, ns[x]);
        }
        w = stop;
        run_pass(k, v, kh, m, causal ? base : lengths[i], longest, scores, qs, outs, ns, slots);
      }
    });
    return out;
  }
  // a causal chunk's later rows read more keys: units taken from both ends in turn, so that each thread's contiguous
  // share of them holds early and late rows alike. On AVX-512 a unit is a row and a key/value head, its GQA group's
  // query heads in pairs (attend_queries_fixed: the same bits as one head at a time)
  const int64_t Hkv = keys.empty() ? 1 : keys[0].size(0), group = Hq / Hkv;
  bool together = false;
#ifdef __AVX512F__
  together = (D == 64 || D == 128) && group >= 2;
  for (int64_t i = 0; i < N && together; ++i) together = keys[i].size(0) == Hkv;
#endif
  const int64_t per = together ? group : 1, slots_per_row = Hq / per, units = R * slots_per_row;
#ifdef __AVX512F__
  if ((D == 64 || D == 128) && !tree) {
    // blocks of up to kChunkRows consecutive rows of one request: a unit is a block and a key/value head (its GQA
    // group's query heads), one pass (attend_queries_fixed) whose rows read the keys the block's first row sees once
    // for all, each the rest of its own one by one: a bfloat16 cache widened once per block instead of converted at
    // every pair's load, no query left over. Each row's arithmetic is its own, the same bits as a unit of one row
    // (a prompt of 2,048 tokens, bf16, AMD EPYC Zen 4, 2026-12-07: attention 1.85 s of the prefill's 3.0 in units of
    // one row, 1.33 of 2.42 in blocks of 16; one layer's attention over 2,048 rows, against units of one row, in one run
    // each: blocks of 4 / 8 / 16 / 32 rows 1.09x / 1.17x / 1.43x / 1.44x as fast)
    std::vector<int64_t> blk_req, blk_j0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j0 = 0; j0 < rows[i]; j0 += kChunkRows) blk_req.push_back(i), blk_j0.push_back(j0);
    const int64_t blocks = static_cast<int64_t>(blk_req.size()), block_units = blocks * slots_per_row;
    at::parallel_for(0, block_units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const float*> qs;
      std::vector<float*> outs;
      std::vector<int64_t> ns;
      std::vector<KeySlots> slots;
      for (int64_t turn = begin; turn < end; ++turn) {
        const int64_t w = turn % 2 == 0 ? turn / 2 : block_units - 1 - turn / 2;
        const int64_t b = w / slots_per_row, h = w % slots_per_row * per, i = blk_req[b], j0 = blk_j0[b];
        const int64_t nb = std::min(kChunkRows, rows[i] - j0), m = per * nb, base = lengths[i] - rows[i];
        const auto& k = keys[i];
        const auto& v = values[i];
        const int64_t kh = h / (Hq / k.size(0));
        qs.resize(m), outs.resize(m), ns.resize(m), slots.resize(m);
        for (int64_t a = 0; a < per; ++a)
          for (int64_t jj = 0; jj < nb; ++jj) {
            const int64_t x = a * nb + jj, r = first[i] + j0 + jj;
            ns[x] = causal ? base + j0 + jj + 1 : lengths[i];
            slots[x] = KeySlots{ns[x], nullptr};
            qs[x] = qp + (r * Hq + h + a) * D;
            outs[x] = op + r * Hq * D + (h + a) * D;
          }
        run_pass(k, v, kh, m, causal ? base + j0 + 1 : lengths[i], causal ? base + j0 + nb : lengths[i], scores, qs, outs,
                 ns, slots);
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> qs(per);
    std::vector<float*> outs(per);
    std::vector<int64_t> ns(per);
    std::vector<KeySlots> slots(per);
    for (int64_t turn = begin; turn < end; ++turn) {
      const int64_t w = turn % 2 == 0 ? turn / 2 : units - 1 - turn / 2;
      const int64_t r = w / slots_per_row, h = w % slots_per_row * per, i = req_of[r];
      const auto& k = keys[i];
      const auto& v = values[i];
      const int64_t kh = h / (Hq / k.size(0));
      const int64_t base = lengths[i] - rows[i];
      const int64_t n = tree ? base + path0[r + 1] - path0[r] : causal ? base + (r - first[i]) + 1 : lengths[i];
      const KeySlots slot{tree ? base : n, tree ? path.data() + path0[r] : nullptr};
      if (static_cast<int64_t>(scores.size()) < per * n) scores.resize(per * n);
      const auto unit = [&](auto kp, auto vp) {
        if (per > 1) {
          for (int64_t a = 0; a < per; ++a) {
            qs[a] = qp + (r * Hq + h + a) * D;
            outs[a] = op + r * Hq * D + (h + a) * D;
            ns[a] = n;
            slots[a] = slot;
          }
          const int64_t shared = tree ? base : n;  // the keys read in slot order
          if (D == 64)
            attend_queries_fixed<8>(qs.data(), per, kp, k.stride(1), vp, v.stride(1), shared, ns.data(), slots.data(),
                                    sc, scores.data(), n, outs.data());
          else
            attend_queries_fixed<16>(qs.data(), per, kp, k.stride(1), vp, v.stride(1), shared, ns.data(), slots.data(),
                                     sc, scores.data(), n, outs.data());
          return;
        }
        const float* qr = qp + (r * Hq + h) * D;
        float* orow = op + r * Hq * D + h * D;
        if (D == 64) attend_row_fixed<8>(qr, kp, k.stride(1), vp, v.stride(1), n, sc, scores.data(), orow, slot);
        else if (D == 128) attend_row_fixed<16>(qr, kp, k.stride(1), vp, v.stride(1), n, sc, scores.data(), orow, slot);
        else attend_row(qr, kp, k.stride(1), vp, v.stride(1), n, D, sc, scores.data(), orow, slot);
      };
      if (bf16)
        unit(reinterpret_cast<const c10::BFloat16*>(head_of(k, kh)), reinterpret_cast<const c10::BFloat16*>(head_of(v, kh)));
      else
        unit(reinterpret_cast<const float*>(head_of(k, kh)), reinterpret_cast<const float*>(head_of(v, kh)));
    }
  });
  return out;
}

torch::Tensor attend(torch::Tensor q, c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                     std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> rows,
                     std::vector<int64_t> lengths, double scale, std::vector<int64_t> parents) {
  return attend_rows(q, k_new, v_new, keys, values, rows, lengths, scale, true, parents);
}

// ---------------------------------------------------------------------------------------------------------------
// The reduced-precision product of model.precision=int8 (AVX-512 VNNI builds on CPUs with VNNI): q4 weights times
// activations quantized to int8 per row and per group of 32 (d_x = max|x| / 127), with AVX-512 VNNI integer dot
// products, as llama.cpp computes Q4_1 x Q8_1: y[r, c] = sum_g d_w[c,g] d_x[r,g] sum_k q_w q_x + m_w[c,g] d_x[r,g] sum_k q_x.
// Weights: vnni [P, G, 4, 64] bytes, chunk u's byte 4c + b = q[4u + b][c] | q[4(u + 4) + b][c] << 4; scales s
// [P, G, 32] float16, a panel's 16 d_w then its 16 m_w per group: the GGUF's own float16 values (Q4_1 stores them so),
// widened exactly to float32 in registers, so the products are those of float32 scales at half their bytes (a 1-row
// call streams 0.625 bytes a weight, not 0.75).
#ifdef __AVX512F__
// sum[i] = row i's integer dot product with one group's 8 weight chunks (x: the rows' int8 bytes from the group's
// first, K apart), in two chains (k 0-15 and 16-31, added exactly) with the rows side by side, so the VPDPBUSD latency
// overlaps; per row the same sum at any MT. UW: the weights are VPDPBUSD's unsigned operand (q4 nibbles), else the
// activations are (q8's, shifted).
template <int MT, bool UW>
__attribute__((target("avx512vnni,avx512bw,avx512f")))
inline void group_dots(const __m512i* w, const uint8_t* x, int64_t K, __m512i* sum) {
  __m512i s[MT], t[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) s[i] = t[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u)
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const int32_t* x4 = reinterpret_cast<const int32_t*>(x + i * K);
      const __m512i a = _mm512_set1_epi32(x4[u]), b = _mm512_set1_epi32(x4[u + 4]);
      s[i] = UW ? _mm512_dpbusd_epi32(s[i], w[u], a) : _mm512_dpbusd_epi32(s[i], a, w[u]);
      t[i] = UW ? _mm512_dpbusd_epi32(t[i], w[u + 4], b) : _mm512_dpbusd_epi32(t[i], b, w[u + 4]);
    }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) sum[i] = _mm512_add_epi32(s[i], t[i]);
}

// 16 float16 scales -> float32 (exact).
__attribute__((target("avx512f")))
inline __m512 scales16(const uint16_t* s) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))); }

// How many groups ahead the int8 products ask for their weights and scales (_mm_prefetch; the same values, the same
// bits): a call of a few rows streams ~33 GB/s with it against ~26 without (the hardware prefetcher restarts at every
// panel range and every call; docs/cpu_backend.md, 2026-12-06: 30 layers' q4 products 1 / 2 / 4 / 8 rows 2.5 / 3.0 /
// 3.7 / 6.1 ms -> 2.0 / 2.1 / 2.7 / 4.6, flat from 8 to 32 groups).
constexpr int64_t kPrefetchGroups = 12;

// One panel's rows r0 .. r0 + MT - 1 (group_dots per group, then each row's scales).
template <int MT>
__attribute__((target("avx512vnni,avx512bw,avx512f")))
void q4_int8_tile(int64_t p, int64_t r0, const uint8_t* wp, const uint16_t* sp, const int8_t* xqp,
                  const float* dxp, const float* sxp, int64_t K, int64_t G, float* yp, int64_t n) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* src = wp + (p * G + g) * 256;
    {  // the weights and scales kPrefetchGroups groups on (the next panel's past the last)
      const int64_t ahead = p * G + g + kPrefetchGroups;
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) _mm_prefetch(reinterpret_cast<const char*>(wp + ahead * 256 + u * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sp + ahead * 2 * kPanel), _MM_HINT_T0);
    }
    __m512i w[8];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m512i v = _mm512_loadu_si512(src + u * 64);
      w[u] = _mm512_and_si512(v, low);
      w[u + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 dw = scales16(sp + (p * G + g) * 2 * kPanel), mw = scales16(sp + (p * G + g) * 2 * kPanel + kPanel);
    __m512i sum[MT];
    group_dots<MT, true>(w, reinterpret_cast<const uint8_t*>(xqp) + r0 * K + g * kGroup, K, sum);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dxp[(r0 + i) * G + g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), scale,
                               _mm512_fmadd_ps(mw, _mm512_set1_ps(sxp[(r0 + i) * G + g]), acc[i]));
    }
  }
  const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
  const __mmask16 keep = ncols >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(yp + (r0 + i) * n + n0, keep, acc[i]);
}

// The rows in tiles of at most 4 (balanced: 6 rows = 3 + 3), each panel's groups re-read from L1 per tile.
template <typename Tile>
inline void int8_tiles(int64_t M, const Tile& tile) {
  const int64_t tiles = (M + 3) / 4, base = M / tiles, extra = M % tiles;
  int64_t r = 0;
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t mt = base + (j < extra ? 1 : 0);
    tile(r, mt);
    r += mt;
  }
}

void q4_int8_panels(int64_t begin, int64_t end, const uint8_t* wp, const uint16_t* sp, const int8_t* xqp,
                    const float* dxp, const float* sxp, int64_t M, int64_t K, int64_t G, float* yp, int64_t n) {
  for (int64_t p = begin; p < end; ++p)
    int8_tiles(M, [&](int64_t r0, int64_t mt) {
      switch (mt) {
        case 4: q4_int8_tile<4>(p, r0, wp, sp, xqp, dxp, sxp, K, G, yp, n); break;
        case 3: q4_int8_tile<3>(p, r0, wp, sp, xqp, dxp, sxp, K, G, yp, n); break;
        case 2: q4_int8_tile<2>(p, r0, wp, sp, xqp, dxp, sxp, K, G, yp, n); break;
        default: q4_int8_tile<1>(p, r0, wp, sp, xqp, dxp, sxp, K, G, yp, n); break;
      }
    });
}

// The same product on AMX tiles (Intel CPUs with AMX-INT8, where Linux grants the tile state): per panel and group,
// the 16 columns' 32 weights unpacked once into a B tile (the VNNI chunks' nibbles are already its rows), each tile of
// up to 16 rows' int8 activations times it in one TDPBSUD (signed x unsigned bytes, int32 sums: the very integers
// group_dots adds), then each row's scales as q4_int8_tile applies them, in the same order: the same bits as the VNNI
// path at any M, so a row keeps its value alone or in a batch whichever path runs. Used for calls of kAmxRows rows or
// more (q8: kAmxRowsQ8; set_amx(false): never).
constexpr int64_t kAmxRows = 12;
constexpr int64_t kAmxRowsQ8 = 12;  // the q8 products (the int8 head, int8 drafts): VNNI below it (a forward of 4 / 8 rows at
                                    // context 256, 2026-12-07: 5.7-5.8 / 9.3 ms against 6.3-6.6 / 9.7 ms with AMX from 4)
bool g_amx = false;  // AMX granted and asked for (set_amx)

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_available() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;  // TILE, INT8
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

// One group's sums of one tile of rows into ct, on tile set S (C, A, B = 0, 1, 2 or 3, 4, 5: two sets, so that
// consecutive groups overlap; the tile intrinsics take literal numbers): TDPBSUD, signed activations times unsigned
// weights (q4's nibbles, q8's q + 128).
template <int S>
__attribute__((target("amx-tile,amx-int8")))
inline void amx_group(const uint8_t* bt, const uint8_t* x, int64_t K, int32_t* ct) {
  if constexpr (S == 0) {
    _tile_loadd(2, bt, 64);
    _tile_zero(0);
    _tile_loadd(1, x, K);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, ct, 64);
  } else {
    _tile_loadd(5, bt, 64);
    _tile_zero(3);
    _tile_loadd(4, x, K);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(3, ct, 64);
  }
}

// Tiles 0-2 and 3-5: two sets of C (h rows x 16 int32 sums), A (h rows x one group's 32 bytes), B (8 rows x 64 bytes).
__attribute__((target("amx-tile")))
inline void amx_config(int64_t h) {
  TileConfig cfg;
  for (int s = 0; s < 2; ++s) {
    cfg.rows[3 * s] = h; cfg.colsb[3 * s] = 64;
    cfg.rows[3 * s + 1] = h; cfg.colsb[3 * s + 1] = 32;
    cfg.rows[3 * s + 2] = 8; cfg.colsb[3 * s + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Balanced tiles of h rows (4, 8, 12 or 16) for M rows, and the rows they span (those past M zeros).
inline int64_t amx_height(int64_t M) {
  const int64_t tiles = (M + 15) / 16;
  return ((M + tiles - 1) / tiles + 3) / 4 * 4;
}
inline int64_t amx_padded(int64_t M) { return (M + 15) / 16 * amx_height(M); }

// One tile of MT rows (xt: its first row's activations, K apart; dx its scales; rowp the rows' second term per group,
// q4's s_x float32, q8's integer sums sq) against one panel's G groups (bt: their B tiles, 512 bytes each; ws its
// float16 scales: q4's d and m, 32 a group; q8's d, 16 a group), the running sums in registers, each row's scales applied as
// q4_int8_tile / q8_int8_tile apply them; group g + 1's tile product overlaps group g's scaling.
template <int MT, bool Q8>
__attribute__((target("amx-tile,amx-int8,avx512bw,avx512f")))
void int8_tile_amx(const uint8_t* bt, const uint8_t* xt, const float* dxp, const void* rowp, const void* ws, int64_t K,
                   int64_t G, float* y, int64_t ldy, int64_t rows, __mmask16 keep) {
  alignas(64) int32_t ct[2][16 * 16];
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  amx_group<0>(bt, xt, K, ct[0]);
  for (int64_t g = 0; g < G; ++g) {
    if (g + 1 < G) {
      if (g & 1) amx_group<0>(bt + (g + 1) * 512, xt + (g + 1) * kGroup, K, ct[0]);
      else amx_group<1>(bt + (g + 1) * 512, xt + (g + 1) * kGroup, K, ct[1]);
    }
    const int32_t* cg = ct[g & 1];
    if constexpr (Q8) {
      const __m512 dw = scales16(static_cast<const uint16_t*>(ws) + g * kPanel);
      const int32_t* sq = static_cast<const int32_t*>(rowp);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dxp[i * G + g]));
        const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(cg + i * 16), _mm512_set1_epi32(128 * sq[i * G + g]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[i]);
      }
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(ws) + g * 2 * kPanel;
      const __m512 dw = scales16(s), mw = scales16(s + kPanel);
      const float* sxp = static_cast<const float*>(rowp);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dxp[i * G + g]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + i * 16)), scale,
                                 _mm512_fmadd_ps(mw, _mm512_set1_ps(sxp[i * G + g]), acc[i]));
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
    if (i < rows) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
}

// One panel p (its B tiles bt, float16 scales ws) for all M rows in tiles of h (4, 8, 12 or 16; x, dx and rowp, 4
// bytes a row and group, hold whole tiles, the rows past M zeros).
template <bool Q8>
__attribute__((target("amx-tile,amx-int8,avx512bw,avx512f")))
void int8_panel_amx(int64_t p, const uint8_t* bt, const void* ws, const uint8_t* x, const float* dxp, const void* rowp,
                    int64_t M, int64_t K, int64_t G, float* yp, int64_t n, int64_t h) {
  const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
  const __mmask16 keep = ncols >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  for (int64_t r0 = 0; r0 < M; r0 += h) {
    const int64_t rows = std::min<int64_t>(h, M - r0);
    const uint8_t* xt = x + r0 * K;
    const float* dx = dxp + r0 * G;
    const void* rw = static_cast<const uint32_t*>(rowp) + r0 * G;
    float* y = yp + r0 * n + n0;
    switch (h) {
      case 16: int8_tile_amx<16, Q8>(bt, xt, dx, rw, ws, K, G, y, n, rows, keep); break;
      case 12: int8_tile_amx<12, Q8>(bt, xt, dx, rw, ws, K, G, y, n, rows, keep); break;
      case 8: int8_tile_amx<8, Q8>(bt, xt, dx, rw, ws, K, G, y, n, rows, keep); break;
      default: int8_tile_amx<4, Q8>(bt, xt, dx, rw, ws, K, G, y, n, rows, keep); break;
    }
  }
}

// Panels [begin, end) of the product: each panel's B tiles unpacked once, then its row tiles (xq, dx and sx hold whole
// tiles of h rows (4, 8, 12 or 16), the rows past M zeros).
__attribute__((target("amx-tile,amx-int8,avx512bw,avx512f")))
void q4_int8_panels_amx(int64_t begin, int64_t end, const uint8_t* wp, const uint16_t* sp,
                        const int8_t* xqp, const float* dxp, const float* sxp, int64_t M, int64_t K, int64_t G,
                        float* yp, int64_t n, int64_t h) {
  amx_config(h);
  const __m512i low = _mm512_set1_epi8(0x0F);
  std::vector<uint8_t> btv(G * 512 + 64);
  uint8_t* bts = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(btv.data()) + 63) & ~uintptr_t(63));
  for (int64_t p = begin; p < end; ++p) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = wp + (p * G + g) * 256;
      if (p + 1 < end) {  // the next panel's weights and scales, a group's at a time
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) _mm_prefetch(reinterpret_cast<const char*>(src + G * 256 + u * 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sp + ((p + 1) * G + g) * 2 * kPanel), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i v = _mm512_loadu_si512(src + u * 64);
        _mm512_store_si512(bts + g * 512 + u * 64, _mm512_and_si512(v, low));
        _mm512_store_si512(bts + g * 512 + (u + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    }
    int8_panel_amx<false>(p, bts, sp + p * G * 2 * kPanel, reinterpret_cast<const uint8_t*>(xqp), dxp, sxp, M, K, G,
                          yp, n, h);
  }
  _tile_release();
}

// Activations [M, K] -> int8 per row and group of 32: q = round-to-nearest-even(x * 127 / max|x|), d_x = max|x| / 127,
// s_x = d_x * sum q, and (where sq is given) sum q itself (each row's values from its own inputs only).
__attribute__((target("avx512bw,avx512f")))
void quantize_rows(const float* xp, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* sq) {
  const int64_t G = K / kGroup;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = xp + r * K + g * kGroup;
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * K + g * kGroup), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * K + g * kGroup + 16), _mm512_cvtepi32_epi8(qb));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      dx[r * G + g] = amax / 127.f;
      sx[r * G + g] = dx[r * G + g] * static_cast<float>(total);
      if (sq != nullptr) sq[r * G + g] = total;
    }
}

// quantize_rows over row blocks (row_blocks: on every thread for many rows).
void quantize_row_blocks(const float* xp, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx,
                         int32_t* sq = nullptr) {
  const int64_t G = K / kGroup;
  row_blocks(M, [&](int64_t b, int64_t e) {
    quantize_rows(xp + b * K, e - b, K, xq + b * K, dx + b * G, sx + b * G, sq == nullptr ? nullptr : sq + b * G);
  });
}

// y [M, n] = x [M, K] @ W^T for q4 weights in the VNNI layout above (P panels, float16 scales s [P, G, 32]),
// the activations quantized to int8 per row and group of 32 here. Each row's result depends on its own values only.
void matmul_q4_int8(const uint8_t* wp, const uint16_t* sp, int64_t P, int64_t K, const float* xp,
                    int64_t M, float* yp, int64_t n) {
  const int64_t G = K / kGroup;
  const bool amx = g_amx && M >= kAmxRows;
  const int64_t h = amx_height(M), padded = amx ? amx_padded(M) : M;  // AMX: whole tiles of h rows
  std::vector<int8_t> xq(padded * K);
  std::vector<float> dx(padded * G), sx(padded * G);
  quantize_row_blocks(xp, M, K, xq.data(), dx.data(), sx.data());
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
    if (amx)
      q4_int8_panels_amx(begin, end, wp, sp, xq.data(), dx.data(), sx.data(), M, K, G, yp, n, h);
    else
      q4_int8_panels(begin, end, wp, sp, xq.data(), dx.data(), sx.data(), M, K, G, yp, n);
  });
}

// q8 weights (GGUF Q8_0: w = d q, q int8, d float16) times int8 activations: model.precision=int8's LM head and the
// int8 drafts. VPDPBUSD multiplies unsigned by signed bytes, so the weights are stored shifted to unsigned (q_w + 128,
// as q4's nibbles are unsigned) and each group's integer sum drops 128 * sum_k q_x, the row's own (sq, from the
// quantization): y[r, c] = sum_g d_w[c,g] d_x[r,g] (sum_k q_x (q_w + 128) - 128 sq[r,g]), the integer part exact, the
// groups added in order (a fixed computation of the row's own values). A 1-row call streams 1.0625 bytes a weight
// (float16 scales, no per-column corrections): the head of SmolLM2 28.3 MB + 1.8 MB a step, not 28.3 + 3.5 + 3.5.
// Weights: vnni [P, G, 8, 64] uint8, chunk u's bytes 4c + b = column c's q + 128 at k = 32 g + 4u + b; scales d
// [P, G, 16] float16.
template <int MT>
__attribute__((target("avx512vnni,avx512bw,avx512f")))
void q8_int8_tile(int64_t p, int64_t r0, const uint8_t* wp, const uint16_t* dp, const int8_t* xqp, const float* dxp,
                  const int32_t* sqp, int64_t K, int64_t G, float* yp, int64_t n) {
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* src = wp + (p * G + g) * 512;
    {  // as q4_int8_tile
      const int64_t ahead = p * G + g + kPrefetchGroups;
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) _mm_prefetch(reinterpret_cast<const char*>(wp + ahead * 512 + u * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(dp + ahead * kPanel), _MM_HINT_T0);
    }
    __m512i w[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) w[u] = _mm512_loadu_si512(src + u * 64);
    const __m512 dw = scales16(dp + (p * G + g) * kPanel);
    __m512i sum[MT];
    group_dots<MT, true>(w, reinterpret_cast<const uint8_t*>(xqp) + r0 * K + g * kGroup, K, sum);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dxp[(r0 + i) * G + g]));
      const __m512i exact = _mm512_sub_epi32(sum[i], _mm512_set1_epi32(128 * sqp[(r0 + i) * G + g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[i]);
    }
  }
  const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
  const __mmask16 keep = ncols >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(yp + (r0 + i) * n + n0, keep, acc[i]);
}

void q8_int8_panels(int64_t begin, int64_t end, const uint8_t* wp, const uint16_t* dp, const int8_t* xqp,
                    const float* dxp, const int32_t* sqp, int64_t M, int64_t K, int64_t G, float* yp, int64_t n) {
  for (int64_t p = begin; p < end; ++p)
    int8_tiles(M, [&](int64_t r0, int64_t mt) {
      switch (mt) {
        case 4: q8_int8_tile<4>(p, r0, wp, dp, xqp, dxp, sqp, K, G, yp, n); break;
        case 3: q8_int8_tile<3>(p, r0, wp, dp, xqp, dxp, sqp, K, G, yp, n); break;
        case 2: q8_int8_tile<2>(p, r0, wp, dp, xqp, dxp, sqp, K, G, yp, n); break;
        default: q8_int8_tile<1>(p, r0, wp, dp, xqp, dxp, sqp, K, G, yp, n); break;
      }
    });
}

// The same on AMX tiles (as q4_int8_panels_amx): the q8 chunks are already B tiles, loaded as they lie; TDPBSUD's
// sums are group_dots' integers.
__attribute__((target("amx-tile,amx-int8,avx512bw,avx512f")))
void q8_int8_panels_amx(int64_t begin, int64_t end, const uint8_t* wp, const uint16_t* dp, const int8_t* xqp,
                        const float* dxp, const int32_t* sqp, int64_t M, int64_t K, int64_t G, float* yp, int64_t n,
                        int64_t h) {
  amx_config(h);
  for (int64_t p = begin; p < end; ++p)
    int8_panel_amx<true>(p, wp + p * G * 512, dp + p * G * kPanel, reinterpret_cast<const uint8_t*>(xqp), dxp, sqp, M,
                         K, G, yp, n, h);
  _tile_release();
}

void matmul_q8_int8(const uint8_t* wp, const uint16_t* dp, int64_t P, int64_t K, const float* xp, int64_t M,
                    float* yp, int64_t n) {
  const int64_t G = K / kGroup;
  const bool amx = g_amx && M >= kAmxRowsQ8;
  const int64_t h = amx_height(M), padded = amx ? amx_padded(M) : M;  // AMX: whole tiles of h rows
  std::vector<int8_t> xq(padded * K);
  std::vector<float> dx(padded * G), sx(padded * G);
  std::vector<int32_t> sq(padded * G);
  quantize_row_blocks(xp, M, K, xq.data(), dx.data(), sx.data(), sq.data());
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
    if (amx)
      q8_int8_panels_amx(begin, end, wp, dp, xq.data(), dx.data(), sq.data(), M, K, G, yp, n, h);
    else
      q8_int8_panels(begin, end, wp, dp, xq.data(), dx.data(), sq.data(), M, K, G, yp, n);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The drafter's bf16 product (model.draft_precision=bf16, AVX-512 BF16 CPUs): bf16 weights, activations rounded to
// bf16 (nearest even), VDPBF16PS: each instruction adds two products per column to a float32 sum, twice the MACs of
// a float32 FMA and half the bytes of a float32 weight. The drafter is trained and stored in bf16, so its weights
// are its own values; only its activations are rounded. Drafts only propose tokens the target verifies, so this
// changes what is proposed, never what is output. Weights: [P, K / 2, 32] uint16, pair u's element 2c + b = column
// c's weight at k = 2u + b. Every output is one chain over the pairs in order, a fixed computation of its own row.
// bf16 of a float32, round to nearest even (a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

template <int MT, int NP>
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))
void tile_bf16(const uint16_t* __restrict w, int64_t p0, int64_t K2, const uint32_t* __restrict xb, int64_t m0,
               float* __restrict y, int64_t n) {
  __m512 a[NP][MT];
#pragma GCC unroll 16
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) a[j][i] = _mm512_setzero_ps();
  const uint16_t* src[NP];
#pragma GCC unroll 16
  for (int j = 0; j < NP; ++j) src[j] = w + (p0 + j) * K2 * 32;
  for (int64_t u = 0; u < K2; ++u) {
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(src[j] + u * 32);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i)
        a[j][i] = _mm512_dpbf16_ps(a[j][i], wv, (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[(m0 + i) * K2 + u])));
    }
  }
  store_tile<MT, NP>(a, p0, m0, y, n);
}

template <int MT, int NP>
void unit_bf16(const uint16_t* w, int64_t p0, int64_t np, int64_t K2, const uint32_t* xb, int64_t m0, float* y,
               int64_t n) {
  if (np == NP) tile_bf16<MT, NP>(w, p0, K2, xb, m0, y, n);
  else for (int64_t j = 0; j < np; ++j) tile_bf16<MT, 1>(w, p0 + j, K2, xb, m0, y, n);
}

void rows_bf16(const uint16_t* w, int64_t p0, int64_t np, int64_t K2, const uint32_t* xb, int64_t m0, int64_t mt,
               float* y, int64_t n) {
#define BP_T(MT, NP) case MT: unit_bf16<MT, NP>(w, p0, np, K2, xb, m0, y, n); break;
  switch (mt) {
    BP_T(16, 1) BP_T(15, 1) BP_T(14, 1) BP_T(13, 1) BP_T(12, 1) BP_T(11, 1) BP_T(10, 1) BP_T(9, 1)
    BP_T(8, 2) BP_T(7, 2) BP_T(6, 2) BP_T(5, 2) BP_T(4, 4) BP_T(3, 4) BP_T(2, 4)
    default: unit_bf16<1, 4>(w, p0, np, K2, xb, m0, y, n); break;
  }
#undef BP_T
}

// y [M, n] = bf16(x) [M, K] @ W^T for W in the layout above (P panels; K even).
void matmul_bf16(const uint16_t* wp, int64_t P, int64_t K, const float* xp, int64_t M, float* yp, int64_t n) {
  if (M <= 0) return;
  const int64_t K2 = K / 2;
  std::vector<uint32_t> xb(M * K2);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t u = 0; u < K2; ++u)
      xb[r * K2 + u] = static_cast<uint32_t>(to_bf16(xp[r * K + 2 * u])) |
                       (static_cast<uint32_t>(to_bf16(xp[r * K + 2 * u + 1])) << 16);
  tiles16(M, P, [&](int64_t p0, int64_t np, int64_t r, int64_t mt) { rows_bf16(wp, p0, np, K2, xb.data(), r, mt, yp, n); });
}

// x [M, K] float32, w [P, K / 2, 32] (bf16 bits as int16) -> y [M, n] (+ bias).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear_bf16: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.element_size() == 2 && w.size(1) * 2 == K && w.size(2) == 32 &&
              w.size(0) * kPanel >= n, "linear_bf16: weights do not match x");
  auto y = torch::empty({M, n}, x.options());
  matmul_bf16(static_cast<const uint16_t*>(w.data_ptr()), w.size(0), K, x.data_ptr<float>(), M, y.data_ptr<float>(), n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// x [M, K] float32, vnni [P, G, 8, 64] uint8 (q + 128), d [P, G, 16] float16 -> y [M, n].
torch::Tensor linear_q8_int8(torch::Tensor x, torch::Tensor vnni, torch::Tensor d, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && vnni.is_contiguous() && d.is_contiguous() &&
              d.scalar_type() == torch::kHalf && vnni.scalar_type() == torch::kUInt8, "linear_q8_int8: bad input");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, P = vnni.size(0);
  TORCH_CHECK(K % kGroup == 0 && vnni.numel() == P * G * 512 && d.numel() == P * G * kPanel && P * kPanel >= n,
              "linear_q8_int8: bad weights");
  auto y = torch::empty({M, n}, x.options());
  matmul_q8_int8(static_cast<const uint8_t*>(vnni.data_ptr()), static_cast<const uint16_t*>(d.data_ptr()), P, K,
                 x.data_ptr<float>(), M, y.data_ptr<float>(), n);
  return y;
}

torch::Tensor linear_q4_int8(torch::Tensor x, torch::Tensor vnni, torch::Tensor scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && vnni.is_contiguous() && scales.is_contiguous(),
              "linear_q4_int8: bad input");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, P = vnni.size(0);
  TORCH_CHECK(K % kGroup == 0 && vnni.numel() == P * G * 256 && scales.scalar_type() == torch::kHalf &&
              scales.numel() == P * G * 2 * kPanel && P * kPanel >= n, "linear_q4_int8: bad weights");
  auto y = torch::empty({M, n}, x.options());
  matmul_q4_int8(static_cast<const uint8_t*>(vnni.data_ptr()), static_cast<const uint16_t*>(scales.data_ptr()), P, K,
                 x.data_ptr<float>(), M, y.data_ptr<float>(), n);
  return y;
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// The native decoder stack: a Llama-family target's decoder layers (RMSNorm, the fused q/k/v product with optional
// biases, q/k norms where the family has them, rotary, the append to each request's preallocated KV cache and the
// batch-invariant attention above, the o product, the residual, RMSNorm, the fused gate/up product, SiLU x up, the
// down product, the residual), the final norm, and the hidden states the drafter taps: ONE call per forward, for any
// number of rows of any number of requests. Every element-wise step is a fixed computation of its own row (norm sums
// in 8 lanes added in a fixed order, the same exp8 as the attention's softmax), and every product the matmul above, so
// a row's result is the same bits alone, in a verify or in a batched step of many requests, on AVX2 and AVX-512.
namespace {

struct Lin {
  int64_t fmt = 0, n = 0, exact_rows = 0;  // fmt 0: float32 panels in q
  torch::Tensor q, d, m, f32, bias;
  int64_t P = 0, K = 0;
};

// y [M, n] = x [M, K] @ W^T (+ bias); calls of more rows than exact_rows use the float32 panels kept beside an exact
// form (the same bits).
constexpr int64_t kQ4Int8 = 4;  // q4 weights in the VNNI layout (d: their float16 scales), int8 activations (model.precision=int8)
constexpr int64_t kBF16Dot = 5;  // bf16 weights in pairs, bf16 activations (the drafter's model.draft_precision=bf16)
constexpr int64_t kQ8Int8 = 6;  // q8 weights (q + 128) in the VNNI layout (d: their float16 scales), int8 activations (int8 drafts)

void apply(const Lin& w, const float* x, int64_t M, float* y) {
  if (w.fmt == kBF16Dot) {
#ifdef __AVX512F__
    matmul_bf16(static_cast<const uint16_t*>(w.q.data_ptr()), w.P, w.K, x, M, y, w.n);
#else
    TORCH_CHECK(false, "bf16 products need the AVX-512 build of the kernel");
#endif
  } else if (w.fmt == kQ8Int8) {
#ifdef __AVX512F__
    matmul_q8_int8(static_cast<const uint8_t*>(w.q.data_ptr()), static_cast<const uint16_t*>(w.d.data_ptr()), w.P, w.K,
                   x, M, y, w.n);
#else
    TORCH_CHECK(false, "int8 products need the AVX-512 build of the kernel");
#endif
  } else if (w.fmt == kQ4Int8) {
#ifdef __AVX512F__
    matmul_q4_int8(static_cast<const uint8_t*>(w.q.data_ptr()), static_cast<const uint16_t*>(w.d.data_ptr()), w.P, w.K,
                   x, M, y, w.n);
#else
    TORCH_CHECK(false, "int8 products need the AVX-512 build of the kernel");
#endif
  } else {
  const bool wide = w.fmt != 0 && w.f32.defined() && w.f32.numel() > 0 && M > w.exact_rows;
  if (w.fmt == 0 || wide) {
    const torch::Tensor& panels = wide ? w.f32 : w.q;
    matmul(0, static_cast<const uint8_t*>(panels.data_ptr()), nullptr, nullptr, panels.size(0), w.K, x, M, y, w.n);
  } else {
    matmul(w.fmt, static_cast<const uint8_t*>(w.q.data_ptr()), w.fmt == kBF16 ? nullptr : w.d.data_ptr<float>(),
           w.fmt == kQ4 ? w.m.data_ptr<float>() : nullptr, w.P, w.K, x, M, y, w.n);
  }
  }
  if (w.bias.defined() && w.bias.numel() > 0) {
    const float* b = w.bias.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < w.n; ++c) y[r * w.n + c] += b[c];
  }
}

// x [H] -> w * (x * rsqrt(mean(x^2) + eps)) (LlamaRMSNorm's steps in float32; the sum of squares in 8 lanes, then
// the lanes added in a fixed order).
inline void rms_norm(const float* __restrict x, const float* __restrict w, int64_t H, float eps, float* __restrict out) {
  const int64_t lanes = H / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < lanes; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float s = hsum8(acc);
  for (int64_t i = lanes; i < H; ++i) s += x[i] * x[i];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * r);
}

// q [D] rotated in place: q * cos + rotate_half(q) * sin (transformers' apply_rotary_pos_emb, element for element).
inline void rotate(float* __restrict q, const float* __restrict cos, const float* __restrict sin, int64_t D) {
  const int64_t half = D / 2;
  alignas(64) float tmp[512];
  for (int64_t d = 0; d < D; ++d) tmp[d] = q[d];
  for (int64_t d = 0; d < half; ++d) q[d] = tmp[d] * cos[d] + (-tmp[d + half]) * sin[d];
  for (int64_t d = half; d < D; ++d) q[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

// out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up, 8 lanes at a time with the attention's exp8.
inline void silu_mul(const float* __restrict gate, const float* __restrict up, int64_t n, float* __restrict out) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    alignas(32) float g8[8] = {0}, u8[8] = {0}, o8[8];
    for (int64_t j = 0; i + j < n; ++j) { g8[j] = gate[i + j]; u8[j] = up[i + j]; }
    const __m256 g = _mm256_load_ps(g8);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
    _mm256_store_ps(o8, _mm256_mul_ps(s, _mm256_load_ps(u8)));
    for (int64_t j = 0; i + j < n; ++j) out[i + j] = o8[j];
  }
}

Lin to_lin(const std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                            c10::optional<torch::Tensor>>& t, int64_t K) {
  Lin w;
  w.fmt = std::get<0>(t);
  w.q = std::get<1>(t).contiguous();
  w.d = std::get<2>(t).contiguous();
  w.m = std::get<3>(t).contiguous();
  w.f32 = std::get<4>(t).contiguous();
  w.n = std::get<5>(t);
  w.exact_rows = std::get<6>(t);
  if (std::get<7>(t).has_value() && std::get<7>(t)->defined()) w.bias = std::get<7>(t)->contiguous().to(torch::kFloat32);
  w.P = w.q.size(0);
  w.K = K;
  TORCH_CHECK(w.fmt == 0 || w.fmt == kBF16 || w.fmt == kQ8 || w.fmt == kQ4 || w.fmt == kQ4Int8 || w.fmt == kBF16Dot ||
              w.fmt == kQ8Int8, "Stack: unknown weight format ", w.fmt);
  TORCH_CHECK(w.fmt == kQ8Int8 ? (K % kGroup == 0 && w.q.numel() == w.P * (K / kGroup) * 512 &&
                                  w.d.numel() == w.q.numel() / 32 && w.q.scalar_type() == torch::kUInt8 &&
                                  w.d.scalar_type() == torch::kHalf)
              : w.fmt == kQ4Int8 ? (w.q.numel() == w.P * (K / kGroup) * 256 && w.d.scalar_type() == torch::kHalf &&
                                    w.d.numel() == w.P * (K / kGroup) * 2 * kPanel)
              : w.fmt == kBF16Dot ? (w.q.dim() == 3 && w.q.size(1) * 2 == K && w.q.size(2) == 32) : w.q.size(1) == K,
              "Stack: a weight's K does not match its input");
  TORCH_CHECK(w.P * kPanel >= w.n, "Stack: a weight has fewer panels than columns");
  return w;
}

struct Layer {
  Lin qkv, o, gate_up, down;
  torch::Tensor in_norm, post_norm, q_norm, k_norm;
};

}  // namespace

using LinSpec = std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                           c10::optional<torch::Tensor>>;

// One pre-norm layer's packed products and norms (q/k norms where the family has them), checked against the shapes.
Layer make_layer(int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, const LinSpec& qkv, const LinSpec& o,
                 const LinSpec& gate_up, const LinSpec& down, torch::Tensor in_norm, torch::Tensor post_norm,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm) {
  Layer l;
  l.qkv = to_lin(qkv, H);
  l.o = to_lin(o, Hq * D);
  l.gate_up = to_lin(gate_up, H);
  l.down = to_lin(down, I);
  TORCH_CHECK(l.qkv.n == (Hq + 2 * Hkv) * D && l.o.n == H && l.gate_up.n == 2 * I && l.down.n == H,
              "a layer's weights do not match the model's shapes");
  l.in_norm = in_norm.contiguous().to(torch::kFloat32);
  l.post_norm = post_norm.contiguous().to(torch::kFloat32);
  if (q_norm.has_value() && q_norm->defined()) l.q_norm = q_norm->contiguous().to(torch::kFloat32);
  if (k_norm.has_value() && k_norm->defined()) l.k_norm = k_norm->contiguous().to(torch::kFloat32);
  return l;
}

// The tensors a stack was packed from and their in-place version counters then (Stack, DraftStack): changed() tells
// the owner to pack again after a weight was trained or assigned in place. A loop here, not in Python: read in Python
// the ~200 counters took 128 us a step (2026-12-07, AMD EPYC Zen 4, HumanEval; every tensor object cold after the
// forward streamed the weights), 2.5% of a plain step.
struct Watch {
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> versions;
  void set(std::vector<torch::Tensor> ts) {
    versions.clear();
    for (const auto& t : ts) versions.push_back(static_cast<int64_t>(t._version()));
    tensors = std::move(ts);
  }
  bool changed() const {
    for (size_t i = 0; i < tensors.size(); ++i)
      if (static_cast<int64_t>(tensors[i]._version()) != versions[i]) return true;
    return false;
  }
};

class Stack {
 public:
  Stack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
        double scale, torch::Tensor norm)
      : H(hidden), Hq(heads), Hkv(kv_heads), D(head_dim), I(intermediate), eps_(static_cast<float>(eps)),
        scale_(scale), norm_(norm.contiguous().to(torch::kFloat32)) {
    TORCH_CHECK(Hq % Hkv == 0 && D <= 512 && D % 2 == 0, "Stack: unsupported head layout");
  }

  void add_layer(const LinSpec& qkv, const LinSpec& o, const LinSpec& gate_up, const LinSpec& down,
                 torch::Tensor in_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm) {
    layers_.push_back(make_layer(H, Hq, Hkv, D, I, qkv, o, gate_up, down, in_norm, post_norm, q_norm, k_norm));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  void watch(std::vector<torch::Tensor> weights) { watch_.set(std::move(weights)); }
  bool changed() const { return watch_.changed(); }

  // h [R, H] float32 (the embedded rows of N requests, request i's rows[i] consecutive); cos, sin [R, D]; keys,
  // values: request-major, keys[i * L + l] request i's layer-l key buffer [Hkv, C, D] (the append goes to positions
  // lengths[i] - rows[i] .. lengths[i] - 1); taps: indices into transformers' hidden_states (0: the embedding, l: layer
  // l's output, L: the final norm's); parents: empty (causal rows) or a draft tree's parent of each row among its
  // request's rows (attend_rows). Returns (the final normed states [R, H], the taps side by side [R, T * H]).
  std::vector<torch::Tensor> forward(torch::Tensor h_in, torch::Tensor cos, torch::Tensor sin,
                                     std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                                     std::vector<int64_t> rows, std::vector<int64_t> lengths,
                                     std::vector<int64_t> taps, std::vector<int64_t> parents) {
    const int64_t L = num_layers(), N = static_cast<int64_t>(rows.size());
    TORCH_CHECK(h_in.dim() == 2 && h_in.size(1) == H && h_in.scalar_type() == torch::kFloat32, "Stack: h must be float32 [R, H]");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == N * L && static_cast<int64_t>(values.size()) == N * L,
                "Stack: one key and one value buffer per request and layer");
    const int64_t R = h_in.size(0);
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == R && cos.size(1) == D && sin.sizes() == cos.sizes(), "Stack: cos/sin must be [R, D]");
    cos = cos.contiguous().to(torch::kFloat32);
    sin = sin.contiguous().to(torch::kFloat32);
    auto opts = h_in.options();
    torch::Tensor h = h_in.contiguous().clone();
    const int64_t T = static_cast<int64_t>(taps.size()), QKV = (Hq + 2 * Hkv) * D;
    auto tapped = torch::empty({R, T * H}, opts);
    auto x = torch::empty({R, H}, opts), qkv = torch::empty({R, QKV}, opts), q = torch::empty({R, Hq, D}, opts);
    auto y = torch::empty({R, H}, opts), gu = torch::empty({R, 2 * I}, opts), act = torch::empty({R, I}, opts);
    float* hp = h.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* gup = gu.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    auto tap = [&](int64_t index, const float* src) {
      for (int64_t t = 0; t < T; ++t)
        if (taps[t] == index)
          for (int64_t r = 0; r < R; ++r) std::copy_n(src + r * H, H, tapped.data_ptr<float>() + r * T * H + t * H);
    };
    tap(0, hp);
    std::vector<torch::Tensor> lk(N), lv(N);
    // k / v as views of the q/k/v product (rows of QKV floats; heads of D)
    auto k_new = qkv.as_strided({R, Hkv, D}, {QKV, D, 1}, Hq * D);
    auto v_new = qkv.as_strided({R, Hkv, D}, {QKV, D, 1}, (Hq + Hkv) * D);
    for (int64_t li = 0; li < L; ++li) {
      const Layer& l = layers_[li];
      const float* w_in = l.in_norm.data_ptr<float>();
      row_blocks(R, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rms_norm(hp + r * H, w_in, H, eps_, xp + r * H);
      });
      apply(l.qkv, xp, R, qkvp);
      row_blocks(R, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          float* row = qkvp + r * QKV;
          for (int64_t hd = 0; hd < Hq + Hkv; ++hd) {  // the q heads, then the k heads
            float* v = row + hd * D;
            if (l.q_norm.defined()) {
              alignas(64) float tmp[512];
              rms_norm(v, (hd < Hq ? l.q_norm : l.k_norm).data_ptr<float>(), D, eps_, tmp);
              std::copy_n(tmp, D, v);
            }
            rotate(v, cp + r * D, sp + r * D, D);
          }
          std::copy_n(row, Hq * D, qp + r * Hq * D);
        }
      });
      for (int64_t i = 0; i < N; ++i) {
        lk[i] = keys[i * L + li];
        lv[i] = values[i * L + li];
      }
      auto att = attend_rows(q, k_new, v_new, lk, lv, rows, lengths, scale_, true, parents);
      apply(l.o, att.data_ptr<float>(), R, yp);
      const float* w_post = l.post_norm.data_ptr<float>();
      row_blocks(R, [&](int64_t b, int64_t e) {
        for (int64_t i = b * H; i < e * H; ++i) hp[i] = hp[i] + yp[i];
        for (int64_t r = b; r < e; ++r) rms_norm(hp + r * H, w_post, H, eps_, xp + r * H);
      });
      apply(l.gate_up, xp, R, gup);
      at::parallel_for(0, R, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) silu_mul(gup + r * 2 * I, gup + r * 2 * I + I, I, ap + r * I);
      });
      apply(l.down, ap, R, yp);
      row_blocks(R, [&](int64_t b, int64_t e) { for (int64_t i = b * H; i < e * H; ++i) hp[i] = hp[i] + yp[i]; });
      if (li + 1 < L) tap(li + 1, hp);
    }
    auto out = torch::empty({R, H}, opts);
    for (int64_t r = 0; r < R; ++r) rms_norm(hp + r * H, norm_.data_ptr<float>(), H, eps_, out.data_ptr<float>() + r * H);
    tap(L, out.data_ptr<float>());
    return {out, tapped};
  }

 private:
  int64_t H, Hq, Hkv, D, I;
  float eps_;
  double scale_;
  torch::Tensor norm_;
  std::vector<Layer> layers_;
  Watch watch_;
};

// The DFlash drafter's forward as one call (DraftStack): the context features' projection (fc, hidden_norm), then per
// layer the input norm of the block rows, the fused q/k/v product over [context rows ; block rows] of every request,
// q/k norms and rotary, the append of the new context and block keys/values to each request's draft cache, the full
// (non-causal) attention of the block rows over their request's whole cache, o, the residual, the MLP, and the final
// norm. Each row a fixed computation of its own request's inputs (the same bits alone or beside other requests).
class DraftStack {
 public:
  DraftStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
             double scale, const LinSpec& fc, int64_t features, torch::Tensor hidden_norm, torch::Tensor norm)
      : H(hidden), Hq(heads), Hkv(kv_heads), D(head_dim), I(intermediate), F(features), eps_(static_cast<float>(eps)),
        scale_(scale), fc_(to_lin(fc, features)), hidden_norm_(hidden_norm.contiguous().to(torch::kFloat32)),
        norm_(norm.contiguous().to(torch::kFloat32)) {
    TORCH_CHECK(Hq % Hkv == 0 && D <= 512 && D % 2 == 0 && fc_.n == H, "DraftStack: unsupported shapes");
  }

  void add_layer(const LinSpec& qkv, const LinSpec& o, const LinSpec& gate_up, const LinSpec& down,
                 torch::Tensor in_norm, torch::Tensor post_norm, torch::Tensor q_norm, torch::Tensor k_norm) {
    layers_.push_back(make_layer(H, Hq, Hkv, D, I, qkv, o, gate_up, down, in_norm, post_norm, q_norm, k_norm));
  }

  void watch(std::vector<torch::Tensor> weights) { watch_.set(std::move(weights)); }
  bool changed() const { return watch_.changed(); }

  // features [C, F] (request i's ctx[i] rows consecutive), h [B, H] (the embedded block rows, block[i] per request),
  // cos/sin [C + B, D] in the order [ctx rows of request 0 ; its block rows ; ctx rows of request 1 ; ...];
  // keys[i * L + l] / values: request i's layer-l draft cache [Hkv, cap, D]; the ctx[i] + block[i] new rows go to
  // positions lengths[i] - ctx[i] - block[i] .. lengths[i] - 1. Returns the final normed block rows [B, H].
  torch::Tensor forward(torch::Tensor features, torch::Tensor h_in, torch::Tensor cos, torch::Tensor sin,
                        std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> ctx,
                        std::vector<int64_t> block, std::vector<int64_t> lengths) {
    const int64_t L = static_cast<int64_t>(layers_.size()), N = static_cast<int64_t>(block.size());
    TORCH_CHECK(static_cast<int64_t>(ctx.size()) == N && static_cast<int64_t>(lengths.size()) == N &&
                static_cast<int64_t>(keys.size()) == N * L && static_cast<int64_t>(values.size()) == N * L,
                "DraftStack: one ctx, block, length and per-layer cache per request");
    int64_t C = 0, B = 0;
    for (int64_t i = 0; i < N; ++i) { C += ctx[i]; B += block[i]; }
    TORCH_CHECK(features.dim() == 2 && features.size(0) == C && features.size(1) == F, "DraftStack: features must be [C, F]");
    TORCH_CHECK(h_in.dim() == 2 && h_in.size(0) == B && h_in.size(1) == H, "DraftStack: h must be [B, H]");
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == C + B && cos.size(1) == D && sin.sizes() == cos.sizes(),
                "DraftStack: cos/sin must be [C + B, D]");
    features = features.contiguous().to(torch::kFloat32);
    cos = cos.contiguous().to(torch::kFloat32);
    sin = sin.contiguous().to(torch::kFloat32);
    auto opts = h_in.options().dtype(torch::kFloat32);
    torch::Tensor h = h_in.contiguous().to(torch::kFloat32).clone();
    const int64_t R = C + B, QKV = (Hq + 2 * Hkv) * D;
    auto ctxh = torch::empty({std::max<int64_t>(C, 1), H}, opts), proj = torch::empty({std::max<int64_t>(C, 1), H}, opts);
    auto kv_in = torch::empty({R, H}, opts), qkv = torch::empty({R, QKV}, opts), q = torch::empty({B, Hq, D}, opts);
    auto x = torch::empty({B, H}, opts), y = torch::empty({B, H}, opts), gu = torch::empty({B, 2 * I}, opts);
    auto act = torch::empty({B, I}, opts);
    float* hp = h.data_ptr<float>();
    float* cp = ctxh.data_ptr<float>();
    if (C > 0) {  // the context rows: hidden_norm(fc(features)), the same in every layer
      apply(fc_, features.data_ptr<float>(), C, proj.data_ptr<float>());
      for (int64_t r = 0; r < C; ++r) rms_norm(proj.data_ptr<float>() + r * H, hidden_norm_.data_ptr<float>(), H, eps_, cp + r * H);
    }
    // where each row of [ctx ; block] per request sits: source (ctx row or block row) and destination in kv_in
    std::vector<int64_t> ctx0(N + 1, 0), blk0(N + 1, 0), row0(N + 1, 0);
    for (int64_t i = 0; i < N; ++i) {
      ctx0[i + 1] = ctx0[i] + ctx[i];
      blk0[i + 1] = blk0[i] + block[i];
      row0[i + 1] = row0[i] + ctx[i] + block[i];
    }
    const float* cosp = cos.data_ptr<float>();
    const float* sinp = sin.data_ptr<float>();
    float* kvp = kv_in.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    std::vector<torch::Tensor> lk(N), lv(N);
    for (int64_t li = 0; li < L; ++li) {
      const Layer& l = layers_[li];
      for (int64_t r = 0; r < B; ++r) rms_norm(hp + r * H, l.in_norm.data_ptr<float>(), H, eps_, xp + r * H);
      for (int64_t i = 0; i < N; ++i) {
        if (ctx[i] > 0) std::copy_n(cp + ctx0[i] * H, ctx[i] * H, kvp + row0[i] * H);
        std::copy_n(xp + blk0[i] * H, block[i] * H, kvp + (row0[i] + ctx[i]) * H);
      }
      apply(l.qkv, kvp, R, qkvp);
      for (int64_t i = 0; i < N; ++i) {
        auto& kb = keys[i * L + li];
        auto& vb = values[i * L + li];
        TORCH_CHECK(kb.dim() == 3 && kb.size(0) == Hkv && kb.size(2) == D && kb.stride(2) == 1 && vb.stride(2) == 1 &&
                    kb.scalar_type() == torch::kFloat32 && vb.scalar_type() == torch::kFloat32 &&
                    lengths[i] <= kb.size(1) && lengths[i] >= ctx[i] + block[i], "DraftStack: a draft cache does not fit");
        const int64_t base = lengths[i] - ctx[i] - block[i];
        for (int64_t t = 0; t < ctx[i] + block[i]; ++t) {
          const int64_t r = row0[i] + t;
          float* row = qkvp + r * QKV;
          const bool is_block = t >= ctx[i];
          for (int64_t hd = is_block ? 0 : Hq; hd < Hq + Hkv; ++hd) {  // the block rows' q heads, every row's k heads
            float* v = row + hd * D;
            alignas(64) float tmp[512];
            rms_norm(v, (hd < Hq ? l.q_norm : l.k_norm).data_ptr<float>(), D, eps_, tmp);
            std::copy_n(tmp, D, v);
            rotate(v, cosp + r * D, sinp + r * D, D);
          }
          if (is_block) std::copy_n(row, Hq * D, qp + (blk0[i] + t - ctx[i]) * Hq * D);
          for (int64_t hd = 0; hd < Hkv; ++hd) {
            std::copy_n(row + (Hq + hd) * D, D, kb.data_ptr<float>() + hd * kb.stride(0) + (base + t) * kb.stride(1));
            std::copy_n(row + (Hq + Hkv + hd) * D, D, vb.data_ptr<float>() + hd * vb.stride(0) + (base + t) * vb.stride(1));
          }
        }
        lk[i] = kb;
        lv[i] = vb;
      }
      auto att = attend_rows(q, c10::nullopt, c10::nullopt, lk, lv, block, lengths, scale_, false);
      apply(l.o, att.data_ptr<float>(), B, yp);
      for (int64_t e = 0; e < B * H; ++e) hp[e] = hp[e] + yp[e];
      for (int64_t r = 0; r < B; ++r) rms_norm(hp + r * H, l.post_norm.data_ptr<float>(), H, eps_, xp + r * H);
      apply(l.gate_up, xp, B, gu.data_ptr<float>());
      for (int64_t r = 0; r < B; ++r)
        silu_mul(gu.data_ptr<float>() + r * 2 * I, gu.data_ptr<float>() + r * 2 * I + I, I, act.data_ptr<float>() + r * I);
      apply(l.down, act.data_ptr<float>(), B, yp);
      for (int64_t e = 0; e < B * H; ++e) hp[e] = hp[e] + yp[e];
    }
    auto out = torch::empty({B, H}, opts);
    for (int64_t r = 0; r < B; ++r) rms_norm(hp + r * H, norm_.data_ptr<float>(), H, eps_, out.data_ptr<float>() + r * H);
    return out;
  }

 private:
  int64_t H, Hq, Hkv, D, I, F;
  float eps_;
  double scale_;
  Lin fc_;
  torch::Tensor hidden_norm_, norm_;
  std::vector<Layer> layers_;
  Watch watch_;
};

// Token rows moved inside KV buffers [B, H, L, D] (each row's D values contiguous): in every buffer, row src[j] goes to
// row dst[j], j in order; a draft tree's accepted path moved behind its context (pipeline.models.cache.compact), in one
// call instead of two indexed copies per layer. Rows ascend and dst[j] < src[j]: no move reads a row an earlier move wrote.
void move_rows(std::vector<torch::Tensor> buffers, std::vector<int64_t> dst, std::vector<int64_t> src) {
  TORCH_CHECK(dst.size() == src.size(), "move_rows: one destination per source row");
  for (size_t j = 0; j < dst.size(); ++j)
    TORCH_CHECK(dst[j] >= 0 && dst[j] <= src[j] && (j == 0 || (dst[j] > dst[j - 1] && src[j] > src[j - 1])),
                "move_rows: rows must ascend, each moved back");
  for (const auto& t : buffers) {
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "move_rows: buffers must be [B, H, L, D] with D contiguous");
    TORCH_CHECK(dst.empty() || src.back() < t.size(2), "move_rows: a row beyond a buffer's length");
    const int64_t bytes = t.size(3) * t.element_size(), es = t.element_size();
    char* base = static_cast<char*>(t.data_ptr());
    for (int64_t b = 0; b < t.size(0); ++b)
      for (int64_t h = 0; h < t.size(1); ++h) {
        char* head = base + (b * t.stride(0) + h * t.stride(1)) * es;
        for (size_t j = 0; j < dst.size(); ++j)
          if (dst[j] != src[j]) std::memmove(head + dst[j] * t.stride(2) * es, head + src[j] * t.stride(2) * es, bytes);
      }
  }
}

std::string isa() {
#ifdef __AVX512F__
  return "avx512";
#else
  return "avx2";
#endif
}

// Whether the int8 products run on AMX tiles where they can (kAmxRows rows or more): on asks for it, granted only
// where the CPU has AMX-INT8 and the kernel lets this process use the tile state. Returns whether they now do.
bool set_amx(bool on) {
#ifdef __AVX512F__
  static const bool granted = amx_available();
  g_amx = on && granted;
  return g_amx;
#else
  return false && on;
#endif
}


// ---------------------------------------------------------------------------------------------------------------
// Each row's k best columns, best first: x [R, V] float32 -> [R, k] int64. The order is a total one: NaN above every
// number, then larger values, and among equal values (NaNs included) the lower column first; so the result is
// torch.topk's wherever a row's k + 1 best values are distinct. One pass a row: the first k columns sorted in, then
// each later one compared with the k-th best (16 at a time on AVX-512, a column passing only where it is NaN or above
// it) and inserted in order. 49,152 columns, k = 4: ~10 us a row against torch.topk's ~86 (AMD EPYC Zen 4, 2026-12-07).
namespace {

inline bool above(float a, float b) { return a > b || (a != a && b == b); }  // a ranks before b (ties: neither)

void topk_row(const float* x, int64_t V, int64_t k, float* best, int64_t* at) {
  int64_t have = 0;
  const auto insert = [&](float v, int64_t j) {  // v ranks above the k-th best, or fewer than k are held
    int64_t i = have < k ? have++ : k - 1;          // the slot it fills (when full, the k-th best drops out)
    for (; i > 0 && above(v, best[i - 1]); --i) best[i] = best[i - 1], at[i] = at[i - 1];
    best[i] = v, at[i] = j;
  };
  int64_t j = 0;
  for (; j < std::min(k, V); ++j) insert(x[j], j);
#ifdef __AVX512F__
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    // lanes not at or below the k-th best: above it, or NaN (an unordered compare); a NaN k-th best passes every lane
    __mmask16 pass = _mm512_cmp_ps_mask(v, _mm512_set1_ps(best[k - 1]), _CMP_NLE_UQ);
    while (pass) {
      const int lane = __builtin_ctz(pass);
      pass &= pass - 1;
      if (above(x[j + lane], best[k - 1])) insert(x[j + lane], j + lane);
    }
  }
#endif
  for (; j < V; ++j)
    if (above(x[j], best[k - 1])) insert(x[j], j);
}

}  // namespace

torch::Tensor topk_rows(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "topk_rows: x must be float32 [R, V]");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "topk_rows: k must be in 1..V");
  x = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R, k}, x.options().dtype(torch::kInt64));
  std::vector<float> best(k);
  for (int64_t r = 0; r < R; ++r)
    topk_row(x.data_ptr<float>() + r * V, V, k, best.data(), out.data_ptr<int64_t>() + r * k);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack W [N, K] into [ceil(N/16), K, 16] panels");
  m.def("linear", &linear, "y = x @ W^T (+ bias) from packed panels");
  m.def("linear_exact", &linear_exact, "y = x @ W^T (+ bias) from bf16 / q8 / q4 panels expanded exactly");
  m.def("attend", &attend, "causal attention of many requests' rows over their own caches, each row bit-identical alone or batched",
        pybind11::arg("q"), pybind11::arg("k_new"), pybind11::arg("v_new"), pybind11::arg("keys"), pybind11::arg("values"),
        pybind11::arg("rows"), pybind11::arg("lengths"), pybind11::arg("scale"),
        pybind11::arg("parents") = std::vector<int64_t>{});
  m.def("move_rows", &move_rows, "token rows moved back inside KV buffers [B, H, L, D] (a tree's accepted path)",
        pybind11::arg("buffers"), pybind11::arg("dst"), pybind11::arg("src"));
  m.def("unpack_exact", &unpack_exact, "the float32 weight that linear_exact computes with");
  m.def("topk_rows", &topk_rows, "each row's k best columns, best first (NaN first, ties: the lower column)",
        pybind11::arg("x"), pybind11::arg("k"));
#ifdef __AVX512F__
  m.def("linear_q4_int8", &linear_q4_int8, "q4 weights (VNNI layout) x int8 activations (AVX-512 VNNI)");
  m.def("linear_q8_int8", &linear_q8_int8, "q8 weights (VNNI layout) x int8 activations (AVX-512 VNNI)");
  m.def("linear_bf16", &linear_bf16, "bf16 weights (pairs) x bf16 activations (AVX-512 BF16)");
#endif
  m.def("isa", &isa, "the instruction set this build's products use (avx512 | avx2)");
  m.def("set_amx", &set_amx, "int8 products of 12 or more rows on AMX tiles where the CPU and kernel allow it; returns "
        "whether they now run there", pybind11::arg("on"));
  pybind11::class_<Stack>(m, "Stack", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &Stack::add_layer)
      .def("num_layers", &Stack::num_layers)
      .def("watch", &Stack::watch)
      .def("changed", &Stack::changed)
      .def("forward", &Stack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DraftStack>(m, "DraftStack", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, const LinSpec&, int64_t,
                          torch::Tensor, torch::Tensor>())
      .def("add_layer", &DraftStack::add_layer)
      .def("watch", &DraftStack::watch)
      .def("changed", &DraftStack::changed)
      .def("forward", &DraftStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
