// llamactl's CPU decode attention: one new position per row against the static KV cache, reading
// only the cache positions in use (SDPA reads the whole cache under a mask), the query heads of a
// KV head sharing each cache row's loads (grouped-query attention without a copy).
//
// decode_attention(q [B, H_kv, R, D], k/v [B', H_kv, S, D] (B' >= B: cache rows 0..B-1 are used),
// pos [B] or [1] int64, scale, k_scale, v_scale) -> [B, H_kv, R, D]: row b attends to cache
// positions 0..pos[b] (pos[0] for every row when pos has one element). q, k, v: bfloat16 or float32
// alike, sums and the softmax in float32; or k, v int8 or float8_e4m3fn with float16 scales
// k_scale, v_scale [B', H_kv, S] (an 8-bit cache, runtime.kv_format: a position's key is
// k * k_scale), each position's scale multiplied into its score and its weight.
//
// kv_quantize(x [..., D] float32 or bfloat16, int8) -> (values [..., D] int8 or float8_e4m3fn,
// scales [...] float16): runtime.kv_format.quantize's rounding in one pass (a cache write's
// dozen PyTorch operators a layer and step, one here).
//
// Work is split over (row, KV head, chunk of 32-256 positions), as flash-decoding does, so that a
// long cache keeps every thread busy when B x H_kv is small; each chunk keeps its running max and
// sum, and a last pass combines the chunks of a (row, head). exp is a polynomial (2^f on [0, 1),
// relative error about 2e-7) that the compiler vectorizes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t CHUNK = 256;  // cache positions one task reads, at most
constexpr int64_t MIN_CHUNK = 32;  // ... and at least (fewer tasks rather than tinier ones)
constexpr int64_t MAX_R = 16;  // query heads per KV head (kernels/cpu.py ATTN_MAX_GROUP)
constexpr int64_t MAX_D = 256;  // head width (kernels/cpu.py ATTN_MAX_HEAD_DIM)

inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return static_cast<float>(v); }
inline float as_float(c10::Float8_e4m3fn v) { return static_cast<float>(v); }
inline float as_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 2^f on [0, 1), degree-5 minimax, highest power first; e^x for x <= 0 is 2^n 2^f with
// x log2(e) = n + f, and below -87 it is 0 to float precision
constexpr float EXP2_POLY[6] = {1.8775767e-3f, 8.9893397e-3f, 5.5826318e-2f, 2.4015361e-1f, 6.9315308e-1f, 1.0f};
constexpr float EXP_FLOOR = -87.0f, LOG2E = 1.4426950409f;

inline float exp_neg(float x) {
  // e^x for x <= 0 (a score less the running max)
  x = std::max(x, EXP_FLOOR) * LOG2E;
  const float n = std::floor(x), f = x - n;
  float p = EXP2_POLY[0];
  for (int i = 1; i < 6; ++i) p = p * f + EXP2_POLY[i];
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, 4);
  return p * s;
}

