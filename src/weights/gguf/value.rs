//! GGUF metadata values: the thirteen value types, arrays of them (nested too), and their reading.

use super::cursor::Cursor;
use crate::weights::Result;

/// Arrays nest (an array of arrays is legal); real files never go deeper than two levels.
const MAX_ARRAY_DEPTH: usize = 8;

/// GGUF value type ids, as on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes on disk (strings and arrays: their length field).
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements (all of that type).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Read a value of type `ty`; `field` names it in errors (the metadata key).
    pub fn read(c: &mut Cursor, ty: ValueType, field: &str) -> Result<Value> {
        Self::read_nested(c, ty, field, 0)
    }

    fn read_nested(c: &mut Cursor, ty: ValueType, field: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(c.u8(field)?),
            ValueType::I8 => Value::I8(c.i8(field)?),
            ValueType::U16 => Value::U16(c.u16(field)?),
            ValueType::I16 => Value::I16(c.i16(field)?),
            ValueType::U32 => Value::U32(c.u32(field)?),
            ValueType::I32 => Value::I32(c.i32(field)?),
            ValueType::F32 => Value::F32(c.f32(field)?),
            ValueType::U64 => Value::U64(c.u64(field)?),
            ValueType::I64 => Value::I64(c.i64(field)?),
            ValueType::F64 => Value::F64(c.f64(field)?),
            ValueType::Bool => match c.u8(field)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(c.error(field, format!("bool byte is {b}, not 0 or 1"))),
            },
            ValueType::String => Value::String(c.string(field)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(c.error(
                        field,
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let id = c.u32(field)?;
                let elem = ValueType::from_id(id)
                    .ok_or_else(|| c.error(field, format!("unknown array element type {id}")))?;
                let n = c.count(field, elem.min_size())?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(Self::read_nested(c, elem, field, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // The shortest decimal that round-trips the f32 is what the writer meant (1e-5, not
            // 9.99999974e-6).
            Value::F32(v) => Some(v.to_string().parse().unwrap_or(v.into())),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// JSON form; arrays longer than `max_items` are cut to their first items plus a count.
    pub fn to_json(&self, max_items: usize) -> serde_json::Value {
        use serde_json::json;
        match self {
            Value::U8(v) => json!(v),
            Value::I8(v) => json!(v),
            Value::U16(v) => json!(v),
            Value::I16(v) => json!(v),
            Value::U32(v) => json!(v),
            Value::I32(v) => json!(v),
            Value::F32(v) => json!(v),
            Value::Bool(v) => json!(v),
            Value::String(v) => json!(v),
            Value::U64(v) => json!(v),
            Value::I64(v) => json!(v),
            Value::F64(v) => json!(v),
            Value::Array(_, items) if items.len() > max_items => json!({
                "len": items.len(),
                "head": items.iter().take(max_items).map(|v| v.to_json(max_items)).collect::<Vec<_>>(),
            }),
            Value::Array(_, items) => items.iter().map(|v| v.to_json(max_items)).collect(),
        }
    }
}

impl std::fmt::Display for Value {
    /// Short human form: long arrays show their length and first items.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::String(s) if s.chars().count() > 60 => {
                write!(
                    f,
                    "{:?}… ({} chars)",
                    s.chars().take(60).collect::<String>(),
                    s.chars().count()
                )
            }
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(ty, items) => {
                let head: Vec<String> = items.iter().take(4).map(|v| v.to_string()).collect();
                let more = if items.len() > 4 { ", …" } else { "" };
                write!(f, "[{}{more}] ({} × {ty:?})", head.join(", "), items.len())
            }
            other => write!(f, "{}", other.to_json(0)),
        }
    }
}
