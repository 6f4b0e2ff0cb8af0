#include "trace_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace glmcheck {
namespace {

// src/trace/stats.rs: elements per chunk of the fixed summation order, and lanes of a chunk's
// sums (element i into lane i mod 16, each lane in order, then the lanes in order).
constexpr size_t kChunk = size_t(1) << 16;
constexpr size_t kMomentLanes = 16;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
// src/trace/stats.rs: lanes and piece size of the content hash, and xxHash64's primes.
constexpr size_t kHashLanes = 256;
constexpr size_t kHashPiece = size_t(1) << 20;
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL,
                   kP3 = 0x165667B19E3779F9ULL, kP4 = 0x85EBCA77C2B2AE63ULL,
                   kP5 = 0x27D4EB2F165667C5ULL;

uint64_t xxh_round(uint64_t acc, uint64_t word) {
    acc += word * kP2;
    return ((acc << 31) | (acc >> 33)) * kP1;
}

// Little-endian u64 words (the last zero-padded), word i into lane i mod 256, then the byte
// count and the lanes merged and avalanched as xxHash64 does.
uint64_t lane_hash(const unsigned char *b, size_t n) {
    uint64_t lanes[kHashLanes];
    std::fill(lanes, lanes + kHashLanes, kP1 + kP2);
    for (size_t i = 0; 8 * i < n; ++i) {
        uint64_t word = 0;
        const size_t have = std::min<size_t>(8, n - 8 * i);
        for (size_t k = 0; k < have; ++k) word |= uint64_t(b[8 * i + k]) << (8 * k);
        lanes[i % kHashLanes] = xxh_round(lanes[i % kHashLanes], word);
    }
    uint64_t h = kP5 + uint64_t(n);
    for (uint64_t lane : lanes) h = (h ^ xxh_round(0, lane)) * kP1 + kP4;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
}

// src/trace/stats.rs `sketch_slot`: SplitMix64 of the element's index; its low bits pick the
// bucket, its top bit the sign.
constexpr size_t kSketchBuckets = 32;

void sketch_slot(uint64_t i, size_t &bucket, bool &minus) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    bucket = size_t(z % kSketchBuckets);
    minus = (z >> 63) == 1;
}

// src/trace/stats.rs `sketch`: per chunk, each finite value into its bucket in index order;
// the chunks' buckets added in chunk order.
template <typename T>
std::vector<double> sketch(const T *xs, size_t n) {
    if (n == 0) return {};
    std::vector<double> out(kSketchBuckets, 0.0);
    for (size_t at = 0; at < n; at += kChunk) {
        double part[kSketchBuckets] = {};
        for (size_t i = at; i < std::min(n, at + kChunk); ++i) {
            const double v = double(xs[i]);
            if (!std::isfinite(v)) continue;
            size_t bucket;
            bool minus;
            sketch_slot(uint64_t(i), bucket, minus);
            part[bucket] += minus ? -v : v;
        }
        for (size_t b = 0; b < kSketchBuckets; ++b) out[b] += part[b];
    }
    return out;
}

struct Sums {
    uint64_t finite = 0, nan = 0, inf = 0, zeros = 0;
    double sum = 0.0, sum_sq = 0.0;
    double min = INFINITY, max = -INFINITY;
};

// Lanes added one after another, from lane 0.
double in_lane_order(const double *lanes) {
    double total = 0.0;
    for (size_t i = 0; i < kMomentLanes; ++i) total += lanes[i];
    return total;
}

template <typename T>
Sums chunk_sums(const T *xs, size_t n) {
    Sums s;
    double sum[kMomentLanes] = {}, sum_sq[kMomentLanes] = {};
    for (size_t i = 0; i < n; ++i) {
        const double v = double(xs[i]);
        if (std::isnan(v)) {
            s.nan++;
        } else if (std::isinf(v)) {
            s.inf++;
        } else {
            s.finite++;
            s.zeros += v == 0.0;
            sum[i % kMomentLanes] += v;
            sum_sq[i % kMomentLanes] += v * v;
            s.min = std::fmin(s.min, v);
            s.max = std::fmax(s.max, v);
        }
    }
    s.sum = in_lane_order(sum);
    s.sum_sq = in_lane_order(sum_sq);
    return s;
}

