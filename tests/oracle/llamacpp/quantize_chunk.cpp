// ggml's own quantization of raw float32 rows, for the tests that hold glmcheck's quantizers to
// llama.cpp's bytes:
//
//   quantize_chunk TYPE ROW_LEN IN.f32 OUT.bin [IMATRIX.f32]
//
// TYPE is a ggml type name as ggml_type_name() gives it (q4_K, iq4_xs, tq1_0, ...). IN.f32 holds
// whole rows of ROW_LEN little-endian float32 values; OUT.bin receives what ggml_quantize_chunk
// writes for them: the tensor's bytes as llama-quantize would store them. IMATRIX.f32 (ROW_LEN
// values) is the per-column importance that llama-quantize passes for an imatrix quantization;
// without it the call is the plain (non-imatrix) one.
// Exit status: 0 on success, 2 on bad arguments or input.

#include "ggml.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

[[noreturn]] void fail(const char *what, const char *detail) {
    std::fprintf(stderr, "quantize_chunk: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    std::fprintf(stderr, "usage: quantize_chunk TYPE ROW_LEN IN.f32 OUT.bin [IMATRIX.f32]\n");
    std::exit(2);
}

std::vector<float> read_f32(const char *path) {
    FILE *f = std::fopen(path, "rb");
    if (!f) fail("cannot open", path);
    std::vector<float> out;
    float buf[4096];
    size_t n;
    while ((n = std::fread(buf, sizeof(float), 4096, f)) > 0) out.insert(out.end(), buf, buf + n);
    std::fclose(f);
    return out;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) fail("wrong number of arguments", nullptr);
    ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char *name = ggml_type_name((ggml_type) t);
        if (name && std::strcmp(name, argv[1]) == 0) type = (ggml_type) t;
    }
    if (type == GGML_TYPE_COUNT) fail("unknown type", argv[1]);
    const long row_len = std::atol(argv[2]);
    if (row_len <= 0 || row_len % ggml_blck_size(type) != 0) fail("bad ROW_LEN", argv[2]);
    const std::vector<float> src = read_f32(argv[3]);
    if (src.size() % row_len != 0) fail("input is not whole rows", argv[3]);
    std::vector<float> imatrix;
    if (argc == 6) {
        imatrix = read_f32(argv[5]);
        if ((long) imatrix.size() != row_len) fail("IMATRIX must hold ROW_LEN values", argv[5]);
    } else if (ggml_quantize_requires_imatrix(type)) {
        fail("this type needs an imatrix", argv[1]);
    }
    const long rows = (long) src.size() / row_len;
    std::vector<unsigned char> dst(ggml_row_size(type, row_len) * rows);
    ggml_quantize_init(type);
    const size_t written = ggml_quantize_chunk(type, src.data(), dst.data(), 0, rows, row_len,
                                               imatrix.empty() ? nullptr : imatrix.data());
    if (written != dst.size()) fail("ggml wrote an unexpected size", nullptr);
    FILE *out = std::fopen(argv[4], "wb");
    if (!out || std::fwrite(dst.data(), 1, dst.size(), out) != dst.size()) fail("cannot write", argv[4]);
    std::fclose(out);
    return 0;
}
