// llamactl's CPU low-bit products (a decode step's rows, or a prefill's: 4 rows of x share each
// weight load there, tile_dot_rows) and 16-bit matrix-vector products, built on the user's machine
// by llamactl.kernels.cpu (g++ -O3 -march=native) and called as torch operators.
//
// qgemv: low-bit weights read once per call, never dequantized to a copy. In the manner of
// llama.cpp's Q4_0/Q8_0 dot products, each row of x is rounded to int8 per block of 32 inputs
// (scale amax / 127, one float per block) and multiplied with the unsigned weight codes in
// integers (AVX-512 VNNI's vpdpbusd: u8 x s8 -> s32), then scaled per block:
//   y[m, n] = sum_b dx[m, b] * s[n, g(b)] * (sum_{i in b} q[n, i] * xq[m, i] - z[n, g(b)] * sum_{i in b} xq[m, i])
// (the integer dot and the zero point's part are exact in float: both below 2^24)
// Weights are stored in tiles of 16 output rows (the last tile padded with zero rows), the rows of
// a tile interleaved by 4 inputs, so that one 64-byte load feeds one vpdpbusd for 16 outputs at
// once (x's 4 bytes broadcast) and a tile's 16 sums stay in one register's lanes (no horizontal
// sums). Per tile, units of 4 inputs, each 64 bytes (byte 4 r + j of a unit for row r, input j):
//   8 bits (codes 0..255): unit u holds inputs 4u .. 4u + 3; a tile is 16 K bytes
//   4 bits (codes 0..15): per chunk of 64 inputs 8 units, unit t holding inputs 4t + j in its low
//     nibbles and 32 + 4t + j in its high ones (a last chunk of 32: 4 units, 16 in place of 32);
//     a tile is 8 K bytes
//   5 and 6 bits: the low 4 bits as for 4, then (from byte 8 K of the tile) per unit u (counted
//     over the tile), nibble h (0 low, 1 high) and extra bit e (bits - 4 of them), a 64-bit mask
//     whose bit 4 r + j is bit 4 + e of that code; a tile is 8 K + 2 K (bits - 4) bytes. One masked
//     byte add puts a plane's bit into 64 codes, so 5 and 6 bits cost their bytes and two to four
//     instructions a unit more than 4
// Scales s: [tiles, groups, 16] float32, or fp16 where the checkpoint's scales are fp16 exactly;
// zero points z: uint8 [tiles, groups, 16]; blk2grp [K / 32]: the group of each block of 32 inputs
// (every block lies in one group; groups of any size and order).
//
// bgemv: 16-bit weights (bf16) with x rounded to bf16, accumulated in float (AVX-512 BF16's
// vdpbf16ps), for the 16-bit layers. dequant: qgemv's weights as bf16 [N, K], for prefill's matmul.
//
// Without AVX-512 VNNI / BF16 the same arithmetic runs in plain loops (slower, same results).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 16;
constexpr int64_t UNIT = 64;  // bytes of one unit of 4 inputs for a tile's 16 rows
constexpr int64_t MAX_ROWS = 8;  // bgemv's rows (qgemv takes any number)
constexpr int64_t PREFETCH = 2048;  // bytes ahead of the weight stream to prefetch

// x rounded per block: codes xq [M, K], scales dx and code sums xsum [M, K / 32].
// Kept per thread between calls (no allocation per call).
struct QuantRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum, row;
};

template <typename T>
void quantize_row(QuantRows& q, float* row, const T* x, int64_t r, int64_t k, const int64_t* perm) {
  // row r of x (through perm) rounded into q; row: a float buffer of k
  const int64_t nb = k / BLOCK;
  const T* xr = x + r * k;
  if (perm) for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(xr[perm[i]]);
  else for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(xr[i]);
  int8_t* xq = q.xq.data() + r * k;
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = row + b * BLOCK;
    int32_t sum = 0;
    float d;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
    d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1))) / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv));  // round half to even, as nearbyint
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float amax = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
    d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * inv));
      xq[b * BLOCK + i] = static_cast<int8_t>(c);
      sum += c;
    }
#endif
    q.dx[r * nb + b] = d;
    q.xsum[r * nb + b] = static_cast<float>(sum);
  }
}

