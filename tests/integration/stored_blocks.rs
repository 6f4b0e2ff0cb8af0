//! A rank's shard read as stored GGML blocks (what a GPU rank uploads and dequantizes on its
//! device) holds exactly the values of the whole weight dequantized and cut on the host, for
//! every split weight, rank, TP degree, file layout and planted shard fault; weights a planted
//! weight fault or another file set's storage changes are never read that way.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use glmcheck::dtype::Precision;
use glmcheck::exec::backend::Cpu;
use glmcheck::exec::cpu::host_weight::HostWeight;
use glmcheck::exec::faults::inject::Injection;
use glmcheck::exec::source::lazy_weight::LazyWeight;
use glmcheck::exec::source::sharder::Sharder;
use glmcheck::exec::source::WeightSource;
use glmcheck::exec::storage::stored::StoredMatrix;
use glmcheck::model::names::{LayerWeight, LayerWeight::*, WeightId};
use glmcheck::shard::plan::splits_rows;
use glmcheck::weights::file_read::{as_room, filled_vec};

/// Every split matrix of the model: attention's, the dense MLP's, the shared expert's and two
/// routed experts' per MoE layer.
fn split_matrices(src: &WeightSource) -> Vec<(WeightId, LayerWeight)> {
    let cfg = &src.cfg;
    let mut out = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        for role in [QB, KvB, AttnOut] {
            out.push((WeightId::Layer(l, role), role));
        }
        if !cfg.is_moe_layer(l) {
            for role in [Gate, Up, Down] {
                out.push((WeightId::Layer(l, role), role));
            }
            continue;
        }
        for role in [SharedGate, SharedUp, SharedDown] {
            out.push((WeightId::Layer(l, role), role));
        }
        for expert in [0, cfg.n_routed_experts - 1] {
            for which in [ExpertsGate, ExpertsUp, ExpertsDown] {
                let id = WeightId::Expert {
                    layer: l,
                    expert,
                    which,
                };
                out.push((id, which));
            }
        }
    }
    out
}

/// How many shards were read as stored blocks, as row blocks and as column blocks, after
/// checking each against the host's cut of the whole weight.
#[derive(Debug, Default, PartialEq)]
struct Counts {
    row_blocks: usize,
    column_blocks: usize,
    host_only: usize,
}

fn check_every_shard(src: &WeightSource, faults: &[Option<Injection>]) -> Counts {
    let mut counts = Counts::default();
    // What a GPU keeps each block's bytes under: one key, one content.
    let mut by_key = HashMap::new();
    for (id, role) in split_matrices(src) {
        let whole = src.matrix(id).expect("the weight dequantizes");
        let stored = src.stored_matrix(id);
        for tp in [1, 2, 4] {
            for &fault in faults {
                let sharder = Sharder {
                    tp,
                    ep: false,
                    fault,
                };
                for rank in 0..tp {
                    let host = sharder.shard(&whole, role, rank).unwrap();
                    let block = stored.and_then(|m| {
                        let (rows, cols) = sharder.block(role, rank, m.rows, m.cols).unwrap()?;
                        m.block(rows, cols)
                    });
                    let Some(block) = block else {
                        counts.host_only += 1;
                        continue;
                    };
                    let values = block.dequantize().unwrap();
                    let kept = by_key.entry(block.key()).or_insert_with(|| values.clone());
                    assert_eq!(*kept, values, "{id:?}: one key for two blocks");
                    assert_eq!(
                        values, host,
                        "{id:?} rank {rank} of {tp} under {fault:?}: stored block differs"
                    );
                    if splits_rows(role) || tp == 1 {
                        counts.row_blocks += 1;
                    } else {
                        counts.column_blocks += 1;
                    }
                }
            }
        }
    }
    counts
}

fn shard_faults() -> Vec<Option<Injection>> {
    vec![
        None,
        Some(Injection::UnshardedColumn(KvB)),
        Some(Injection::UnshardedColumn(ExpertsUp)),
        Some(Injection::RankOrder(AttnOut)),
        Some(Injection::RankOrder(ExpertsDown)),
        Some(Injection::ShardAxis(QB)),
    ]
}

fn synth(dir: &Path, name: &str, extra: &[&str]) -> WeightSource {
    let model = dir.join(name);
    common::synth_tiny(&model, extra);
    common::weight_source(&model)
}

