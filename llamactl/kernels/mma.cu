// y[M, N] = x[M, K] . W[N, K]^T for 4-bit, 8-bit or FP8 (e4m3) W in groups along K, on the tensor cores
// (mma.m16n8k16, bf16 or fp16 in, fp32 accumulate): the codes are laid out at load so that each
// lane's 32-bit words hold its B fragments, dequantized in registers (Marlin's magic-number
// conversions), never through shared memory.
// Built at first use by nvcc or NVRTC (kernels/mma.py); no headers, PTX by inline assembly.
//
// Layouts (kernels/mma.py `pack` writes them), for n-tile n8, 128-column chunk c, lane (g = lane / 4,
// t = lane % 4):
//   4 bits: qw uint4 [N / 8][K / 128][32]; word j of the uint4 (columns c * 128 + 32 j ..) holds in
//       its nibbles 0..7 W[n8 * 8 + g, base + {2t, 2t + 8, 16 + 2t, 16 + 2t + 8, 2t + 1, 2t + 9,
//       16 + 2t + 1, 16 + 2t + 9}]: b0 and b1 of two k-steps (nibbles 0/4 and 1/5, then 2/6 and 3/7)
//   8 bits (int8 and FP8): qw uint4 [N / 8][K / 128][2][32]; word j of uint4 h is k-step s = 4 h + j
//       (columns c * 128 + 16 s ..), its bytes 0..3 W[n8 * 8 + g, base + {2t, 2t + 1, 2t + 8, 2t + 9}]: b0, b1
//   sz  uint32 [K / group][N]: the scale in the high half (in x's type; FP8: times 2^120 for bf16,
//       2^8 for fp16, what the codes' exponents lack), in the low half -(magic + zero) in x's type
//       (magic 128 for bf16 4-bit codes, 1024 for fp16), for bf16 8-bit codes the zero point as an
//       integer, for FP8 nothing
//   x   bf16 or fp16 [M, K] row-major (16-byte aligned); out fp32 [M, N] (added to where split > 1)
// Grid (N / 128, split), 128 threads: warp w owns columns blockIdx.x * 128 + 32 w .. + 32 (four
// n-tiles), over the chunks [blockIdx.y * per, ..) of K; the rows in MT tiles of 16.

#define XS_STRIDE 136  // halves a staged row of x: 128 + 8 (rows 4 banks apart: no conflicts)

