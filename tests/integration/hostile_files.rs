//! Truncated and hostile weight files. Whatever the bytes, `ModelFiles::open` and dequantizing
//! every tensor it lists must return (never panic, never hang), and every error must name the
//! file: a user handed a broken download needs to know which file is broken.
//!
//! Each format starts from one valid file; the cases are every truncation of its header, a sample
//! of truncations of its data, every header byte overwritten with a few hostile values, every
//! header offset overwritten with hostile u32 and u64 values, and hand-aimed edits of the fields
//! a parser is most likely to trust (counts, dims, type ids, offsets, alignment, nesting).

use crate::common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use glmcheck::weights::gguf::writer::GgufWriter;
use glmcheck::weights::gguf::{GgufFile, Value, ValueType};
use glmcheck::weights::{GgmlType, ModelFiles};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Byte values written over every header byte: NUL, a bool of 7, sign and top bits, and the
/// JSON characters that change a safetensors header's structure.
const BYTES: [u8; 8] = [0x00, 0x07, 0x7f, 0x80, 0xff, b'"', b'9', b'-'];
/// u32 values written at every header offset: unknown value and GGML type ids, all ones.
const U32S: [u32; 4] = [13, 42, 0x8000_0000, u32::MAX];
/// u64 values written at every header offset: counts, lengths, dims and offsets that overflow
/// or point far past the end.
const U64S: [u64; 6] = [
    1 << 31,
    1 << 32,
    1 << 62,
    (1 << 63) + 1,
    u64::MAX - 31,
    u64::MAX,
];
/// Truncations sampled in the data region (every header truncation is tried).
const DATA_CUTS: usize = 64;
/// Far longer than any case of these small files takes; a case past it loops on hostile input.
const SLOW: Duration = Duration::from_secs(2);

/// One file to try.
struct Case {
    label: String,
    bytes: Vec<u8>,
    /// The edit makes the file invalid, so opening it must fail.
    must_fail: bool,
}

impl Case {
    fn new(label: impl Into<String>, bytes: Vec<u8>, must_fail: bool) -> Self {
        Case {
            label: label.into(),
            bytes,
            must_fail,
        }
    }
}

/// Deterministic filler bytes for tensor data (the dequantizers must cope with any bits).
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A tensor of `ty` and row-major `shape` with noise for data.
fn add_tensor(w: &mut GgufWriter, name: &str, ty: GgmlType, shape: &[u64]) {
    let bytes = ty.bytes_for(shape.iter().product()).expect("whole blocks") as usize;
    w.tensor(name, ty, shape, noise(bytes, name.len() as u64));
}

/// Metadata of several value types (a string array and a nested array among them) and tensors of
/// a float, a legacy, a k-quant type, plus an empty one whose zero dim hides huge dims.
fn valid_gguf_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("hostile".into()))
        .metadata("general.alignment", Value::U32(32))
        .metadata("test.u8", Value::U8(200))
        .metadata("test.i16", Value::I16(-3))
        .metadata("test.f32", Value::F32(0.5))
        .metadata("test.bool", Value::Bool(true))
        .metadata("test.u64", Value::U64(1 << 40))
        .metadata("test.f64", Value::F64(-2.5))
        .metadata("test.strings", string_array(&["a", "bc", "Grüße"]))
        .metadata("test.nested", nested(2));
    add_tensor(&mut w, "w.f32", GgmlType::F32, &[2, 32]);
    add_tensor(&mut w, "w.q8_0", GgmlType::Q8_0, &[2, 64]);
    add_tensor(&mut w, "w.q4_k", GgmlType::Q4_K, &[2, 256]);
    add_tensor(&mut w, "w.empty", GgmlType::F32, &[1, 1, 0]);
    w
}

