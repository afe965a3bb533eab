// llamactl/kernels/mma.cu run on the CPU, as written: each block's 128 threads are host threads,
// __syncthreads a barrier of the block, and the inline-assembly steps (lop3, prmt, the bf16x2 and
// f16x2 FMAs, mma.sync m16n8k16) emulated from the PTX ISA's definitions; mma.sync is a barrier of
// the warp where every lane's fragments meet (the ISA's fragment layouts, written here apart from
// the kernel and from mma.py). Catches the kernel's indexing (staging, fragments, split-K, the
// output) on a machine without a GPU. Built by tests/kernels/test_mma.py with g++ -std=c++20.
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define MMA_HOST 1
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint4 {
  unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class T>
static inline T __ldg(const T* p) { return *p; }
struct Dim3 {
  unsigned x, y, z;
};
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim{128, 1, 1};
using std::min;

static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[4];
static std::mutex atomic_mutex;

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float atomicAdd(float* p, float v) {
  std::lock_guard<std::mutex> hold(atomic_mutex);
  const float old = *p;
  *p = old + v;
  return old;
}
static inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline unsigned lop3_and_or(unsigned a, unsigned b, unsigned c) { return (a & b) | c; }

// prmt.b32 (default mode): byte i of d is byte (nibble i of sel) & 7 of {b, a}; bit 3 replicates its sign
static inline unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  const uint64_t v = (uint64_t)b << 32 | a;
  unsigned d = 0;
  for (int i = 0; i < 4; i++) {
    const unsigned s = (sel >> (4 * i)) & 0xf;
    unsigned byte = (v >> (8 * (s & 7))) & 0xff;
    if (s & 8) byte = (byte & 0x80) ? 0xff : 0;
    d |= byte << (8 * i);
  }
  return d;
}

static inline double half_value(unsigned h, bool f16) {
  if (f16) {
    _Float16 x;
    const unsigned short bits = h;
    std::memcpy(&x, &bits, 2);
    return (double)x;
  }
  return (double)__uint_as_float(h << 16);
}

static inline unsigned half_bits(double v, bool f16) {  // rounded to nearest even
  if (f16) {
    const _Float16 x = (_Float16)v;
    unsigned short bits;
    std::memcpy(&bits, &x, 2);
    return bits;
  }
  unsigned u = __float_as_uint((float)v);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1);
  return u >> 16;
}

// fma.rn.{bf16x2,f16x2}: each half a * b + c, rounded once
template <bool F16>
static inline unsigned fma_x2(unsigned a, unsigned b, unsigned c) {
  unsigned d = 0;
  for (int h = 0; h < 2; h++) {
    const double v = half_value((a >> (16 * h)) & 0xffff, F16) * half_value((b >> (16 * h)) & 0xffff, F16) +
                     half_value((c >> (16 * h)) & 0xffff, F16);
    d |= half_bits(v, F16) << (16 * h);
  }
  return d;
}

// What a warp's mma.sync.m16n8k16 sees: every lane's A and B registers
struct WarpFragments {
  unsigned a[32][4], b[32][2];
};
static WarpFragments fragments[4];

// The ISA's layouts, lane = 4 groupID + threadID_in_group: A's register i holds row groupID + 8 (i % 2),
// columns 2 tid + 8 (i / 2) and + 1 (low half first); B's register i rows 2 tid + 8 i and + 1 of
// column groupID; C's c0, c1 row groupID, columns 2 tid and + 1, c2, c3 the same of row groupID + 8.
template <bool F16>
static inline void mma_16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  WarpFragments& f = fragments[warp];
  f.a[lane][0] = a0, f.a[lane][1] = a1, f.a[lane][2] = a2, f.a[lane][3] = a3;
  f.b[lane][0] = b0, f.b[lane][1] = b1;
  warp_barrier[warp]->arrive_and_wait();
  auto a = [&](int r, int k) {
    const unsigned reg = f.a[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)];
    return half_value((k & 1) ? reg >> 16 : reg & 0xffff, F16);
  };
  auto b = [&](int k, int n) {
    const unsigned reg = f.b[n * 4 + ((k & 7) >> 1)][k >> 3];
    return half_value((k & 1) ? reg >> 16 : reg & 0xffff, F16);
  };
  const int g = lane >> 2, t = lane & 3;
  float d[4];
  for (int i = 0; i < 4; i++) {
    const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
    double s = 0;
    for (int k = 0; k < 16; k++) s += a(r, k) * b(k, n);
    d[i] = (float)(c[i] + s);
  }
  warp_barrier[warp]->arrive_and_wait();  // every lane has read the fragments before any writes more
  for (int i = 0; i < 4; i++) c[i] = d[i];
}

#include "../../llamactl/kernels/mma.cu"

typedef void (*Kernel)(const unsigned short*, const uint4*, const unsigned*, float*, int, int, int, int, int, int);
static const struct {
  const char* name;
  Kernel fn;
} kernels[] = {
    {"mma_int4_bf16_1", mma_int4_bf16_1}, {"mma_int4_bf16_2", mma_int4_bf16_2}, {"mma_int4_bf16_4", mma_int4_bf16_4},
    {"mma_int4_f16_1", mma_int4_f16_1},   {"mma_int4_f16_2", mma_int4_f16_2},   {"mma_int4_f16_4", mma_int4_f16_4},
    {"mma_int8_bf16_1", mma_int8_bf16_1}, {"mma_int8_bf16_2", mma_int8_bf16_2}, {"mma_int8_bf16_4", mma_int8_bf16_4},
    {"mma_int8_f16_1", mma_int8_f16_1},   {"mma_int8_f16_2", mma_int8_f16_2},   {"mma_int8_f16_4", mma_int8_f16_4},
    {"mma_fp8_bf16_1", mma_fp8_bf16_1},   {"mma_fp8_bf16_2", mma_fp8_bf16_2},   {"mma_fp8_bf16_4", mma_fp8_bf16_4},
    {"mma_fp8_f16_1", mma_fp8_f16_1},     {"mma_fp8_f16_2", mma_fp8_f16_2},     {"mma_fp8_f16_4", mma_fp8_f16_4},
};

// The grid (grid_x, grid_y) of 128-thread blocks, one block at a time; 0, or -1 for an unknown name
extern "C" int launch(const char* name, const void* x, const void* qw, const void* sz, float* out, int M, int N,
                      int K, int group, int per, int atomic, int grid_x, int grid_y) {
  Kernel fn = nullptr;
  for (const auto& k : kernels)
    if (std::string(k.name) == name) fn = k.fn;
  if (!fn) return -1;
  for (int by = 0; by < grid_y; by++)
    for (int bx = 0; bx < grid_x; bx++) {
      std::barrier<> block(128);
      block_barrier = &block;
      std::barrier<> w0(32), w1(32), w2(32), w3(32);
      warp_barrier[0] = &w0, warp_barrier[1] = &w1, warp_barrier[2] = &w2, warp_barrier[3] = &w3;
      std::vector<std::thread> threads;
      for (int i = 0; i < 128; i++)
        threads.emplace_back([&, i] {
          threadIdx = {(unsigned)i, 0, 0};
          blockIdx = {(unsigned)bx, (unsigned)by, 0};
          fn((const unsigned short*)x, (const uint4*)qw, (const unsigned*)sz, out, M, N, K, group, per, atomic);
        });
      for (auto& th : threads) th.join();
    }
  return 0;
}