// One (row, KV head, chunk): the R queries' running max m, sum l and unnormalized output acc [R, D].
// ks, vs: an int8 cache's scales of positions 0.. (nullptr: none)
template <typename T>
void chunk_attention(const float* q, const T* k, const T* v, const c10::Half* ks, const c10::Half* vs, int64_t t0,
                     int64_t t1, int64_t r, int64_t d, float* m, float* l, float* acc) {
  thread_local std::vector<float> kf, sc;
  kf.resize(d);
  sc.resize(MAX_R * CHUNK);
  const int64_t n = t1 - t0;
  for (int64_t t = 0; t < n; ++t) {  // scores [R, n]
    const T* kt = k + (t0 + t) * d;
    for (int64_t i = 0; i < d; ++i) kf[i] = as_float(kt[i]);
    for (int64_t j = 0; j < r; ++j) {
      const float* qj = q + j * d;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qj[i] * kf[i];
      sc[j * CHUNK + t] = ks ? s * static_cast<float>(ks[t0 + t]) : s;
    }
  }
  for (int64_t j = 0; j < r; ++j) {  // probabilities, less the chunk's max
    float* s = sc.data() + j * CHUNK;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_neg(s[t] - mx);
      sum += s[t];
    }
    m[j] = mx;
    l[j] = sum;
    std::fill(acc + j * d, acc + (j + 1) * d, 0.0f);
  }
  for (int64_t t = 0; t < n; ++t) {  // acc[j] = sum_t p[j, t] v[t]
    const T* vt = v + (t0 + t) * d;
    for (int64_t i = 0; i < d; ++i) kf[i] = as_float(vt[i]);
    const float w = vs ? static_cast<float>(vs[t0 + t]) : 1.0f;
    for (int64_t j = 0; j < r; ++j) {
      const float p = sc[j * CHUNK + t] * w;
      float* a = acc + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * kf[i];
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> float: the bits shifted up
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {  // 16 int8 -> float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {  // 16 e4m3 -> float: exponent and mantissa under
  // float's (e4m3's value times 2^-120), times 2^120; subnormals (exponent 0: mantissa x 2^-9) apart,
  // so a flush-to-zero mode cannot lose them; the sign put back
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), _mm512_set1_ps(0x1p120f));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 f = _mm512_mask_mul_ps(normal, sub, _mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// e^x of 16 lanes, x <= 0 (exp_neg's polynomial, vectorized)
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR)), _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// chunk_attention for D = 16 DV: one query head at a time with its D / 16 vectors of q, and of its
// output, in registers (DV independent sums a cache row, not one chain the length of the chunk);
// the chunk's K and V rows (at most 256 x D) stay in L1/L2 for the next query head of the group
template <int DV, typename T>
void chunk_attention_avx512(const float* q, const T* k, const T* v, const c10::Half* ks, const c10::Half* vs,
                            int64_t t0, int64_t t1, int64_t r, float* m, float* l, float* acc) {
  constexpr int64_t d = 16 * DV;
  alignas(64) float sc[CHUNK + 16];  // one query head's scores, padded to whole vectors
  const int64_t n = t1 - t0, whole = (n + 15) / 16;
  const T* kc = k + t0 * d;
  const T* vc = v + t0 * d;
  for (int64_t j = 0; j < r; ++j) {
    __m512 qv[DV];
    for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(q + j * d + 16 * c);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      __m512 s = _mm512_mul_ps(qv[0], load16(kc + t * d));
      for (int c = 1; c < DV; ++c) s = _mm512_fmadd_ps(qv[c], load16(kc + t * d + 16 * c), s);
      sc[t] = ks ? _mm512_reduce_add_ps(s) * static_cast<float>(ks[t0 + t]) : _mm512_reduce_add_ps(s);
      mx = std::max(mx, sc[t]);
    }
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < whole; ++b) {  // probabilities less the chunk's max; the padding gets 0
      const __mmask16 live = n - 16 * b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16 * b)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(sc + 16 * b), vmx)));
      _mm512_storeu_ps(sc + 16 * b, e);
      sum = _mm512_add_ps(sum, e);
    }
    m[j] = mx;
    l[j] = _mm512_reduce_add_ps(sum);
    __m512 a[DV];  // acc[j] = sum_t p[t] v[t]
    for (int c = 0; c < DV; ++c) a[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m512 p = _mm512_set1_ps(vs ? sc[t] * static_cast<float>(vs[t0 + t]) : sc[t]);
      for (int c = 0; c < DV; ++c) a[c] = _mm512_fmadd_ps(p, load16(vc + t * d + 16 * c), a[c]);
    }
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + j * d + 16 * c, a[c]);
  }
}

// chunk_attention_avx512 for DV = 1..MAX_D / 16, indexed by DV - 1
template <typename T, int... I>
const auto& avx512_kernels(std::integer_sequence<int, I...>) {
  static const std::array table{chunk_attention_avx512<I + 1, T>...};
  return table;
}
#endif

