// llamactl's CPU matrix-vector products for the decode step (a few rows at a time), built on the
// user's machine by llamactl.kernels.cpu (g++ -O3 -march=native) and called as torch operators.
//
// qgemv: low-bit weights read once per call, never dequantized to a copy. In the manner of
// llama.cpp's Q4_0/Q8_0 dot products, each row of x is rounded to int8 per block of 32 inputs
// (scale amax / 127, one float per block) and multiplied with the unsigned weight codes in
// integers (AVX-512 VNNI's vpdpbusd: u8 x s8 -> s32), then scaled per block:
//   y[m, n] = sum_b dx[m, b] * s[n, g(b)] * sum_{i in b} q[n, i] * xq[m, i]
//           - sum_g s[n, g] * z[n, g] * sum_{b in g} dx[m, b] * sum_{i in b} xq[m, i]
// Weight layouts (one row of w per output, per chunk of 64 inputs; a last chunk of 32 the same
// way with 32 in place of 64):
//   4 bits (codes 0..15): 32 bytes, byte j holding input j in its low nibble, input 32 + j in its high
//   8 bits (codes 0..255): 64 bytes, one a code
// blk2grp [K / 32]: the scale group of each block of 32 inputs (every block lies in one group).
//
// bgemv: 16-bit weights (bf16) with x rounded to bf16, accumulated in float (AVX-512 BF16's
// vdpbf16ps), for the 16-bit layers. dequant: qgemv's weights as bf16, for prefill's matmul.
//
// Without AVX-512 VNNI / BF16 the same arithmetic runs in plain loops (slower, same results).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t MAX_ROWS = 8;

struct QuantRows {
  // per row of x: int8 codes [K], one scale per block [K / 32], per group sum_b dx * sum(xq) [G]
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<float> gz;
  std::vector<float> xs;  // per chunk of 64: dx of its two blocks, 8 lanes each (row_dot)
};

template <typename T>
float as_float(T v) { return static_cast<float>(v); }

template <typename T>
QuantRows quantize_rows(const T* x, int64_t m, int64_t k, const int64_t* perm, const int32_t* blk2grp, int64_t groups) {
  const int64_t nb = k / BLOCK;
  QuantRows q{std::vector<int8_t>(m * k), std::vector<float>(m * nb), std::vector<float>(m * groups, 0.f),
              std::vector<float>(m * nb * 8, 0.f)};
  std::vector<float> row(k);
  for (int64_t r = 0; r < m; ++r) {
    const T* xr = x + r * k;
    for (int64_t i = 0; i < k; ++i) row[i] = as_float(xr[perm ? perm[i] : i]);
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(row[b * BLOCK + i]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(row[b * BLOCK + i] * inv));
        q.xq[r * k + b * BLOCK + i] = static_cast<int8_t>(v);
        sum += v;
      }
      q.dx[r * nb + b] = d;
      q.gz[r * groups + blk2grp[b]] += d * static_cast<float>(sum);
      for (int64_t i = 0; i < 8; ++i) q.xs[r * nb * 8 + b * 8 + i] = d;
    }
  }
  return q;
}

// How a row's scale groups fall on its blocks of 32 (blk2grp): GROUPED, every group whole chunks of
// 64 (a group's chunks are summed before its scale multiplies them); BLOCKWISE, one group a block
// (group size 32: two consecutive scales a chunk); GENERIC, anything else.
enum Mode { GROUPED = 0, BLOCKWISE = 1, GENERIC = 2 };

// The plain-loop dot of one weight row over blocks [b, nb): sum dx[b] * s[g(b)] * (codes . xq).
template <int BITS>
float tail_dot(const uint8_t* w, const int8_t* xq, const float* dx, const float* s, const int32_t* blk2grp,
               int64_t b, int64_t nb) {
  float total = 0.f;
  for (; b < nb; b += 2) {
    const int64_t width = b + 2 <= nb ? 2 * BLOCK : BLOCK;  // a chunk of 64, or a last one of 32
    const uint8_t* wc = BITS == 4 ? w + b * BLOCK / 2 : w + b * BLOCK;
    for (int64_t half = 0; half * BLOCK < width; ++half) {
      int32_t dot = 0;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const int64_t j = half * BLOCK + i;  // position in the chunk
        int32_t code;
        if constexpr (BITS == 4) {
          const int64_t h = width / 2;
          code = j < h ? (wc[j] & 0x0F) : (wc[j - h] >> 4);
        } else {
          code = wc[j];
        }
        dot += code * static_cast<int32_t>(xq[b * BLOCK + j]);
      }
      total += dx[b + half] * s[blk2grp[b + half]] * static_cast<float>(dot);
    }
  }
  return total;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLAMACTL_VNNI 1