fn string_array(items: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

/// `[[…[1, 2]…]]`: arrays `depth` deep around a u32 array.
fn nested(depth: usize) -> Value {
    let inner = Value::Array(ValueType::U32, vec![Value::U32(1), Value::U32(2)]);
    (1..depth).fold(inner, |v, _| Value::Array(ValueType::Array, vec![v]))
}

fn write_gguf(w: &GgufWriter, dir: &Path, name: &str) -> Vec<u8> {
    let path = dir.join(name);
    w.write(&path).expect("write GGUF");
    std::fs::read(&path).expect("read GGUF back")
}

/// A GGUF string as on disk: u64 length, then the bytes.
fn gguf_string(s: &str) -> Vec<u8> {
    [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat()
}

/// Where the bytes right after the GGUF string `s` start (a key's type id, a name's n_dims).
fn after(file: &[u8], s: &str) -> usize {
    let needle = gguf_string(s);
    let at = file.windows(needle.len()).position(|w| w == needle);
    at.unwrap_or_else(|| panic!("`{s}` not in the file")) + needle.len()
}

/// `base` with `patch` written at `at`, cut at the end of the file.
fn overwrite(base: &[u8], at: usize, patch: &[u8]) -> Vec<u8> {
    let mut out = base.to_vec();
    let end = (at + patch.len()).min(out.len());
    out[at..end].copy_from_slice(&patch[..end - at]);
    out
}

/// Every truncation of the header, a sample of the data's, and every header offset overwritten
/// with each of [`BYTES`], [`U32S`] and [`U64S`].
fn sweeps(base: &[u8], header_end: usize) -> Vec<Case> {
    let data_step = ((base.len() - header_end) / DATA_CUTS).max(1);
    let cuts = (0..=header_end).chain((header_end + 1..base.len()).step_by(data_step));
    let mut cases: Vec<Case> = cuts
        .map(|n| Case::new(format!("cut to {n} bytes"), base[..n].to_vec(), false))
        .collect();
    for at in 0..header_end {
        let patches = BYTES
            .iter()
            .map(|b| vec![*b])
            .chain(U32S.iter().map(|v| v.to_le_bytes().to_vec()))
            .chain(U64S.iter().map(|v| v.to_le_bytes().to_vec()));
        for patch in patches {
            cases.push(Case::new(
                format!("{patch:02x?} at byte {at}"),
                overwrite(base, at, &patch),
                false,
            ));
        }
    }
    cases
}

/// Where a tensor's info fields are, found after its name.
struct InfoAt {
    n_dims: usize,
    dims: usize,
    ty: usize,
    offset: usize,
}

fn info_at(file: &[u8], name: &str, n_dims: usize) -> InfoAt {
    let n = after(file, name);
    InfoAt {
        n_dims: n,
        dims: n + 4,
        ty: n + 4 + 8 * n_dims,
        offset: n + 8 + 8 * n_dims,
    }
}

/// Hand-aimed edits of a valid GGUF; each must be refused, unless marked otherwise.
fn gguf_targeted(base: &[u8], dir: &Path) -> Vec<Case> {
    let u64_at = |at: usize, v: u64| overwrite(base, at, &v.to_le_bytes());
    let u32_at = |at: usize, v: u32| overwrite(base, at, &v.to_le_bytes());
    let q8 = info_at(base, "w.q8_0", 2);
    let empty = info_at(base, "w.empty", 3);
    let strings = after(base, "test.strings");
    let alignment = after(base, "general.alignment") + 4;
    let mut cases = vec![
        Case::new("magic", overwrite(base, 0, b"GGUG"), true),
        Case::new("version 1", u32_at(4, 1), true),
        Case::new("version 4", u32_at(4, 4), true),
        Case::new("huge tensor count", u64_at(8, u64::MAX), true),
        Case::new("huge metadata count", u64_at(16, 1 << 60), true),
        Case::new("huge key length", u64_at(24, u64::MAX - 7), true),
        Case::new(
            "unknown value type",
            u32_at(after(base, "test.u8"), 13),
            true,
        ),
        Case::new(
            "bool byte 7",
            overwrite(base, after(base, "test.bool") + 4, &[7]),
            true,
        ),
        Case::new(
            "bad UTF-8 in a key",
            overwrite(base, after(base, "test.u64") - 1, &[0xc3]),
            true,
        ),
        Case::new(
            "bad UTF-8 in a string value",
            overwrite(base, strings + 24, &[0xff]),
            true,
        ),
        Case::new(
            "bad UTF-8 in a tensor name",
            overwrite(base, q8.n_dims - 1, &[0x80]),
            true,
        ),
        Case::new(
            "duplicate key",
            overwrite(base, after(base, "test.u64") - 3, b"f64"),
            true,
        ),
        Case::new("unknown array element type", u32_at(strings + 4, 42), true),
        Case::new(
            "huge string array count",
            u64_at(strings + 8, 1 << 59),
            true,
        ),
        Case::new("alignment 48", u32_at(alignment, 48), true),
        Case::new("alignment 0", u32_at(alignment, 0), true),
        Case::new("alignment 2 MiB", u32_at(alignment, 2 << 20), true),
        // A valid power of two moves the data section; offsets then either fit or are refused.
        Case::new("alignment 64", u32_at(alignment, 64), false),
        Case::new("alignment 1", u32_at(alignment, 1), false),
        Case::new("five dims", u32_at(q8.n_dims, 5), true),
        Case::new("huge n_dims", u32_at(q8.n_dims, u32::MAX), true),
        Case::new("dims overflow", u64_at(q8.dims + 8, u64::MAX), true),
        Case::new("row not whole blocks", u64_at(q8.dims, 48), true),
        Case::new("zero row of a block type", u64_at(q8.dims, 0), false),
        Case::new("unknown GGML type 4", u32_at(q8.ty, 4), true),
        Case::new("unknown GGML type 42", u32_at(q8.ty, 42), true),
        Case::new(
            "type without a dequantizer",
            u32_at(q8.ty, GgmlType::I8.id()),
            false,
        ),
        Case::new("offset past the end", u64_at(q8.offset, 1 << 20), true),
        Case::new("offset overflows", u64_at(q8.offset, u64::MAX - 31), true),
        Case::new("misaligned offset", u64_at(q8.offset, 1), true),
        // ne [0, MAX, MAX]: no elements, but the row-major shape [MAX, MAX, 0] overflows a
        // product taken outermost first.
        Case::new(
            "zero dim before huge dims",
            overwrite(
                &u64_at(empty.dims + 8, u64::MAX),
                empty.dims + 16,
                &u64::MAX.to_le_bytes(),
            ),
            true,
        ),
    ];
    let mut deep = valid_gguf_writer();
    deep.metadata("test.deep", nested(12));
    cases.push(Case::new(
        "arrays nested 12 deep",
        write_gguf(&deep, dir, "deep.gguf"),
        true,
    ));
    cases
}

/// What one case did wrong, if anything.
fn check(path: &Path, case: &Case) -> Option<String> {
    std::fs::write(path, &case.bytes).expect("write case");
    let start = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| open_and_dequantize(path)));
    let took = start.elapsed();
    let name = path.display().to_string();
    let wrong = match outcome {
        Err(_) => Some("panicked".to_string()),
        Ok((true, _)) if case.must_fail => Some("opened".to_string()),
        Ok((_, errors)) => errors
            .into_iter()
            .find(|m| !m.contains(&name))
            .map(|m| format!("error does not name the file: {m}")),
    };
    let wrong = wrong.or_else(|| (took > SLOW).then(|| format!("took {took:?}")));
    wrong.map(|w| format!("{}: {w}", case.label))
}

