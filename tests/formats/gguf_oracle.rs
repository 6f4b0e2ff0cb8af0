//! The GGUF reader and the dequantizers against gguf-py: a file written by `GGUFWriter` is read
//! back with the same metadata, tensor infos and offsets that `GGUFReader` sees, and every tensor
//! dequantizes bit for bit like `gguf.quants.dequantize` — whole, by row range and by expert.

use crate::common;

use std::path::Path;

use glmcheck::weights::gguf::Value;
use glmcheck::weights::{Encoding, ModelFiles};
use safetensors::SafeTensors;
use serde_json::Value as Json;

fn expected_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let view = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: element {i} is {} ({:#x}), gguf-py says {} ({:#x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

fn written(dir: &Path) -> (ModelFiles, Json, Vec<u8>) {
    common::run_oracle("formats.write_gguf", &[dir.to_str().unwrap()]);
    let files = ModelFiles::open(&dir.join("model.gguf")).expect("open");
    let manifest: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let expected = std::fs::read(dir.join("expected.safetensors")).unwrap();
    (files, manifest, expected)
}

#[test]
fn reads_what_gguf_py_wrote_and_dequantizes_bit_for_bit() {
    let dir = common::scratch();
    let (files, manifest, expected) = written(dir.path());
    let st = SafeTensors::deserialize(&expected).unwrap();
    let gguf = files.gguf().unwrap();

    // Metadata: every key gguf-py reads back has the same value here.
    for (key, want) in manifest["metadata"].as_object().unwrap() {
        let got = gguf
            .get(key)
            .unwrap_or_else(|| panic!("metadata {key} missing"));
        assert_eq!(&got.to_json(usize::MAX), want, "metadata {key}");
    }
    let nested = gguf.get("test.nested").unwrap();
    assert_eq!(nested.to_json(usize::MAX), serde_json::json!([[1, 2], [3]]));
    assert_eq!(
        gguf.get("test.u64").and_then(Value::as_u64),
        Some((1 << 63) + 5)
    );

    // Tensor infos: names, types, shapes and absolute data offsets as GGUFReader has them.
    let infos = manifest["tensors"].as_array().unwrap();
    assert_eq!(files.tensors().len(), infos.len());
    for (t, info) in files.tensors().iter().zip(infos) {
        assert_eq!(t.name, info["name"].as_str().unwrap());
        let Encoding::Ggml(ty) = t.encoding else {
            panic!("{}: not a GGML type", t.name)
        };
        assert_eq!(
            u64::from(ty.id()),
            info["type"].as_u64().unwrap(),
            "{} type",
            t.name
        );
        let shape: Vec<u64> = info["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, shape, "{} shape", t.name);
        assert_eq!(
            t.offset,
            info["offset"].as_u64().unwrap(),
            "{} offset",
            t.name
        );
    }

    // Values: whole tensors, row ranges, single experts.
    let mut types_seen = 0;
    for t in files.tensors() {
        let want = expected_f32(&st, &t.name);
        assert_bits(&t.name, &files.dequantize(t).unwrap(), &want);
        let row = t.row_len() as usize;
        assert_bits(
            &format!("{} rows 1..3", t.name),
            &files.dequantize_rows(t, 1..3).unwrap(),
            &want[row..3 * row],
        );
        if t.shape.len() == 3 {
            let per_expert = (t.shape[1] * t.shape[2]) as usize;
            assert_bits(
                &format!("{} expert 2", t.name),
                &files.dequantize_expert(t, 2).unwrap(),
                &want[2 * per_expert..3 * per_expert],
            );
            assert!(
                files.dequantize_expert(t, 3).is_err(),
                "expert past the end must be refused"
            );
            types_seen += 1;
        }
    }
    assert_eq!(types_seen, 26, "every type gguf-py dequantizes is covered");
}

/// `a` and `b` agree to `rel` of their size (sums in another order differ in the last bits).
fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

#[test]
fn dequant_health_and_dump_match_numpy_and_gguf_py() {
    let dir = common::scratch();
    let (_, manifest, expected) = written(dir.path());
    let out = dir.path().join("dump.safetensors");
    let model = dir.path().join("model.gguf");
    // Random F32/F16/BF16 bytes hold NaN and Inf patterns, so the verdict is a failure.
    let report = common::glmcheck_json(
        [
            std::ffi::OsStr::new("dequant"),
            "--json".as_ref(),
            "--dump".as_ref(),
            out.as_os_str(),
            model.as_os_str(),
        ],
        1,
    );
    assert_eq!(report["verdict"], "fail");
    let numpy = manifest["health"].as_object().unwrap();
    let tensors = report["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), numpy.len());
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let (got, want) = (&t["health"], &numpy[name]);
        for count in ["count", "nan", "inf", "zeros", "beyond_f16", "outliers"] {
            assert_eq!(got[count], want[count], "{name} {count}");
        }
        assert_eq!(
            got["absmax"].as_f64(),
            want["absmax"].as_f64(),
            "{name} absmax"
        );
        for moment in ["mean", "std"] {
            let (g, w) = (
                got[moment].as_f64().unwrap(),
                want[moment].as_f64().unwrap(),
            );
            assert!(close(g, w, 1e-9), "{name} {moment}: {g} vs numpy {w}");
        }
    }

    let dumped = std::fs::read(&out).unwrap();
    let (got, want) = (
        SafeTensors::deserialize(&dumped).unwrap(),
        SafeTensors::deserialize(&expected).unwrap(),
    );
    assert_eq!(got.len(), want.len());
    for name in want.names() {
        assert_eq!(
            got.tensor(name).unwrap().shape(),
            want.tensor(name).unwrap().shape(),
            "{name}"
        );
        assert_bits(name, &expected_f32(&got, name), &expected_f32(&want, name));
    }
}

/// A split set written by gguf-py opens as one model from any of its shards, with the same
/// metadata and the same values as the single file.
#[test]
fn split_sets_open_as_one_model_from_any_shard() {
    let dir = common::scratch();
    let (whole, _, _) = written(dir.path());
    for shard in ["model-00001-of-00003.gguf", "model-00002-of-00003.gguf"] {
        let split = ModelFiles::open(&dir.path().join("split").join(shard)).unwrap();
        assert_eq!(split.files().len(), 3, "{shard}");
        assert_eq!(split.tensors().len(), whole.tensors().len());
        let meta = split.gguf().unwrap();
        assert_eq!(
            meta.get("test.string"),
            whole.gguf().unwrap().get("test.string")
        );
        for t in whole.tensors() {
            let s = split.require(&t.name).unwrap();
            assert_eq!(
                (&s.encoding, &s.shape),
                (&t.encoding, &t.shape),
                "{}",
                t.name
            );
            assert_bits(
                &t.name,
                &split.dequantize(s).unwrap(),
                &whole.dequantize(t).unwrap(),
            );
        }
    }
    let lone = dir.path().join("split/model-00002-of-00003.gguf");
    std::fs::remove_file(dir.path().join("split/model-00003-of-00003.gguf")).unwrap();
    let err = ModelFiles::open(&lone)
        .err()
        .expect("a missing shard is an error")
        .to_string();
    assert!(err.contains("model-00003-of-00003.gguf"), "{err}");
}
