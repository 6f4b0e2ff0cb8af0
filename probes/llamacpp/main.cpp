// glmcheck-llamacpp-probe: runs a prompt through llama.cpp (CPU) with the graph eval callback
// and writes a glmcheck trace of its glm-dsa graph (probes/docs/llamacpp.md lists the stages).
//
//   glmcheck-llamacpp-probe MODEL.gguf --tokens IDS --out DIR [--full GLOB]... [--threads N]
//                           [--dtype f32|bf16|f16] [--no-repack] [--list-nodes] [--verbose]
//
// Exit status: 0 written, 1 llama.cpp failed, 2 bad arguments or input.

#include "gguf.h"
#include "llama.h"
#include "stages.h"
#include "trace_writer.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

const char *kUsage =
    "usage: glmcheck-llamacpp-probe MODEL.gguf --tokens IDS --out DIR [--full GLOB]... [--threads N]\n"
    "                               [--dtype f32|bf16|f16] [--no-repack] [--list-nodes] [--verbose]";

bool g_verbose = false;
// llama.cpp's last error line, for this program's own one-line message.
std::string g_last_error;

void on_log(enum ggml_log_level level, const char *text, void *) {
    if (g_verbose) std::fputs(text, stderr);
    if (level == GGML_LOG_LEVEL_ERROR) {
        g_last_error = text;
        while (!g_last_error.empty() && (g_last_error.back() == '\n' || g_last_error.back() == ' ')) g_last_error.pop_back();
    }
}

[[noreturn]] void usage(const std::string &why) {
    std::fprintf(stderr, "glmcheck-llamacpp-probe: %s (--help shows the usage)\n", why.c_str());
    std::exit(2);
}

[[noreturn]] void fail(const std::string &why, int code = 1) {
    const std::string cause = g_last_error.empty() ? "" : " (llama.cpp: " + g_last_error + ")";
    std::fprintf(stderr, "glmcheck-llamacpp-probe: %s%s\n", why.c_str(), cause.c_str());
    std::exit(code);
}

int parse_int(const std::string &s, const std::string &what) {
    char *end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0 || v > (1L << 30)) usage("bad " + what + ": " + s);
    return int(v);
}

std::vector<llama_token> parse_ids(const std::string &s) {
    std::vector<llama_token> ids;
    size_t at = 0;
    while (true) {
        const size_t comma = s.find(',', at);
        ids.push_back(parse_int(s.substr(at, comma - at), "token id"));
        if (comma == std::string::npos) return ids;
        at = comma + 1;
    }
}

// What the eval callback collects.
struct Recorder {
    int n_tokens = 0;
    int n_head = 0;
    bool list_nodes = false;
    std::vector<std::string> full;  // --full globs
    std::vector<glmcheck::Stage> stages;
    std::map<std::string, size_t> index;  // stage name -> position in `stages`
};

// Element (i0, i1, i2, i3) of a host tensor as f64, any strides.
double element(const ggml_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    const char *p = static_cast<const char *>(t->data) + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
    switch (t->type) {
        case GGML_TYPE_F32: return *reinterpret_cast<const float *>(p);
        case GGML_TYPE_F16: return ggml_fp16_to_fp32(*reinterpret_cast<const ggml_fp16_t *>(p));
        case GGML_TYPE_BF16: return ggml_bf16_to_fp32(*reinterpret_cast<const ggml_bf16_t *>(p));
        case GGML_TYPE_I32: return *reinterpret_cast<const int32_t *>(p);
        default: fail(std::string("node ") + t->name + " holds " + ggml_type_name(t->type) + " values");
    }
}

// The node's values in ggml order (ne[0] fastest), i.e. row-major with the token axis outermost.
std::vector<double> values_of(const ggml_tensor *t) {
    if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
        fail(std::string("node ") + t->name + " is not in host memory (run on the CPU)");
    }
    std::vector<double> out;
    out.reserve(size_t(ggml_nelements(t)));
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
                for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) out.push_back(element(t, i0, i1, i2, i3));
    return out;
}