/// Open the file and dequantize every tensor it lists: whether it opened, and every error.
fn open_and_dequantize(path: &Path) -> (bool, Vec<String>) {
    match ModelFiles::open(path) {
        Err(e) => (false, vec![e.to_string()]),
        Ok(files) => (
            true,
            files
                .tensors()
                .iter()
                .filter_map(|t| files.dequantize(t).err())
                .map(|e| e.to_string())
                .collect(),
        ),
    }
}

/// Run every case against one file path; fail listing what went wrong.
fn run_cases(path: &Path, cases: &[Case]) {
    let wrong: Vec<String> = cases.iter().filter_map(|c| check(path, c)).collect();
    let shown = wrong
        .iter()
        .take(20)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n  ");
    assert!(
        wrong.is_empty(),
        "{} of {} cases went wrong:\n  {shown}",
        wrong.len(),
        cases.len()
    );
}

/// The valid GGUF and the end of its header (where the data section starts).
fn valid_gguf(dir: &Path) -> (Vec<u8>, usize) {
    let base = write_gguf(&valid_gguf_writer(), dir, "valid.gguf");
    let parsed = GgufFile::open(&dir.join("valid.gguf")).expect("the valid GGUF opens");
    (base, parsed.data_offset as usize)
}

#[test]
fn hostile_gguf_files_fail_cleanly() {
    let dir = common::scratch();
    let (base, header_end) = valid_gguf(dir.path());
    let mut cases = vec![Case::new("valid", base.clone(), false)];
    cases.extend(gguf_targeted(&base, dir.path()));
    cases.extend(sweeps(&base, header_end));
    run_cases(&dir.path().join("case.gguf"), &cases);
}