// TensorStats::of: first-pass sums per chunk merged in chunk order, then the squared deviations
// from the mean, again per chunk and in chunk order. Compiled with -ffp-contract=off (no FMA),
// as Rust evaluates it.
template <typename T>
Stats moments(const T *xs, size_t n) {
    Stats st;
    st.count = n;
    st.hash = content_hash(xs, n * sizeof(T));  // the host's bytes: little-endian
    st.sketch = sketch(xs, n);
    if (n == 0) return st;
    Sums s;
    for (size_t at = 0; at < n; at += kChunk) {
        const Sums c = chunk_sums(xs + at, std::min(kChunk, n - at));
        if (at == 0) {
            s = c;
            continue;
        }
        s.finite += c.finite;
        s.nan += c.nan;
        s.inf += c.inf;
        s.zeros += c.zeros;
        s.sum = s.sum + c.sum;
        s.sum_sq = s.sum_sq + c.sum_sq;
        s.min = std::fmin(s.min, c.min);
        s.max = std::fmax(s.max, c.max);
    }
    st.nan = s.nan;
    st.inf = s.inf;
    if (s.finite == 0) return st;
    const double count = double(s.finite);
    const double mean = s.sum / count;
    double deviation = 0.0;
    for (size_t at = 0; at < n; at += kChunk) {
        double part[kMomentLanes] = {};
        for (size_t i = at; i < std::min(n, at + kChunk); ++i) {
            const double v = double(xs[i]);
            if (std::isfinite(v)) part[(i - at) % kMomentLanes] += (v - mean) * (v - mean);
        }
        deviation += in_lane_order(part);
    }
    st.zeros = s.zeros;
    st.mean = mean;
    st.std = std::sqrt(deviation / count);
    st.min = s.min;
    st.max = s.max;
    st.absmax = std::fmax(std::fabs(s.min), std::fabs(s.max));
    st.l2 = std::sqrt(s.sum_sq);
    return st;
}

std::string number(double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return buf;
}

std::string stats_json(const Stats &s) {
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(s.hash));
    std::ostringstream o;
    o << "{\"count\": " << s.count << ", \"mean\": " << number(s.mean) << ", \"std\": " << number(s.std)
      << ", \"min\": " << number(s.min) << ", \"max\": " << number(s.max) << ", \"absmax\": " << number(s.absmax)
      << ", \"l2\": " << number(s.l2) << ", \"nan\": " << s.nan << ", \"inf\": " << s.inf
      << ", \"zeros\": " << s.zeros << ", \"hash\": \"" << hash << "\"";
    if (!s.sketch.empty()) {
        o << ", \"sketch\": [";
        for (size_t b = 0; b < s.sketch.size(); ++b) o << (b ? ", " : "") << number(s.sketch[b]);
        o << "]";
    }
    o << "}";
    return o.str();
}

std::string shape_json(const std::vector<uint64_t> &shape) {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
}

// A stage's file group: its `L{n}` prefix, or its whole name outside the layers.
std::string group_of(const std::string &name) {
    const std::string head = name.substr(0, name.find('.'));
    bool layer = head.size() > 1 && head[0] == 'L';
    for (size_t i = 1; layer && i < head.size(); ++i) layer = head[i] >= '0' && head[i] <= '9';
    return layer ? head : name;
}

// Write `data` to `path` through `path.partial` and a rename.
void write_file(const std::filesystem::path &path, const std::string &data) {
    const auto tmp = std::filesystem::path(path.string() + ".partial");
    std::ofstream f(tmp, std::ios::binary);
    f.write(data.data(), std::streamsize(data.size()));
    f.close();
    if (!f) throw std::runtime_error("cannot write " + tmp.string());
    std::filesystem::rename(tmp, path);
}