void record(Recorder &r, const glmcheck::NodeStage &ns, const ggml_tensor *t) {
    const std::vector<double> v = values_of(t);
    const uint64_t n = v.size(), tokens = uint64_t(r.n_tokens);
    if (n % tokens != 0) fail(ns.stage + ": " + std::to_string(n) + " values for " + std::to_string(tokens) + " tokens");
    glmcheck::Stage s;
    s.name = ns.stage;
    s.dims = ns.dims;
    s.shape = {tokens, n / tokens};
    if (ns.by_head) s.shape = {tokens, uint64_t(r.n_head), n / tokens / uint64_t(r.n_head)};
    s.is_ids = t->type == GGML_TYPE_I32;
    const bool key_positions = s.name.size() > 16 && s.name.compare(s.name.size() - 16, 16, ".attn.index_topk") == 0;
    const uint64_t row = n / tokens;
    for (uint64_t i = 0; i < n; ++i) {
        if (!s.is_ids) {
            s.values.push_back(float(v[i]));
            continue;
        }
        int32_t id = int32_t(v[i]);
        // A query sees the KV cells up to its own position (one sequence from an empty cache, so
        // cell = position); a top-k wider than that also returns masked cells: none, as -1.
        if (key_positions && id > int32_t(i / row)) id = -1;
        s.ids.push_back(id);
    }
    s.stats = s.is_ids ? glmcheck::stats_of(s.ids.data(), s.ids.size()) : glmcheck::stats_of(s.values.data(), s.values.size());
    for (const auto &g : r.full) s.full = s.full || glmcheck::glob_match(g.c_str(), s.name.c_str());
    if (!s.full) {
        s.values = {};
        s.ids = {};
    }
    const auto found = r.index.find(s.name);
    if (found == r.index.end()) {
        r.index[s.name] = r.stages.size();
        r.stages.push_back(std::move(s));
    } else {
        r.stages[found->second] = std::move(s);  // a later step of the same stage (routing weights)
    }
}

bool on_node(ggml_tensor *t, bool ask, void *user) {
    auto &r = *static_cast<Recorder *>(user);
    const std::string weight = t->src[0] ? t->src[0]->name : "";
    const glmcheck::NodeStage ns = glmcheck::stage_of(t->name, ggml_op_name(t->op), weight);
    if (ask) {
        if (r.list_nodes) {
            std::fprintf(stderr, "node %-28s %-10s %-6s [%lld, %lld, %lld, %lld] src0 %-32s -> %s\n", t->name,
                         ggml_op_name(t->op), ggml_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1],
                         (long long)t->ne[2], (long long)t->ne[3], weight.c_str(),
                         ns.stage.empty() ? "-" : ns.stage.c_str());
        }
        return !ns.stage.empty();
    }
    if (!ns.stage.empty()) record(r, ns, t);
    return true;
}

// One stored number or bool at `p`, of GGUF type `type`, as JSON; empty for another type.
std::string number_json(gguf_type type, const void *p) {
    char buf[64];
    switch (type) {
        case GGUF_TYPE_UINT8: return std::to_string(*static_cast<const uint8_t *>(p));
        case GGUF_TYPE_INT8: return std::to_string(*static_cast<const int8_t *>(p));
        case GGUF_TYPE_UINT16: return std::to_string(*static_cast<const uint16_t *>(p));
        case GGUF_TYPE_INT16: return std::to_string(*static_cast<const int16_t *>(p));
        case GGUF_TYPE_UINT32: return std::to_string(*static_cast<const uint32_t *>(p));
        case GGUF_TYPE_INT32: return std::to_string(*static_cast<const int32_t *>(p));
        case GGUF_TYPE_UINT64: return std::to_string(*static_cast<const uint64_t *>(p));
        case GGUF_TYPE_INT64: return std::to_string(*static_cast<const int64_t *>(p));
        case GGUF_TYPE_FLOAT32: std::snprintf(buf, sizeof buf, "%.9g", *static_cast<const float *>(p)); return buf;
        case GGUF_TYPE_FLOAT64: std::snprintf(buf, sizeof buf, "%.17g", *static_cast<const double *>(p)); return buf;
        case GGUF_TYPE_BOOL: return *static_cast<const int8_t *>(p) ? "true" : "false";
        default: return "";
    }
}

