// The helpers the kernel bodies name, spelled for CUDA (mx.fast.cuda_kernel's header;
// cuda_fp16.h and cuda_bf16.h come with MLX's own). kernels/gpu.py puts `kv_tid` and
// `kv_group` (and `thread_position_in_grid`) in front of each body.
__device__ inline float kv_half(__half x) { return __half2float(x); }
__device__ inline float kv_half_bits(unsigned int x) {
  return __half2float(__ushort_as_half((unsigned short)x));
}
__device__ inline float kv_float(float x) { return x; }
__device__ inline float kv_float(__half x) { return __half2float(x); }
__device__ inline float kv_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float kv_exp(float x) { return expf(x); }
__device__ inline float kv_max(float a, float b) { return fmaxf(a, b); }
__device__ inline float kv_tanh(float x) { return tanhf(x); }
__device__ inline float kv_cos(float x) { return cosf(x); }
__device__ inline float kv_sin(float x) { return sinf(x); }
__device__ inline float kv_rsqrt(float x) { return rsqrtf(x); }
__device__ inline float kv_round(float x) { return roundf(x); }
__device__ inline float kv_rint(float x) { return rintf(x); }
__device__ inline float kv_to_half(float x) { return __half2float(__float2half_rn(x)); }
#define KV_NEG_INF (-INFINITY)
#define KV_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#define KV_BARRIER() __syncthreads()
#define KV_SHUFFLE_XOR(x, mask) __shfl_xor_sync(0xffffffffu, (x), (mask))
#define KV_RETURN return
#define KV_UNROLL _Pragma("unroll")
