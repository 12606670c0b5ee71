// The helpers the kernel bodies name, spelled for Metal (mx.fast.metal_kernel's header).
// kernels/gpu.py puts `kv_tid` and `kv_group` in front of each body from Metal's thread
// attributes (MLX declares an attribute only where the source names it).
inline float kv_half(half x) { return float(x); }
inline float kv_half_bits(uint x) { return float(as_type<half>(ushort(x))); }
template <typename U> inline float kv_float(U x) { return static_cast<float>(x); }
inline float kv_exp(float x) { return metal::exp(x); }
inline float kv_max(float a, float b) { return metal::max(a, b); }
inline float kv_tanh(float x) { return metal::precise::tanh(x); }
inline float kv_cos(float x) { return metal::precise::cos(x); }
inline float kv_sin(float x) { return metal::precise::sin(x); }
inline float kv_rsqrt(float x) { return metal::precise::rsqrt(x); }
inline float kv_round(float x) { return metal::round(x); }
inline float kv_rint(float x) { return metal::rint(x); }
inline float kv_to_half(float x) { return float(half(x)); }
constant float KV_NEG_INF = -INFINITY;
#define KV_SHARED_ARRAY(type, name, count) threadgroup type name[count]
#define KV_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define KV_SHUFFLE_XOR(x, mask) metal::simd_shuffle_xor((x), (ushort)(mask))
#define KV_RETURN return
#define KV_UNROLL _Pragma("clang loop unroll(full)")
