//! The safetensors reader and FP8 dequantization (E4M3 and E5M2 values, f32, bf16 and F8_E8M0
//! block scales) against files and values written by torch.

use crate::common;

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use glmcheck::weights::fp8::{
    dequant_block_scaled, f8e4m3_to_f32, f8e5m2_to_f32, f8e8m0_to_f32, is_ue8m0, DEFAULT_BLOCK,
};
use glmcheck::weights::safetensors::{SafetensorsSet, INDEX_NAME};
use glmcheck::weights::{Encoding, GgmlType, TensorEntry};
use serde_json::Value;

/// The oracle's files, written once per test run (`glmcheck_oracle.formats.make_safetensors`).
fn oracle() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
        common::run_oracle(
            "formats.make_safetensors",
            &[dir.path().to_str().expect("UTF-8 path")],
        );
        dir
    })
    .path()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).expect("read oracle JSON")).expect("oracle JSON")
}

fn open(path: &Path) -> SafetensorsSet {
    SafetensorsSet::open(path).unwrap_or_else(|e| panic!("{e}"))
}

/// The error opening `path` gives; it must name `names`.
fn open_err(path: &Path, names: &Path) -> String {
    let msg = SafetensorsSet::open(path)
        .expect_err("must not open")
        .to_string();
    assert!(
        msg.contains(&names.display().to_string()),
        "error does not name {}: {msg}",
        names.display()
    );
    msg
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("unsigned"))
        .collect()
}

/// A float tensor's values as f32, converted by this crate's dependencies, not by torch.
fn f32_values(t: &TensorEntry, bytes: &[u8]) -> Vec<f32> {
    match t.encoding {
        Encoding::Ggml(GgmlType::F32) => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Encoding::Ggml(GgmlType::F16) => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Encoding::Ggml(GgmlType::BF16) => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Encoding::F8E4M3 => bytes.iter().map(|&b| f8e4m3_to_f32(b)).collect(),
        Encoding::F8E8M0 => bytes.iter().map(|&b| f8e8m0_to_f32(b)).collect(),
        ref e => panic!("{}: no float conversion for {e}", t.name),
    }
}

/// Every tensor of `set` is the one `expected.json` describes, and there are no others.
fn check_against_torch(set: &SafetensorsSet, expected: &Value) {
    let expected = expected.as_object().expect("object");
    assert_eq!(set.tensors.len(), expected.len());
    assert!(
        set.tensors.windows(2).all(|w| w[0].name < w[1].name),
        "tensors sorted by name"
    );
    for (name, want) in expected {
        let t = set.get(name).unwrap_or_else(|| panic!("no tensor {name}"));
        let bytes = set.bytes(t);
        assert_eq!(
            t.encoding.name(),
            want["dtype"].as_str().expect("dtype"),
            "{name}"
        );
        assert_eq!(t.shape, u64s(&want["shape"]), "{name}");
        assert_eq!(
            set.path(t).file_name().and_then(|f| f.to_str()),
            want["file"].as_str(),
            "{name}"
        );
        let raw: Vec<u8> = u64s(&want["raw"]).into_iter().map(|b| b as u8).collect();
        assert_eq!(bytes, &raw[..], "{name} bytes");
        assert_eq!(t.nbytes, raw.len() as u64);
        if let Some(ints) = want.get("i64") {
            let got: Vec<i64> = bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let want: Vec<i64> = ints
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect();
            assert_eq!(got, want, "{name}");
        } else {
            let got: Vec<u64> = f32_values(t, bytes)
                .iter()
                .map(|v| u64::from(v.to_bits()))
                .collect();
            assert_eq!(got, u64s(&want["f32_bits"]), "{name} values");
        }
    }
}

#[test]
fn single_file_matches_torch() {
    let dir = oracle().join("single");
    let set = open(&dir.join("model.safetensors"));
    check_against_torch(&set, &read_json(&dir.join("expected.json")));
    assert_eq!(set.files, [dir.join("model.safetensors")]);
    assert_eq!(set.metadata.get("format").map(String::as_str), Some("pt"));
    // The folder alone finds the one file.
    assert_eq!(open(&dir).tensors, set.tensors);
}

