//! glmcheck's quantizers against llama.cpp's: for every type that llama.cpp quantizes without
//! an importance matrix, `quantize` must write exactly the bytes of ggml's
//! `ggml_quantize_chunk(type, …, imatrix = NULL)`, which is what `llama-quantize` stores without
//! `--imatrix`. The oracle is `tests/oracle/llamacpp/quantize_chunk.cpp`, built by
//! `scripts/setup-llamacpp` against the llama.cpp of llama-cpp-python 0.3.36.
//!
//! Table-driven: every type meets every input set (Gaussian rows of four scales, heavy tails,
//! outliers, zero, constant, one-signed, sparse, subnormal and tie-making blocks). A mismatch
//! names the type, the input set, the first differing block and both blocks' bytes. With
//! `--nocapture` the test prints, per type, how many blocks it compared and how many were
//! identical.

use crate::common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use glmcheck::rng::SplitMix;
use glmcheck::weights::quantize::quantize;
use glmcheck::weights::GgmlType;
use GgmlType as T;

/// Every type llama.cpp quantizes without an importance matrix.
const TYPES: [GgmlType; 18] = [
    T::F32,
    T::F16,
    T::BF16,
    T::Q4_0,
    T::Q4_1,
    T::Q5_0,
    T::Q5_1,
    T::Q8_0,
    T::Q2_K,
    T::Q3_K,
    T::Q4_K,
    T::Q5_K,
    T::Q6_K,
    T::IQ4_NL,
    T::IQ4_XS,
    T::TQ1_0,
    T::TQ2_0,
    T::MXFP4,
];

/// The usual row length: whole blocks of every type.
const ROW: usize = 512;

/// Rows of the large heavy-tailed set, where rare rounding paths show up.
const BULK_ROWS: usize = 2048;

/// One input set: whole rows of `row_len` values.
struct Case {
    name: &'static str,
    row_len: usize,
    values: Vec<f32>,
}

/// The `quantize_chunk` program that scripts/setup-llamacpp builds.
fn oracle_bin() -> PathBuf {
    let bin = common::root().join(".oracles/llama.cpp/build/quantize_chunk");
    assert!(
        bin.exists(),
        "the llama.cpp oracle {} is not built: run scripts/setup-llamacpp (scripts/test does)",
        bin.display()
    );
    bin
}

/// The type's name as `ggml_type_name` spells it: lower case but for the K of the K-quants.
fn ggml_name(ty: GgmlType) -> String {
    let lower = ty.name().to_ascii_lowercase();
    match lower.strip_suffix("_k") {
        Some(stem) => format!("{stem}_K"),
        None => lower,
    }
}

/// ggml's bytes for `values` in rows of `row_len`.
fn ggml_bytes(bin: &Path, dir: &Path, ty: GgmlType, values: &[f32], row_len: usize) -> Vec<u8> {
    let input = dir.join("in.f32");
    let output = dir.join("out.bin");
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&input, bytes).expect("write input");
    let out = Command::new(bin)
        .arg(ggml_name(ty))
        .arg(row_len.to_string())
        .arg(&input)
        .arg(&output)
        .output()
        .expect("start quantize_chunk");
    assert!(
        out.status.success(),
        "quantize_chunk {} failed: {}",
        ggml_name(ty),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&output).expect("read quantize_chunk output")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Uniform integer in `[0, n)`.
fn below(rng: &mut SplitMix, n: u64) -> u64 {
    rng.next_u64() % n
}

fn rows(n: usize, row_len: usize, mut f: impl FnMut(usize, usize) -> f32) -> Vec<f32> {
    (0..n * row_len)
        .map(|i| f(i / row_len, i % row_len))
        .collect()
}

/// Student-t with 3 degrees of freedom (a normal over the root of a mean of three squared
/// normals): the heavy tails of trained weights.
fn student_t(rng: &mut SplitMix) -> f32 {
    let z = rng.normal();
    let chi2 = (0..3).map(|_| rng.normal().powi(2)).sum::<f32>() / 3.0;
    z / chi2.sqrt().max(0.05)
}

