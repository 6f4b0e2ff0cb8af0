//! `glmcheck shards`: vLLM's plan on the tiny synthetic model in both layouts — whole heads of
//! q_b and kv_b per rank, o_proj and down split by columns, experts by their intermediate rows
//! or whole under EP, replicated norms and latent projections; bytes per rank add up to the
//! checkpoint with the replicated part counted on every rank; a degree that does not divide the
//! heads is a usage error.

use crate::common;

use serde_json::Value;

fn weights(json: &Value) -> Vec<Value> {
    json["weights"].as_array().unwrap().clone()
}

fn find<'a>(ws: &'a [Value], name: &str) -> &'a Value {
    ws.iter()
        .find(|w| w["name"] == name)
        .unwrap_or_else(|| panic!("{name} listed"))
}

#[test]
fn the_plan_splits_heads_columns_and_experts_as_vllm_does() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    let hf = dir.path().join("hf");
    common::glmcheck_json(["synth", "--out", gguf.to_str().unwrap(), "--json"], 0);
    common::glmcheck_json(
        [
            "synth",
            "--format",
            "hf",
            "--out",
            hf.to_str().unwrap(),
            "--json",
        ],
        0,
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    let heads = config["num_attention_heads"].as_u64().unwrap();
    let qk =
        config["qk_nope_head_dim"].as_u64().unwrap() + config["qk_rope_head_dim"].as_u64().unwrap();
    let inter = config["moe_intermediate_size"].as_u64().unwrap();

    let plan = common::glmcheck_json(
        [
            "shards",
            gguf.to_str().unwrap(),
            "--tp",
            "2",
            "--json",
            "--tensor",
            "*",
        ],
        0,
    );
    let ws = weights(&plan);
    let q_b = find(&ws, "blk.0.attn_q_b.weight");
    assert_eq!(
        q_b["ranks"][1]["holds"],
        format!("rows {}..{}", heads / 2 * qk, heads * qk)
    );
    assert_eq!(
        find(&ws, "blk.0.attn_k_b.weight")["ranks"][0]["holds"],
        format!("heads 0..{}", heads / 2)
    );
    assert_eq!(
        find(&ws, "blk.0.attn_q_a.weight")["ranks"][1]["holds"],
        "all"
    );
    assert_eq!(
        find(&ws, "blk.0.attn_output.weight")["placement"],
        "split columns (RowParallel)"
    );
    let up = find(&ws, "blk.1.ffn_up_exps.weight");
    assert_eq!(
        up["ranks"][1]["holds"],
        format!("intermediate {}..{}", inter / 2, inter)
    );
    let total: u64 = std::fs::metadata(&gguf).unwrap().len();
    let per_rank: Vec<u64> = plan["bytes_per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    assert!(
        per_rank.iter().all(|&b| b > total / 3 && b < total),
        "{per_rank:?} of {total}"
    );

    let ep = common::glmcheck_json(
        [
            "shards",
            hf.to_str().unwrap(),
            "--tp",
            "2",
            "--ep",
            "--json",
            "--tensor",
            "*",
        ],
        0,
    );
    let ws = weights(&ep);
    let experts = config["n_routed_experts"].as_u64().unwrap();
    let last = format!("model.layers.1.mlp.experts.{}.up_proj.weight", experts - 1);
    if ws.iter().any(|w| w["name"] == last.as_str()) {
        let e = find(&ws, &last);
        assert_eq!(
            (
                e["ranks"][0]["holds"].as_str(),
                e["ranks"][1]["holds"].as_str()
            ),
            (Some("none"), Some("all"))
        );
    } else {
        let e = find(&ws, "model.layers.1.mlp.experts.gate_up_proj");
        assert_eq!(
            e["ranks"][1]["holds"],
            format!("experts {}..{}", experts / 2, experts)
        );
    }

    let out = std::process::Command::new(common::glmcheck_bin())
        .args(["shards", gguf.to_str().unwrap(), "--tp", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tp 3"));
}
