// A glmcheck trace (docs/design.md §5) written from C++: manifest.json plus one safetensors file
// per layer group, in the format src/trace/ reads. Statistics are summed in the order
// src/trace/stats.rs sums them, so they equal glmcheck's own bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glmcheck {

// One recorded stage: f32 values, or i32 ids (stored in `ids`).
struct Stage {
    std::string name;
    std::vector<uint64_t> shape;
    std::string dims;
    bool is_ids = false;
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

// Write the trace folder `dir` (absent or empty): stages whose name matches one of `full` keep
// their values; every stage gets its statistics and content hash. Throws std::runtime_error.
void write_trace(const std::string &dir, const Header &header, const std::vector<Stage> &stages,
                 const std::vector<std::string> &full);

}  // namespace glmcheck
