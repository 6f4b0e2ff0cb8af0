//! One file of an SGLang dump: a `torch.save` zip archive holding `{"value": tensor, "meta":
//! {...}}`. The pickle is read by [`super::pickle`] (data only), the tensor's storage from the
//! archive's `data/KEY` record, which torch stores uncompressed: a compressed record is refused,
//! so nothing read can outgrow the file.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use half::{bf16, f16};

use super::pickle::{self, Obj, Value};

/// The pickle of a dumper file is its metadata, a few KB; of an older per-pass file, an index of
/// the pass's tensors (about 400 KB for GLM-5). This bounds what is read of it.
const MAX_PICKLE_BYTES: u64 = 16 << 20;

/// A tensor's values: floating point as f32, integers (ids, positions) as i32.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A tensor read from a dump file.
#[derive(Clone, Debug, PartialEq)]
pub struct PtTensor {
    pub shape: Vec<u64>,
    /// torch's dtype name of the stored values (`bfloat16`, `float32`, `int64`…).
    pub dtype: &'static str,
    pub values: Values,
}

/// A dump file's contents; `value` is None where it is not a tensor (a list of request ids).
#[derive(Debug)]
pub struct DumpFile {
    pub meta: Obj,
    pub value: Option<PtTensor>,
}

/// An opened `torch.save` archive: its pickle read, its storage records read when asked.
pub struct Archive {
    zip: zip::ZipArchive<File>,
    /// The archive's folder (`archive/`, or the file's stem in older torch).
    prefix: String,
    pub top: Obj,
}

impl Archive {
    /// Open `path`; the error is the reason, for the caller to put beside the file's name.
    pub fn open(path: &Path) -> Result<Archive, String> {
        let file = File::open(path).map_err(|e| e.to_string())?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| format!("not a torch.save archive: {e}"))?;
        let pkl_names: Vec<String> = zip
            .file_names()
            .filter_map(|n| n.ok().map(|n| n.into_owned()))
            .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .collect();
        let [pkl_name] = pkl_names.as_slice() else {
            return Err(format!("{} data.pkl records, not one", pkl_names.len()));
        };
        let prefix = pkl_name.trim_end_matches("data.pkl").to_string();
        let pickled = {
            let entry = zip.by_name(pkl_name).map_err(|e| e.to_string())?;
            if entry.size() > MAX_PICKLE_BYTES {
                return Err(format!("data.pkl of {} bytes", entry.size()));
            }
            let mut bytes = Vec::new();
            entry
                .take(MAX_PICKLE_BYTES)
                .read_to_end(&mut bytes)
                .map_err(|e| format!("data.pkl: {e}"))?;
            bytes
        };
        let top = pickle::read(&pickled).map_err(|e| format!("data.pkl: {e}"))?;
        Ok(Archive { zip, prefix, top })
    }

    /// The tensor `obj` (part of [`Archive::top`]) describes; None where it is no tensor.
    pub fn tensor(&mut self, obj: &Obj) -> Result<Option<PtTensor>, String> {
        match tensor_call(obj) {
            Some(args) => tensor(&mut self.zip, &self.prefix, args).map(Some),
            None => Ok(None),
        }
    }
}

/// Read a file of SGLang's dumper; the error is the reason, for the caller to put beside the
/// file's name.
pub fn read(path: &Path) -> Result<DumpFile, String> {
    let mut archive = Archive::open(path)?;
    let top = archive.top.clone();
    let (Some(value), Some(meta)) = (top.get("value"), top.get("meta")) else {
        return Err("data.pkl: not a {\"value\", \"meta\"} dict of SGLang's dumper".into());
    };
    if !matches!(meta.value, Value::Dict(_)) {
        return Err("data.pkl: meta is not a dict".into());
    }
    let value = archive.tensor(value).map_err(|e| format!("value: {e}"))?;
    Ok(DumpFile {
        meta: meta.clone(),
        value,
    })
}

/// The arguments of `_rebuild_tensor_v2` where `obj` is a tensor (or a parameter holding one).
fn tensor_call(obj: &Obj) -> Option<&[Obj]> {
    let Value::Call(callable, args) = &obj.value else {
        return None;
    };
    let Value::Global(module, name) = &callable.value else {
        return None;
    };
    match (module.as_str(), name.as_str()) {
        ("torch._utils", "_rebuild_tensor_v2") => args.as_seq(),
        ("torch._utils", "_rebuild_parameter") => tensor_call(args.as_seq()?.first()?),
        _ => None,
    }
}

/// Storage type → (torch dtype name, bytes per element).
fn storage_type(name: &str) -> Option<(&'static str, usize)> {
    Some(match name {
        "FloatStorage" => ("float32", 4),
        "DoubleStorage" => ("float64", 8),
        "HalfStorage" => ("float16", 2),
        "BFloat16Storage" => ("bfloat16", 2),
        "LongStorage" => ("int64", 8),
        "IntStorage" => ("int32", 4),
        "ShortStorage" => ("int16", 2),
        "CharStorage" => ("int8", 1),
        "ByteStorage" => ("uint8", 1),
        "BoolStorage" => ("bool", 1),
        _ => return None,
    })
}