// The bytes of one stored number or bool of GGUF type `type`; 0 for another type.
size_t number_size(gguf_type type) {
    switch (type) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

// Arrays of numbers longer than this (none a loader reads per layer) are left out.
constexpr size_t METADATA_ARRAY_LIMIT = 4096;

// The GGUF's metadata as a JSON object, typed as stored: scalars, and arrays of numbers (a
// per-layer key such as the indexer types); tokenizer tables and string arrays left out.
std::string metadata_json(const char *path) {
    gguf_init_params params = {true, nullptr};
    gguf_context *g = gguf_init_from_file(path, params);
    if (g == nullptr) fail(std::string("cannot read the GGUF metadata of ") + path, 2);
    std::string out = "{";
    for (int64_t i = 0; i < gguf_get_n_kv(g); ++i) {
        const std::string key = gguf_get_key(g, i);
        if (key.rfind("tokenizer.", 0) == 0) continue;
        const gguf_type type = gguf_get_kv_type(g, i);
        std::string value;
        if (type == GGUF_TYPE_STRING) {
            value = glmcheck::json_string(gguf_get_val_str(g, i));
        } else if (type == GGUF_TYPE_ARRAY) {
            const gguf_type item = gguf_get_arr_type(g, i);
            const size_t n = gguf_get_arr_n(g, i), size = number_size(item);
            if (n > METADATA_ARRAY_LIMIT || size == 0) continue;
            const char *data = static_cast<const char *>(gguf_get_arr_data(g, i));
            value = "[";
            for (size_t k = 0; k < n; ++k) value += (k ? ", " : "") + number_json(item, data + k * size);
            value += "]";
        } else {
            value = number_json(type, gguf_get_val_data(g, i));
            if (value.empty()) continue;
        }
        out += (out.size() > 1 ? ", " : "") + glmcheck::json_string(key) + ": " + value;
    }
    gguf_free(g);
    return out + "}";
}

// FNV-1a 64 of the metadata and the file's size: cheap, and another conversion or quantization
// of the weights almost always differs in one of them.
std::string fingerprint(const char *path, const std::string &metadata) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    const std::string text = metadata + "\n" + std::to_string(ec ? 0 : size);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(glmcheck::fnv1a(text.data(), text.size())));
    return std::string("fnv1a64:") + hex;
}

// `general.file_type` as the trace's dtype: what the float weights are stored in.
std::string dtype_of(const llama_model *model) {
    char buf[32];
    if (llama_model_meta_val_str(model, "general.file_type", buf, sizeof buf) < 0) return "f32";
    switch (std::atoi(buf)) {
        case LLAMA_FTYPE_MOSTLY_F16: return "f16";
        case LLAMA_FTYPE_MOSTLY_BF16: return "bf16";
        default: return "f32";
    }
}

}  // namespace

