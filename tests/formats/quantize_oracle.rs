//! The quantizers against gguf-py: bit for bit where gguf-py quantizes (`gguf.quants.quantize`),
//! and for the types it does not, a round-trip error bound plus gguf-py reading our bytes
//! exactly as our dequantizer does.
//!
//! Our quantizers follow ggml (`tests/llamacpp/quantize_llamacpp.rs` holds every type to ggml's own
//! bytes), and where gguf-py and ggml disagree ggml wins. They disagree in one place these
//! inputs reach: the minimum of a Q4_1 or Q5_1 block whose least value is a zero of both signs.
//! ggml scans with `v < min`, so the first zero stays; numpy's `min` keeps the last. The two
//! store `m` as +0 and -0 (f16 0x0000 and 0x8000), so there the sign bit of `m` is not compared.

use crate::common;

use std::collections::HashMap;
use std::sync::OnceLock;

use glmcheck::rng::SplitMix;
use glmcheck::weights::quant::dequantize;
use glmcheck::weights::quantize::{has_quantizer, quantize, QuantizeError};
use glmcheck::weights::GgmlType;
use GgmlType as T;

/// Row length: whole blocks of every type.
const ROW: usize = 512;

/// The types gguf-py quantizes, which must come out byte for byte as its bytes.
const EXACT: [GgmlType; 11] = [
    T::F32,
    T::F16,
    T::BF16,
    T::Q4_0,
    T::Q4_1,
    T::Q5_0,
    T::Q5_1,
    T::Q8_0,
    T::TQ1_0,
    T::TQ2_0,
    T::MXFP4,
];

/// Types whose quantize → dequantize error is bounded, with the bound on the relative RMS error
/// over Gaussian rows. A b-bit uniform code over a block's range leaves an
/// error of about 2^-b of the range, and a Gaussian block's range is some 5 standard deviations:
/// 8 bits ≈ 1%, 6 ≈ 4%, 5 ≈ 8%, 4 ≈ 15%, 3 ≈ 30%, 2 ≈ 50%. The K-quants' fitted scales and the
/// IQ4 codebook (levels denser near zero, where Gaussians are) do better than the naive rule,
/// so the bounds sit between the measured errors and that rule.
const ROUND_TRIP: [(GgmlType, f64); 13] = [
    (T::Q8_0, 0.01),
    (T::Q6_K, 0.03),
    (T::Q5_0, 0.06),
    (T::Q5_1, 0.06),
    (T::Q5_K, 0.05),
    (T::Q4_0, 0.12),
    (T::Q4_1, 0.12),
    (T::Q4_K, 0.10),
    (T::MXFP4, 0.15),
    (T::IQ4_NL, 0.10),
    (T::IQ4_XS, 0.10),
    (T::Q3_K, 0.20),
    (T::Q2_K, 0.40),
];

/// The test rows: `moderate` Gaussian rows first (where error bounds apply), then the edges.
struct Inputs {
    values: Vec<f32>,
    moderate: usize,
}

struct Oracle {
    inputs: Inputs,
    /// The scratch folder's files by name, read back before the folder is removed (a static
    /// is never dropped, so a folder it held would outlive the run).
    files: HashMap<String, Vec<u8>>,
}

impl Oracle {
    fn file(&self, name: &str) -> &[u8] {
        self.files
            .get(name)
            .unwrap_or_else(|| panic!("gguf-py wrote no {name}"))
    }
}

