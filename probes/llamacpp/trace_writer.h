// A glmcheck trace (docs/design.md §5) written from C++: manifest.json plus one safetensors file
// per layer group, in the format src/trace/ reads. Statistics are summed in the order
// src/trace/stats.rs sums them, so they equal glmcheck's own bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glmcheck {

// src/trace/stats.rs's TensorStats: moments over the finite values, and the content hash.
struct Stats {
    uint64_t count = 0, nan = 0, inf = 0, zeros = 0, hash = 0;
    double mean = 0, std = 0, min = 0, max = 0, absmax = 0, l2 = 0;
    // src/trace/stats.rs `sketch`: the finite values added with random signs into 32 buckets,
    // which a permutation or a sign flip moves while the moments stay; empty for no values.
    std::vector<double> sketch;
};

Stats stats_of(const float *xs, size_t n);
Stats stats_of(const int32_t *xs, size_t n);

// One recorded stage: its statistics, and its f32 values or i32 ids when they are kept
// (`--full`); a stage kept only by its statistics holds no values, so a long run stays small.
struct Stage {
    std::string name;
    std::vector<uint64_t> shape;
    std::string dims;
    bool is_ids = false;
    bool full = false;
    Stats stats;
    std::vector<float> values;
    std::vector<int32_t> ids;
};

// The manifest's header fields; each `*_json` member is written verbatim as a JSON value.
struct Header {
    std::string producer_json;
    std::string model_json;
    std::vector<int32_t> tokens;
    std::string backend;
    std::string dtype;
};

// `--full` globs over dot-separated names: `*` stays inside one part, `**` spans parts.
bool glob_match(const char *pattern, const char *name);

// A JSON string literal of `s`.
std::string json_string(const std::string &s);

// FNV-1a 64 over `bytes`, continuing from `h`.
uint64_t fnv1a(const void *bytes, size_t n, uint64_t h = 0xcbf29ce484222325ULL);

// A stage's content hash (src/trace/stats.rs `content_hash`): the lane hash of the bytes up to
// 1 MiB; past that, the lane hash of the 1 MiB pieces' lane hashes, 8 little-endian bytes each.
uint64_t content_hash(const void *bytes, size_t n);

// Write the trace folder `dir` (absent or empty): every stage's record, and the values of the
// `full` ones. Throws std::runtime_error.
void write_trace(const std::string &dir, const Header &header, const std::vector<Stage> &stages);

}  // namespace glmcheck
