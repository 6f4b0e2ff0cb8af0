#include "stages.h"

#include <cstdlib>
#include <map>

namespace glmcheck {
namespace {

struct Rule {
    const char *stage;
    const char *dims;
    const char *op;  // nullptr: any op
    bool by_head;
};

// Graph names (src/models/glm-dsa.cpp, deepseek2.cpp, src/llama-graph.cpp of llama.cpp) to
// stages. A name given to two nodes of a layer is told apart by its op: `qr` is q_a's MUL_MAT,
// then the norm's MUL; `q_pe`/`k_pe` are a view before RoPE and the ROPE after; `kv_cmpr` a view,
// then the norm. DeepSeek's graph names all of its query's steps `q`: q_a's MUL_MAT (told apart
// by its weight, in `stage_of`), the norm's MUL, then q_b's (or V2-Lite's attn_q) MUL_MAT.
const std::multimap<std::string, Rule> &rules() {
    static const std::multimap<std::string, Rule> r = {
        {"attn_norm", {"attn_norm", "t d", nullptr, false}},
        {"qr", {"attn.q_a", "t d", "MUL_MAT", false}},
        {"qr", {"attn.q_a_norm", "t d", "MUL", false}},
        {"q", {"attn.q", "t h(tp) d", "MUL_MAT", true}},
        {"q", {"attn.q_a_norm", "t d", "MUL", false}},
        {"kv_cmpr_pe", {"attn.kv_a", "t d", "MUL_MAT", false}},
        {"kv_cmpr", {"attn.kv_a_norm", "t d", "MUL", false}},
        {"q_pe", {"attn.q_rope", "t h(tp) d", "ROPE", true}},
        {"k_pe", {"attn.k_rope", "t d", "ROPE", false}},
        {"top_k", {"attn.index_topk", "t k", nullptr, false}},
        {"kqv_out", {"attn.ctx", "t h(tp) d", nullptr, true}},
        {"ffn_inp", {"attn_resid", "t d", nullptr, false}},
        {"ffn_norm", {"ffn_norm", "t d", nullptr, false}},
        {"ffn_moe_logits", {"moe.router_logits", "t e", nullptr, false}},
        {"ffn_moe_topk", {"moe.topk_ids", "t k", nullptr, false}},
        // The routing weights as they reach the experts: each step replaces the one before.
        {"ffn_moe_weights", {"moe.topk_weights", "t k", nullptr, false}},
        {"ffn_moe_weights_softmax", {"moe.topk_weights", "t k", nullptr, false}},
        {"ffn_moe_weights_norm", {"moe.topk_weights", "t k", nullptr, false}},
        {"ffn_moe_weights_scaled", {"moe.topk_weights", "t k", nullptr, false}},
        {"ffn_moe_out", {"moe.routed", "t d partial(tp)", nullptr, false}},
        {"ffn_shexp", {"moe.shared", "t d partial(tp)", nullptr, false}},
        {"ffn_out", {"ffn.out", "t d", nullptr, false}},
        {"l_out", {"out", "t d", nullptr, false}},
    };
    return r;
}

// `blk.N.attn_output.weight` → N, else -1.
int attn_output_layer(const std::string &weight) {
    const std::string head = "blk.", tail = ".attn_output.weight";
    if (weight.size() <= head.size() + tail.size() || weight.compare(0, head.size(), head) != 0 ||
        weight.compare(weight.size() - tail.size(), tail.size(), tail) != 0) {
        return -1;
    }
    const std::string digits = weight.substr(head.size(), weight.size() - head.size() - tail.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) return -1;
    return std::atoi(digits.c_str());
}

}  // namespace

NodeStage stage_of(const std::string &name, const std::string &op, const std::string &weight) {
    if (name == "embd") return {"embed", "t d", false};
    if (name == "result_norm") return {"final_norm", "t d", false};
    if (name == "result_output") return {"logits", "t v(tp)", false};
    // o_proj's product has no name of its own: it is the MUL_MAT by attn_output.
    if (op == "MUL_MAT") {
        const int layer = attn_output_layer(weight);
        if (layer >= 0) return {"L" + std::to_string(layer) + ".attn.out", "t d", false};
    }
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || dash + 1 == name.size() ||
        name.find_first_not_of("0123456789", dash + 1) != std::string::npos) {
        return {};
    }
    const std::string base = name.substr(0, dash), layer = name.substr(dash + 1);
    const std::string q_a = ".attn_q_a.weight";
    if (base == "q" && op == "MUL_MAT" && weight.size() > q_a.size() &&
        weight.compare(weight.size() - q_a.size(), q_a.size(), q_a) == 0) {
        return {"L" + layer + ".attn.q_a", "t d", false};
    }
    const auto [lo, hi] = rules().equal_range(base);
    for (auto it = lo; it != hi; ++it) {
        const Rule &r = it->second;
        if (r.op == nullptr || op == r.op) return {"L" + layer + "." + r.stage, r.dims, r.by_head};
    }
    return {};
}

const char *unseen_stages() {
    return "L*.attn.kv: llama.cpp runs MLA absorbed (attn_k_b folded into the query, attn_v_b "
           "applied after attention), so kv_b's product [T, heads, nope+v] is never formed; "
           "attn.q_a_norm..attn.ctx still pin every input and output of attention.";
}

}  // namespace glmcheck