template <int BITS>
inline __m512i load_codes(const uint8_t* w, int64_t b) {
  // the 64 codes of the chunk starting at block b, as unsigned bytes in input order
  if constexpr (BITS == 4) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * BLOCK / 2));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    return _mm512_loadu_si512(w + b * BLOCK);
  }
}

// The vector part for R consecutive weight rows (w: the first, rows row_bytes apart; s: its
// scales, rows `groups` apart) over blocks [0, nb2), nb2 even: out[r] = sum dx * s * (codes . xq).
// xs: per chunk of 64, 16 floats (dx of its first block 8 times, then of its second). The R rows
// share every load of x and keep R independent accumulators.
template <int BITS, int R, int MODE>
void vec_rows(const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* xs, const float* s, int64_t groups,
              const int32_t* grp, int64_t nb2, float* out) {
  __m512 acc[R], gacc[R];
  for (int r = 0; r < R; ++r) acc[r] = gacc[r] = _mm512_setzero_ps();
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  int32_t group = grp[0];
  for (int64_t b = 0; b < nb2; b += 2) {
    const __m512i xv = _mm512_loadu_si512(xq + b * BLOCK);
    const __m512 xscale = _mm512_loadu_ps(xs + b * 8);
    if (MODE == GROUPED && grp[b] != group) {  // a new group: the last one's sums times its scales
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_set1_ps(s[r * groups + group]), acc[r]);
        gacc[r] = _mm512_setzero_ps();
      }
      group = grp[b];
    }
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_codes<BITS>(w + r * row_bytes, b), xv);
      const __m512 f = _mm512_cvtepi32_ps(dot);  // lanes 0-7: block b, 8-15: b + 1
      if constexpr (MODE == GROUPED) {
        gacc[r] = _mm512_fmadd_ps(f, xscale, gacc[r]);
      } else {
        __m512 ws;
        if constexpr (MODE == BLOCKWISE) {  // s[b], s[b + 1]: one 8-byte load, spread over the halves
          const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + r * groups + b)));
          ws = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(two));
        } else {
          ws = _mm512_insertf32x8(_mm512_set1_ps(s[r * groups + grp[b]]), _mm256_set1_ps(s[r * groups + grp[b + 1]]), 1);
        }
        acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(xscale, ws), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (MODE == GROUPED) acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_set1_ps(s[r * groups + group]), acc[r]);
    out[r] = _mm512_reduce_add_ps(acc[r]);
  }
}

template <int BITS, int R>
void vec_rows_mode(int mode, const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* xs, const float* s,
                   int64_t groups, const int32_t* grp, int64_t nb2, float* out) {
  if (mode == GROUPED) vec_rows<BITS, R, GROUPED>(w, row_bytes, xq, xs, s, groups, grp, nb2, out);
  else if (mode == BLOCKWISE) vec_rows<BITS, R, BLOCKWISE>(w, row_bytes, xq, xs, s, groups, grp, nb2, out);
  else vec_rows<BITS, R, GENERIC>(w, row_bytes, xq, xs, s, groups, grp, nb2, out);
}
#endif

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    i = n;
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// out[r] for weight rows o .. o + R - 1 against one row of x: the dots, less the zero points' part
template <int BITS, int R>
void rows_dot(const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* dx, const float* xs, const float* s,
              const float* sz, const float* gz, int64_t groups, const int32_t* grp, int64_t nb, int mode, float* out) {
  int64_t b = 0;
  for (int r = 0; r < R; ++r) out[r] = 0.f;
#ifdef LLAMACTL_VNNI
  b = nb / 2 * 2;
  if (b) vec_rows_mode<BITS, R>(mode, w, row_bytes, xq, xs, s, groups, grp, b, out);
#endif
  for (int r = 0; r < R; ++r) {
    out[r] += tail_dot<BITS>(w + r * row_bytes, xq, dx, s + r * groups, grp, b, nb);
    out[r] -= dot_f32(sz + r * groups, gz, groups);
  }
}