// T: q's and out's type; K: the cache's (T, or int8_t / Float8_e4m3fn with scales ks, vs)
template <typename T, typename K = T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::Half* ks, const c10::Half* vs,
         const int64_t* pos, bool per_row, float scale, at::Tensor& out) {
  const int64_t b = q.size(0), h = q.size(1), r = q.size(2), d = q.size(3), s = k.size(2);
  int64_t longest = 1;
  for (int64_t i = 0; i < b; ++i) longest = std::max(longest, pos[per_row ? i : 0] + 1);
  // chunks of MIN_CHUNK..CHUNK positions, enough tasks for every thread (4 each) where there are
  // fewer rows x heads than that
  const int64_t want = std::max<int64_t>(1, (4 * at::get_num_threads() + b * h - 1) / (b * h));
  const int64_t size = std::clamp<int64_t>((longest + want - 1) / want, MIN_CHUNK, CHUNK);
  const int64_t chunks = (longest + size - 1) / size;
  // per task: m [R], l [R], acc [R, D]
  const int64_t stride = r * (d + 2);
  std::vector<float> work(b * h * chunks * stride);
  const T* qp = q.data_ptr<T>();
  const K* kp = k.data_ptr<K>();
  const K* vp = v.data_ptr<K>();
  at::parallel_for(0, b * h * chunks, 1, [&](int64_t lo, int64_t hi) {
    float qf[MAX_R * MAX_D];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c = task % chunks, bh = task / chunks, row = bh / h, head = bh % h;
      const int64_t len = pos[per_row ? row : 0] + 1, t0 = c * size, t1 = std::min(len, t0 + size);
      float* w = work.data() + task * stride;
      if (t0 >= t1) {  // past this row's positions
        std::fill(w, w + r, -std::numeric_limits<float>::infinity());
        std::fill(w + r, w + 2 * r, 0.0f);
        continue;
      }
      const T* qh = qp + bh * r * d;
      for (int64_t i = 0; i < r * d; ++i) qf[i] = as_float(qh[i]) * scale;
      const int64_t cache = (row * h + head) * s * d, scales = (row * h + head) * s;
      const c10::Half* kss = ks ? ks + scales : nullptr;
      const c10::Half* vss = vs ? vs + scales : nullptr;
#if defined(__AVX512F__)
      if (d % 16 == 0) {
        avx512_kernels<K>(std::make_integer_sequence<int, MAX_D / 16>())[d / 16 - 1](
            qf, kp + cache, vp + cache, kss, vss, t0, t1, r, w, w + r, w + 2 * r);
        continue;
      }
#endif
      chunk_attention<K>(qf, kp + cache, vp + cache, kss, vss, t0, t1, r, d, w, w + r, w + 2 * r);
    }
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, b * h, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> y(d);
    for (int64_t bh = lo; bh < hi; ++bh) {
      for (int64_t j = 0; j < r; ++j) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, work[(bh * chunks + c) * stride + j]);
        float sum = 0.0f;
        std::fill(y.begin(), y.end(), 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float* w = work.data() + (bh * chunks + c) * stride;
          if (w[r + j] == 0.0f) continue;  // an empty chunk
          const float f = exp_neg(w[j] - mx);
          sum += f * w[r + j];
          const float* a = w + 2 * r + j * d;
          for (int64_t i = 0; i < d; ++i) y[i] += f * a[i];
        }
        T* o = op + (bh * r + j) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(y[i] / sum);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                            double scale, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "decode_attention: contiguous tensors");
  const bool int8 = k.scalar_type() == at::kChar, fp8 = k.scalar_type() == at::kFloat8_e4m3fn, eight = int8 || fp8;
  TORCH_CHECK((eight || q.scalar_type() == k.scalar_type()) && k.scalar_type() == v.scalar_type(),
              "decode_attention: q, k, v of one dtype, or k, v int8 or float8_e4m3fn");
  TORCH_CHECK(eight == (k_scale.has_value() && v_scale.has_value()),
              "decode_attention: scales with an 8-bit cache alone");
  if (eight) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kHalf && sc->is_contiguous() && sc->dim() == 3 &&
                      sc->sizes() == k.sizes().slice(0, 3),
                  "decode_attention: scales float16 [B', H_kv, S], contiguous");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "decode_attention: cache [B' >= B, H_kv, S, D] for q [B, H_kv, R, D]");
  TORCH_CHECK(q.size(2) <= MAX_R && q.size(3) <= MAX_D, "decode_attention: at most 16 query heads a KV head, D <= 256");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && (pos.numel() == q.size(0) || pos.numel() == 1),
              "decode_attention: pos int64 [B] or [1]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < k.size(2), "decode_attention: a position outside the cache");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const bool per_row = pos.numel() == q.size(0) && q.size(0) > 1;
  const float sc = static_cast<float>(scale);
  const c10::Half* ks = eight ? k_scale->data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs = eight ? v_scale->data_ptr<c10::Half>() : nullptr;
  if (q.scalar_type() == at::kBFloat16 && int8)
    run<c10::BFloat16, int8_t>(q, k, v, ks, vs, pp, per_row, sc, out);
  else if (q.scalar_type() == at::kFloat && int8)
    run<float, int8_t>(q, k, v, ks, vs, pp, per_row, sc, out);
  else if (q.scalar_type() == at::kBFloat16 && fp8)
    run<c10::BFloat16, c10::Float8_e4m3fn>(q, k, v, ks, vs, pp, per_row, sc, out);
  else if (q.scalar_type() == at::kFloat && fp8)
    run<float, c10::Float8_e4m3fn>(q, k, v, ks, vs, pp, per_row, sc, out);
  else if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(q, k, v, nullptr, nullptr, pp, per_row, sc, out);
  else if (q.scalar_type() == at::kFloat)
    run<float>(q, k, v, nullptr, nullptr, pp, per_row, sc, out);
  else
    TORCH_CHECK(false, "decode_attention: bfloat16 or float32, not ", q.scalar_type());
  return out;
}