fn non_negative(obj: &Obj, what: &str) -> Result<u64, String> {
    match obj.as_int() {
        Some(i) if i >= 0 => Ok(i as u64),
        _ => Err(format!("{what} is not a non-negative integer")),
    }
}

fn ints(obj: &Obj, what: &str) -> Result<Vec<u64>, String> {
    let items = obj
        .as_seq()
        .ok_or_else(|| format!("{what} is not a tuple"))?;
    items.iter().map(|i| non_negative(i, what)).collect()
}

/// Read the tensor `_rebuild_tensor_v2(storage, offset, size, stride, …)` describes.
fn tensor(zip: &mut zip::ZipArchive<File>, prefix: &str, args: &[Obj]) -> Result<PtTensor, String> {
    let [storage, offset, size, stride, ..] = args else {
        return Err("_rebuild_tensor_v2 with fewer than 4 arguments".into());
    };
    let Value::PersistentId(pid) = &storage.value else {
        return Err("a storage that is not a persistent id".into());
    };
    let record = pid.as_seq().unwrap_or_default();
    let [kind, ty, key, _location, numel, ..] = record else {
        return Err("a storage record of other than 5 fields".into());
    };
    let ty_name = match (&kind.value, &ty.value) {
        (Value::Str(k), Value::Global(_, name)) if k == "storage" => name,
        _ => return Err("a storage record that is not ('storage', type, …)".into()),
    };
    let (dtype, elem) =
        storage_type(ty_name).ok_or_else(|| format!("storage type {ty_name} is not read"))?;
    let key = key.as_str().ok_or("a storage key that is not a string")?;
    let (offset, numel) = (
        non_negative(offset, "offset")?,
        non_negative(numel, "numel")?,
    );
    let (shape, strides) = (ints(size, "size")?, ints(stride, "stride")?);
    if shape.len() != strides.len() {
        return Err(format!("size {shape:?} and stride {strides:?}"));
    }
    let count = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let count = count.ok_or_else(|| format!("size {shape:?} overflows"))?;
    // The last element's index in the storage must lie inside it.
    let last = shape.iter().zip(&strides).try_fold(offset, |at, (&d, &s)| {
        at.checked_add(d.saturating_sub(1).checked_mul(s)?)
    });
    if count > 0 && last.is_none_or(|l| l >= numel) {
        return Err(format!(
            "size {shape:?} stride {strides:?} offset {offset} reach past the storage's {numel} elements"
        ));
    }
    let name = format!("{prefix}data/{key}");
    let mut entry = zip
        .by_name(&name)
        .map_err(|_| format!("storage record {name} is missing"))?;
    if entry.compression() != zip::CompressionMethod::Stored {
        return Err(format!(
            "storage record {name} is compressed; torch.save stores them plain"
        ));
    }
    let bytes_needed = numel
        .checked_mul(elem as u64)
        .filter(|&b| b <= entry.size());
    let Some(bytes_needed) = bytes_needed else {
        return Err(format!(
            "storage record {name} holds {} bytes, fewer than {numel} elements of {elem}",
            entry.size()
        ));
    };
    let mut bytes = Vec::with_capacity(bytes_needed as usize);
    (&mut entry)
        .take(bytes_needed)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("storage record {name}: {e}"))?;
    if bytes.len() as u64 != bytes_needed {
        return Err(format!("storage record {name} ends early"));
    }
    let at = element_offsets(&shape, &strides, offset);
    let word = |i: u64| &bytes[i as usize * elem..][..elem];
    let floats = |f: fn(&[u8]) -> f32| Values::F32(at.iter().map(|&i| f(word(i))).collect());
    let ints = |f: fn(&[u8]) -> i64| -> Result<Values, String> {
        at.iter()
            .map(|&i| i32::try_from(f(word(i))).map_err(|_| "an id beyond i32".to_string()))
            .collect::<Result<Vec<i32>, String>>()
            .map(Values::I32)
    };
    let values = match dtype {
        "float32" => floats(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
        "float64" => floats(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32),
        "float16" => floats(|b| f16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32()),
        "bfloat16" => floats(|b| bf16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32()),
        "int64" => ints(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))?,
        "int32" => ints(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")).into())?,
        "int16" => ints(|b| i16::from_le_bytes(b.try_into().expect("2 bytes")).into())?,
        "int8" => ints(|b| i8::from_le_bytes([b[0]]).into())?,
        _ => ints(|b| b[0].into())?,
    };
    Ok(PtTensor {
        shape,
        dtype,
        values,
    })
}

/// The storage index of every element in row-major order (strides may be any: a transposed
/// view is saved with its storage as it is).
fn element_offsets(shape: &[u64], strides: &[u64], offset: u64) -> Vec<u64> {
    let mut out = vec![offset];
    for (&d, &s) in shape.iter().zip(strides) {
        out = out
            .iter()
            .flat_map(|&base| (0..d).map(move |i| base + i * s))
            .collect();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_strides_of_a_transposed_view() {
        // A 2×3 tensor viewed as its 3×2 transpose: strides (1, 3).
        assert_eq!(element_offsets(&[3, 2], &[1, 3], 0), [0, 3, 1, 4, 2, 5]);
        assert_eq!(element_offsets(&[2], &[2], 1), [1, 3]);
        assert_eq!(element_offsets(&[], &[], 4), [4]);
    }
}