template <typename T>
void store_row(T* out, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(v[i]);
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros,
                 const at::Tensor& blk2grp, const at::Tensor& perm, int64_t bits) {
  // x: [M, K] float32 or bf16; w: uint8 [N, K * bits / 8]; scales, szeros: float32 [N, G]
  // blk2grp: int32 [K / 32]; perm: int64 [K] (act-order: x is read as x[:, perm]) or empty -> [M, N]
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qgemv: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qgemv: x must be float32 or bf16");
  TORCH_CHECK(bits == 4 || bits == 8, "qgemv: bits must be 4 or 8");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), groups = scales.size(1);
  TORCH_CHECK(k % BLOCK == 0 && blk2grp.numel() == k / BLOCK, "qgemv: K must be whole blocks of 32");
  TORCH_CHECK(w.size(1) == k * bits / 8 && w.scalar_type() == at::kByte && w.is_contiguous(), "qgemv: weight layout");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && szeros.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  szeros.is_contiguous() && scales.sizes() == szeros.sizes() && scales.size(0) == n,
              "qgemv: scales and szeros must be float32 [N, G]");
  TORCH_CHECK(blk2grp.scalar_type() == at::kInt && blk2grp.is_contiguous(), "qgemv: blk2grp must be int32");
  TORCH_CHECK(m <= MAX_ROWS, "qgemv: at most 8 rows");
  const int64_t* p = perm.numel() ? perm.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!p || (perm.numel() == k && perm.scalar_type() == at::kLong), "qgemv: perm must be int64 [K]");
  const int32_t* grp = blk2grp.data_ptr<int32_t>();
  QuantRows q = x.scalar_type() == at::kBFloat16
                    ? quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, p, grp, groups)
                    : quantize_rows(x.data_ptr<float>(), m, k, p, grp, groups);
  at::Tensor y = at::empty({m, n}, x.options());
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = szeros.data_ptr<float>();
  const int64_t nb = k / BLOCK, row_bytes = k * bits / 8;
  int mode = GROUPED, blockwise = 1;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 2 && grp[b] != grp[b - 1]) mode = GENERIC;
    blockwise &= grp[b] == b;
  }
  if (mode == GENERIC && blockwise) mode = BLOCKWISE;
  constexpr int64_t R = 4;  // weight rows a step shares x's loads between
  at::parallel_for(0, (n + R - 1) / R, 4, [&](int64_t begin, int64_t end) {
    float tmp[R];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * R, rows = std::min(R, n - o);
      for (int64_t r = 0; r < m; ++r) {
        const int8_t* xq = q.xq.data() + r * k;
        const float* dx = q.dx.data() + r * nb;
        const float* xs = q.xs.data() + r * nb * 8;
        const float* gz = q.gz.data() + r * groups;
        for (int64_t i = 0; i < rows;) {
          const uint8_t* wr = wp + (o + i) * row_bytes;
          const float* s = sp + (o + i) * groups;
          const float* sz = zp + (o + i) * groups;
          const int take = rows - i >= R ? R : 1;
          if (take == R) {
            if (bits == 4) rows_dot<4, R>(wr, row_bytes, xq, dx, xs, s, sz, gz, groups, grp, nb, mode, tmp);
            else rows_dot<8, R>(wr, row_bytes, xq, dx, xs, s, sz, gz, groups, grp, nb, mode, tmp);
          } else {
            if (bits == 4) rows_dot<4, 1>(wr, row_bytes, xq, dx, xs, s, sz, gz, groups, grp, nb, mode, tmp);
            else rows_dot<8, 1>(wr, row_bytes, xq, dx, xs, s, sz, gz, groups, grp, nb, mode, tmp);
          }
          if (bf16_out) store_row(y.data_ptr<c10::BFloat16>() + r * n + o + i, tmp, take);
          else store_row(y.data_ptr<float>() + r * n + o + i, tmp, take);
          i += take;
        }
      }
    }
  });
  return y;
}