template <typename T>
void quantize_rows(QuantRows& q, const T* x, int64_t m, int64_t k, const int64_t* perm) {
  const int64_t nb = k / BLOCK;
  q.xq.resize(m * k);
  q.dx.resize(m * nb);
  q.xsum.resize(m * nb);
  q.row.resize(k);
  if (m == 1) return quantize_row(q, q.row.data(), x, 0, k, perm);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {  // a prefill's rows on every thread
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) quantize_row(q, row.data(), x, r, k, perm);
  });
}

// Where the high bit planes of nibble h (0 low, 1 high) of unit u start in a 5- or 6-bit tile of
// K inputs (BITS - 4 of them, 8 bytes each).
template <int BITS>
inline const uint8_t* planes_at(const uint8_t* tile, int64_t k, int64_t u, int h) {
  return tile + 8 * k + (u * 2 + h) * (BITS - 4) * 8;
}

// Plane e of nibble h of unit u, as a 64-bit integer.
template <int BITS>
inline uint64_t plane_mask(const uint8_t* tile, int64_t k, int64_t u, int h, int e) {
  uint64_t m;
  std::memcpy(&m, planes_at<BITS>(tile, k, u, h) + e * 8, 8);
  return m;
}

// The code of (row r, input i) in a tile of K inputs (the layout above).
template <int BITS>
inline int32_t code_at(const uint8_t* tile, int64_t r, int64_t i, int64_t k) {
  if constexpr (BITS == 8) {
    return tile[(i / 4) * UNIT + 4 * r + i % 4];
  } else {
    const int64_t c = i / 64, base = c * 64, half = std::min<int64_t>(64, k - base) / 2, p = i - base;
    const int h = p < half ? 0 : 1;
    const int64_t q = h ? p - half : p, u = c * 8 + q / 4, bit = 4 * r + q % 4;
    const uint8_t byte = tile[u * UNIT + bit];
    int32_t code = h ? (byte >> 4) : (byte & 0x0F);
    if constexpr (BITS > 4)
      for (int e = 0; e < BITS - 4; ++e) code |= static_cast<int32_t>((plane_mask<BITS>(tile, k, u, h, e) >> bit) & 1) << (4 + e);
    return code;
  }
}

inline float as_float(float v) { return v; }
inline float as_float(c10::Half v) { return static_cast<float>(v); }

// A tile's 16 outputs for one row of x, in plain loops.
template <int BITS, typename S>
void tile_dot_plain(const uint8_t* w, const int8_t* xq, const float* dx, const float* xsum, const S* s,
                    const uint8_t* z, const int32_t* grp, int64_t k, float* out) {
  const int64_t nb = k / BLOCK;
  for (int64_t r = 0; r < TILE; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t dot = 0;
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i) dot += code_at<BITS>(w, r, i, k) * xq[i];
      const int64_t g = grp[b] * TILE + r;
      total += dx[b] * as_float(s[g]) * (static_cast<float>(dot) - static_cast<float>(z[g]) * xsum[b]);
    }
    out[r] = total;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLAMACTL_VNNI 1

