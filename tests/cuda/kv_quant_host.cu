// Host build of kv_quant.cuh's codecs (nvcc, no GPU needed), for tests/test_cupy_kernels.py.
//
//   kv_quant_host quantize KIND HEAD_DIM IN OUT   float32 rows [n, HEAD_DIM] -> quantized rows
//   kv_quant_host decode KIND OUT                 the 256 bytes decoded: float32 element / kWiden
//
// KIND: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 (SL_KV). A row is composed as sl_cache_write does:
// the largest magnitude, sl_kv_scale, sl_kv_inverse, each element's sl_kv_quantize, zero
// padding, the scale's bytes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <cuda_fp16.h>
#include "kv_quant.cuh"

template <typename T>
static void quantize(int head_dim, const char* in, const char* out) {
    FILE* f = std::fopen(in, "rb");
    std::vector<float> values;
    float x;
    while (std::fread(&x, sizeof x, 1, f) == 1) values.push_back(x);
    std::fclose(f);
    const size_t rows = values.size() / head_dim;
    const int row_bytes = sl_kv_row_bytes(head_dim);
    std::vector<unsigned char> bytes(rows * row_bytes, 0xAB);
    for (size_t r = 0; r < rows; ++r) {
        const float* source = values.data() + r * head_dim;
        unsigned char* row = bytes.data() + r * row_bytes;
        float peak = 0.f;
        for (int d = 0; d < head_dim; ++d) peak = fmaxf(peak, fabsf(source[d]));
        const float scale = sl_kv_scale<T>(peak);
        const float inverse = sl_kv_inverse(scale);
        for (int d = 0; d < head_dim; ++d) row[d] = sl_kv_quantize<T>(source[d], inverse);
        for (int d = head_dim; d < sl_kv_scale_offset(head_dim); ++d) row[d] = 0;
        std::memcpy(row + sl_kv_scale_offset(head_dim), &scale, sizeof scale);
    }
    f = std::fopen(out, "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
}

template <typename T>
static void decode(const char* out) {
    float values[256];
    for (int b = 0; b < 256; ++b) values[b] = SlKV<T>::decode((unsigned char)b) * SlKV<T>::kWiden;
    FILE* f = std::fopen(out, "wb");
    std::fwrite(values, sizeof(float), 256, f);
    std::fclose(f);
}

int main(int argc, char** argv) {
    if (argc < 4) return 2;
    const int kind = std::atoi(argv[2]);
    if (!std::strcmp(argv[1], "quantize") && argc == 6) {
        const int head_dim = std::atoi(argv[3]);
        if (kind == 1) quantize<sl_int8>(head_dim, argv[4], argv[5]);
        else if (kind == 2) quantize<sl_e4m3>(head_dim, argv[4], argv[5]);
        else quantize<sl_e5m2>(head_dim, argv[4], argv[5]);
        return 0;
    }
    if (!std::strcmp(argv[1], "decode")) {
        if (kind == 1) decode<sl_int8>(argv[3]);
        else if (kind == 2) decode<sl_e4m3>(argv[3]);
        else decode<sl_e5m2>(argv[3]);
        return 0;
    }
    return 2;
}
