//! `glmcheck shards MODEL --actual MANIFEST`: an engine's shard manifest against vLLM's plan on
//! the tiny synthetic model (8 heads, so TP 8 splits it) in both layouts. A correct manifest
//! passes at TP 2, 4 and 8 in every dtype; planted faults — a rank holding kv_b whole, every rank
//! holding rank 0's block, ranks reversed for q_b, o_proj split by rows, merged gate/up taken as
//! one block — are each named with their class, weight, rank and rows; a manifest written by an
//! independent numpy oracle passes, and its unsharded variant fails; hostile manifests are
//! input errors naming the file and the field.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use glmcheck::diagnose::manifest::{plan_manifest, planned_entries};
use glmcheck::model::names::{LayerWeight, WeightId};
use glmcheck::shard::identify::Dtype;
use glmcheck::shard::manifest::{ShardEntry, ShardManifest};
use glmcheck::shard::plan::gather;
use glmcheck::shard::plan::{rank_view, Placement};
use serde_json::Value;

/// The tiny preset with 8 heads (TP 8 needs them), as a q8_0 GGUF or a bf16 Hugging Face
/// folder.
fn synth(dir: &Path, hf: bool) -> PathBuf {
    let out = dir.join(if hf { "hf" } else { "m.gguf" });
    let mut args = vec!["synth", "--set", "num_attention_heads=8"];
    if hf {
        args.extend(["--format", "hf", "--quant", "bf16"]);
    } else {
        args.extend(["--quant", "q8_0"]);
    }
    args.extend(["--out", out.to_str().unwrap(), "--json"]);
    common::glmcheck_json(args, 0);
    out
}

fn write(dir: &Path, name: &str, m: &ShardManifest) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(m).unwrap()).unwrap();
    p
}

/// `glmcheck shards MODEL --actual MANIFEST --json ARGS…`, its exit code asserted.
fn shards(model: &Path, manifest: &Path, code: i32, args: &[&str]) -> Value {
    let mut all = vec![
        "shards",
        model.to_str().unwrap(),
        "--actual",
        manifest.to_str().unwrap(),
        "--json",
    ];
    all.extend(args);
    common::glmcheck_json(all, code)
}

fn mismatches(v: &Value) -> Vec<Value> {
    v["mismatches"].as_array().unwrap().clone()
}

/// Rank `rank`'s entry for `name`.
fn entry<'a>(m: &'a mut ShardManifest, rank: usize, name: &str) -> &'a mut ShardEntry {
    m.ranks[rank]
        .weights
        .iter_mut()
        .find(|w| w.name == name)
        .unwrap_or_else(|| panic!("{name} on rank {rank}"))
}

fn shard_count(m: &ShardManifest) -> u64 {
    m.ranks.iter().map(|r| r.weights.len() as u64).sum()
}

#[test]
fn correct_manifests_pass_at_every_degree_dtype_and_layout() {
    let dir = common::scratch();
    for hf in [false, true] {
        let model = synth(dir.path(), hf);
        let ws = common::weight_source(&model);
        for (tp, dtype) in [(2, Dtype::F32), (4, Dtype::Bf16), (8, Dtype::F16)] {
            let m = plan_manifest(&ws, tp, false, dtype).unwrap();
            assert_eq!(m.ranks.len() as u64, tp);
            let p = write(dir.path(), "plan.json", &m);
            let v = shards(&model, &p, 0, &[]);
            assert_eq!(v["verdict"], "pass", "hf {hf} tp {tp}");
            assert_eq!(v["checked"].as_u64(), Some(shard_count(&m)));
            assert_eq!(v["ok"], v["checked"]);
            assert_eq!(v["tp"].as_u64(), Some(tp));
            assert!(mismatches(&v).is_empty());
            assert_eq!(v["not_in_manifest"], Value::Array(vec![]));
        }
        // Expert parallelism: whole experts per rank (stacked in the GGUF, one tensor per
        // expert in the Hugging Face folder).
        let m = plan_manifest(&ws, 2, true, Dtype::Bf16).unwrap();
        let p = write(dir.path(), "ep.json", &m);
        let v = shards(&model, &p, 0, &["--ep", "--tp", "2"]);
        assert_eq!(v["ep"], true);
        assert_eq!(v["checked"].as_u64(), Some(shard_count(&m)));
        assert!(mismatches(&v).is_empty());
    }
}

