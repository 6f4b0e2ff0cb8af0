//! glmcheck against llama.cpp and transformers on the family's other members, converted the way
//! their GGUFs are made: a tiny random DeepSeek-V3 (YaRN), DeepSeek-V2-Lite, DeepSeek-V2,
//! Kimi-K2 and GLM-4.7-Flash built by transformers' own classes and converted by llama.cpp's
//! converter to an F32 `deepseek2` GGUF, and DeepSeek-V3.2 (YaRN, its DSA indexer keeping 4
//! positions) to a `deepseek32` one (`glmcheck_oracle.llamacpp.family`), then run by
//! glmcheck, by llama.cpp (dump_logits, the whole prompt in one batch) and by transformers. At
//! every position the logits agree within 1e-4 × max|logit| with the same top-1, and 16 greedy
//! tokens are identical; `glmcheck inspect` names the member and passes the schema check.
//!
//! Where llama.cpp differs from transformers (facts of its source, .oracles/llama.cpp/src):
//! * group-limited routing: `build_moe_ffn` (src/llama-graph.cpp) ranks expert groups by the sum
//!   of each group's two best scores whatever the gating, where DeepSeek-V2's
//!   `group_limited_greedy` (transformers, DeepSeek's reference) ranks them by the best one. A V2
//!   GGUF with several groups, fewer of them used than experts chosen, therefore runs another
//!   model in llama.cpp: glmcheck follows transformers there (and that difference is asserted),
//!   and agrees with llama.cpp on V2 in one group. llama.cpp also asserts
//!   `expert_group_used_count < expert_group_count` (src/llama-model.cpp).
//! * the deepseek2 loader (src/models/deepseek2.cpp) reads a missing `expert_gating_func` as
//!   softmax (V2/V2.5 files predate the key; GLM-4.7-Flash's 47/48-layer, 154880-token shape
//!   reads as sigmoid), yet still chooses with `exp_probs_b` where the file has it: a V3 file
//!   without the key runs softmax scores with the bias. glmcheck reads such a file the same way.
//! * llama.cpp's context takes YaRN's mscale equal to mscale_all_dim on deepseek2 only; on
//!   deepseek32 it takes 1 (src/llama-context.cpp), so a V3.2 file whose mscale_all_dim is not 1
//!   runs another model: glmcheck reads it as llama.cpp does.
//! * it reads `attention.q_lora_rank` as required unless the model has 26 or 27 layers (how it
//!   tells DeepSeek-V2-Lite), so the V2-Lite model has 27 layers.
//!
//! The legacy whole `attn_kv_b` form (before MLA absorption: no `*_mla` keys, per-head
//! `key_length`/`value_length`) is still loaded by llama.cpp, unabsorbed; a V3 file rewritten to
//! it agrees the same way.

use crate::common;
use crate::llamacpp_oracle::{
    agree, llama_cpp, long_sequence, oracle_model, run_glmcheck, run_llama_cpp, tokens_of, Model,
    GENERATE, TOLERANCE,
};

use std::path::Path;

const SHORT: &str = "5,77,300";
const MEDIUM: &str = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16";

pub(super) fn make_model(dir: &Path, arch: &str, extra: &[&str], sequences: &[&str]) -> Model {
    let (src, n) = (llama_cpp().join("src"), GENERATE.to_string());
    let mut args = vec![
        dir.to_str().unwrap(),
        arch,
        "--llama-cpp",
        src.to_str().unwrap(),
        "--generate",
        &n,
    ];
    args.extend(extra);
    oracle_model("llamacpp.family", args, sequences)
}

/// `glmcheck inspect`: the member it names, and the schema check passed.
fn assert_inspect(gguf: &Path, member: &str) -> serde_json::Value {
    let json = common::glmcheck_json(["inspect".as_ref(), gguf.as_os_str(), "--json".as_ref()], 0);
    let arch = if member == "deepseek_v32" {
        "deepseek32"
    } else {
        "deepseek2"
    };
    assert_eq!(json["architecture"], arch, "{json}");
    assert_eq!(json["family"]["member"], member, "{}", json["family"]);
    assert_eq!(json["schema"]["ok"], true, "{}", json["schema"]);
    json
}

/// One sequence run everywhere: (glmcheck, llama.cpp batch) logits and greedy tokens.
struct Runs {
    ours: (Vec<f32>, serde_json::Value),
    llama: (Vec<f32>, serde_json::Value),
}