fn cases() -> Vec<Case> {
    let mut rng = SplitMix::new(0x6c6c_616d);
    let mut cases = Vec::new();
    let mut add = |name, row_len, values| {
        cases.push(Case {
            name,
            row_len,
            values,
        })
    };
    for (name, scale) in [
        ("gauss-1e-4", 1e-4f32),
        ("gauss-0.02", 0.02),
        ("gauss-1", 1.0),
        ("gauss-300", 300.0),
    ] {
        add(name, ROW, rows(32, ROW, |_, _| rng.normal() * scale));
    }
    add("gauss-1/256", 256, rows(16, 256, |_, _| rng.normal()));
    add("gauss-1/64", 64, rows(32, 64, |_, _| rng.normal()));
    add(
        "student-t-0.02",
        ROW,
        rows(64, ROW, |_, _| student_t(&mut rng) * 0.02),
    );
    add(
        "student-t-bulk",
        ROW,
        rows(BULK_ROWS, ROW, |r, _| {
            student_t(&mut rng) * [1e-3, 0.02, 0.5, 4.0][r % 4]
        }),
    );
    add(
        "outliers",
        ROW,
        rows(8, ROW, |r, i| {
            let v = rng.normal() * 0.02;
            if (i + 13 * r) % 67 == 0 {
                v * 40.0
            } else {
                v
            }
        }),
    );
    add("zeros", ROW, vec![0.0; 2 * ROW]);
    add(
        "constant",
        ROW,
        rows(6, ROW, |r, _| [0.5, -3.25, 1e-3, 7.0, -1e-5, 300.0][r]),
    );
    add(
        "zero-block",
        ROW,
        rows(8, ROW, |r, i| {
            // A zero block of 32, of 16 or of 256 values inside a nonzero row.
            let zero = match r % 4 {
                0 => (32 * r..32 * r + 32).contains(&i),
                1 => (16 * r..16 * r + 16).contains(&i),
                2 => i >= 256,
                _ => i < 256 && i % 32 >= 16,
            };
            if zero {
                0.0
            } else {
                rng.normal() * 0.02
            }
        }),
    );
    add(
        "all-positive",
        ROW,
        rows(6, ROW, |r, _| {
            rng.normal().abs() * 0.02 + [0.0, 0.01, 1.0][r % 3]
        }),
    );
    add(
        "all-negative",
        ROW,
        rows(6, ROW, |r, _| {
            -rng.normal().abs() * 0.02 - [0.0, 0.01, 1.0][r % 3]
        }),
    );
    add("tiny-1e-6", ROW, rows(8, ROW, |_, _| rng.normal() * 1e-6));
    add(
        "sparse",
        ROW,
        rows(8, ROW, |_, _| {
            if below(&mut rng, 20) == 0 {
                rng.normal()
            } else {
                0.0
            }
        }),
    );
    add(
        "integers",
        ROW,
        rows(8, ROW, |r, _| {
            let span = [4u64, 8, 16, 3][r % 4];
            below(&mut rng, 2 * span + 1) as f32 - span as f32
        }),
    );
    add(
        "signed-zeros",
        ROW,
        rows(4, ROW, |r, i| {
            let zero = if (i + r) % 3 == 0 { -0.0 } else { 0.0 };
            if r >= 2 && i % 32 == 31 {
                rng.normal()
            } else {
                zero
            }
        }),
    );
    add(
        "subnormal",
        ROW,
        rows(8, ROW, |r, _| {
            rng.normal() * [1e-15, 1e-20, 1e-39, 1e-44][r % 4]
        }),
    );
    add(
        "huge",
        ROW,
        rows(6, ROW, |r, _| rng.normal() * [6e4, 1e5, 1e30][r % 3]),
    );
    add(
        "scale-ties",
        ROW,
        rows(8, ROW, |_, i| scale_tie(&mut rng, i)),
    );
    add("float-ties", ROW, rows(4, ROW, |_, _| float_tie(&mut rng)));
    add(
        "pow2-edges",
        ROW,
        rows(4, ROW, |r, i| pow2_edge(&mut rng, r, i)),
    );
    cases
}