int main(int argc, char **argv) {
    if (argc == 2 && std::string(argv[1]) == "--help") {
        std::printf("%s\n", kUsage);
        return 0;
    }
    if (argc < 2) usage("MODEL is required");
    const char *model_path = argv[1];
    std::vector<llama_token> tokens;
    std::string out_dir, dtype;
    std::vector<std::string> full;
    int threads = int(std::thread::hardware_concurrency());
    bool repack = true, list_nodes = false;
    std::string argv_json = "[";
    for (int i = 0; i < argc; ++i) argv_json += (i ? ", " : "") + glmcheck::json_string(argv[i]);
    argv_json += "]";
    for (int i = 2; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage(a + " needs a value");
            return argv[++i];
        };
        if (a == "--tokens") tokens = parse_ids(value());
        else if (a == "--out") out_dir = value();
        else if (a == "--full") full.push_back(value());
        else if (a == "--threads") threads = parse_int(value(), "--threads");
        else if (a == "--dtype") {
            dtype = value();
            if (dtype != "f32" && dtype != "bf16" && dtype != "f16") usage("--dtype is f32, bf16 or f16");
        } else if (a == "--no-repack") repack = false;
        else if (a == "--list-nodes") list_nodes = true;
        else if (a == "--verbose") g_verbose = true;
        else usage("unknown argument " + a);
    }
    if (tokens.empty()) usage("--tokens is required");
    if (out_dir.empty()) usage("--out is required");
    // The top-k ids too (a few ints per token): bisect follows the engine's choice at the
    // reference's near ties only where it can read it.
    if (full.empty()) full = {"logits", "L*.out", "L*.attn.index_topk", "L*.moe.topk_ids"};
    llama_log_set(on_log, nullptr);
    const std::string metadata = metadata_json(model_path);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = repack;
    llama_model *model = llama_model_load_from_file(model_path, mp);
    if (model == nullptr) fail(std::string("llama.cpp cannot load ") + model_path);
    char arch[64] = "";
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch);
    // The family's graphs: GLM-5's, and DeepSeek's (V2/V3, Kimi-K2, GLM-4.7-Flash; V3.2), which
    // name their nodes alike.
    const std::string family[] = {"glm-dsa", "deepseek2", "deepseek32"};
    if (std::find(std::begin(family), std::end(family), std::string(arch)) == std::end(family)) {
        fail(std::string(model_path) + ": architecture `" + arch + "`, not glm-dsa, deepseek2 or deepseek32", 2);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (llama_token t : tokens) {
        if (t >= n_vocab) fail("token id " + std::to_string(t) + " is past the vocabulary (" + std::to_string(n_vocab) + ")", 2);
    }

    Recorder rec;
    rec.n_tokens = int(tokens.size());
    rec.n_head = llama_model_n_head(model);
    rec.list_nodes = list_nodes;
    rec.full = full;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = uint32_t(tokens.size() < 256 ? 256 : tokens.size());
    cp.n_batch = cp.n_ubatch = cp.n_ctx;  // the whole prompt in one graph
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = threads < 1 ? 1 : threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.no_perf = true;
    cp.cb_eval = on_node;
    cp.cb_eval_user_data = &rec;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) fail("llama.cpp cannot create a context");

    llama_batch batch = llama_batch_init(int32_t(tokens.size()), 0, 1);
    for (size_t i = 0; i < tokens.size(); ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = int32_t(i);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;  // every position: the graph keeps all rows up to the logits
    }
    batch.n_tokens = int32_t(tokens.size());
    const int rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rc != 0) fail("llama_decode returned " + std::to_string(rc));
    if (rec.stages.empty()) fail("the graph exposed no stage this probe knows (is it of the family: glm-dsa, deepseek2, deepseek32?)");

    glmcheck::Header h;
    h.producer_json = "{\"name\": \"glmcheck-llamacpp-probe\", \"llama_cpp\": " +
                      glmcheck::json_string(llama_print_system_info()) + ", \"repack\": " +
                      (repack ? "true" : "false") + ", \"argv\": " + argv_json + ", \"notes\": [" +
                      glmcheck::json_string(glmcheck::unseen_stages()) + "]}";
    h.model_json = "{\"source\": " + glmcheck::json_string(model_path) + ", \"config\": " + metadata +
                   ", \"fingerprint\": " + glmcheck::json_string(fingerprint(model_path, metadata)) + "}";
    h.tokens = tokens;
    h.backend = "llama.cpp";
    h.dtype = dtype.empty() ? dtype_of(model) : dtype;
    try {
        glmcheck::write_trace(out_dir, h, rec.stages);
    } catch (const std::exception &e) {
        fail(e.what(), 2);
    }
    std::printf("{\"trace\": %s, \"stages\": %zu, \"tokens\": %zu}\n", glmcheck::json_string(out_dir).c_str(),
                rec.stages.size(), tokens.size());
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