// One row of D values: its scale (largest magnitude / qmax, clamped to float16's range, rounded
// to float16) and its values divided by it, rounded to the format (int8: to nearest, ties to
// even, within +-127; e4m3: within +-448, then the format's own rounding), as kv_format.quantize
template <typename T, typename Q>
void quantize_row(const T* x, int64_t d, Q* q, c10::Half* scale) {
  constexpr bool INT8 = std::is_same_v<Q, int8_t>;
  constexpr float QMAX = INT8 ? 127.0f : 448.0f;
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(as_float(x[i])));
  const c10::Half s(std::clamp(amax / QMAX, 0x1p-24f, 65504.0f));
  const float sf = static_cast<float>(s);
  *scale = s;
  for (int64_t i = 0; i < d; ++i) {
    const float y = as_float(x[i]) / sf;
    if constexpr (INT8)
      q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f));
    else
      q[i] = static_cast<c10::Float8_e4m3fn>(std::clamp(y, -QMAX, QMAX));
  }
}

template <typename T, typename Q>
void quantize_rows(const at::Tensor& x, at::Tensor& q, at::Tensor& scale) {
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  const T* xp = x.data_ptr<T>();
  Q* qp = q.data_ptr<Q>();
  c10::Half* sp = scale.data_ptr<c10::Half>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) quantize_row(xp + i * d, d, qp + i * d, sp + i);
  });
}

std::tuple<at::Tensor, at::Tensor> kv_quantize(const at::Tensor& x, bool int8) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "kv_quantize: x [..., D], contiguous");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(int8 ? at::kChar : at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kHalf));
  if (x.scalar_type() == at::kFloat && int8)
    quantize_rows<float, int8_t>(x, q, scale);
  else if (x.scalar_type() == at::kFloat)
    quantize_rows<float, c10::Float8_e4m3fn>(x, q, scale);
  else if (x.scalar_type() == at::kBFloat16 && int8)
    quantize_rows<c10::BFloat16, int8_t>(x, q, scale);
  else if (x.scalar_type() == at::kBFloat16)
    quantize_rows<c10::BFloat16, c10::Float8_e4m3fn>(x, q, scale);
  else
    TORCH_CHECK(false, "kv_quantize: float32 or bfloat16, not ", x.scalar_type());
  return {q, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llamactl_cpu, lib) {
  lib.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor pos, float scale, Tensor? k_scale=None, "
          "Tensor? v_scale=None) -> Tensor");
  lib.def("kv_quantize(Tensor x, bool int8) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llamactl_cpu, CPU, lib) {
  lib.impl("decode_attention", decode_attention);
  lib.impl("kv_quantize", kv_quantize);
}