inline __m512 load_scales(const float* s) { return _mm512_loadu_ps(s); }
inline __m512 load_scales(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

inline __m512i bcast4(const int8_t* x) {  // x's 4 bytes in every lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// 64 codes of nibble h of unit u (bytes 0..15) with a 5- or 6-bit tile's high bits added
template <int BITS>
inline __m512i with_high(__m512i c, const uint8_t* tile, int64_t k, int64_t u, int h) {
  if constexpr (BITS > 4) {  // the masks loaded straight into mask registers (kmovq k, m64: through a
    // general register they cost 1.35x (5 bits) and 1.7x (6 bits) a product; gcc declares the pointer non-const)
    __mmask64* m = reinterpret_cast<__mmask64*>(const_cast<uint8_t*>(planes_at<BITS>(tile, k, u, h)));
    c = _mm512_mask_add_epi8(c, _load_mask64(m), c, _mm512_set1_epi8(16));
    if constexpr (BITS > 5) c = _mm512_mask_add_epi8(c, _load_mask64(m + 1), c, _mm512_set1_epi8(32));
  }
  return c;
}

// A tile's 16 outputs for one row of x: one vpdpbusd per unit, independent accumulators.
template <int BITS, typename S>
void tile_dot(const uint8_t* w, const int8_t* xq, const float* dx, const float* xsum, const S* s, const uint8_t* z,
              const int32_t* grp, int64_t k, float* out) {
  const int64_t nb = k / BLOCK;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  // block b's integer dot `dot` (times `unit`: 16 for high nibbles used in place) into acc:
  // acc += dx[b] / unit * s[g(b)] * (dot - unit * z[g(b)] * xsum[b]), for the 16 rows
  const auto add = [&](__m512& acc, __m512i dot, int64_t b, float unit) {
    const int64_t g = grp[b] * TILE;
    const __m512 zs = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g))));
    const __m512 f = _mm512_fnmadd_ps(zs, _mm512_set1_ps(unit * xsum[b]), _mm512_cvtepi32_ps(dot));
    acc = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(dx[b] / unit), load_scales(s + g)), acc);
  };
  if constexpr (BITS == 8) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + b * 8 * UNIT;
      const int8_t* xb = xq + b * BLOCK;
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        i0 = _mm512_dpbusd_epi32(i0, _mm512_loadu_si512(wb + t * UNIT), bcast4(xb + 4 * t));
        i1 = _mm512_dpbusd_epi32(i1, _mm512_loadu_si512(wb + (t + 1) * UNIT), bcast4(xb + 4 * t + 4));
      }
      add(b % 2 ? acc1 : acc0, _mm512_add_epi32(i0, i1), b, 1.f);
    }
  } else {
    // 4 bits: the high nibbles are used in place (16 x the code); 5 and 6 bits shift them down
    // first, as their high bits go above them
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    const float hi_unit = BITS == 4 ? 16.f : 1.f;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const uint8_t* wc = w + b * 4 * UNIT;  // a chunk of 64 inputs: 8 units
      const int8_t* x0 = xq + b * BLOCK;
      const int64_t u0 = b / 2 * 8;  // the chunk's first unit
      _mm_prefetch(reinterpret_cast<const char*>(wc + PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wc + PREFETCH + 4 * UNIT), _MM_HINT_T0);
      __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, hi[2] = {lo[0], lo[0]};
      for (int t = 0; t < 8; ++t) {
        const __m512i v = _mm512_loadu_si512(wc + t * UNIT);
        __m512i cl = _mm512_and_si512(v, lo4), ch = _mm512_and_si512(v, hi4);
        if constexpr (BITS > 4) {
          cl = with_high<BITS>(cl, w, k, u0 + t, 0);
          ch = with_high<BITS>(_mm512_srli_epi16(ch, 4), w, k, u0 + t, 1);
        }
        lo[t % 2] = _mm512_dpbusd_epi32(lo[t % 2], cl, bcast4(x0 + 4 * t));
        hi[t % 2] = _mm512_dpbusd_epi32(hi[t % 2], ch, bcast4(x0 + BLOCK + 4 * t));
      }
      add(acc0, _mm512_add_epi32(lo[0], lo[1]), b, 1.f);
      add(acc1, _mm512_add_epi32(hi[0], hi[1]), b + 1, hi_unit);
    }
    if (b < nb) {  // a last chunk of 32 inputs: 4 units, inputs 4t + j low, 16 + 4t + j high
      const uint8_t* wc = w + b * 4 * UNIT;
      const int8_t* x0 = xq + b * BLOCK;
      const int64_t u0 = b / 2 * 8;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(wc + t * UNIT);
        const __m512i cl = with_high<BITS>(_mm512_and_si512(v, lo4), w, k, u0 + t, 0);
        const __m512i ch = with_high<BITS>(_mm512_srli_epi16(_mm512_and_si512(v, hi4), 4), w, k, u0 + t, 1);
        lo = _mm512_dpbusd_epi32(lo, cl, bcast4(x0 + 4 * t));
        hi = _mm512_dpbusd_epi32(hi, ch, bcast4(x0 + 16 + 4 * t));
      }
      add(acc0, _mm512_add_epi32(lo, hi), b, 1.f);
    }
  }
  _mm512_storeu_ps(out, _mm512_add_ps(acc0, acc1));
}

