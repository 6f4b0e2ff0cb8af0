//! The dequantizers against gguf-py's `gguf.quants.dequantize`, bit for bit, on random valid
//! blocks of every type gguf-py dequantizes (made by `glmcheck_oracle.formats.quant_blocks`).

use crate::common;

use std::path::Path;
use std::sync::OnceLock;

use glmcheck::weights::quant::{dequantize, dequantize_rows, QuantError};
use glmcheck::weights::GgmlType;

const BLOCKS_PER_TYPE: usize = 300;

/// One type's random blocks and gguf-py's f32 for them.
struct Case {
    ty: GgmlType,
    blocks: Vec<u8>,
    expected: Vec<f32>,
}

/// A row of the generator's `types.json`: one type as gguf-py's `GGML_QUANT_SIZES` knows it.
#[derive(serde::Deserialize)]
struct TypeRow {
    name: String,
    id: u32,
    block_size: usize,
    type_size: usize,
    dequantized: bool,
}

struct Oracle {
    cases: Vec<Case>,
    types: Vec<TypeRow>,
}

/// Runs the generator once per test binary and reads everything it wrote.
fn oracle() -> &'static Oracle {
    static ORACLE: OnceLock<Oracle> = OnceLock::new();
    ORACLE.get_or_init(|| {
        let dir = common::scratch();
        let out = dir.path().to_str().expect("utf-8 scratch path");
        common::run_oracle(
            "formats.quant_blocks",
            &[out, "--blocks", &BLOCKS_PER_TYPE.to_string(), "--seed", "7"],
        );
        let types: Vec<TypeRow> = serde_json::from_slice(
            &std::fs::read(dir.path().join("types.json")).expect("read types.json"),
        )
        .expect("parse types.json");
        let cases = types
            .iter()
            .filter(|t| t.dequantized)
            .map(|t| read_case(dir.path(), &t.name))
            .collect();
        Oracle { cases, types }
    })
}

fn read_case(dir: &Path, name: &str) -> Case {
    let ty = GgmlType::from_name(name)
        .unwrap_or_else(|| panic!("gguf-py type {name} unknown to GgmlType"));
    let blocks = std::fs::read(dir.join(format!("{name}.blocks"))).expect("read blocks");
    let expected = std::fs::read(dir.join(format!("{name}.expected")))
        .expect("read expected")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Case {
        ty,
        blocks,
        expected,
    }
}