// dots of R consecutive bf16 weight rows (k apart) with one bf16 row of x
template <int R>
void bf16_rows_dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, float* out) {
  int64_t i = 0;
  for (int r = 0; r < R; ++r) out[r] = 0.f;
#if defined(__AVX512BF16__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * k + i)), xv);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#endif
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r) out[r] += static_cast<float>(w[r * k + i]) * static_cast<float>(x[i]);
}

at::Tensor bgemv(const at::Tensor& x, const at::Tensor& w) {
  // x: [M, K] float32 or bf16 (rounded to bf16); w: bf16 [N, K] -> [M, N] in x's dtype
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bgemv: shapes");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "bgemv: w must be contiguous bf16");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "bgemv: at most 8 rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bgemv: x must be float32 or bf16");
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* xp = xb.data_ptr<c10::BFloat16>();
  // one weight row at a time: rows of 4 KB read side by side alias in the L1 cache (measured 5x slower)
  c10::BFloat16* yb = bf16_out ? y.data_ptr<c10::BFloat16>() : nullptr;
  float* yf = bf16_out ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t r = 0; r < m; ++r) {
        float v;
        bf16_rows_dot<1>(wp + o * k, xp + r * k, k, &v);
        if (yb) yb[r * n + o] = static_cast<c10::BFloat16>(v);
        else yf[r * n + o] = v;
      }
  });
  return y;
}

at::Tensor dequant(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros, const at::Tensor& blk2grp,
                   int64_t bits, int64_t k) {
  // qgemv's weights -> bf16 [N, K] (s * code - s * z), for prefill's matmul
  TORCH_CHECK(bits == 4 || bits == 8, "dequant: bits must be 4 or 8");
  const int64_t n = w.size(0), groups = scales.size(1), nb = k / BLOCK, row_bytes = k * bits / 8;
  TORCH_CHECK(w.size(1) == row_bytes && blk2grp.numel() == nb, "dequant: weight layout");
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kBFloat16));
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = szeros.data_ptr<float>();
  const int32_t* grp = blk2grp.data_ptr<int32_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* wr = wp + o * row_bytes;
      c10::BFloat16* orow = op + o * k;
      for (int64_t b = 0; b < nb; b += 2) {
        const int64_t width = b + 2 <= nb ? 2 * BLOCK : BLOCK;
        for (int64_t j = 0; j < width; ++j) {
          int32_t code;
          if (bits == 4) {
            const uint8_t* wc = wr + b * BLOCK / 2;
            const int64_t h = width / 2;
            code = j < h ? (wc[j] & 0x0F) : (wc[j - h] >> 4);
          } else {
            code = wr[b * BLOCK + j];
          }
          const int32_t g = grp[b + j / BLOCK];
          orow[b * BLOCK + j] = static_cast<c10::BFloat16>(sp[o * groups + g] * code - zp[o * groups + g]);
        }
      }
    }
  });
  return out;
}

int64_t features() {
  // which vector paths this build has: 1 VNNI (qgemv), 2 BF16 (bgemv)
  int64_t f = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  f |= 1;
#endif
#if defined(__AVX512BF16__)
  f |= 2;
#endif
  return f;
}

}  // namespace

TORCH_LIBRARY(llamactl_cpu, lib) {
  lib.def("qgemv(Tensor x, Tensor w, Tensor scales, Tensor szeros, Tensor blk2grp, Tensor perm, int bits) -> Tensor");
  lib.def("bgemv(Tensor x, Tensor w) -> Tensor");
  lib.def("dequant(Tensor w, Tensor scales, Tensor szeros, Tensor blk2grp, int bits, int k) -> Tensor");
  lib.def("features() -> int");
}

TORCH_LIBRARY_IMPL(llamactl_cpu, CPU, lib) {
  lib.impl("qgemv", qgemv);
  lib.impl("bgemv", bgemv);
  lib.impl("dequant", dequant);
}

TORCH_LIBRARY_IMPL(llamactl_cpu, CompositeExplicitAutograd, lib) {
  lib.impl("features", features);
}