#[test]
fn index_set_opens_as_one() {
    let dir = oracle().join("sharded");
    let expected = read_json(&dir.join("expected.json"));
    for path in [dir.clone(), dir.join(INDEX_NAME)] {
        let set = open(&path);
        assert_eq!(set.files.len(), 3);
        check_against_torch(&set, &expected);
        assert_eq!(
            set.metadata.get("shard").map(String::as_str),
            Some("0"),
            "metadata of the first shard"
        );
    }
}

/// A scratch copy of the sharded checkpoint, without its index when `index` is false.
fn sharded_copy(index: bool) -> tempfile::TempDir {
    let scratch = common::scratch();
    for item in fs::read_dir(oracle().join("sharded")).unwrap() {
        let path = item.unwrap().path();
        let name = path.file_name().unwrap();
        if path.extension().is_some_and(|e| e == "safetensors") || (index && name == INDEX_NAME) {
            fs::copy(&path, scratch.path().join(name)).unwrap();
        }
    }
    scratch
}

fn shard(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("model-{i:05}-of-00003.safetensors"))
}

#[test]
fn folder_without_index_joins_its_files() {
    let dir = sharded_copy(false);
    check_against_torch(
        &open(dir.path()),
        &read_json(&oracle().join("sharded/expected.json")),
    );
    // The same tensors in a fourth file are in two places.
    fs::copy(shard(dir.path(), 2), dir.path().join("extra.safetensors")).unwrap();
    let msg = open_err(dir.path(), &dir.path().join("extra.safetensors"));
    assert!(
        msg.contains("model.layers.1.norm.weight") && msg.contains("also in"),
        "{msg}"
    );
}

