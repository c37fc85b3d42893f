// Scalar types, constants and dtype conversions shared by every kernel (inline PTX: NVRTC gets no
// CUDA headers). The element type is chosen by one `#define` pasted before this file:
// ELEM_F32, ELEM_F16 or ELEM_BF16.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (-__int_as_float(0x7f800000))
#define NAN_F __int_as_float(0x7fffffff)

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two f32 rounded into one register: `lo` at the lower address (the first element of a pair).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#if defined(ELEM_F32)
typedef float elem_t;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float from_f32(float x) { return x; }
#elif defined(ELEM_F16)
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return f16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_f16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_f16x2(lo, hi); }
#elif defined(ELEM_BF16)
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return bf16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_bf16x2(lo, hi); }
#else
#error "define ELEM_F32, ELEM_F16 or ELEM_BF16"
#endif

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// f32 rounded to the element type and back.
__device__ __forceinline__ float round_elem(float x) { return to_f32(from_f32(x)); }