fn run_both(dir: &Path, model: &Model, k: usize, ids: &str) -> Runs {
    Runs {
        // The models' rms_norm_eps is 1e-6, the latent norms' eps of both llama.cpp and
        // transformers.
        ours: {
            let o = run_glmcheck(&model.gguf, ids, "1e-6", &dir.join(format!("{k}.trace")));
            (o.logits, o.generated)
        },
        llama: run_llama_cpp(
            &model.gguf,
            ids,
            "batch",
            &dir.join(format!("{k}-batch.f32")),
        ),
    }
}

/// The member built with `extra` agrees three ways on three sequences (3, 16 and 64 tokens).
fn check_member(arch: &str, extra: &[&str], member: &str) {
    let dir = common::scratch();
    let long = long_sequence();
    let sequences = [SHORT, MEDIUM, long.as_str()];
    let model = make_model(dir.path(), arch, extra, &sequences);
    assert_inspect(&model.gguf, member);
    for (k, ids) in sequences.iter().enumerate() {
        let n = tokens_of(ids).len();
        let what = format!("{arch} {extra:?}, {n} tokens");
        let Runs { ours, llama } = run_both(dir.path(), &model, k, ids);
        let (v, hf) = (model.vocab, &model.hf_logits[k]);
        let vs_llama = agree(
            &format!("{what}: glmcheck vs llama.cpp"),
            &ours.0,
            &llama.0,
            v,
        );
        let vs_hf = agree(&format!("{what}: glmcheck vs transformers"), &ours.0, hf, v);
        let llama_hf = agree(
            &format!("{what}: llama.cpp vs transformers"),
            &llama.0,
            hf,
            v,
        );
        println!(
            "{what}: max |Δlogit| glmcheck−llama.cpp {vs_llama:.2e}, glmcheck−transformers \
             {vs_hf:.2e}, llama.cpp−transformers {llama_hf:.2e}"
        );
        assert_eq!(ours.1.as_array().unwrap().len(), GENERATE);
        assert_eq!(ours.1, llama.1, "{what}: greedy tokens, llama.cpp");
        assert_eq!(
            ours.1, model.hf_generated[k],
            "{what}: greedy tokens, transformers"
        );
    }
}

/// Max over positions of max |a − b| / max|b|: how far apart two runs are, relative.
fn worst_relative(a: &[f32], b: &[f32], vocab: usize) -> f64 {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| {
            let scale = y.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
            let err = x
                .iter()
                .zip(y)
                .fold(0f64, |m, (p, q)| m.max(f64::from((p - q).abs())));
            err / scale
        })
        .fold(0.0, f64::max)
}

#[test]
fn deepseek_v3_yarn_agrees() {
    check_member("v3", &["--yarn"], "deepseek_v3");
}

/// DeepSeek-V3.2: the converter writes arch `deepseek32` with the DSA indexer's keys, and
/// llama.cpp runs the indexer (4 of 64 key positions kept at the long prompt).
#[test]
fn deepseek_v3_2_yarn_agrees() {
    check_member("v32", &["--yarn"], "deepseek_v32");
}

#[test]
fn deepseek_v2_lite_agrees() {
    check_member("v2-lite", &[], "deepseek_v2");
}

/// DeepSeek-V2's softmax router without groups: all three agree.
#[test]
fn deepseek_v2_one_group_agrees() {
    check_member(
        "v2",
        &["--set", "n_group=1", "--set", "topk_group=1"],
        "deepseek_v2",
    );
}

#[test]
fn kimi_k2_agrees() {
    check_member("kimi-k2", &[], "kimi_k2");
}

#[test]
fn glm_4_7_flash_agrees() {
    check_member("glm-4.7-flash", &[], "glm4_moe_lite");
}

#[test]
fn whole_attn_kv_b_deepseek_v3_agrees() {
    check_member("v3", &["--yarn", "--whole-kv-b"], "deepseek_v3");
}