// R rows of x against one tile (4 or 8 bits): each unit's 64 bytes are loaded and split into
// nibbles once for all R rows, and only the vpdpbusd is per row (a prefill's product: R times
// tile_dot's multiplies for one load and mask). Each row's sums are tile_dot's, in its order (the
// integer dots are exact, the float steps the same), so a row gets the same result in any batch.
// xq, dx, xsum: row r at r * k, r * (k / 32); out: [R, 16].
template <int BITS, int R, typename S>
void tile_dot_rows(const uint8_t* w, const int8_t* xq, const float* dx, const float* xsum, const S* s,
                   const uint8_t* z, const int32_t* grp, int64_t k, float* out) {
  static_assert(BITS == 4 || BITS == 8, "tile_dot_rows: 4 or 8 bits");
  const int64_t nb = k / BLOCK;
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  // block b's integer dots (times `unit`) into each row's acc, as tile_dot's `add`; the group's
  // zero points and scales loaded once for the R rows
  const auto add = [&](__m512* acc, const __m512i* dot, int64_t b, float unit) {
    const int64_t g = grp[b] * TILE;
    const __m512 zs = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g))));
    const __m512 sc = load_scales(s + g);
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_fnmadd_ps(zs, _mm512_set1_ps(unit * xsum[r * nb + b]), _mm512_cvtepi32_ps(dot[r]));
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(dx[r * nb + b] / unit), sc), acc[r]);
    }
  };
  if constexpr (BITS == 8) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + b * 8 * UNIT;
      __m512i i[R];
      for (int r = 0; r < R; ++r) i[r] = _mm512_setzero_si512();
      for (int t = 0; t < 8; ++t) {
        const __m512i v = _mm512_loadu_si512(wb + t * UNIT);
        for (int r = 0; r < R; ++r) i[r] = _mm512_dpbusd_epi32(i[r], v, bcast4(xq + r * k + b * BLOCK + 4 * t));
      }
      add(b % 2 ? acc1 : acc0, i, b, 1.f);
    }
  } else {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {  // a chunk of 64 inputs: 8 units, the high nibbles in place (16 x)
      const uint8_t* wc = w + b * 4 * UNIT;
      _mm_prefetch(reinterpret_cast<const char*>(wc + PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wc + PREFETCH + 4 * UNIT), _MM_HINT_T0);
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int t = 0; t < 8; ++t) {
        const __m512i v = _mm512_loadu_si512(wc + t * UNIT);
        const __m512i cl = _mm512_and_si512(v, lo4), ch = _mm512_and_si512(v, hi4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x0 = xq + r * k + b * BLOCK;
          lo[r] = _mm512_dpbusd_epi32(lo[r], cl, bcast4(x0 + 4 * t));
          hi[r] = _mm512_dpbusd_epi32(hi[r], ch, bcast4(x0 + BLOCK + 4 * t));
        }
      }
      add(acc0, lo, b, 1.f);
      add(acc1, hi, b + 1, 16.f);
    }
    if (b < nb) {  // a last chunk of 32 inputs: 4 units, inputs 4t + j low, 16 + 4t + j high
      const uint8_t* wc = w + b * 4 * UNIT;
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(wc + t * UNIT);
        const __m512i cl = _mm512_and_si512(v, lo4), ch = _mm512_srli_epi16(_mm512_and_si512(v, hi4), 4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x0 = xq + r * k + b * BLOCK;
          lo[r] = _mm512_dpbusd_epi32(lo[r], cl, bcast4(x0 + 4 * t));
          hi[r] = _mm512_dpbusd_epi32(hi[r], ch, bcast4(x0 + 16 + 4 * t));
        }
      }
      for (int r = 0; r < R; ++r) lo[r] = _mm512_add_epi32(lo[r], hi[r]);
      add(acc0, lo, b, 1.f);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, _mm512_add_ps(acc0[r], acc1[r]));
}
#endif

template <int BITS, typename S>
void tile_dot_any(const uint8_t* w, const int8_t* xq, const float* dx, const float* xsum, const S* s,
                  const uint8_t* z, const int32_t* grp, int64_t k, float* out) {
#ifdef LLAMACTL_VNNI
  tile_dot<BITS, S>(w, xq, dx, xsum, s, z, grp, k, out);
#else
  tile_dot_plain<BITS, S>(w, xq, dx, xsum, s, z, grp, k, out);
#endif
}