/// Writes the inputs and our blocks, runs gguf-py once per test binary.
fn oracle() -> &'static Oracle {
    static ORACLE: OnceLock<Oracle> = OnceLock::new();
    ORACLE.get_or_init(|| {
        let inputs = inputs();
        let dir = common::scratch();
        let bytes: Vec<u8> = inputs.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("input.f32"), bytes).expect("write input");
        for (ty, _) in ROUND_TRIP {
            let ours = quantize(ty, &inputs.values, ROW).expect("quantize");
            std::fs::write(dir.path().join(format!("{ty}.ours")), ours).expect("write ours");
        }
        let names = |ts: &mut dyn Iterator<Item = GgmlType>| {
            ts.map(|t| t.name()).collect::<Vec<_>>().join(",")
        };
        common::run_oracle(
            "formats.quantize_ref",
            &[
                dir.path().to_str().expect("utf-8 scratch path"),
                "--row-len",
                &ROW.to_string(),
                "--quantize",
                &names(&mut EXACT.into_iter()),
                "--dequantize",
                &names(&mut ROUND_TRIP.iter().map(|&(t, _)| t)),
            ],
        );
        let files = std::fs::read_dir(dir.path())
            .expect("list the scratch folder")
            .map(|entry| {
                let path = entry.expect("scratch entry").path();
                let name = path.file_name().expect("a file name").to_string_lossy();
                let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {name}: {e}"));
                (name.into_owned(), bytes)
            })
            .collect();
        Oracle { inputs, files }
    })
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn inputs() -> Inputs {
    let mut rng = SplitMix::new(2024);
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let scales = [1e-3f32, 0.02, 1.0, 30.0, 1e3];
    for i in 0..40 {
        let scale = scales[i % scales.len()];
        rows.push((0..ROW).map(|_| rng.normal() * scale).collect());
    }
    let moderate = rows.len();
    for _ in 0..4 {
        // An outlier every 67 values, as real weights have.
        let mut row: Vec<f32> = (0..ROW).map(|_| rng.normal()).collect();
        row.iter_mut().step_by(67).for_each(|v| *v *= 20.0);
        rows.push(row);
    }
    rows.push(vec![0.0; ROW]);
    rows.push(
        (0..ROW)
            .map(|i| if i % 2 == 0 { 0.0 } else { -0.0 })
            .collect(),
    );
    for scale in [1e-30f32, 1e-37, 1e-39, 1e-44, 6e4, 1e5, 1e30, 5e37] {
        rows.push((0..ROW).map(|_| rng.normal() * scale).collect());
    }
    rows.push(
        (0..ROW)
            .map(|i| [f32::MAX, -f32::MAX, 1.0, 0.0][i % 4])
            .collect(),
    );
    for r in 0..4 {
        rows.push(scale_ties(&mut rng, r));
        rows.push(range_ties(&mut rng, r));
    }
    rows.push(float_ties(&mut rng));
    rows.push(mxfp4_edges(&mut rng));
    Inputs {
        values: rows.concat(),
        moderate,
    }
}

/// Uniform integer in `[0, n)`.
fn below(rng: &mut SplitMix, n: u64) -> u64 {
    rng.next_u64() % n
}

/// Blocks of 32 led by an extreme that makes the legacy, ternary and MXFP4 scales exact
/// (127 → Q8_0's d = 1, -8 → Q4_0's, -16 → Q5_0's, 2 → TQ's halves, 8 → MXFP4's unit), the rest
/// half-integers within it: codes land exactly on rounding ties.
fn scale_ties(rng: &mut SplitMix, shift: usize) -> Vec<f32> {
    const EXTREMES: [f32; 11] = [
        127.0, -8.0, -16.0, 8.0, 2.0, -2.0, 12.0, 31.0, 15.0, 1.0, 4.0,
    ];
    (0..ROW / 32)
        .flat_map(|b| {
            let s = EXTREMES[(b + shift) % EXTREMES.len()];
            let m = 2 * s.abs() as u64;
            let rest: Vec<f32> = (1..32)
                .map(|_| (below(rng, 2 * m + 1) as f32 - m as f32) / 2.0)
                .collect();
            std::iter::once(s).chain(rest)
        })
        .collect()
}

/// Blocks spanning exactly 15 or 31 from an integer minimum (Q4_1's and Q5_1's d = 1) with
/// half-integer steps between: `(x - min) / d + 0.5` lands on integers.
fn range_ties(rng: &mut SplitMix, shift: usize) -> Vec<f32> {
    (0..ROW / 32)
        .flat_map(|b| {
            let span = if (b + shift).is_multiple_of(2) {
                15u64
            } else {
                31
            };
            let lo = [0.0f32, -3.0, 2.0][(b + shift) % 3];
            let rest: Vec<f32> = (2..32)
                .map(|_| lo + below(rng, span) as f32 + 0.5)
                .collect();
            [lo, lo + span as f32].into_iter().chain(rest)
        })
        .collect()
}

/// Floats exactly halfway between BF16 or F16 neighbours, and around F16's largest value.
fn float_ties(rng: &mut SplitMix) -> Vec<f32> {
    (0..ROW)
        .map(|i| {
            let bits = rng.next_u64() as u32;
            // Exponent within 2^-20..2^12 so that F16 ties include subnormals.
            let exp = (107 + (bits >> 23) % 32) << 23;
            let sign_mant = bits & 0x807f_ffff;
            match i % 4 {
                0 => f32::from_bits((sign_mant & !0xffff) | 0x8000 | exp),
                1 => f32::from_bits((sign_mant & !0x1fff) | 0x1000 | exp),
                2 => [65504.0, 65519.99, 65520.0, -65536.0][i / 4 % 4],
                _ => f32::from_bits(sign_mant | exp),
            }
        })
        .collect()
}