#[test]
fn stored_shards_equal_the_host_cut_in_every_layout() {
    let dir = common::scratch();
    let faults = shard_faults();
    // Q8_0's 32-value blocks: every split, of rows or of columns, falls on whole blocks.
    let q8 = synth(dir.path(), "q8.gguf", &["--quant", "q8_0"]);
    let c = check_every_shard(&q8, &faults);
    // llama.cpp's split kv_b is assembled on the host, and shard-axis reshapes on the host.
    assert!(c.row_blocks > 0 && c.column_blocks > 0, "{c:?}");
    let layers = q8.cfg.num_hidden_layers as usize;
    let rank_cases = 1 + 2 + 4;
    let kv_b_cases = layers * rank_cases * faults.len();
    // q_b under shard-axis (kv_b's counted above).
    let shard_axis_cases = layers * rank_cases;
    assert_eq!(c.host_only, kv_b_cases + shard_axis_cases, "{c:?}");

    // Q4_K_M's 256-value super-blocks: column splits narrower than a block stay on the host.
    let q4 = synth(dir.path(), "q4.gguf", &["--quant", "q4_k_m"]);
    let c = check_every_shard(&q4, &faults);
    assert!(c.row_blocks > 0, "{c:?}");

    // Hugging Face bf16, one tensor per expert, and transformers' fused gate_up.
    for (name, experts) in [("hf-per", "per-expert"), ("hf-fused", "fused")] {
        let hf = synth(
            dir.path(),
            name,
            &["--format", "hf", "--hf-experts", experts],
        );
        let c = check_every_shard(&hf, &faults);
        let layers = hf.cfg.num_hidden_layers as usize;
        assert_eq!(c.host_only, layers * (1 + 2 + 4), "{name}: {c:?}");
        assert!(c.column_blocks > 0, "{name}: {c:?}");
    }
}

#[test]
fn weights_a_fault_or_another_storage_changes_are_read_on_the_host() {
    let dir = common::scratch();
    let model = dir.path().join("hf");
    common::synth_tiny(&model, &["--format", "hf"]);
    let plain = common::weight_source(&model);
    let kv_b = WeightId::Layer(0, KvB);
    assert!(plain.stored_matrix(kv_b).is_some());
    assert!(plain.stored_matrix(WeightId::LmHead).is_some());

    let split = common::weight_source(&model).with_fault(Some(Injection::KvBSplitOrder));
    assert!(split.stored_matrix(kv_b).is_none());
    assert!(split.stored_matrix(WeightId::Layer(0, QB)).is_some());
    let flat = common::weight_source(&model).with_fault(Some(Injection::FlatLmHead));
    assert!(flat.stored_matrix(WeightId::LmHead).is_none());
    let misread = common::weight_source(&model).with_fault(Some(Injection::DequantQ4kScales));
    assert!(misread.stored_matrix(WeightId::Layer(0, QB)).is_none());

    let gguf = dir.path().join("q4.gguf");
    common::synth_tiny(&gguf, &["--quant", "q4_k_m"]);
    let through = common::weight_source(&model).stored_as(&common::weight_source(&gguf));
    assert!(through.stored_matrix(WeightId::Layer(0, QB)).is_none());
    // Norms and the embedding are not matrices read as blocks.
    assert!(plain.stored_matrix(WeightId::Layer(0, AttnNorm)).is_none());
    assert!(plain.stored_matrix(WeightId::Embed).is_none());
}