/// DeepSeek-V2's group_limited_greedy with 4 groups, 2 used, 3 experts chosen: glmcheck and
/// transformers rank groups by their best score and agree; llama.cpp ranks them by their two best
/// and runs another model, which must show in its logits or its greedy tokens (a short prompt may
/// choose the same groups both ways until its generation does not).
#[test]
fn deepseek_v2_groups_follow_transformers_where_llama_cpp_differs() {
    let dir = common::scratch();
    let sequences = [SHORT, MEDIUM];
    let extra = [
        "--set",
        "n_group=4",
        "--set",
        "topk_group=2",
        "--set",
        "num_experts_per_tok=3",
    ];
    let model = make_model(dir.path(), "v2", &extra, &sequences);
    let json = assert_inspect(&model.gguf, "deepseek_v2");
    assert_eq!(json["config"]["topk_method"], "group_limited_greedy");
    let mut llama_differs = false;
    for (k, ids) in sequences.iter().enumerate() {
        let n = tokens_of(ids).len();
        let what = format!("v2 groups, {n} tokens");
        let Runs { ours, llama } = run_both(dir.path(), &model, k, ids);
        let (v, hf) = (model.vocab, &model.hf_logits[k]);
        let vs_hf = agree(&format!("{what}: glmcheck vs transformers"), &ours.0, hf, v);
        let off = worst_relative(&llama.0, &ours.0, v);
        println!(
            "{what}: max |Δlogit| glmcheck−transformers {vs_hf:.2e}; llama.cpp off glmcheck by \
             {off:.2e} × max|logit|, greedy tokens {}",
            if ours.1 == llama.1 { "equal" } else { "differ" }
        );
        assert_eq!(
            ours.1, model.hf_generated[k],
            "{what}: greedy tokens, transformers"
        );
        llama_differs |= off > 100.0 * TOLERANCE || ours.1 != llama.1;
    }
    assert!(
        llama_differs,
        "llama.cpp's group ranking (two best) should differ from DeepSeek-V2's (best)"
    );
}

/// A V3 file without `expert_gating_func`: llama.cpp's deepseek2 loader reads softmax (and still
/// chooses with the file's `exp_probs_b`); glmcheck reads it the same way and matches llama.cpp,
/// while both are far from the sigmoid model transformers runs.
#[test]
fn missing_gating_func_reads_as_softmax_like_llama_cpp() {
    let dir = common::scratch();
    let sequences = [SHORT, MEDIUM];
    let model = make_model(
        dir.path(),
        "v3",
        &["--yarn", "--drop-key", "expert_gating_func"],
        &sequences,
    );
    let json = assert_inspect(&model.gguf, "deepseek_v3");
    assert_eq!(
        json["config"]["scoring_func"], "softmax",
        "{}",
        json["config"]
    );
    assert_eq!(json["config"]["topk_method"], "noaux_tc");
    agrees_with_llama_cpp_only(
        dir.path(),
        &model,
        &sequences,
        "v3 without expert_gating_func",
    );
}

/// glmcheck's reading of `model`'s GGUF agrees with llama.cpp's run of it (logits and greedy
/// tokens), and both run another model than the transformers checkpoint it was converted from.
fn agrees_with_llama_cpp_only(dir: &Path, model: &Model, sequences: &[&str], what: &str) {
    for (k, ids) in sequences.iter().enumerate() {
        let what = format!("{what}, {} tokens", tokens_of(ids).len());
        let Runs { ours, llama } = run_both(dir, model, k, ids);
        let v = model.vocab;
        let vs_llama = agree(
            &format!("{what}: glmcheck vs llama.cpp"),
            &ours.0,
            &llama.0,
            v,
        );
        let off = worst_relative(&ours.0, &model.hf_logits[k], v);
        println!(
            "{what}: max |Δlogit| glmcheck−llama.cpp {vs_llama:.2e}; off transformers' model by \
             {off:.2e} × max|logit|"
        );
        assert_eq!(ours.1, llama.1, "{what}: greedy tokens, llama.cpp");
        assert!(
            off > 100.0 * TOLERANCE,
            "{what}: llama.cpp's reading should run another model than transformers'"
        );
    }
}

/// DeepSeek-V2-Lite's YaRN (mscale = mscale_all_dim = 0.707) in a V3.2 checkpoint: llama.cpp's
/// deepseek32 takes mscale 1 where deepseek2 takes mscale_all_dim, so it scales cos/sin by
/// mscale(1)/mscale(0.707) and the softmax by mscale(1)², where transformers leaves cos/sin
/// unscaled and the softmax × mscale(0.707)². glmcheck reads the file as llama.cpp runs it.
#[test]
fn deepseek32_takes_mscale_1_beside_another_mscale_all_dim_like_llama_cpp() {
    let dir = common::scratch();
    let sequences = [SHORT, MEDIUM];
    let yarn = r#"rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}"#;
    let model = make_model(dir.path(), "v32", &["--set", yarn], &sequences);
    let json = assert_inspect(&model.gguf, "deepseek_v32");
    let y = &json["config"]["yarn"];
    assert_eq!(y["mscale_all_dim"], 1.0, "{y}");
    agrees_with_llama_cpp_only(
        dir.path(),
        &model,
        &sequences,
        "v32 with mscale_all_dim 0.707",
    );
}
