// Prototype (session O), not product code: the 4-row quantized matmul with its weights
// repacked so that a 512-bit register's lanes are 16 output columns (each lane 4 consecutive
// 4-bit weights of its column as bytes; x's int16 codes split into two signed bytes; one
// vpdpbusd per 4 weights, row and high/low half), against agentkv::quantized_matmul on the
// same weights (MLX's affine layout, groups of 32, float32 scales). Measures both and their
// error against an exact double-precision product. docs/compute.md has what it found.
// Build and run on an AVX-512 VNNI machine, from the repository root:
//   g++ -std=c++20 -O3 -ffp-contract=off -Icsrc -o /tmp/qmm_columns \
//       docs/prototypes/qmm_columns.cpp csrc/core/qmm.cpp csrc/core/thread_pool.cpp -lpthread
//   /tmp/qmm_columns 1536 576   # N K
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include "core/qmm.h"
using namespace std;
constexpr int M = 4, G = 32;
struct Packed { vector<uint8_t> w; vector<float> s, b; int64_t N, K; };
// packed[nb][g][p][lane n][t]: low nibble = code(n, 8p + t), high = code(n, 8p + 4 + t)
Packed repack(const vector<uint8_t>& codes, const vector<float>& s, const vector<float>& b, int64_t N, int64_t K) {
  Packed P{vector<uint8_t>(N * K / 2), vector<float>(N * K / G), vector<float>(N * K / G), N, K};
  const int64_t groups = K / G;
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* dst = P.w.data() + (nb * groups + g) * 256;
      for (int p = 0; p < 4; ++p)
        for (int n = 0; n < 16; ++n)
          for (int t = 0; t < 4; ++t) {
            const int64_t col = nb * 16 + n, k = g * G + 8 * p + t;
            dst[p * 64 + n * 4 + t] = codes[col * K + k] | (codes[col * K + k + 4] << 4);
          }
      for (int n = 0; n < 16; ++n) {
        P.s[(nb * groups + g) * 16 + n] = s[(nb * 16 + n) * groups + g];
        P.b[(nb * groups + g) * 16 + n] = b[(nb * 16 + n) * groups + g];
      }
    }
  return P;
}
struct XCodes { vector<int8_t> hi, lo; vector<float> d, sum; };
XCodes quantize_x(const vector<float>& x, int64_t K) {
  XCodes c{vector<int8_t>(M * K), vector<int8_t>(M * K), vector<float>(M * K / G), vector<float>(M * K / G)};
  for (int r = 0; r < M; ++r)
    for (int64_t g = 0; g < K / G; ++g) {
      float amax = 0; for (int i = 0; i < G; ++i) amax = max(amax, fabsf(x[r * K + g * G + i]));
      const float d = amax / 32512.f, inv = amax > 0 ? 32512.f / amax : 0;
      int sum = 0;
      for (int i = 0; i < G; ++i) {
        const int q = (int)nearbyintf(x[r * K + g * G + i] * inv);
        const int lo = (int8_t)(uint8_t)(q & 0xFF), hi = (q - lo) / 256;
        c.hi[r * K + g * G + i] = hi; c.lo[r * K + g * G + i] = lo; sum += q;
      }
      c.d[r * (K / G) + g] = d; c.sum[r * (K / G) + g] = d * sum;
    }
  return c;
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void kernel(const Packed& P, const XCodes& x, float* y, int64_t nb0, int64_t nb1) {
  const int64_t K = P.K, groups = K / G;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[M], bias[M];
    for (int r = 0; r < M; ++r) acc[r] = bias[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* src = P.w.data() + (nb * groups + g) * 256;
      __m512i w[8];
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(src + 64 * p);
        w[2 * p] = _mm512_and_si512(v, mask);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
      const __m512 s = _mm512_loadu_ps(P.s.data() + (nb * groups + g) * 16);
      const __m512 b = _mm512_loadu_ps(P.b.data() + (nb * groups + g) * 16);
      for (int r = 0; r < M; ++r) {
        const int8_t* hi = x.hi.data() + r * K + g * G;
        const int8_t* lo = x.lo.data() + r * K + g * G;
        __m512i ah = _mm512_setzero_si512(), al = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) {  // K-quad q: w[q] holds k = 4q..4q+3 per lane? (8p+t / 8p+4+t)
          const int k0 = (q / 2) * 8 + (q % 2) * 4;
          int32_t h, l; memcpy(&h, hi + k0, 4); memcpy(&l, lo + k0, 4);
          ah = _mm512_dpbusd_epi32(ah, w[q], _mm512_set1_epi32(h));
          al = _mm512_dpbusd_epi32(al, w[q], _mm512_set1_epi32(l));
        }
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ah, 8), al);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x.d[r * groups + g]));
        acc[r] = _mm512_fmadd_ps(f, s, acc[r]);
        bias[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(x.sum[r * groups + g]), bias[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * P.N + nb * 16, _mm512_add_ps(acc[r], bias[r]));
  }
}
int main(int argc, char** argv) {
  const int64_t N = atoi(argv[1]), K = atoi(argv[2]); const int reps = 2000;
  mt19937 rng(1); uniform_int_distribution<int> code(0, 15); normal_distribution<float> nd(0, 1);
  vector<uint8_t> codes(N * K); for (auto& c : codes) c = code(rng);
  vector<float> s(N * K / G), b(N * K / G); for (auto& v : s) v = fabsf(nd(rng)) * 0.01f; for (auto& v : b) v = nd(rng) * 0.05f;
  vector<uint32_t> words(N * K / 8, 0);
  for (int64_t n = 0; n < N; ++n) for (int64_t k = 0; k < K; ++k) words[(n * K + k) / 8] |= uint32_t(codes[n * K + k]) << (4 * (k % 8));
  vector<float> x(M * K); for (auto& v : x) v = nd(rng);
  agentkv::QuantizedWeights W{words.data(), s.data(), b.data(), agentkv::ScaleType::f32, 4, G, N, K};
  vector<float> y1(M * N), y2(M * N);
  agentkv::quantized_matmul(x.data(), W, y1.data(), M);
  auto t0 = chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) agentkv::quantized_matmul(x.data(), W, y1.data(), M);
  auto t1 = chrono::steady_clock::now();
  Packed P = repack(codes, s, b, N, K);
  XCodes xc = quantize_x(x, K);
  auto run2 = [&] {
    thread th([&] { kernel(P, xc, y2.data(), 0, N / 32); });
    kernel(P, xc, y2.data(), N / 32, N / 16); th.join(); };
  auto run1 = [&] { kernel(P, xc, y2.data(), 0, N / 16); };
  run1();
  auto t2 = chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) run1();
  auto t3 = chrono::steady_clock::now();
  double maxrel = 0, e1 = 0, e2 = 0, scale = 0;
  for (int r = 0; r < M; ++r) for (int64_t n = 0; n < N; ++n) {
    double ref = 0; for (int64_t k = 0; k < K; ++k) ref += (double)(s[n * (K / G) + k / G] * codes[n * K + k] + b[n * (K / G) + k / G]) * x[r * K + k];
    e1 = max(e1, fabs(y1[r * N + n] - ref)); e2 = max(e2, fabs(y2[r * N + n] - ref)); scale = max(scale, fabs(ref));
  }
  printf("max |err| vs exact: qmm %.3e, prototype %.3e (outputs up to %.3f)\n", e1, e2, scale);
  run2();
  auto t4 = chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) run2();
  auto t5 = chrono::steady_clock::now();
  printf("N=%ld K=%ld M=4: agentkv qmm (its pool, 2 threads) %.1f us; prototype 1 thread %.1f us, 2 threads (a thread started per call) %.1f us\n",
         (long)N, (long)K, chrono::duration<double, micro>(t1 - t0).count() / reps,
         chrono::duration<double, micro>(t3 - t2).count() / reps,
         chrono::duration<double, micro>(t5 - t4).count() / reps);
  (void)maxrel;
}
