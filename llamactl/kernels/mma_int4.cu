// y[M, N] = x[M, K] . W[N, K]^T for 4-bit W in groups along K, on the tensor cores (mma.m16n8k16,
// bf16 or fp16 in, fp32 accumulate): the codes are laid out at load so that each lane's 32-bit word
// holds the 8 nibbles of its B fragments for two k-steps, dequantized in registers (Marlin's
// magic-number conversion: 0x4300 | q is the bf16 128 + q, 0x6400 | q the fp16 1024 + q), never
// through shared memory.
// Compiled at first use by NVRTC (kernels/mma_int4.py); no headers, PTX by inline assembly.
//
// Layouts (kernels/mma_int4.py `pack` writes them):
//   qw  uint4 [N / 8][K / 128][32]: for n-tile n8, 128-column chunk c, lane (g = lane / 4,
//       t = lane % 4), word j of the uint4 (32 columns c * 128 + 32 j ..): the nibbles 0..7 are
//       W[n8 * 8 + g, base + {2t, 2t + 8, 16 + 2t, 16 + 2t + 8, 2t + 1, 2t + 9, 16 + 2t + 1, 16 + 2t + 9}]
//   sz  uint32 [K / group][N]: -(128 + zero) in the low half, the scale in the high half (bf16;
//       fp16 kernels: -(1024 + zero) and the scale in fp16)
//   x   bf16 or fp16 [M, K] row-major (16-byte aligned); out fp32 [M, N] (added to where split > 1)
// Grid (N / 128, split), 128 threads: warp w owns columns blockIdx.x * 128 + 32 w .. + 32 (four
// n-tiles), over the chunks [blockIdx.y * per, ..) of K; the rows in MT tiles of 16.

#define XS_STRIDE 136  // halves a staged row of x: 128 + 8 (rows 4 banks apart: no conflicts)

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

// Two nibbles (bits 0-3 and 16-19 of q) -> (q - z) * s in both halves, with nz2 = -(128 + z)
// (fp16: -(1024 + z)) and s2 = s in both halves
template <bool F16>
__device__ __forceinline__ unsigned dequant2(unsigned q, unsigned nz2, unsigned s2) {
  unsigned x = lop3_and_or(q, 0x000f000fu, F16 ? 0x64006400u : 0x43004300u);  // 1024 + q / 128 + q
  unsigned y = fma_x2<F16>(x, F16 ? 0x3c003c00u : 0x3f803f80u, nz2);        // q - z: exact
  return fma_x2<F16>(y, s2, 0x80008000u);                                      // one rounding of (q - z) * s
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

template <int MT, bool F16>
__device__ __forceinline__ void mma_int4_body(const unsigned short* __restrict__ x, const uint4* __restrict__ qw,
                                              const unsigned* __restrict__ sz, float* __restrict__ out, int M,
                                              int N, int K, int group, int per, int atomic) {
  __shared__ __align__(16) unsigned short xs[MT * 16 * XS_STRIDE];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 7;
  const int c0 = blockIdx.y * per, c1 = min(chunks, c0 + per);
  const int n0 = blockIdx.x * 128 + warp * 32;  // this warp's first column
  const int n8_0 = n0 >> 3;

  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[m][i][e] = 0.f;

  uint4 cur[4], nxt[4];
  if (c0 < c1) {
#pragma unroll
    for (int i = 0; i < 4; i++) cur[i] = __ldg(qw + ((unsigned long long)(n8_0 + i) * chunks + c0) * 32 + lane);
  }
  for (int c = c0; c < c1; c++) {
    if (c + 1 < c1) {  // the next chunk's codes on their way while this one computes
#pragma unroll
      for (int i = 0; i < 4; i++) nxt[i] = __ldg(qw + ((unsigned long long)(n8_0 + i) * chunks + c + 1) * 32 + lane);
    }
    // this chunk's scales and zeros [32-column part][n-tile], loaded before the staging and its
    // barrier so that their latency hides behind them
    unsigned zs[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int grp = (c * 128 + j * 32) / group;
#pragma unroll
      for (int i = 0; i < 4; i++) zs[j][i] = __ldg(sz + (unsigned long long)grp * N + n0 + i * 8 + g);
    }
    // x[:, c * 128 .. + 128] into shared memory (rows past M: zeros)
    for (int idx = threadIdx.x; idx < MT * 16 * 16; idx += blockDim.x) {
      const int row = idx >> 4, col8 = idx & 15;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (row < M) v = __ldg(reinterpret_cast<const uint4*>(x + (unsigned long long)row * K + c * 128 + col8 * 8));
      *reinterpret_cast<uint4*>(xs + row * XS_STRIDE + col8 * 8) = v;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; j++) {  // 32 columns: two k-steps of 16
      unsigned b[4][4];  // [n-tile][k-step 0: b0 b1, k-step 1: b0 b1]
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const unsigned w = j == 0 ? cur[i].x : j == 1 ? cur[i].y : j == 2 ? cur[i].z : cur[i].w;
        const unsigned z = zs[j][i];
        const unsigned nz2 = (z & 0xffffu) | (z << 16), s2 = (z >> 16) | (z & 0xffff0000u);
        b[i][0] = dequant2<F16>(w, nz2, s2);
        b[i][1] = dequant2<F16>(w >> 4, nz2, s2);
        b[i][2] = dequant2<F16>(w >> 8, nz2, s2);
        b[i][3] = dequant2<F16>(w >> 12, nz2, s2);
      }
#pragma unroll
      for (int s = 0; s < 2; s++) {
        const int kk = j * 32 + s * 16 + 2 * t;
#pragma unroll
        for (int m = 0; m < MT; m++) {
          const unsigned short* r0 = xs + (m * 16 + g) * XS_STRIDE + kk;
          const unsigned short* r1 = r0 + 8 * XS_STRIDE;
          const unsigned a0 = *reinterpret_cast<const unsigned*>(r0);
          const unsigned a1 = *reinterpret_cast<const unsigned*>(r1);
          const unsigned a2 = *reinterpret_cast<const unsigned*>(r0 + 8);
          const unsigned a3 = *reinterpret_cast<const unsigned*>(r1 + 8);
#pragma unroll
          for (int i = 0; i < 4; i++) mma_16<F16>(acc[m][i], a0, a1, a2, a3, b[i][2 * s], b[i][2 * s + 1]);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; i++) cur[i] = nxt[i];
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

#define MMA_INT4(NAME, MT, F16)                                                                              \
  extern "C" __global__ void __launch_bounds__(128) NAME(                                                    \
      const unsigned short* x, const uint4* qw, const unsigned* sz, float* out, int M, int N, int K, int group, \
      int per, int atomic) {                                                                                 \
    mma_int4_body<MT, F16>(x, qw, sz, out, M, N, K, group, per, atomic);                                     \
  }

MMA_INT4(mma_int4_bf16_1, 1, false)
MMA_INT4(mma_int4_bf16_2, 2, false)
MMA_INT4(mma_int4_bf16_4, 4, false)
MMA_INT4(mma_int4_f16_1, 1, true)
MMA_INT4(mma_int4_f16_2, 2, true)
MMA_INT4(mma_int4_f16_4, 4, true)