#ifndef MMA_HOST  // the host emulation of the tests (tests/kernels/mma_host.cpp) gives its own
__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;  // (a & b) | c
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <bool F16>
__device__ __forceinline__ unsigned fma_x2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  if (F16)
    asm volatile("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else
    asm volatile("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;  // bytes of {b, a} picked by the selector's nibbles
  asm volatile("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

template <bool F16>
__device__ __forceinline__ void mma_16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
  if (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#endif

// The pair (magic + q0, magic + q1) in x's type -> (q - z) * s in both halves: z exact, one rounding
template <bool F16>
__device__ __forceinline__ unsigned scaled(unsigned x, unsigned z) {
  const unsigned nz2 = (z & 0xffffu) | (z << 16), s2 = (z >> 16) | (z & 0xffff0000u);
  const unsigned y = fma_x2<F16>(x, F16 ? 0x3c003c00u : 0x3f803f80u, nz2);  // q - z: exact
  return fma_x2<F16>(y, s2, 0x80008000u);                                   // one rounding of (q - z) * s
}

enum Codes { INT4, INT8, FP8 };

// An FP8 byte pair placed as (b0 << 8, b1 << 8) -> the same bits in x's type: sign, then exponent
// and mantissa under it, which is the e4m3 value times 2^-120 (bf16) or 2^-8 (fp16), exactly
template <bool F16>
__device__ __forceinline__ unsigned e4m3_x2(unsigned x) {
  return (x & 0x80008000u) | (F16 ? (x >> 1) & 0x3f803f80u : (x >> 4) & 0x07f007f0u);
}

// B fragments (b0, b1) of k-step `s` of a word (4 bits: a word holds two k-steps; 8 bits: one),
// with its group's sz word z
template <int KIND, bool F16>
__device__ __forceinline__ void frag_b(unsigned w, int s, unsigned z, unsigned& b0, unsigned& b1) {
  if (KIND == FP8) {  // then the scale, one rounding
    const unsigned s2 = (z >> 16) | (z & 0xffff0000u);
    b0 = fma_x2<F16>(e4m3_x2<F16>(prmt(w, 0u, 0x1404)), s2, 0x80008000u);
    b1 = fma_x2<F16>(e4m3_x2<F16>(prmt(w, 0u, 0x3424)), s2, 0x80008000u);
  } else if (KIND == INT4) {  // two nibbles (bits 0-3 and 16-19) -> 128 + q (bf16) / 1024 + q (fp16)
    const unsigned magic = F16 ? 0x64006400u : 0x43004300u;
    b0 = scaled<F16>(lop3_and_or(w >> (8 * s), 0x000f000fu, magic), z);
    b1 = scaled<F16>(lop3_and_or(w >> (8 * s + 4), 0x000f000fu, magic), z);
  } else if (F16) {  // bytes 0, 1 -> 0x64qq: 1024 + q
    b0 = scaled<true>(prmt(w, 0x64646464u, 0x4140), z);
    b1 = scaled<true>(prmt(w, 0x64646464u, 0x4342), z);
  } else {  // bf16 holds 128 + q only to 127: through fp32 (2^23 + q), q - z exact, bf16 its high half
    const float cz = __uint_as_float(0x4B000000u | (z & 0xffffu));
    const unsigned s2 = (z >> 16) | (z & 0xffff0000u);
    unsigned f[4];
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = __float_as_uint(__uint_as_float(prmt(w, 0x4B000000u, 0x7650 + i)) - cz);
    b0 = fma_x2<false>(prmt(f[0], f[1], 0x7632), s2, 0x80008000u);
    b1 = fma_x2<false>(prmt(f[2], f[3], 0x7632), s2, 0x80008000u);
  }
}

// Everything a chunk needs that is loaded ahead of it, into registers: the warp's codes, their
// scales and zeros [32-column part][n-tile], and this thread's share of x's 128 columns
template <int V, int XL>
struct Ahead {
  uint4 codes[4][V];
  unsigned zs[4][4];
  uint4 x[XL];
};

template <int V, int XL>
__device__ __forceinline__ void load_ahead(Ahead<V, XL>& a, const unsigned short* __restrict__ x,
                                           const uint4* __restrict__ qw, const unsigned* __restrict__ sz, int c,
                                           int chunks, int n0, int lane, int g, int M, int N, int K, int group) {
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int h = 0; h < V; h++)
      a.codes[i][h] = __ldg(qw + ((((unsigned long long)(n0 >> 3) + i) * chunks + c) * V + h) * 32 + lane);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const int grp = (c * 128 + j * 32) / group;
#pragma unroll
    for (int i = 0; i < 4; i++) a.zs[j][i] = __ldg(sz + (unsigned long long)grp * N + n0 + i * 8 + g);
  }
#pragma unroll
  for (int e = 0; e < XL; e++) {  // rows past M: zeros
    const int idx = threadIdx.x + e * 128, row = idx >> 4, col8 = idx & 15;
    a.x[e] = make_uint4(0u, 0u, 0u, 0u);
    if (row < M) a.x[e] = __ldg(reinterpret_cast<const uint4*>(x + (unsigned long long)row * K + c * 128 + col8 * 8));
  }
}

template <int XL>
__device__ __forceinline__ void stage_x(unsigned short* xs, const uint4 (&v)[XL]) {
#pragma unroll
  for (int e = 0; e < XL; e++) {
    const int idx = threadIdx.x + e * 128;
    *reinterpret_cast<uint4*>(xs + (idx >> 4) * XS_STRIDE + (idx & 15) * 8) = v[e];
  }
}

template <int KIND, int MT, bool F16>
__device__ __forceinline__ void mma_body(const unsigned short* __restrict__ x, const uint4* __restrict__ qw,
                                         const unsigned* __restrict__ sz, float* __restrict__ out, int M, int N,
                                         int K, int group, int per, int atomic) {
  constexpr int V = KIND == INT4 ? 1 : 2;  // uint4 of codes a lane reads per n-tile and chunk
  constexpr int XL = MT * 16 * 16 / 128;   // uint4 of x a thread stages per chunk
  __shared__ __align__(16) unsigned short xs[2][MT * 16 * XS_STRIDE];  // x's chunk, two buffers
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 7;
  const int c0 = blockIdx.y * per, c1 = min(chunks, c0 + per);
  const int n0 = blockIdx.x * 128 + warp * 32;  // this warp's first column

  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[m][i][e] = 0.f;

  Ahead<V, XL> cur, nxt;
  if (c0 < c1) {
    load_ahead(cur, x, qw, sz, c0, chunks, n0, lane, g, M, N, K, group);
    stage_x(xs[0], cur.x);
  }
  __syncthreads();
  for (int c = c0; c < c1; c++) {
    const int buf = (c - c0) & 1;
    // the next chunk on its way while this one computes; staged after it, one barrier a chunk
    if (c + 1 < c1) load_ahead(nxt, x, qw, sz, c + 1, chunks, n0, lane, g, M, N, K, group);
#pragma unroll
    for (int ks = 0; ks < 8; ks++) {  // k-steps of 16 columns
      unsigned b[4][2];  // [n-tile][b0, b1]
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const uint4 v = cur.codes[i][KIND == INT4 ? 0 : ks >> 2];
        const int j = KIND == INT4 ? ks >> 1 : ks & 3;
        const unsigned w = j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
        frag_b<KIND, F16>(w, ks & 1, cur.zs[ks >> 1][i], b[i][0], b[i][1]);
      }
      const int kk = ks * 16 + 2 * t;
#pragma unroll
      for (int m = 0; m < MT; m++) {
        const unsigned short* r0 = xs[buf] + (m * 16 + g) * XS_STRIDE + kk;
        const unsigned short* r1 = r0 + 8 * XS_STRIDE;
        const unsigned a0 = *reinterpret_cast<const unsigned*>(r0);
        const unsigned a1 = *reinterpret_cast<const unsigned*>(r1);
        const unsigned a2 = *reinterpret_cast<const unsigned*>(r0 + 8);
        const unsigned a3 = *reinterpret_cast<const unsigned*>(r1 + 8);
#pragma unroll
        for (int i = 0; i < 4; i++) mma_16<F16>(acc[m][i], a0, a1, a2, a3, b[i][0], b[i][1]);
      }
    }
    if (c + 1 < c1) {
      stage_x(xs[buf ^ 1], nxt.x);  // (the other buffer: every thread read it before the last barrier)
      cur = nxt;
    }
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < MT; m++) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int col = n0 + i * 8 + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int row = m * 16 + g + 8 * h;
        if (row < M) {
          float* o = out + (unsigned long long)row * N + col;
          if (atomic) {
            atomicAdd(o, acc[m][i][2 * h]);
            atomicAdd(o + 1, acc[m][i][2 * h + 1]);
          } else {
            o[0] = acc[m][i][2 * h];
            o[1] = acc[m][i][2 * h + 1];
          }
        }
      }
    }
  }
}

#define MMA(NAME, KIND, MT, F16)                                                                              \
  extern "C" __global__ void __launch_bounds__(128) NAME(                                                    \
      const unsigned short* x, const uint4* qw, const unsigned* sz, float* out, int M, int N, int K, int group, \
      int per, int atomic) {                                                                                 \
    mma_body<KIND, MT, F16>(x, qw, sz, out, M, N, K, group, per, atomic);                                    \
  }
#define MMA_TILES(KIND, NAME, TYPE, F16) \
  MMA(mma_##NAME##_##TYPE##_1, KIND, 1, F16) MMA(mma_##NAME##_##TYPE##_2, KIND, 2, F16) MMA(mma_##NAME##_##TYPE##_4, KIND, 4, F16)

MMA_TILES(INT4, int4, bf16, false)
MMA_TILES(INT4, int4, f16, true)
MMA_TILES(INT8, int8, bf16, false)
MMA_TILES(INT8, int8, f16, true)
MMA_TILES(FP8, fp8, bf16, false)
MMA_TILES(FP8, fp8, f16, true)