// f(std::integral_constant<int, bits>) for the stored widths (4, 5, 6, 8)
template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, 8>{});
  }
}

template <typename T>
void store_row(T* out, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(v[i]);
}

void check_layout(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& blk2grp,
                  int64_t bits, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, op, ": bits must be 4, 5, 6 or 8");
  TORCH_CHECK(k % BLOCK == 0 && blk2grp.numel() == k / BLOCK, op, ": K must be whole blocks of 32");
  const int64_t tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == tiles &&
                  w.size(1) == k * bits / 8 * TILE, op, ": weight layout (uint8 [tiles, K * bits / 8 * 16])");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == tiles && scales.size(2) == TILE,
              op, ": scales must be float32 or fp16 [tiles, G, 16]");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous() && zeros.sizes() == scales.sizes(), op,
              ": zeros must be uint8 [tiles, G, 16]");
  TORCH_CHECK(blk2grp.scalar_type() == at::kInt && blk2grp.is_contiguous(), op, ": blk2grp must be int32");
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                 const at::Tensor& blk2grp, const at::Tensor& perm, int64_t bits, int64_t n) {
  // x: [M, K] float32 or bf16; w, scales, zeros: the tiles (above); blk2grp: int32 [K / 32];
  // perm: int64 [K] (act-order: x is read as x[:, perm]) or empty -> [M, n] in x's dtype
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qgemv: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qgemv: x must be float32 or bf16");
  const int64_t m = x.size(0), k = x.size(1), groups = scales.size(1), nb = k / BLOCK;
  check_layout(w, scales, zeros, blk2grp, bits, n, k, "qgemv");
  const int64_t* p = perm.numel() ? perm.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!p || (perm.numel() == k && perm.scalar_type() == at::kLong), "qgemv: perm must be int64 [K]");
  const int32_t* grp = blk2grp.data_ptr<int32_t>();
  thread_local QuantRows q;
  if (x.scalar_type() == at::kBFloat16) quantize_rows(q, x.data_ptr<c10::BFloat16>(), m, k, p);
  else quantize_rows(q, x.data_ptr<float>(), m, k, p);
  at::Tensor y = at::empty({m, n}, x.options());
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  const bool half = scales.scalar_type() == at::kHalf;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  const void* sp = scales.data_ptr();
  const int64_t tile_bytes = w.size(1), tiles = w.size(0);
  const QuantRows& qr = q;
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    float tmp[4 * TILE];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = wp + t * tile_bytes;
      const uint8_t* zt = zp + t * groups * TILE;
      const int64_t o = t * TILE, rows = std::min(TILE, n - o);
      const auto put = [&](int64_t r, const float* v) {  // the tile's outputs of x's row r into y
        if (bf16_out) store_row(y.data_ptr<c10::BFloat16>() + r * n + o, v, rows);
        else store_row(y.data_ptr<float>() + r * n + o, v, rows);
      };
      const auto tile_rows = [&](auto st) {
        dispatch_bits(bits, [&](auto tag) {
          constexpr int BITS = decltype(tag)::value;
          int64_t r = 0;
#ifdef LLAMACTL_VNNI
          if constexpr (BITS == 4 || BITS == 8) {  // 4 rows a weight load (tile_dot_rows)
            for (; r + 4 <= m; r += 4) {
              tile_dot_rows<BITS, 4>(wt, qr.xq.data() + r * k, qr.dx.data() + r * nb, qr.xsum.data() + r * nb, st,
                                     zt, grp, k, tmp);
              for (int64_t i = 0; i < 4; ++i) put(r + i, tmp + i * TILE);
            }
          }
#endif
          for (; r < m; ++r) {
            tile_dot_any<BITS>(wt, qr.xq.data() + r * k, qr.dx.data() + r * nb, qr.xsum.data() + r * nb, st, zt,
                               grp, k, tmp);
            put(r, tmp);
          }
        });
      };
      if (half) tile_rows(static_cast<const c10::Half*>(sp) + t * groups * TILE);
      else tile_rows(static_cast<const float*>(sp) + t * groups * TILE);
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
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + i) + PREFETCH, _MM_HINT_T0);
      acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * k + i)), xv);
    }
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

