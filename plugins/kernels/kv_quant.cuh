// cupy-paged: quantized KV cache rows on the GPU (`[engine] kv_cache_dtype`), the codecs
// of servelab/plugins/kernels/kv_quant.py bit for bit.
//
// Selected with -D SL_KV: 0 = the model's dtype ("auto"), 1 = int8, 2 = fp8 e4m3,
// 3 = fp8 e5m2. A quantized row (docs/attention.md, "Quantized KV cache") is SL_HEAD_DIM
// one-byte values, zero padding to a multiple of 4, then the row's float32 scale:
// value = element * scale, scale = max|x| / max (0 for a row of zeros), element =
// x / scale (x * (1 / scale), as the reference computes it) clamped to +-max and rounded
// (int8: half to even; fp8: to nearest even, the conversion torch and c10 use).
//
// The functions are __host__ __device__ so the test suite can compile them for the host
// with nvcc and compare their bytes with torch's on a machine without a GPU. The source
// is inlined into each kernel's text by cupy_paged.kernel_source (so CuPy's compile cache
// sees edits to it); nvcc finds it beside the .cu files.

#ifndef SL_KV_QUANT_CUH
#define SL_KV_QUANT_CUH

#ifndef SL_KV
#define SL_KV 0
#endif

// One-byte cache elements, distinct types so the codec is picked by template.
struct sl_int8 { unsigned char bits; };
struct sl_e4m3 { unsigned char bits; };
struct sl_e5m2 { unsigned char bits; };

__host__ __device__ inline unsigned int sl_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    unsigned int u;
    __builtin_memcpy(&u, &x, sizeof u);
    return u;
#endif
}

__host__ __device__ inline float sl_bits_float(unsigned int u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    __builtin_memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// A float16's bits as float (exact): the fp8 decoders widen through float16.
__host__ __device__ inline float sl_half_bits_float(unsigned short bits) {
    return __half2float(__ushort_as_half(bits));
}

// Round-to-nearest-even float -> fp8 with `mantissa` bits and exponent bias `bias`, for
// |x| within the format's finite range (callers clamp). Normal results add the rounding
// bias to the float's bits and keep the top bits; subnormal ones come out of a float add
// of a magic number, which rounds at the subnormal's last place.
template <int MANTISSA, int BIAS>
__host__ __device__ inline unsigned char sl_fp8_encode(float x) {
    constexpr unsigned int shift = 23 - MANTISSA;
    constexpr unsigned int min_normal = (unsigned int)(127 - BIAS + 1) << 23;   // 2^(1 - bias)
    constexpr unsigned int magic = (unsigned int)(127 - BIAS + 1 + shift) << 23;  // 2^(1 - bias + shift)
    unsigned int bits = sl_float_bits(x);
    const unsigned int sign = bits & 0x80000000u;
    bits ^= sign;
    unsigned int result;
    if (bits < min_normal) {
        result = sl_float_bits(sl_bits_float(bits) + sl_bits_float(magic)) - magic;
    } else {
        const unsigned int odd = (bits >> shift) & 1u;
        bits += ((unsigned int)(BIAS - 127) << 23) + ((1u << (shift - 1)) - 1u) + odd;
        result = bits >> shift;
    }
    return (unsigned char)(result | (sign >> 24));
}

// Codec of each element type: kMax (QUANTIZED_KV_MAX), encode (of a clamped x / scale),
// and decode, which returns element / kWiden (the caller multiplies kWiden into the scale).
template <typename T> struct SlKV;

template <> struct SlKV<sl_int8> {
    static constexpr float kMax = 127.f;
    static constexpr float kWiden = 1.f;
    __host__ __device__ static unsigned char encode(float x) { return (unsigned char)(signed char)(int)rintf(x); }
    __host__ __device__ static float decode(unsigned char b) { return (float)(signed char)b; }
};

template <> struct SlKV<sl_e4m3> {
    static constexpr float kMax = 448.f;
    // An e4m3 byte's sign, exponent and mantissa land on a float16's with the exponent 8
    // lower (subnormals included): the float16 holds the value times 2^-8.
    static constexpr float kWiden = 256.f;
    __host__ __device__ static unsigned char encode(float x) { return sl_fp8_encode<3, 7>(x); }
    __host__ __device__ static float decode(unsigned char b) {
        return sl_half_bits_float((unsigned short)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)));
    }
};

template <> struct SlKV<sl_e5m2> {
    static constexpr float kMax = 57344.f;
    static constexpr float kWiden = 1.f;  // an e5m2 byte is the high byte of a float16
    __host__ __device__ static unsigned char encode(float x) { return sl_fp8_encode<2, 15>(x); }
    __host__ __device__ static float decode(unsigned char b) { return sl_half_bits_float((unsigned short)(b << 8)); }
};

// The row's scale from its largest magnitude, and the factor elements are computed with.
template <typename T> __host__ __device__ inline float sl_kv_scale(float peak) { return peak / SlKV<T>::kMax; }
__host__ __device__ inline float sl_kv_inverse(float scale) { return scale > 0.f ? 1.f / scale : 0.f; }

template <typename T> __host__ __device__ inline unsigned char sl_kv_quantize(float x, float inverse) {
    return SlKV<T>::encode(fminf(fmaxf(x * inverse, -SlKV<T>::kMax), SlKV<T>::kMax));
}

// Where a row's scale starts (in bytes) and the row's length: kv_scale_offset / kv_row_elements.
constexpr int sl_kv_scale_offset(int head_dim) { return (head_dim + 3) / 4 * 4; }
constexpr int sl_kv_row_bytes(int head_dim) { return sl_kv_scale_offset(head_dim) + 4; }

#if SL_KV == 1
typedef sl_int8 sl_kv_t;
#elif SL_KV == 2
typedef sl_e4m3 sl_kv_t;
#elif SL_KV == 3
typedef sl_e5m2 sl_kv_t;
#elif SL_KV != 0
#error "SL_KV must be 0 (auto), 1 (int8), 2 (fp8 e4m3) or 3 (fp8 e5m2)"
#endif

#endif  // SL_KV_QUANT_CUH