#[test]
fn a_read_past_a_tensor_names_it_and_reads_nothing() {
    let dir = common::scratch();
    let model = dir.path().join("q8.gguf");
    common::synth_tiny(&model, &["--quant", "q8_0"]);
    let files = glmcheck::weights::ModelFiles::open(&model).unwrap();
    let t = files.require("blk.0.attn_q_b.weight").unwrap();
    let mut two = [7u8; 2];
    // SAFETY: the reader writes only bytes of the file.
    let room = unsafe { as_room(&mut two) };
    let err = files
        .read_into(t, t.nbytes - 1, room)
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.0.attn_q_b.weight"), "{err}");
    assert!(err.contains("outside its"), "{err}");
    assert_eq!(two, [7, 7]);
    let mut last = [0u8; 1];
    // SAFETY: as above.
    files
        .read_into(t, t.nbytes - 1, unsafe { as_room(&mut last) })
        .unwrap();
    assert_eq!(last[0], files.bytes(t)[t.nbytes as usize - 1]);

    // A read of several MiB goes out on several threads, into memory nothing wrote before: the
    // bytes are the map's, in order.
    let big = dir.path().join("small.gguf");
    common::glmcheck_json(
        [
            "synth",
            "--preset",
            "small",
            "--quant",
            "f32",
            "--json",
            "--out",
            big.to_str().unwrap(),
        ],
        0,
    );
    let files = glmcheck::weights::ModelFiles::open(&big).unwrap();
    let t = files.tensors().iter().max_by_key(|t| t.nbytes).unwrap();
    assert!(t.nbytes > 8 << 20, "{} is {} bytes", t.name, t.nbytes);
    // SAFETY: the reader writes every byte or fails.
    let whole: Vec<u8> =
        unsafe { filled_vec(t.nbytes as usize - 3, |room| files.read_into(t, 3, room)) }.unwrap();
    assert!(whole == files.bytes(t)[3..], "{}", t.name);

    // F32 blocks are read straight into the values: the map's bytes as little-endian f32, for
    // the whole matrix and for a block of rows and columns.
    let matrix = StoredMatrix::new(&files, t, 0, t.rows()).unwrap();
    let (rows, cols) = (matrix.rows, matrix.cols);
    let mapped: Vec<u32> = files
        .bytes(t)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let bits = |m: glmcheck::exec::mat::Mat<f32>| -> Vec<u32> {
        m.data().iter().map(|v| v.to_bits()).collect()
    };
    assert!(bits(matrix.whole().dequantize().unwrap()) == mapped);
    let block = matrix.block(1..rows - 1, cols / 4..cols / 2).unwrap();
    let want: Vec<u32> = (1..rows - 1)
        .flat_map(|r| mapped[r * cols + cols / 4..r * cols + cols / 2].to_vec())
        .collect();
    assert!(bits(block.dequantize().unwrap()) == want);

    // Blocks are read in place in the map (the CPU backend's held blocks): a block of whole
    // rows as its rows, a block of columns as its own bytes of each row of their span, which
    // is all it counts as its own. Dropping them gives their pages back; the same bytes map
    // again.
    let map = files.bytes(t);
    let rows_block = matrix.block(1..rows - 1, 0..cols).unwrap();
    for _ in 0..2 {
        let in_place = rows_block.blocks().unwrap();
        let got: Vec<u8> = in_place.rows(0..rows - 2).flatten().copied().collect();
        assert!(got == map[cols * 4..(rows - 1) * cols * 4]);
        assert!(got == rows_block.read_bytes().unwrap());
        assert_eq!(in_place.nbytes(), (rows - 2) * cols * 4);
    }
    let columns = block.blocks().unwrap();
    assert_eq!(columns.nbytes(), (rows - 2) * (cols / 4) * 4);
    for (r, row) in columns.rows(0..rows - 2).enumerate() {
        let at = ((r + 1) * cols + cols / 4) * 4;
        assert!(row == &map[at..at + cols], "row {r} of the column block");
    }
    assert!(matrix.whole().blocks().unwrap().nbytes() == t.nbytes as usize);
    let err = files
        .mapped(t, 1, t.nbytes as usize)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&t.name) && err.contains("outside its"),
        "{err}"
    );
}

/// llama.cpp's split kv_b held by the CPU backend, each rank's heads decoded a head at a time
/// from `attn_k_b` and `attn_v_b` in place, holds exactly the host's cut of kv_b assembled from
/// the two parts dequantized whole, at every TP degree and rank, in Q8_0 and Q4_K_M.
#[test]
fn split_kv_b_decoded_by_heads_equals_the_whole_assembled_and_cut() {
    let dir = common::scratch();
    for (name, quant) in [("q8.gguf", "q8_0"), ("q4.gguf", "q4_k_m")] {
        let src = synth(dir.path(), name, &["--quant", quant]);
        let cpu = Cpu::<f32>::new(Precision::F32);
        for l in 0..src.cfg.num_hidden_layers {
            assert!(src.stored_kv_b(l).is_some(), "{name}: kv_b stored split");
            let whole = src.matrix(WeightId::Layer(l, KvB)).expect("kv_b assembles");
            for tp in [1, 2, 4] {
                let sharder = Sharder {
                    tp,
                    ep: false,
                    fault: None,
                };
                for rank in 0..tp {
                    let held = LazyWeight::layer(&src, l, KvB)
                        .shard_held(&cpu, sharder, rank)
                        .expect("held");
                    let HostWeight::Values(held) = &*held else {
                        panic!("{name}: kv_b held as blocks, not assembled");
                    };
                    let host = sharder.shard(&whole, KvB, rank).unwrap();
                    assert_eq!(*held, host, "{name} layer {l} rank {rank} of {tp}");
                }
            }
        }
    }
}