/// Blocks of 32 led by an extreme that makes a legacy, ternary or MXFP4 scale exact (127 for
/// Q8_0's d = 1, -8 for Q4_0's, -16 for Q5_0's, ...), the rest multiples of one half within it,
/// so that codes land on rounding ties.
fn scale_tie(rng: &mut SplitMix, i: usize) -> f32 {
    const EXTREMES: [f32; 8] = [127.0, -8.0, -16.0, 8.0, 2.0, 15.0, 31.0, -4.0];
    let s = EXTREMES[(i / 32 + i / 512) % EXTREMES.len()];
    if i.is_multiple_of(32) {
        return s;
    }
    let m = 2 * s.abs() as u64;
    (below(rng, 2 * m + 1) as f32 - m as f32) / 2.0
}

/// Values exactly halfway between two F16 or two BF16 neighbours (normal and subnormal F16),
/// and around F16's largest value.
fn float_tie(rng: &mut SplitMix) -> f32 {
    let bits = rng.next_u64() as u32;
    let exp = (100 + (bits >> 23) % 40) << 23;
    let sign_mant = bits & 0x807f_ffff;
    match bits % 5 {
        0 => f32::from_bits((sign_mant & !0xffff) | 0x8000 | exp),
        1 => f32::from_bits((sign_mant & !0x1fff) | 0x1000 | exp),
        2 => [65504.0, 65519.99, 65520.0, -65536.0][(bits >> 8) as usize % 4],
        _ => f32::from_bits(sign_mant | exp),
    }
}

/// MXFP4 blocks whose absmax is a power of two or the float just below one (where the floor
/// of log2 turns), the other values on or halfway between E2M1 levels.
fn pow2_edge(rng: &mut SplitMix, r: usize, i: usize) -> f32 {
    const HALVES: [f32; 12] = [
        0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 5.0,
    ];
    let b = i / 32 + 16 * r;
    let top = 2f32.powi(b as i32 - 40);
    if i.is_multiple_of(32) {
        return if b.is_multiple_of(2) {
            top
        } else {
            f32::from_bits(top.to_bits() - 1)
        };
    }
    let v = HALVES[below(rng, 12) as usize] * top / 8.0;
    if below(rng, 2) == 0 {
        v
    } else {
        -v
    }
}

/// Per type: blocks compared and blocks identical.
#[derive(Default, Clone, Copy)]
struct Tally {
    compared: usize,
    identical: usize,
}

#[test]
fn every_type_writes_ggml_bytes() {
    let bin = oracle_bin();
    let dir = common::scratch();
    let cases = cases();
    let mut tally = [Tally::default(); TYPES.len()];
    let mut failures = Vec::new();
    for (t, &ty) in TYPES.iter().enumerate() {
        let (bs, ts) = (ty.block_size(), ty.type_size());
        for case in cases.iter().filter(|c| c.row_len % bs == 0) {
            let ours = quantize(ty, &case.values, case.row_len).expect("quantize");
            let want = ggml_bytes(&bin, dir.path(), ty, &case.values, case.row_len);
            assert_eq!(ours.len(), want.len(), "{ty} on {}: sizes", case.name);
            let blocks = ours.len() / ts;
            let differ: Vec<usize> = (0..blocks)
                .filter(|&k| ours[k * ts..][..ts] != want[k * ts..][..ts])
                .collect();
            tally[t].compared += blocks;
            tally[t].identical += blocks - differ.len();
            if let Some(&k) = differ.first() {
                failures.push(format!(
                    "{ty} on {} ({} of {blocks} blocks differ): first block {k} (row {}, values \
                     {:?})\n  glmcheck {}\n  ggml     {}",
                    case.name,
                    differ.len(),
                    k * bs / case.row_len,
                    &case.values[k * bs..(k + 1) * bs],
                    hex(&ours[k * ts..][..ts]),
                    hex(&want[k * ts..][..ts]),
                ));
            }
        }
    }
    println!("| type | blocks compared | blocks identical |");
    println!("|---|---:|---:|");
    for (ty, t) in TYPES.iter().zip(&tally) {
        println!("| {ty} | {} | {} |", t.compared, t.identical);
    }
    assert!(
        failures.is_empty(),
        "glmcheck's bytes differ from ggml's:\n{}",
        failures.join("\n")
    );
}
