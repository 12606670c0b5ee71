// The host kernels of csrc/core on fixed random inputs, their results written to stdout as
// raw floats: run once as built and once with AGENTKV_CPU=portable, the two outputs must be
// the same bytes (tests/native/test_paths.py builds this for aarch64 and runs it under
// qemu, so the NEON paths are held to the portable ones on an x86 machine).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/attention.h"
#include "core/half.h"
#include "core/qmm.h"
#include "core/rows.h"

namespace {

std::mt19937 rng(7);

std::vector<float> normal(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(rng);
  }
  return v;
}

std::vector<uint32_t> words(size_t n) {
  std::vector<uint32_t> v(n);
  for (auto& x : v) {
    x = static_cast<uint32_t>(rng());
  }
  return v;
}

std::vector<uint16_t> halves(size_t n, float scale) {
  std::vector<uint16_t> v(n);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (auto& x : v) {
    x = agentkv::float_to_half(dist(rng));
  }
  return v;
}

void emit(const std::vector<float>& v) {
  std::fwrite(v.data(), sizeof(float), v.size(), stdout);
}

// Packed weights (csrc/core/qmm.h) are any bytes: random codes, float16 scales and biases.
std::vector<uint8_t> bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) {
    x = static_cast<uint8_t>(rng());
  }
  return v;
}

void matmuls() {
  for (int bits : {4, 5, 8}) {  // random packed bytes: every code and fifth bit occurs
    for (int group : {32, 64, 128}) {
      const int64_t N = 48, K = 640;
      const auto w = bytes(N * K * bits / 8);
      const auto s = halves(N * K / group, 0.05f);
      const auto b = halves(N * K / group, 0.05f);
      agentkv::QuantizedWeights q{w.data(), s.data(), b.data(), agentkv::ScaleType::f16,
                                  bits,     group,    N,        K};
      for (int64_t M : {1, 2, 3, 6, 9, 13}) {
        auto x = normal(M * K);
        x[3] = 40.0f;  // an outlier in one block
        std::vector<float> y(M * N);
        agentkv::quantized_matmul(x.data(), q, y.data(), M);
        emit(y);
      }
    }
  }
  for (int bits : {4, 5}) {  // two-level (K-quant) scales: float16 d, then 8 x 16 bytes m
    const int64_t N = 48, K = 512, supers = N / agentkv::kPackColumns * K / 256;
    const auto w = bytes(N * K * bits / 8);
    std::vector<uint8_t> sb[2];
    for (auto& part : sb) {
      part = bytes(supers * agentkv::kSuperBytes);
      for (int64_t i = 0; i < supers; ++i) {
        const auto d = halves(agentkv::kPackColumns, 2e-3f);
        std::memcpy(part.data() + i * agentkv::kSuperBytes, d.data(), 32);
      }
    }
    agentkv::QuantizedWeights q{
        w.data(), sb[0].data(), sb[1].data(), agentkv::ScaleType::ksuper, bits, 32, N, K};
    for (int64_t M : {1, 3, 9, 13}) {
      auto x = normal(M * K);
      std::vector<float> y(M * N);
      agentkv::quantized_matmul(x.data(), q, y.data(), M);
      emit(y);
    }
  }
}

// A contiguous 4-bit cache [1, heads, T, 64] (format 1), and format 2's per-channel keys
// with a float16 tail, for 1, 3 and 17 queries.
void attention() {
  const int heads = 2, rep = 3, dim = 64, T = 300;
  for (int channel : {0, 64}) {
    for (int queries : {1, 3, 17}) {
      const auto kw = words(static_cast<size_t>(heads) * T * dim * 4 / 32);
      const auto vw = words(static_cast<size_t>(heads) * T * dim * 4 / 32);
      const int key_scales = channel ? dim / channel : dim / 64;
      const auto ks = halves(static_cast<size_t>(heads) * T * key_scales, 0.1f);
      const auto kb = halves(static_cast<size_t>(heads) * T * key_scales, 0.1f);
      const auto vs = halves(static_cast<size_t>(heads) * T, 0.1f);
      const auto vb = halves(static_cast<size_t>(heads) * T, 0.1f);
      const auto tail = halves(static_cast<size_t>(heads) * 64 * dim, 1.0f);
      const auto q = normal(static_cast<size_t>(heads) * rep * queries * dim);
      std::vector<float> out(static_cast<size_t>(heads) * rep * queries * dim);
      agentkv::AttentionArgs a;
      a.q = q.data();
      a.q_strides[2] = dim;
      a.q_strides[1] = static_cast<int64_t>(queries) * dim;
      a.q_strides[0] = a.q_strides[1] * heads * rep;
      a.out = out.data();
      a.batch = 1;
      a.q_heads = heads * rep;
      a.kv_heads = heads;
      a.queries = queries;
      a.keys = T;
      a.scale = 0.125f;
      for (auto* view : {&a.k, &a.v}) {
        view->bits = 4;
        view->group = 64;
        view->dim = dim;
        view->w_strides[2] = dim * 4 / 32;
        view->w_strides[1] = view->w_strides[2] * T;
        view->w_strides[0] = view->w_strides[1] * heads;
      }
      a.k.words = kw.data();
      a.k.scales = ks.data();
      a.k.biases = kb.data();
      a.k.s_strides[2] = key_scales;
      a.k.s_strides[1] = static_cast<int64_t>(key_scales) * T;
      a.k.s_strides[0] = a.k.s_strides[1] * heads;
      a.k.channel_tokens = channel;
      a.k.tail = channel ? tail.data() : nullptr;
      a.v.words = vw.data();
      a.v.scales = vs.data();
      a.v.biases = vb.data();
      a.v.s_strides[2] = 1;
      a.v.s_strides[1] = T;
      a.v.s_strides[0] = static_cast<int64_t>(T) * heads;
      agentkv::quantized_attention(a);
      emit(out);
    }
  }
}

void silu() {
  auto g = normal(1003, 6.0f);
  g[0] = -200.0f;  // below exp's range
  g[1] = std::numeric_limits<float>::infinity();
  g[2] = -std::numeric_limits<float>::infinity();
  g[3] = std::numeric_limits<float>::quiet_NaN();
  const auto u = normal(1003);
  std::vector<float> out(g.size());
  agentkv::silu_mul(g.data(), u.data(), out.data(), static_cast<int64_t>(g.size()));
  emit(out);
}

}  // namespace

int main() {
  std::fprintf(stderr, "%s %s\n", agentkv::qmm_implementation(),
               agentkv::attention_implementation());
  matmuls();
  attention();
  silu();
  return 0;
}