/// A split-set name whose count matches a huge `split.count`: the shard list must not be built.
#[test]
fn huge_split_count_fails_cleanly() {
    let dir = common::scratch();
    let count = 99_999_999_999u64;
    let mut w = valid_gguf_writer();
    w.metadata("split.no", Value::U16(0))
        .metadata("split.count", Value::U64(count));
    let name = format!("hostile-00001-of-{count}.gguf");
    let bytes = write_gguf(&w, dir.path(), &name);
    run_cases(
        &dir.path().join(name),
        &[Case::new("huge split.count", bytes, true)],
    );
}

/// A tensor as safetensors wants it.
fn view<'a>(dtype: Dtype, shape: &[usize], data: &'a [u8]) -> TensorView<'a> {
    TensorView::new(dtype, shape.to_vec(), data).expect("tensor view")
}

/// F32, BF16, a block-scaled FP8 weight with its scale, a plain FP8 and an I64 tensor.
fn valid_safetensors() -> Vec<u8> {
    let data = noise(64, 1);
    let scale = 0.5f32.to_le_bytes();
    let tensors = [
        ("a.f32", view(Dtype::F32, &[2, 3], &data[..24])),
        ("b.bf16", view(Dtype::BF16, &[4], &data[..8])),
        ("c.weight", view(Dtype::F8_E4M3, &[2, 4], &data[..8])),
        ("c.weight_scale_inv", view(Dtype::F32, &[1, 1], &scale)),
        ("d.f8", view(Dtype::F8_E5M2, &[3], &data[..3])),
        ("e.i64", view(Dtype::I64, &[2], &data[..16])),
    ];
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(tensors, Some(meta)).expect("serialize")
}

/// A block-scaled FP8 weight and its f32 scale, of any shapes.
fn fp8_pair(shape: &[usize], scale_shape: &[usize]) -> Vec<u8> {
    let weight = noise(shape.iter().product(), 2);
    let scale = vec![0x3f; 4 * scale_shape.iter().product::<usize>()];
    let tensors = [
        ("w", view(Dtype::F8_E4M3, shape, &weight)),
        ("w_scale_inv", view(Dtype::F32, scale_shape, &scale)),
    ];
    safetensors::serialize(tensors, None).expect("serialize")
}

/// A safetensors file with this JSON header and `data` zero bytes after it.
fn safetensors_with(header: impl AsRef<[u8]>, data: usize) -> Vec<u8> {
    let header = header.as_ref();
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header);
    f.resize(f.len() + data, 0);
    f
}

