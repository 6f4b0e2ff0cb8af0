// The llama.cpp oracle of the tests: runs a GGUF on given token ids with llama.cpp (CPU, F32 K/V
// cache, flash attention off, the fused lightning indexer as llama.cpp runs it by default) and
// writes the logits of every prompt position, then optionally greedy-generates.
//
//   dump_logits MODEL.gguf OUT.f32 IDS [--mode batch|incr] [--generate N] [--threads N]
//               [--ubatch N] [--verbose]
//
// IDS are comma-separated token ids (no tokenizer is involved). OUT.f32 receives raw
// little-endian float32 [n_tokens][n_vocab]. `--mode batch` (default) decodes the whole prompt in
// one llama_decode call; `--mode incr` calls llama_decode once per token, so every position after
// the first reads the MLA latent cache and the indexer-key cache. `--generate N` then takes N
// greedy tokens (the first maximum wins a tie), one llama_decode per token. stdout gets one JSON
// line: {"n_tokens": T, "n_vocab": V, "mode": "...", "generated": [...]}.
// Exit status: 0 on success, 1 on a llama.cpp failure, 2 on bad arguments.

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

bool g_verbose = false;

void on_log(enum ggml_log_level level, const char *text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

[[noreturn]] void usage(const char *why) {
    std::fprintf(stderr,
                 "dump_logits: %s\nusage: dump_logits MODEL.gguf OUT.f32 IDS [--mode batch|incr] "
                 "[--generate N] [--threads N] [--ubatch N] [--verbose]\n",
                 why);
    std::exit(2);
}

[[noreturn]] void fail(const std::string &why) {
    std::fprintf(stderr, "dump_logits: %s\n", why.c_str());
    std::exit(1);
}

int parse_int(const char *s, const char *what) {
    char *end = nullptr;
    long v = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < 0 || v > (1L << 30)) {
        usage((std::string("bad ") + what + ": " + s).c_str());
    }
    return static_cast<int>(v);
}

std::vector<llama_token> parse_ids(const char *s) {
    std::vector<llama_token> ids;
    std::string cur;
    for (const char *p = s;; ++p) {
        if (*p == ',' || *p == '\0') {
            if (cur.empty()) usage("empty token id");
            ids.push_back(parse_int(cur.c_str(), "token id"));
            cur.clear();
            if (*p == '\0') break;
        } else {
            cur += *p;
        }
    }
    return ids;
}

// Decode `tokens` at positions start.. as one batch; every position produces logits.
void decode(llama_context *ctx, const llama_token *tokens, int n, int start) {
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = start + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    int rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rc != 0) fail("llama_decode returned " + std::to_string(rc) + " at position " + std::to_string(start));
}

const float *logits_of(llama_context *ctx, int i) {
    const float *row = llama_get_logits_ith(ctx, i);
    if (row == nullptr) fail("no logits for batch row " + std::to_string(i));
    return row;
}

llama_token argmax(const float *row, int n_vocab) {
    int best = 0;
    for (int i = 1; i < n_vocab; ++i) {
        if (row[i] > row[best]) best = i;
    }
    return best;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 4) usage("MODEL, OUT and IDS are required");
    const char *model_path = argv[1];
    const char *out_path = argv[2];
    const std::vector<llama_token> prompt = parse_ids(argv[3]);
    std::string mode = "batch";
    int generate = 0;
    int threads = static_cast<int>(std::thread::hardware_concurrency());
    int ubatch = 0;
    for (int i = 4; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&]() -> const char * {
            if (i + 1 >= argc) usage((a + " needs a value").c_str());
            return argv[++i];
        };
        if (a == "--mode") {
            mode = value();
            if (mode != "batch" && mode != "incr") usage("--mode is batch or incr");
        } else if (a == "--generate") {
            generate = parse_int(value(), "--generate");
        } else if (a == "--threads") {
            threads = parse_int(value(), "--threads");
        } else if (a == "--ubatch") {
            ubatch = parse_int(value(), "--ubatch");
        } else if (a == "--verbose") {
            g_verbose = true;
        } else {
            usage(("unknown argument " + a).c_str());
        }
    }
    if (threads < 1) threads = 1;
    const int n_prompt = static_cast<int>(prompt.size());
    const int n_total = n_prompt + generate;

    llama_log_set(on_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model *model = llama_model_load_from_file(model_path, mp);
    if (model == nullptr) fail(std::string("cannot load ") + model_path);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (llama_token t : prompt) {
        if (t >= n_vocab) fail("token id " + std::to_string(t) + " is past the vocabulary (" + std::to_string(n_vocab) + ")");
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(n_total < 256 ? 256 : n_total);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = ubatch > 0 ? static_cast<uint32_t>(ubatch) : cp.n_ctx;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.embeddings = false;
    cp.no_perf = true;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) fail("cannot create a context");

    std::vector<float> logits(static_cast<size_t>(n_prompt) * n_vocab);
    if (mode == "batch") {
        decode(ctx, prompt.data(), n_prompt, 0);
        for (int i = 0; i < n_prompt; ++i) {
            std::memcpy(&logits[static_cast<size_t>(i) * n_vocab], logits_of(ctx, i), sizeof(float) * n_vocab);
        }
    } else {
        for (int i = 0; i < n_prompt; ++i) {
            decode(ctx, &prompt[i], 1, i);
            std::memcpy(&logits[static_cast<size_t>(i) * n_vocab], logits_of(ctx, 0), sizeof(float) * n_vocab);
        }
    }

    std::vector<llama_token> generated;
    if (generate > 0) {
        llama_token next = argmax(&logits[static_cast<size_t>(n_prompt - 1) * n_vocab], n_vocab);
        for (int k = 0; k < generate; ++k) {
            generated.push_back(next);
            if (k + 1 == generate) break;
            decode(ctx, &next, 1, n_prompt + k);
            next = argmax(logits_of(ctx, 0), n_vocab);
        }
    }

    FILE *out = std::fopen(out_path, "wb");
    if (out == nullptr) fail(std::string("cannot write ") + out_path);
    size_t written = std::fwrite(logits.data(), sizeof(float), logits.size(), out);
    if (std::fclose(out) != 0 || written != logits.size()) fail(std::string("short write to ") + out_path);

    std::printf("{\"n_tokens\": %d, \"n_vocab\": %d, \"mode\": \"%s\", \"generated\": [", n_prompt, n_vocab, mode.c_str());
    for (size_t k = 0; k < generated.size(); ++k) {
        std::printf("%s%d", k ? ", " : "", generated[k]);
    }
    std::printf("]}\n");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