/// MXFP4 blocks whose absmax is a power of two or just below one (where `floor(log2)` turns),
/// with values on and halfway between E2M1 levels.
fn mxfp4_edges(rng: &mut SplitMix) -> Vec<f32> {
    const HALVES: [f32; 12] = [
        0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 5.0,
    ];
    (0..ROW / 32)
        .flat_map(|b| {
            let k = b as i32 - 8;
            let top = 2f32.powi(k);
            let amax = if b % 2 == 0 {
                top
            } else {
                f32::from_bits(top.to_bits() - 1)
            };
            let rest: Vec<f32> = (1..32)
                .map(|_| {
                    let v = HALVES[below(rng, 12) as usize] * top / 8.0;
                    if rng.next_u64().is_multiple_of(2) {
                        v
                    } else {
                        -v
                    }
                })
                .collect();
            std::iter::once(amax).chain(rest)
        })
        .collect()
}

#[test]
fn gguf_py_quantized_types_match_bit_for_bit() {
    let o = oracle();
    for ty in EXACT {
        let ours = quantize(ty, &o.inputs.values, ROW).expect("quantize");
        let want = o.file(&format!("{ty}.ref"));
        assert_eq!(ours.len(), want.len(), "{ty}");
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let differs = |k: usize| {
            let (a, b) = (&ours[k * ts..][..ts], &want[k * ts..][..ts]);
            if signed_zero_min(ty, &o.inputs.values[k * bs..(k + 1) * bs]) {
                // Byte 3 holds the sign of the f16 `m`, which follows the first zero in ggml.
                a[..3] != b[..3] || a[3] & 0x7f != b[3] & 0x7f || a[4..] != b[4..]
            } else {
                a != b
            }
        };
        if let Some(k) = (0..ours.len() / ts).find(|&k| differs(k)) {
            panic!(
                "{ty}: block {k} (row {}) differs\n values {:?}\n ours {:?}\n gguf-py {:?}",
                k * bs / ROW,
                &o.inputs.values[k * bs..(k + 1) * bs],
                &ours[k * ts..][..ts],
                &want[k * ts..][..ts],
            );
        }
    }
}

/// A Q4_1 or Q5_1 block whose minimum is zero and holds zeros of both signs: where ggml's `m`
/// (ours) and gguf-py's may differ in sign.
fn signed_zero_min(ty: GgmlType, block: &[f32]) -> bool {
    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
    matches!(ty, T::Q4_1 | T::Q5_1)
        && min == 0.0
        && block.iter().any(|v| v.to_bits() == 0)
        && block.iter().any(|v| v.to_bits() == 0x8000_0000)
}

#[test]
fn round_trip_error_is_bounded_and_gguf_py_reads_our_bytes_alike() {
    let o = oracle();
    let n = o.inputs.values.len();
    let moderate = o.inputs.moderate * ROW;
    for (ty, bound) in ROUND_TRIP {
        let ours = o.file(&format!("{ty}.ours"));
        let mut back = vec![0f32; n];
        dequantize(ty, ours, &mut back).expect("dequantize");
        let theirs = f32s(o.file(&format!("{ty}.deq")));
        if let Some(i) = (0..n).find(|&i| back[i].to_bits() != theirs[i].to_bits()) {
            panic!(
                "{ty}: value {i} reads {} here, {} in gguf-py",
                back[i], theirs[i]
            );
        }
        let (err, norm) = o.inputs.values[..moderate]
            .iter()
            .zip(&back)
            .fold((0f64, 0f64), |(e, s), (&x, &y)| {
                (e + f64::from(x - y).powi(2), s + f64::from(x).powi(2))
            });
        let rel = (err / norm).sqrt();
        eprintln!("{ty}: relative RMS error {rel:.4} (bound {bound})");
        assert!(rel < bound, "{ty}: relative RMS error {rel} over {bound}");
    }
}

#[test]
fn same_bytes_on_one_and_two_threads() {
    let mut rng = SplitMix::new(5);
    let values: Vec<f32> = (0..256 * ROW).map(|_| rng.normal()).collect();
    let on = |threads: usize, ty: GgmlType| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool")
            .install(|| quantize(ty, &values, ROW).expect("quantize"))
    };
    for ty in GgmlType::all().filter(|&t| has_quantizer(t)) {
        assert!(on(1, ty) == on(2, ty), "{ty}");
    }
}

#[test]
fn types_without_quantizer_say_so() {
    let values = vec![1.0f32; ROW];
    for ty in [
        T::IQ1_S,
        T::IQ1_M,
        T::IQ2_XXS,
        T::IQ2_XS,
        T::IQ2_S,
        T::IQ3_XXS,
        T::IQ3_S,
        T::NVFP4,
    ] {
        assert_eq!(
            quantize(ty, &values, ROW),
            Err(QuantizeError::NoQuantizer(ty))
        );
    }
}