// A safetensors file of `stages` (each under its own name).
std::string safetensors(const std::vector<const Stage *> &stages) {
    std::string header = "{";
    std::string data;
    for (const Stage *s : stages) {
        const char *bytes = s->is_ids ? reinterpret_cast<const char *>(s->ids.data())
                                      : reinterpret_cast<const char *>(s->values.data());
        const size_t n = 4 * (s->is_ids ? s->ids.size() : s->values.size());
        if (header.size() > 1) header += ", ";
        header += json_string(s->name) + ": {\"dtype\": \"" + (s->is_ids ? "I32" : "F32") +
                  "\", \"shape\": " + shape_json(s->shape) + ", \"data_offsets\": [" +
                  std::to_string(data.size()) + ", " + std::to_string(data.size() + n) + "]}";
        data.append(bytes, n);
    }
    header += "}";
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string out(8, '\0');
    uint64_t len = header.size();
    for (int i = 0; i < 8; ++i) out[i] = char((len >> (8 * i)) & 0xff);
    return out + header + data;
}

}  // namespace

uint64_t fnv1a(const void *bytes, size_t n, uint64_t h) {
    const auto *b = static_cast<const unsigned char *>(bytes);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * kFnvPrime;
    return h;
}

uint64_t content_hash(const void *bytes, size_t n) {
    const auto *b = static_cast<const unsigned char *>(bytes);
    if (n <= kHashPiece) return lane_hash(b, n);
    std::vector<unsigned char> pieces;
    for (size_t at = 0; at < n; at += kHashPiece) {
        const uint64_t h = lane_hash(b + at, std::min(kHashPiece, n - at));
        for (int k = 0; k < 8; ++k) pieces.push_back((unsigned char)(h >> (8 * k)));
    }
    return lane_hash(pieces.data(), pieces.size());
}

Stats stats_of(const float *xs, size_t n) { return moments(xs, n); }

Stats stats_of(const int32_t *xs, size_t n) { return moments(xs, n); }

bool glob_match(const char *p, const char *s) {
    if (*p == '\0') return *s == '\0';
    if (p[0] == '*' && p[1] == '*') {
        for (const char *t = s;; ++t) {
            if (glob_match(p + 2, t)) return true;
            if (*t == '\0') return false;
        }
    }
    if (*p == '*') {
        for (const char *t = s;; ++t) {
            if (glob_match(p + 1, t)) return true;
            if (*t == '\0' || *t == '.') return false;
        }
    }
    if (*p == '?') return *s != '\0' && *s != '.' && glob_match(p + 1, s + 1);
    return *p == *s && glob_match(p + 1, s + 1);
}

std::string json_string(const std::string &s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += char(c);
        } else if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
        } else {
            out += char(c);
        }
    }
    return out + "\"";
}

void write_trace(const std::string &dir, const Header &header, const std::vector<Stage> &stages) {
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    if (!fs::is_empty(dir)) throw std::runtime_error(dir + " already holds files; give the trace a new name");

    std::map<std::string, std::vector<const Stage *>> held;  // by group
    std::string records;
    for (const Stage &s : stages) {
        std::string rec = "    {\"name\": " + json_string(s.name) + ", \"shape\": " + shape_json(s.shape) +
                          ", \"dtype\": \"" + (s.is_ids ? "i32" : "f32") + "\", \"dims\": " + json_string(s.dims) +
                          ", \"stats\": " + stats_json(s.stats);
        if (s.full) {
            const std::string group = group_of(s.name);
            held[group].push_back(&s);
            rec += ", \"file\": " + json_string(group + ".safetensors") + ", \"tensor\": " + json_string(s.name);
        }
        records += (records.empty() ? "" : ",\n") + rec + "}";
    }
    for (const auto &[group, list] : held) write_file(fs::path(dir) / (group + ".safetensors"), safetensors(list));

    std::string tokens = "[";
    for (size_t i = 0; i < header.tokens.size(); ++i) tokens += (i ? ", " : "") + std::to_string(header.tokens[i]);
    tokens += "]";
    const std::string manifest = "{\n  \"format\": \"glmcheck-trace\",\n  \"version\": 2,\n  \"producer\": " +
                                 header.producer_json + ",\n  \"model\": " + header.model_json +
                                 ",\n  \"tokens\": " + tokens + ",\n  \"backend\": " + json_string(header.backend) +
                                 ",\n  \"dtype\": " + json_string(header.dtype) + ",\n  \"tp\": 1,\n  \"stages\": [\n" +
                                 records + "\n  ]\n}\n";
    write_file(fs::path(dir) / "manifest.json", manifest);
}

}  // namespace glmcheck