template <int BITS, typename S>
void dequant_tile(const uint8_t* wt, const S* st, const uint8_t* zt, const int32_t* grp, int64_t k, int64_t rows,
                  c10::BFloat16* out) {
  // one tile -> rows [rows, K] of bf16 (s * code - s * z)
  thread_local std::vector<uint8_t> codes;  // [16, K], the tile's codes in row order
  codes.resize(TILE * k);
  uint8_t* c = codes.data();
  if constexpr (BITS == 8) {
    for (int64_t u = 0; u < k / 4; ++u)
      for (int64_t r = 0; r < TILE; ++r) std::memcpy(c + r * k + 4 * u, wt + u * UNIT + 4 * r, 4);
  } else {
    for (int64_t base = 0; base < k; base += 64) {  // a chunk: its units, low nibbles then high
      const int64_t half = std::min<int64_t>(64, k - base) / 2;
      const uint8_t* wc = wt + base / 64 * 8 * UNIT;
      for (int64_t t = 0; t < half / 4; ++t) {
        uint64_t planes[2][2] = {{0, 0}, {0, 0}};  // [nibble][extra bit]: 5 and 6 bits' high bits
        if constexpr (BITS > 4)
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < BITS - 4; ++e) planes[h][e] = plane_mask<BITS>(wt, k, base / 64 * 8 + t, h, e);
        for (int64_t r = 0; r < TILE; ++r)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = wc[t * UNIT + 4 * r + j];
            const int bit = static_cast<int>(4 * r + j);
            uint8_t lo = byte & 0x0F, hi = byte >> 4;
            for (int e = 0; e < BITS - 4; ++e) {
              lo |= static_cast<uint8_t>(((planes[0][e] >> bit) & 1) << (4 + e));
              hi |= static_cast<uint8_t>(((planes[1][e] >> bit) & 1) << (4 + e));
            }
            c[r * k + base + 4 * t + j] = lo;
            c[r * k + base + half + 4 * t + j] = hi;
          }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / BLOCK; ++b) {
      const int64_t g = grp[b];
      const float s = as_float(st[g * TILE + r]), sz = s * static_cast<float>(zt[g * TILE + r]);
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i)
        out[r * k + i] = static_cast<c10::BFloat16>(s * static_cast<float>(codes[r * k + i]) - sz);
    }
}

at::Tensor dequant(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& blk2grp,
                   int64_t bits, int64_t n, int64_t k) {
  // qgemv's weights -> bf16 [n, K], for prefill's matmul
  check_layout(w, scales, zeros, blk2grp, bits, n, k, "dequant");
  const int64_t groups = scales.size(1), tile_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kBFloat16));
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  const int32_t* grp = blk2grp.data_ptr<int32_t>();
  const bool half = scales.scalar_type() == at::kHalf;
  at::parallel_for(0, w.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = std::min(TILE, n - t * TILE);
      const uint8_t* wt = wp + t * tile_bytes;
      const uint8_t* zt = zp + t * groups * TILE;
      c10::BFloat16* o = op + t * TILE * k;
      if (half) {
        const c10::Half* st = scales.data_ptr<c10::Half>() + t * groups * TILE;
        dispatch_bits(bits, [&](auto tag) { dequant_tile<decltype(tag)::value>(wt, st, zt, grp, k, rows, o); });
      } else {
        const float* st = scales.data_ptr<float>() + t * groups * TILE;
        dispatch_bits(bits, [&](auto tag) { dequant_tile<decltype(tag)::value>(wt, st, zt, grp, k, rows, o); });
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
  lib.def("qgemv(Tensor x, Tensor w, Tensor scales, Tensor zeros, Tensor blk2grp, Tensor perm, int bits, int n) -> Tensor");
  lib.def("bgemv(Tensor x, Tensor w) -> Tensor");
  lib.def("dequant(Tensor w, Tensor scales, Tensor zeros, Tensor blk2grp, int bits, int n, int k) -> Tensor");
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