#[test]
fn planted_faults_are_named_with_class_weight_rank_and_rows() {
    let dir = common::scratch();
    let model = synth(dir.path(), true);
    let ws = common::weight_source(&model);
    let plan = plan_manifest(&ws, 4, false, Dtype::Bf16).unwrap();
    let kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
    let q_b = "model.layers.0.self_attn.q_b_proj.weight";
    let o = "model.layers.0.self_attn.o_proj.weight";
    // kv_b [8 heads · (32 + 32), 64], q_b [8 · (32 + 16), 128], o_proj [256, 8 · 32].
    let one = |m: &ShardManifest, name| {
        let p = write(dir.path(), name, m);
        let v = shards(&model, &p, 1, &[]);
        assert_eq!(v["verdict"], "fail");
        assert_eq!(v["checked"].as_u64(), Some(shard_count(m)));
        mismatches(&v)
    };

    // Rank 3 holds kv_b whole.
    let mut m = plan.clone();
    let whole = planned_entries(&ws, kv_b, 1, false, Dtype::Bf16).unwrap();
    *entry(&mut m, 3, kv_b) = whole[0].1.clone();
    let bad = one(&m, "whole.json");
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0]["weight"], kv_b);
    assert_eq!(bad[0]["rank"], 3);
    assert_eq!(bad[0]["class"], "unsharded_weight");
    assert_eq!(bad[0]["expected"], "rows 384..512");
    assert_eq!(bad[0]["found"], "all");
    assert_eq!(
        bad[0]["evidence"],
        format!("{kv_b} on rank 3 holds the whole [512, 64]; the plan gives rows 384..512")
    );

    // Every rank holds rank 0's kv_b block.
    let mut m = plan.clone();
    let block0 = entry(&mut m, 0, kv_b).clone();
    (1..4).for_each(|r| *entry(&mut m, r, kv_b) = block0.clone());
    let bad = one(&m, "same.json");
    let ranks: Vec<_> = bad.iter().map(|b| b["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, vec![1, 2, 3]);
    assert!(bad.iter().all(|b| b["class"] == "unsharded_weight"));
    assert!(bad.iter().all(|b| b["found"] == "rows 0..128"));
    assert_eq!(
        bad[1]["evidence"],
        format!(
            "{kv_b} on rank 2 holds rows 0..128 of 512, the same block as every rank; \
             the plan gives rows 256..384"
        )
    );

    // Rank 1's kv_b block with its rows in reverse order (a reshape where the per-head
    // transpose belongs scrambles the same way): every statistic is the planned block's, the
    // hash is no slice's.
    let mut m = plan.clone();
    let kv = ws.matrix(WeightId::Layer(0, LayerWeight::KvB)).unwrap();
    let reversed: Vec<f32> = kv.data()[128 * 64..256 * 64]
        .chunks(64)
        .rev()
        .flatten()
        .copied()
        .collect();
    *entry(&mut m, 1, kv_b) = ShardEntry::of(kv_b, vec![128, 64], &reversed, Dtype::Bf16);
    let bad = one(&m, "scrambled.json");
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(
        (bad[0]["rank"].as_u64(), bad[0]["class"].as_str()),
        (Some(1), Some("weight_layout"))
    );
    assert!(
        bad[0]["evidence"]
            .as_str()
            .unwrap()
            .contains("hash matches no slice"),
        "{:#}",
        bad[0]
    );

    // Ranks reversed for q_b.
    let mut m = plan.clone();
    let blocks: Vec<ShardEntry> = (0..4).map(|r| entry(&mut m, r, q_b).clone()).collect();
    (0..4).for_each(|r| *entry(&mut m, r, q_b) = blocks[3 - r].clone());
    let bad = one(&m, "reversed.json");
    assert_eq!(bad.len(), 4);
    assert!(bad.iter().all(|b| b["weight"] == q_b));
    assert!(bad.iter().all(|b| b["class"] == "wrong_shard_layout"));
    assert_eq!(
        (bad[0]["expected"].as_str(), bad[0]["found"].as_str()),
        (Some("rows 0..96"), Some("rows 288..384"))
    );
    assert_eq!(
        bad[0]["evidence"],
        format!("{q_b} on rank 0 holds rows 288..384 of 384 (rank 3's block); the plan gives rows 0..96")
    );

    // o_proj split by rows instead of columns, each block viewed as the planned [256, 64].
    let mut m = plan.clone();
    let full = ws.matrix(WeightId::Layer(0, LayerWeight::AttnOut)).unwrap();
    for r in 0..4u64 {
        let rows = Placement::Split { axis: 0, parts: 1 };
        let view = rank_view(rows, &[256, 256], r, 4).unwrap();
        let values = gather(full.data(), &[256, 256], &view);
        *entry(&mut m, r as usize, o) = ShardEntry::of(o, vec![256, 64], &values, Dtype::Bf16);
    }
    let bad = one(&m, "axis.json");
    assert_eq!(bad.len(), 4);
    assert!(bad.iter().all(|b| b["class"] == "wrong_shard_layout"));
    assert_eq!(
        (bad[1]["expected"].as_str(), bad[1]["found"].as_str()),
        (Some("cols 64..128"), Some("rows 64..128"))
    );
    assert_eq!(
        bad[1]["evidence"],
        format!(
            "{o} on rank 1 holds rows 64..128 of 256, split along the wrong axis viewed as \
             [256, 64]; the plan gives cols 64..128"
        )
    );

    // The table names the same.
    let p = write(dir.path(), "axis.json", &m);
    let out = Command::new(common::glmcheck_bin())
        .args(["shards", model.to_str().unwrap(), "--actual"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let n = shard_count(&m);
    let summary = format!(
        "TP 4: {n} shards checked, {} as planned, 4 mismatched (wrong_shard_layout)",
        n - 4
    );
    assert!(text.contains(&summary), "{text}");
    assert!(
        text.contains(bad[1]["evidence"].as_str().unwrap()),
        "{text}"
    );
}

#[test]
fn vllm_merged_gate_up_is_checked_part_by_part() {
    let dir = common::scratch();
    let model = synth(dir.path(), false);
    let ws = common::weight_source(&model);
    let name = "model.layers.0.mlp.gate_up_proj.weight";
    let entries = planned_entries(&ws, name, 2, false, Dtype::Bf16).unwrap();
    // [gate rows 0..256 ; up rows 0..256] on rank 0 of the [1024, 256] stack.
    assert_eq!(entries[0].1.shape, vec![512, 256]);
    let mut m = plan_manifest(&ws, 2, false, Dtype::Bf16).unwrap();
    for (r, e) in &entries {
        m.ranks[*r as usize].weights.push(e.clone());
    }
    let p = write(dir.path(), "merged.json", &m);
    let v = shards(&model, &p, 0, &[]);
    assert_eq!(v["checked"].as_u64(), Some(shard_count(&m)));

    // Rank 1 takes the second contiguous half: up rows only.
    let gate = ws.matrix(WeightId::Layer(0, LayerWeight::Gate)).unwrap();
    let up = ws.matrix(WeightId::Layer(0, LayerWeight::Up)).unwrap();
    *entry(&mut m, 1, name) = ShardEntry::of(name, vec![512, 256], up.data(), Dtype::Bf16);
    assert_eq!(gate.rows, 512);
    let p = write(dir.path(), "merged-bad.json", &m);
    let bad = mismatches(&shards(&model, &p, 1, &[]));
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0]["rank"], 1);
    assert_eq!(bad[0]["class"], "wrong_shard_layout");
    assert_eq!(bad[0]["expected"], "rows 256..512 + 768..1024");
    assert_eq!(bad[0]["found"], "rows 512..1024");
    assert!(
        bad[0]["evidence"]
            .as_str()
            .unwrap()
            .contains("one contiguous block where the plan takes one of each merged part"),
        "{}",
        bad[0]["evidence"]
    );
}

#[test]
fn an_independent_numpy_manifest_passes_and_its_unsharded_variant_fails() {
    let dir = common::scratch();
    let model = synth(dir.path(), false);
    let m = model.to_str().unwrap();
    let out = dir.path().join("oracle.json");
    let o = out.to_str().unwrap();
    for extra in [&[][..], &["--stats-only"][..]] {
        common::run_oracle(
            "formats.shard_manifest",
            &[&[m, "4", o][..], extra].concat(),
        );
        let v = shards(&model, &out, 0, &[]);
        assert_eq!(v["checked"], 20, "5 weights × 4 ranks");
        assert_eq!(v["ok"], 20);
    }
    let k_b = "blk.0.attn_k_b.weight";
    for extra in [&[][..], &["--stats-only"][..]] {
        let args = [&[m, "4", o, "--unshard", k_b][..], extra].concat();
        common::run_oracle("formats.shard_manifest", &args);
        let bad = mismatches(&shards(&model, &out, 1, &["--tp", "4"]));
        assert_eq!(bad.len(), 4, "{bad:?}");
        for (r, b) in bad.iter().enumerate() {
            assert_eq!(b["weight"], k_b);
            assert_eq!(b["rank"], r);
            assert_eq!(b["class"], "unsharded_weight");
            assert_eq!(b["expected"], format!("heads {}..{}", 2 * r, 2 * r + 2));
            assert_eq!(b["found"], "all");
        }
    }
    // Blocks of one size told apart by their statistics alone.
    let o_proj = "blk.0.attn_output.weight";
    let args = [m, "4", o, "--reverse", o_proj, "--stats-only"];
    common::run_oracle("formats.shard_manifest", &args);
    let bad = mismatches(&shards(&model, &out, 1, &[]));
    let found: Vec<_> = bad.iter().map(|b| b["found"].as_str().unwrap()).collect();
    assert_eq!(
        found,
        [
            "cols 192..256",
            "cols 128..192",
            "cols 64..128",
            "cols 0..64"
        ]
    );
    assert!(bad
        .iter()
        .all(|b| b["weight"] == o_proj && b["class"] == "wrong_shard_layout"));
}

#[test]
fn partial_and_empty_manifests() {
    let dir = common::scratch();
    let model = synth(dir.path(), false);
    let ws = common::weight_source(&model);
    let mut m = plan_manifest(&ws, 2, false, Dtype::Bf16).unwrap();
    m.ranks[1]
        .weights
        .retain(|w| w.name != "blk.0.attn_q_b.weight");
    let v = shards(&model, &write(dir.path(), "p.json", &m), 0, &[]);
    assert_eq!(
        v["not_in_manifest"],
        serde_json::json!([{"weight": "blk.0.attn_q_b.weight", "ranks": [1]}])
    );
    m.ranks.iter_mut().for_each(|r| r.weights.clear());
    let v = shards(&model, &write(dir.path(), "e.json", &m), 1, &[]);
    assert_eq!(
        (v["verdict"].as_str(), v["checked"].as_u64()),
        (Some("fail"), Some(0))
    );
}

#[test]
fn hostile_manifests_are_input_errors_naming_file_and_field() {
    let dir = common::scratch();
    let model = synth(dir.path(), true);
    let ws = common::weight_source(&model);
    let good = serde_json::to_string(&plan_manifest(&ws, 2, false, Dtype::Bf16).unwrap()).unwrap();
    let first_mean = {
        let v: Value = serde_json::from_str(&good).unwrap();
        v["ranks"][0]["weights"][0]["stats"]["mean"].to_string()
    };
    let first_hash = {
        let v: Value = serde_json::from_str(&good).unwrap();
        v["ranks"][0]["weights"][0]["hash"].to_string()
    };
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut v: Value = serde_json::from_str(&good).unwrap();
        f(&mut v);
        v.to_string()
    };
    let w0 = |v: &mut Value| v["ranks"][0]["weights"][0].clone();
    let cases: Vec<(&str, String, &str)> = vec![
        ("truncated", good[..good.len() / 2].to_string(), "EOF"),
        (
            "nan",
            good.replacen(&first_mean, "NaN", 1),
            "ranks[0].weights[0].stats.mean",
        ),
        (
            "string-nan",
            good.replacen(&first_mean, "\"NaN\"", 1),
            "ranks[0].weights[0].stats.mean",
        ),
        (
            "missing-shape",
            edit(&|v| {
                drop(
                    v["ranks"][0]["weights"][1]
                        .as_object_mut()
                        .unwrap()
                        .remove("shape"),
                )
            }),
            "ranks[0].weights[1]: missing field `shape`",
        ),
        (
            "huge-shape",
            edit(&|v| {
                v["ranks"][0]["weights"][0]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])
            }),
            "ranks[0].weights[0].shape",
        ),
        (
            "count",
            edit(&|v| {
                v["ranks"][0]["weights"][0]["shape"] = serde_json::json!([1u64 << 31, 1u64 << 31])
            }),
            "ranks[0].weights[0].stats.count",
        ),
        (
            "dims",
            edit(&|v| v["ranks"][0]["weights"][0]["shape"] = serde_json::json!(vec![1; 9])),
            "ranks[0].weights[0].shape: 9 dimensions",
        ),
        (
            "rank",
            edit(&|v| v["ranks"][1]["rank"] = 7.into()),
            "ranks[1].rank: 7 is out of range for tp 2",
        ),
        (
            "rank-twice",
            edit(&|v| v["ranks"][1]["rank"] = 0.into()),
            "ranks[1].rank: rank 0 is listed twice",
        ),
        (
            "weight-twice",
            edit(&|v| {
                let w = w0(v);
                v["ranks"][0]["weights"].as_array_mut().unwrap().push(w)
            }),
            "is listed twice on rank 0",
        ),
        (
            "negative-std",
            edit(&|v| v["ranks"][0]["weights"][0]["stats"]["std"] = (-1.0).into()),
            "ranks[0].weights[0].stats.std: -1 is negative",
        ),
        (
            "hash",
            good.replacen(&first_hash, "\"12345\"", 1),
            "hash `12345` is not 16 hex digits",
        ),
        (
            "dtype",
            edit(&|v| v["ranks"][0]["weights"][0]["dtype"] = "fp8".into()),
            "ranks[0].weights[0].dtype",
        ),
        (
            "format",
            edit(&|v| v["format"] = "other".into()),
            "format: `other`",
        ),
        ("tp", edit(&|v| v["tp"] = 0.into()), "tp: 0"),
        (
            "name",
            edit(&|v| {
                v["ranks"][0]["weights"][0]["name"] = "model.layers.0.mlp.fancy.weight".into()
            }),
            "ranks[0].weights[0].name: `model.layers.0.mlp.fancy.weight` is not a GLM-5 weight",
        ),
        (
            "absent",
            edit(&|v| {
                v["ranks"][0]["weights"][0]["name"] =
                    "model.layers.0.self_attn.k_b_proj.weight".into()
            }),
            "the model holds no `model.layers.0.self_attn.k_b_proj.weight`",
        ),
        (
            "degree",
            edit(&|v| {
                v["tp"] = 3.into();
                v["ranks"] = serde_json::json!([]);
            }),
            "num_attention_heads = 8 does not split evenly over 3 ranks",
        ),
    ];
    for (case, text, field) in cases {
        let p = dir.path().join(format!("{case}.json"));
        std::fs::write(&p, text).unwrap();
        let out = Command::new(common::glmcheck_bin())
            .args(["shards", model.to_str().unwrap(), "--actual"])
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{case}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{case}: {err}");
        assert!(err.contains(&format!("{case}.json")), "{case}: {err}");
        assert!(err.contains(field), "{case}: {err}");
    }
    // A degree the manifest was not written at.
    let p = dir.path().join("good.json");
    std::fs::write(&p, &good).unwrap();
    let out = Command::new(common::glmcheck_bin())
        .args(["shards", model.to_str().unwrap(), "--tp", "4", "--actual"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tp 4: "));
}
