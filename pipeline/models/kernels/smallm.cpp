// Small-M float32 GEMM for CPU decoding: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = 1..~16 rows.
//
// The weight is packed once into panels of 16 output columns, [ceil(N/16), K, 16], so that one pass
// streams each weight byte from memory exactly once for all M rows: per k, two 8-wide loads of the
// panel and, per row, one broadcast of x[m, k] and two FMAs. Rows are processed in tiles of up to 6
// (12 accumulators); a second tile re-reads the panel from L1/L2, not from memory. Every output
// y[m, n] is one sequential FMA chain over k = 0..K-1, whatever M or the tiling: a row's result is
// bit-identical whether it is computed alone (an autoregressive step) or with others (a verify).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;

template <int MT>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
          float* __restrict y, int64_t ldy, int64_t n0, int64_t ncols, int64_t m0) {
  __m256 acc[MT][2];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) { acc[i][0] = _mm256_setzero_ps(); acc[i][1] = _mm256_setzero_ps(); }
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
  at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = pp + p * K * kPanel;
      const int64_t n0 = p * kPanel, ncols = std::min(kPanel, n - n0);
      int64_t m = 0;
      while (m < M) {
        const int64_t left = M - m;
        if (left >= 6) { tile<6>(xp, K, panel, K, yp, n, n0, ncols, m); m += 6; }
        else if (left >= 4) { tile<4>(xp, K, panel, K, yp, n, n0, ncols, m); m += 4; }
        else if (left >= 2) { tile<2>(xp, K, panel, K, yp, n, n0, ncols, m); m += 2; }
        else { tile<1>(xp, K, panel, K, yp, n, n0, ncols, m); m += 1; }
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack W [N, K] into [ceil(N/16), K, 16] panels");
  m.def("linear", &linear, "y = x @ W^T (+ bias) from packed panels");
}
