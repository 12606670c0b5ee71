// What MLX's Metal JIT puts in front of a custom kernel (<metal_stdlib>, MLX's type names),
// as declarations a host Clang parses in C++14 (what MSL 3.1 is based on), for
// tests/kernels/test_metal_source.py. Not Apple's compiler: a model of the parts of Metal the
// bodies use, from the Metal Shading Language specification.
// - Metal's address spaces are Clang address spaces: a pointer into one does not convert to
//   another, and an unqualified pointer is Metal's thread space (MLX passes an input of fewer
//   than 8 elements in constant, others in device). A threadgroup array, which Metal declares
//   in a kernel's scope, is a static local here (Clang refuses an automatic variable in an
//   address space).
// - Metal's keywords stay keywords (half is a macro: a variable of that name fails).
// - Only the functions of metal:: the helpers call are declared, with Metal's overloads;
//   as_type only between types of one size; bfloat never from a float implicitly (the
//   test keeps -Wimplicit-float-conversion's reports for bfloat, Metal allows them for half).
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread
#define INFINITY __builtin_inff()
#define half _Float16
typedef __bf16 bfloat;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef half float16_t;
typedef bfloat bfloat16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __INT32_TYPE__ int32_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
struct uint3 { uint x, y, z; };
namespace metal {
float exp(float); half exp(half);
float max(float, float); int max(int, int); uint max(uint, uint); half max(half, half);
float min(float, float); int min(int, int); uint min(uint, uint); half min(half, half);
float round(float); float rint(float); float abs(float); int abs(int);
namespace precise { float tanh(float); float cos(float); float sin(float); float exp(float); float rsqrt(float); }
namespace fast { float tanh(float); float cos(float); float sin(float); float exp(float); }
float simd_shuffle_xor(float, ushort); int simd_shuffle_xor(int, ushort);
uint simd_shuffle_xor(uint, ushort); half simd_shuffle_xor(half, ushort);
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
void threadgroup_barrier(mem_flags);
}  // namespace metal
template <typename T, typename U> T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: Metal reinterprets types of one size only");
  return __builtin_bit_cast(T, u);
}
using namespace metal;
