// Which glmcheck stage (docs/design.md §4) a node of llama.cpp's glm-dsa graph is, by the name
// the graph builder gives it (`NAME-LAYER`, or `NAME` outside the layers), its op, and the
// weight it multiplies.
#pragma once

#include <string>

namespace glmcheck {

struct NodeStage {
    std::string stage;  // empty: not a recorded stage
    std::string dims;   // the dims spec (§4)
    // How values become the stage's shape [T, ...]: split the row into heads, or one row per token.
    bool by_head = false;
};

// `name` is the node's ggml name, `op` ggml_op_name() of its op, `weight` the name of its src[0]
// (GGUF tensor names for weights).
NodeStage stage_of(const std::string &name, const std::string &op, const std::string &weight);

// The stages of §4 this graph never forms, each with the reason, for the manifest and --help.
const char *unseen_stages();

}  // namespace glmcheck