/// Hand-written hostile headers; each must be refused, unless marked otherwise.
fn safetensors_targeted(base: &[u8]) -> Vec<Case> {
    const MAX: u64 = u64::MAX;
    // A file of one tensor `t` with this dtype, shape and data offsets, and `data` bytes.
    let one = |dtype: &str, shape: &str, offsets: &str, data: usize| {
        let header =
            format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#);
        safetensors_with(header, data)
    };
    let deep = format!(r#"{{"t":{}{}}}"#, "[".repeat(10_000), "]".repeat(10_000));
    let refused = [
        (
            "header length u64::MAX",
            overwrite(base, 0, &MAX.to_le_bytes()),
        ),
        (
            "header length past the end",
            overwrite(base, 0, &(base.len() as u64).to_le_bytes()),
        ),
        ("reversed offsets", one("F32", "[2]", "[8,0]", 8)),
        ("offsets past the end", one("F32", "[2]", "[0,8]", 4)),
        ("huge offsets", one("F32", "[2]", &format!("[0,{MAX}]"), 8)),
        (
            "shape overflows",
            one("F32", &format!("[{MAX},2]"), "[0,8]", 8),
        ),
        (
            "huge dims before a zero",
            one("F32", &format!("[{MAX},{MAX},0]"), "[0,0]", 0),
        ),
        ("negative dim", one("F32", "[-2]", "[0,8]", 8)),
        ("unknown dtype", one("Q4_K", "[2]", "[0,8]", 8)),
        ("arrays nested 10000 deep", safetensors_with(deep, 0)),
        ("not an object", safetensors_with("[]", 0)),
        (
            "metadata not strings",
            safetensors_with(r#"{"__metadata__":{"a":1}}"#, 0),
        ),
        ("bad UTF-8 in a name", safetensors_with(b"{\"\xff\":1}", 0)),
    ];
    let allowed = [
        (
            "huge dims after a zero",
            one("F32", &format!("[0,{MAX},{MAX}]"), "[0,0]", 0),
        ),
        ("zero-size tensor", one("BF16", "[0,4]", "[0,0]", 0)),
        ("FP8 scale too small", fp8_pair(&[2, 300], &[1, 1])),
        ("FP8 weight not a matrix", fp8_pair(&[8], &[1, 1])),
        ("FP8 scale with no rows", fp8_pair(&[2, 4], &[0, 1])),
        ("FP8 scale of three dims", fp8_pair(&[2, 4], &[1, 1, 1])),
    ];
    let refused = refused.into_iter().map(|(l, b)| Case::new(l, b, true));
    refused
        .chain(allowed.into_iter().map(|(l, b)| Case::new(l, b, false)))
        .collect()
}

#[test]
fn hostile_safetensors_files_fail_cleanly() {
    let dir = common::scratch();
    let base = valid_safetensors();
    let header_end = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let valid = dir.path().join("valid.safetensors");
    std::fs::write(&valid, &base).unwrap();
    ModelFiles::open(&valid).expect("the valid safetensors opens");
    let mut cases = vec![Case::new("valid", base.clone(), false)];
    cases.extend(safetensors_targeted(&base));
    cases.extend(sweeps(&base, header_end));
    run_cases(&dir.path().join("case.safetensors"), &cases);
}

/// The CLI on broken files: exit code 2 and one `glmcheck: error:` line naming the file.
#[test]
fn cli_reports_one_error_line() {
    let dir = common::scratch();
    let (gguf, _) = valid_gguf(dir.path());
    let safetensors = valid_safetensors();
    let q8 = info_at(&gguf, "w.q8_0", 2);
    let files = [
        ("cut.gguf", gguf[..30].to_vec()),
        ("count.gguf", overwrite(&gguf, 8, &u64::MAX.to_le_bytes())),
        (
            "bool.gguf",
            overwrite(&gguf, after(&gguf, "test.bool") + 4, &[7]),
        ),
        (
            "offset.gguf",
            overwrite(&gguf, q8.offset, &(1u64 << 20).to_le_bytes()),
        ),
        (
            "cut.safetensors",
            safetensors[..safetensors.len() - 1].to_vec(),
        ),
        ("json.safetensors", overwrite(&safetensors, 8, b"[")),
    ];
    for (name, bytes) in files {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        for command in ["inspect", "dequant"] {
            let out = Command::new(common::glmcheck_bin())
                .arg(command)
                .arg(&path)
                .output()
                .expect("run glmcheck");
            let stderr = String::from_utf8_lossy(&out.stderr);
            let what = format!("glmcheck {command} {name}: {stderr}");
            assert_eq!(out.status.code(), Some(2), "{what}");
            assert_eq!(stderr.lines().count(), 1, "{what}");
            assert!(
                stderr.starts_with("glmcheck: error: ") && stderr.ends_with('\n'),
                "{what}"
            );
            assert!(stderr.contains(&path.display().to_string()), "{what}");
        }
    }
}

/// A DSA indexer head narrower than the RoPE dims it rotates (GGUF `attention.indexer.key_length`
/// rewritten in the file's bytes; HF `index_head_dim` in config.json) is refused before any
/// forward: `run` exits 2 with one line naming the file and the field, where the forward
/// used to panic inside RoPE.
#[test]
fn an_indexer_head_narrower_than_its_rope_is_a_one_line_error() {
    let dir = common::scratch();
    let good = dir.path().join("tiny.gguf");
    common::synth_tiny(&good, &["--quant", "f32"]);
    let bytes = std::fs::read(&good).unwrap();
    let value = after(&bytes, "glm-dsa.attention.indexer.key_length") + 4;
    let narrow = dir.path().join("narrow.gguf");
    std::fs::write(&narrow, overwrite(&bytes, value, &4u32.to_le_bytes())).unwrap();

    let hf = dir.path().join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    let config = hf.join("config.json");
    let mut j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    j["index_head_dim"] = 0.into();
    std::fs::write(&config, serde_json::to_vec_pretty(&j).unwrap()).unwrap();

    for (model, width) in [(&narrow, "4"), (&hf, "0")] {
        let err = common::run_error_line(model);
        for part in [
            model.to_str().unwrap(),
            "index_head_dim",
            &format!("{width} is less than qk_rope_head_dim"),
        ] {
            assert!(err.contains(part), "{part}: {err}");
        }
    }
}

/// A config.json switch glmcheck does not run (biases on the projections, another activation)
/// is one line, exit 2, naming the folder and the field, not a run of another model.
#[test]
fn a_config_switch_glmcheck_does_not_run_is_a_one_line_error() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    let config = hf.join("config.json");
    let clean: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    for (key, value, says) in [
        (
            "attention_bias",
            serde_json::json!(true),
            "true: glmcheck runs the family without biases",
        ),
        (
            "mlp_bias",
            serde_json::json!(true),
            "true: glmcheck runs the family without biases",
        ),
        (
            "hidden_act",
            serde_json::json!("gelu"),
            "`gelu`: glmcheck runs the family's MLPs with silu",
        ),
    ] {
        let mut j = clean.clone();
        j[key] = value;
        std::fs::write(&config, serde_json::to_vec_pretty(&j).unwrap()).unwrap();
        let err = common::run_error_line(&hf);
        for part in [hf.to_str().unwrap(), key, says] {
            assert!(err.contains(part), "{part}: {err}");
        }
    }
}

/// A trace whose manifest is broken (a stage's shape rewritten to `[-1]` in a trace `glmcheck
/// run` wrote) is one line, exit 2, from every command that reads traces, naming the trace
/// folder once and the stage's field.
#[test]
fn a_broken_trace_is_one_line_naming_its_folder_once() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let good = dir.path().join("good.trace");
    let run = common::glmcheck_output(&[
        "run",
        model.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--out",
        good.to_str().unwrap(),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let broken = dir.path().join("broken.trace");
    std::fs::create_dir(&broken).unwrap();
    for entry in std::fs::read_dir(&good).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, broken.join(path.file_name().unwrap())).unwrap();
    }
    let manifest = broken.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    m["stages"][0]["shape"] = serde_json::json!([-1]);
    std::fs::write(&manifest, m.to_string()).unwrap();
    let (model, good, broken) = (
        model.to_str().unwrap(),
        good.to_str().unwrap(),
        broken.to_str().unwrap(),
    );
    for args in [
        vec!["diff", good, broken],
        vec!["diff", good, good, "--envelope", broken],
        vec!["logits", broken],
        vec!["bisect", model, "--candidate", broken],
    ] {
        let out = common::glmcheck_output(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let what = format!("glmcheck {}: {stderr}", args.join(" "));
        assert_eq!(out.status.code(), Some(2), "{what}");
        assert_eq!(stderr.lines().count(), 1, "{what}");
        assert_eq!(stderr.matches("broken.trace").count(), 1, "{what}");
        assert!(stderr.contains("stages[0]"), "{what}");
    }
}