/// `None` when `got` and `want` agree bit for bit, else where and how they first differ.
fn first_difference(ty: GgmlType, got: &[f32], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!(
            "{ty}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let differing = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    let i = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())?;
    let (g, w) = (got[i], want[i]);
    Some(format!(
        "{ty}: {differing} of {} values differ; first at index {i} (block {}, element {}): \
         got {g:e} ({:#010x}), gguf-py {w:e} ({:#010x})",
        got.len(),
        i / ty.block_size(),
        i % ty.block_size(),
        g.to_bits(),
        w.to_bits()
    ))
}

#[test]
fn oracle_covers_exactly_the_dequantizable_types() {
    let covered: Vec<GgmlType> = oracle().cases.iter().map(|c| c.ty).collect();
    let dequantizable: Vec<GgmlType> = GgmlType::all().filter(|t| t.can_dequantize()).collect();
    assert_eq!(covered, dequantizable);
    assert_eq!(covered.len(), 26);
}

#[test]
fn every_type_matches_gguf_py_bit_for_bit() {
    let mut failures = Vec::new();
    for case in &oracle().cases {
        assert_eq!(
            case.blocks.len(),
            BLOCKS_PER_TYPE * case.ty.type_size(),
            "{}",
            case.ty
        );
        let mut got = vec![f32::NAN; case.expected.len()];
        match dequantize(case.ty, &case.blocks, &mut got) {
            Ok(()) => failures.extend(first_difference(case.ty, &got, &case.expected)),
            Err(e) => failures.push(format!("{}: {e}", case.ty)),
        }
    }
    assert!(
        failures.is_empty(),
        "mismatches against gguf-py:\n{}",
        failures.join("\n")
    );
}

#[test]
fn rows_in_parallel_give_the_same_bits() {
    // Repeat each case to about a million values so that large rows span many parallel chunks.
    let mut failures = Vec::new();
    for case in &oracle().cases {
        let reps = (1usize << 20).div_ceil(case.expected.len());
        let blocks = case.blocks.repeat(reps);
        let expected = case.expected.repeat(reps);
        let bs = case.ty.block_size();
        for row_blocks in [1, 3, 4, BLOCKS_PER_TYPE] {
            let mut got = vec![f32::NAN; expected.len()];
            match dequantize_rows(case.ty, &blocks, &mut got, row_blocks * bs) {
                Ok(()) => failures.extend(
                    first_difference(case.ty, &got, &expected)
                        .map(|d| format!("rows of {row_blocks} blocks: {d}")),
                ),
                Err(e) => failures.push(format!("{}: rows of {row_blocks} blocks: {e}", case.ty)),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "row-wise mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn ggml_type_sizes_match_gguf_py() {
    let types = &oracle().types;
    for row in types {
        let ty = GgmlType::from_name(&row.name)
            .unwrap_or_else(|| panic!("gguf-py type {} unknown", row.name));
        assert_eq!(ty.id(), row.id, "{} id", row.name);
        assert_eq!(ty.block_size(), row.block_size, "{} block size", row.name);
        assert_eq!(ty.type_size(), row.type_size, "{} type size", row.name);
        assert_eq!(
            ty.can_dequantize(),
            row.dequantized,
            "{} dequantizable",
            row.name
        );
    }
    assert_eq!(
        GgmlType::all().count(),
        types.len(),
        "GgmlType and gguf-py list different types"
    );
}

#[test]
fn malformed_buffers_and_unsupported_types_are_errors() {
    use GgmlType as T;
    let mut out = [0.0f32; 64];
    assert_eq!(
        dequantize(T::Q4_0, &[0; 35], &mut out),
        Err(QuantError::PartialBlock {
            ty: T::Q4_0,
            bytes: 35,
            type_size: 18
        })
    );
    assert_eq!(
        dequantize(T::Q4_0, &[0; 36], &mut out[..63]),
        Err(QuantError::OutputSize {
            ty: T::Q4_0,
            blocks: 2,
            expected: 64,
            got: 63
        })
    );
    assert_eq!(
        dequantize(T::Q8_K, &[0; 292], &mut [0.0; 256]),
        Err(QuantError::Unsupported(T::Q8_K))
    );
    for ty in GgmlType::all().filter(|t| !t.can_dequantize()) {
        assert_eq!(
            dequantize(ty, &[], &mut []),
            Err(QuantError::Unsupported(ty))
        );
        assert_eq!(
            dequantize_rows(ty, &[], &mut [], ty.block_size()),
            Err(QuantError::Unsupported(ty))
        );
    }
    assert_eq!(dequantize(T::Q4_K, &[], &mut []), Ok(()));

    let partial = |bytes| QuantError::PartialBlock {
        ty: T::Q8_0,
        bytes,
        type_size: 34,
    };
    assert_eq!(
        dequantize_rows(T::Q8_0, &[0; 68], &mut out, 48),
        Err(partial(68))
    );
    assert_eq!(
        dequantize_rows(T::Q8_0, &[0; 68], &mut out, 0),
        Err(partial(68))
    );
    assert_eq!(
        dequantize_rows(T::Q8_0, &[0; 67], &mut out, 32),
        Err(partial(67))
    );
    assert_eq!(
        dequantize_rows(T::Q8_0, &[0; 68], &mut out[..32], 32),
        Err(QuantError::OutputSize {
            ty: T::Q8_0,
            blocks: 2,
            expected: 64,
            got: 32
        })
    );
}