/// Rewrite the index of `dir` with `edit` applied to its weight map.
fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join(INDEX_NAME);
    let mut index = read_json(&path);
    edit(index["weight_map"].as_object_mut().unwrap());
    fs::write(path, serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
fn index_must_match_its_shards() {
    let dir = sharded_copy(true);
    let (d, index) = (dir.path(), dir.path().join(INDEX_NAME));
    let layer0 = "model.layers.0.attn.weight";

    fs::rename(shard(d, 2), d.join("moved")).unwrap();
    open_err(d, &shard(d, 2));
    fs::rename(d.join("moved"), shard(d, 2)).unwrap();

    edit_index(d, |m| m[layer0] = "model-00002-of-00003.safetensors".into());
    assert!(open_err(d, &shard(d, 1)).contains(layer0));

    edit_index(d, |m| m[layer0] = "model-00001-of-00003.safetensors".into());
    edit_index(d, |m| {
        m.insert("ghost".into(), "model-00003-of-00003.safetensors".into());
    });
    assert!(open_err(d, &shard(d, 3)).contains("`ghost`"));

    edit_index(d, |m| {
        m.remove("ghost");
        m.remove(layer0);
    });
    assert!(open_err(d, &shard(d, 1)).contains("not in the weight_map"));

    edit_index(d, |m| {
        m.insert(layer0.into(), "../model-00001-of-00003.safetensors".into());
    });
    assert!(open_err(d, &index).contains("leaves the folder"));

    fs::write(&index, b"{\"weight_map\": {\"a\": 1}}").unwrap();
    assert!(open_err(d, &index).contains("index JSON at byte"));
}

/// f32 values compared bit for bit, any NaN equal to any NaN.
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn fp8_elements_match_torch_for_every_byte() {
    let table = read_json(&oracle().join("fp8_table.json"));
    for (name, convert) in [
        ("e4m3", f8e4m3_to_f32 as fn(u8) -> f32),
        ("e5m2", f8e5m2_to_f32),
        ("e8m0", f8e8m0_to_f32),
    ] {
        let want = u64s(&table[name]);
        assert_eq!(want.len(), 256);
        for (byte, bits) in (0..=255u8).zip(want) {
            let want = f32::from_bits(bits as u32);
            assert!(
                same_f32(convert(byte), want),
                "{name} {byte:#04x}: {} vs torch {want}",
                convert(byte)
            );
        }
    }
    assert!(f8e4m3_to_f32(0x7f).is_nan() && f8e4m3_to_f32(0xff).is_nan());
    assert_eq!(f8e5m2_to_f32(0x7c), f32::INFINITY);
    // Every E8M0 value torch gives is a UE8M0 scale, and nothing else is: not NaN, nor the
    // floats next to each value.
    for bits in u64s(&table["e8m0"]) {
        let v = f32::from_bits(bits as u32);
        assert_eq!(is_ue8m0(v), !v.is_nan(), "{v}");
        assert!(
            !is_ue8m0(v.next_up()) && !is_ue8m0(v.next_down()) && !is_ue8m0(-v),
            "{v}"
        );
    }
}

/// The FP8 weights, their torch dequantization, and the bits of a row range of it.
struct Fp8Case {
    set: SafetensorsSet,
    expected: SafetensorsSet,
}

impl Fp8Case {
    fn load() -> Self {
        let dir = oracle().join("fp8");
        Fp8Case {
            set: open(&dir.join("weight.safetensors")),
            expected: open(&dir.join("expected.safetensors")),
        }
    }

    fn dequant(
        &self,
        weight: &str,
        scale: &str,
        rows: Range<usize>,
        block: usize,
    ) -> glmcheck::weights::Result<Vec<f32>> {
        let get = |name| self.set.get(name).unwrap_or_else(|| panic!("no {name}"));
        dequant_block_scaled(&self.set, get(weight), get(scale), rows, block)
    }

    fn expected_bits(&self, weight: &str, rows: Range<usize>) -> Vec<u32> {
        let t = self.expected.get(weight).expect("expected");
        let cols = t.row_len() as usize;
        let bytes = &self.expected.bytes(t)[rows.start * cols * 4..rows.end * cols * 4];
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

#[test]
fn block_dequant_is_bit_identical_to_torch() {
    let case = Fp8Case::load();
    // w has f32 scales, w2 bf16 ones, w3 F8_E8M0 ones.
    for weight in ["w.weight", "w2.weight", "w3.weight"] {
        for rows in [
            0..300,
            100..260,
            0..1,
            127..129,
            128..256,
            256..300,
            299..300,
            7..7,
        ] {
            let scale = format!("{weight}_scale_inv");
            let got = case
                .dequant(weight, &scale, rows.clone(), DEFAULT_BLOCK)
                .unwrap();
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert!(
                got == case.expected_bits(weight, rows.clone()),
                "{weight} rows {rows:?} differ from torch"
            );
        }
    }
}

#[test]
fn block_dequant_rejects_what_does_not_fit() {
    let case = Fp8Case::load();
    let err = |weight, scale, rows, block| {
        case.dequant(weight, scale, rows, block)
            .expect_err("must fail")
            .to_string()
    };
    let (w, s) = ("w.weight", "w.weight_scale_inv");
    assert!(err(w, s, 0..300, 64).contains("needs [5, 5]"));
    assert!(err(w, s, 0..300, 0).contains("block size 0"));
    assert!(err(w, s, 200..301, DEFAULT_BLOCK).contains("outside its 300 rows"));
    assert!(err(s, s, 0..3, DEFAULT_BLOCK).contains("not FP8"));
    let e8m0 = "w3.weight_scale_inv";
    assert!(err("w3.weight", e8m0, 0..300, 64).contains("needs [5, 5]"));
    assert!(err(e8m0, e8m0, 0..3, DEFAULT_BLOCK).contains("is F8_E8M0, not FP8"));
    assert!(err(w, "w.weight", 0..1, DEFAULT_BLOCK).contains("not F32, BF16 or F8_E8M0"));
    let msg = err(w, "w2.weight", 0..1, DEFAULT_BLOCK);
    assert!(
        msg.contains("weight.safetensors: tensor `w.weight`") && msg.contains("scale `w2.weight`"),
        "{msg}"
    );
}

/// Write `bytes` as a file in `dir` and try to open it; a failure must name the file.
fn try_open(dir: &Path, bytes: &[u8]) -> Result<SafetensorsSet, String> {
    let path = dir.join("broken.safetensors");
    fs::write(&path, bytes).unwrap();
    SafetensorsSet::open(&path).map_err(|e| {
        let msg = e.to_string();
        assert!(
            msg.contains(&path.display().to_string()),
            "error does not name the file: {msg}"
        );
        msg
    })
}

#[test]
fn corrupt_files_fail_with_the_file_named() {
    let good = fs::read(oracle().join("single/model.safetensors")).unwrap();
    let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let scratch = common::scratch();
    let dir = scratch.path();
    assert!(try_open(dir, &good).is_ok());

    for len in 0..good.len() {
        assert!(
            try_open(dir, &good[..len]).is_err(),
            "truncated to {len} bytes opened"
        );
    }
    // Any change of the length breaks the sum of header and data; a byte with its top bit set
    // is never valid UTF-8 inside the ASCII header.
    let mut bad = good.clone();
    for (at, flip) in (0..8)
        .flat_map(|i| [(i, 0x01), (i, 0x80), (i, 0xff)])
        .chain((8..header_end).map(|i| (i, 0x80)))
    {
        bad[at] ^= flip;
        assert!(try_open(dir, &bad).is_err(), "byte {at} ^ {flip:#x} opened");
        bad[at] ^= flip;
    }
    // Overwriting header bytes with JSON's own characters may leave a valid file (a renamed
    // tensor); it must never panic, and most must fail.
    let mut failures = 0;
    let mut tries = 0;
    for at in 0..header_end {
        for &b in b"\"{}[],:09-e \\" {
            let mut bad = good.clone();
            bad[at] = b;
            tries += 1;
            failures += usize::from(try_open(dir, &bad).is_err());
        }
    }
    assert!(
        failures * 2 > tries,
        "only {failures} of {tries} overwrites failed"
    );
}

/// A safetensors file with this header and that many zero data bytes.
fn file_with(header: impl AsRef<[u8]>, data: usize) -> Vec<u8> {
    let header = header.as_ref();
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header);
    f.resize(f.len() + data, 0);
    f
}

#[test]
fn hostile_headers_name_the_field_and_byte() {
    let scratch = common::scratch();
    let f32_a = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
    let with_length = |n: u64| {
        [
            &n.to_le_bytes()[..],
            &file_with(format!("{{{f32_a}}}"), 8)[8..],
        ]
        .concat()
    };
    let cases = [
        (vec![1, 2, 3], "header length at byte 0"),
        (with_length(u64::MAX), "header length at byte 0"),
        (with_length(1 << 40), "header length at byte 0"),
        (with_length(100_000_001), "header length at byte 0"),
        (file_with(format!("{{{f32_a}}}"), 4), "data_offsets at byte"),
        (
            file_with(format!("{{{f32_a}}}"), 12),
            "data_offsets at byte",
        ),
        (
            file_with(
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            "tensor `a` shape at byte",
        ),
        (
            file_with(
                r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}}"#,
                1,
            ),
            "tensor `a` shape",
        ),
        (
            file_with(
                format!(r#"{{{f32_a},"b":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}}}"#),
                8,
            ),
            "tensor `b` data_offsets at byte",
        ),
        (
            file_with(
                format!(r#"{{{f32_a},"b":{{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}}}"#),
                16,
            ),
            "data_offsets at byte",
        ),
        (file_with(format!("{{{f32_a}"), 8), "header at byte"),
        (
            file_with(
                r#"{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}}"#,
                2,
            ),
            "header at byte",
        ),
        (
            file_with(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,-2]}}"#,
                2,
            ),
            "header at byte",
        ),
        (file_with(b"{\"\xc3\x28\":{}}", 0), "header at byte 10"),
    ];
    for (i, (file, field)) in cases.iter().enumerate() {
        let msg = try_open(scratch.path(), file).expect_err("hostile file opened");
        assert!(msg.contains(field), "case {i}: `{field}` not in: {msg}");
    }
}
