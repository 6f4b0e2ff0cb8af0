//! A pickle reader that builds data and never runs code: the opcodes `torch.save` writes
//! (protocols 2 to 4), with every class reference checked against a short list of torch's tensor
//! rebuilders and storage types, so a hostile `.pt` file is refused by name instead of being
//! executed. Memory is bounded: every object counts its nodes and depth, and references to
//! memoized objects (a pickle "billion laughs" repeats one reference to double the data each
//! time) are charged against a budget.

use std::collections::HashMap;

/// The classes a tensor dump may name: torch's tensor rebuilders, its typed storages and the
/// empty `OrderedDict` of a tensor's backward hooks.
const ALLOWED_GLOBALS: &[(&str, &str)] = &[
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("collections", "OrderedDict"),
    ("torch", "FloatStorage"),
    ("torch", "DoubleStorage"),
    ("torch", "HalfStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "LongStorage"),
    ("torch", "IntStorage"),
    ("torch", "ShortStorage"),
    ("torch", "CharStorage"),
    ("torch", "ByteStorage"),
    ("torch", "BoolStorage"),
];

/// Nodes all objects of one pickle may hold, memo copies included.
const NODE_BUDGET: u64 = 1 << 20;
/// How deep containers may nest.
const MAX_DEPTH: u32 = 64;

/// A value built from a pickle.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Obj>),
    List(Vec<Obj>),
    Dict(Vec<(Obj, Obj)>),
    /// A class from the allowed list (torch's tensor rebuilders and storage types).
    Global(String, String),
    /// `callable(*args)` (REDUCE, NEWOBJ), left for the caller to interpret.
    Call(Box<Obj>, Box<Obj>),
    /// A persistent id: torch's reference to a storage record of the archive.
    PersistentId(Box<Obj>),
}

/// A value with the size of its tree, so that copies can be charged without walking it.
#[derive(Clone, Debug, PartialEq)]
pub struct Obj {
    pub value: Value,
    nodes: u64,
    depth: u32,
}

impl Obj {
    fn leaf(value: Value) -> Obj {
        Obj {
            value,
            nodes: 1,
            depth: 0,
        }
    }

    fn container(value: Value) -> Result<Obj, String> {
        let children: Vec<&Obj> = match &value {
            Value::Tuple(v) | Value::List(v) => v.iter().collect(),
            Value::Dict(kv) => kv.iter().flat_map(|(k, v)| [k, v]).collect(),
            Value::Call(a, b) => vec![a, b],
            Value::PersistentId(a) => vec![a],
            _ => Vec::new(),
        };
        // Children are moved into `value`; their sizes are read first.
        let (nodes, depth) = children
            .iter()
            .fold((1u64, 0u32), |(n, d), c| (n + c.nodes, d.max(c.depth + 1)));
        if depth > MAX_DEPTH {
            return Err(format!("objects nested deeper than {MAX_DEPTH}"));
        }
        Ok(Obj {
            value,
            nodes,
            depth,
        })
    }

    /// `{}`: the metadata of a tensor that came without any.
    pub fn empty_dict() -> Obj {
        Obj::leaf(Value::Dict(Vec::new()))
    }

    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self.value {
            Value::Int(i) => Some(i),
            _ => None,
        }
    }

    /// The items of a tuple or list.
    pub fn as_seq(&self) -> Option<&[Obj]> {
        match &self.value {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// The value at string key `key` of a dict.
    pub fn get(&self, key: &str) -> Option<&Obj> {
        match &self.value {
            Value::Dict(kv) => kv
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// The stack machine's state.
struct Machine<'a> {
    input: &'a [u8],
    at: usize,
    stack: Vec<Obj>,
    /// Where each MARK was pushed.
    marks: Vec<usize>,
    memo: HashMap<u32, Obj>,
    spent: u64,
}

/// Read one pickle from `input`: the object left by STOP.
pub fn read(input: &[u8]) -> Result<Obj, String> {
    let mut m = Machine {
        input,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        spent: 0,
    };
    loop {
        let at = m.at;
        let op = m.take(1)?[0];
        if m.step(op)
            .map_err(|e| format!("opcode {op:#04x} at byte {at}: {e}"))?
        {
            break;
        }
    }
    match (m.stack.pop(), m.stack.is_empty()) {
        (Some(top), true) => Ok(top),
        _ => Err("STOP with other than one object on the stack".into()),
    }
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.input.len());
        let Some(end) = end else {
            return Err(format!("ends inside an opcode at byte {}", self.at));
        };
        let bytes = &self.input[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn text(&mut self, n: usize) -> Result<String, String> {
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "a string that is not UTF-8".into())
    }

    /// A `GLOBAL` operand: text up to a newline.
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.input[self.at..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err("a class name without its newline".into());
        };
        let s = self.text(n)?;
        self.at += 1;
        Ok(s)
    }

    fn pop(&mut self) -> Result<Obj, String> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err("pops past a MARK".into());
        }
        self.stack.pop().ok_or_else(|| "pops an empty stack".into())
    }

    fn top(&mut self) -> Result<&mut Obj, String> {
        self.stack
            .last_mut()
            .ok_or_else(|| "reads an empty stack".into())
    }

    /// Everything pushed since the last MARK, which is dropped.
    fn pop_mark(&mut self) -> Result<Vec<Obj>, String> {
        let mark = self.marks.pop().ok_or("no MARK to pop to")?;
        Ok(self.stack.split_off(mark))
    }

    fn push(&mut self, obj: Obj) -> Result<(), String> {
        self.charge(obj.nodes)?;
        self.stack.push(obj);
        Ok(())
    }

    fn charge(&mut self, nodes: u64) -> Result<(), String> {
        self.spent += nodes;
        if self.spent > NODE_BUDGET {
            return Err(format!("builds more than {NODE_BUDGET} objects"));
        }
        Ok(())
    }

    fn global(&mut self, module: String, name: String) -> Result<(), String> {
        if !ALLOWED_GLOBALS.contains(&(module.as_str(), name.as_str())) {
            return Err(format!(
                "names class `{module}.{name}`; only tensors and plain data are read"
            ));
        }
        self.push(Obj::leaf(Value::Global(module, name)))
    }

    fn memo_put(&mut self, key: u32) -> Result<(), String> {
        let top = self.top()?.clone();
        self.charge(top.nodes)?;
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), String> {
        let obj = self.memo.get(&key).cloned();
        self.push(obj.ok_or_else(|| format!("memo {key} was never stored"))?)
    }

    /// Add `items` to the container on top of the stack (a list or a dict).
    fn extend_top(&mut self, items: Vec<Obj>) -> Result<(), String> {
        let top = self.pop()?;
        let value = match top.value {
            Value::List(mut v) => {
                v.extend(items);
                Value::List(v)
            }
            Value::Dict(mut kv) => {
                if !items.len().is_multiple_of(2) {
                    return Err("a dict item without its value".into());
                }
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    kv.push((k, v));
                }
                Value::Dict(kv)
            }
            _ => return Err("adds items to something that is not a list or dict".into()),
        };
        // The items were charged when pushed; the container's new size is not charged again.
        self.stack.push(Obj::container(value)?);
        Ok(())
    }

    fn tuple(&mut self, items: Vec<Obj>) -> Result<(), String> {
        let obj = Obj::container(Value::Tuple(items))?;
        self.stack.push(obj);
        Ok(())
    }

    /// Run one opcode; true at STOP.
    fn step(&mut self, op: u8) -> Result<bool, String> {
        match op {
            0x80 => {
                let proto = self.u8()?;
                if !(2..=5).contains(&proto) {
                    return Err(format!("pickle protocol {proto}"));
                }
            }
            0x95 => {
                self.take(8)?; // FRAME: a length hint only
            }
            b'.' => return Ok(true),
            b'(' => self.marks.push(self.stack.len()),
            b'N' => self.push(Obj::leaf(Value::None))?,
            0x88 => self.push(Obj::leaf(Value::Bool(true)))?,
            0x89 => self.push(Obj::leaf(Value::Bool(false)))?,
            b'K' => {
                let v = self.u8()?;
                self.push(Obj::leaf(Value::Int(v.into())))?
            }
            b'M' => {
                let v = self.u16()?;
                self.push(Obj::leaf(Value::Int(v.into())))?
            }
            b'J' => {
                let v = self.u32()? as i32;
                self.push(Obj::leaf(Value::Int(v.into())))?
            }
            0x8a => {
                let n = self.u8()? as usize;
                if n > 8 {
                    return Err(format!("an integer of {n} bytes"));
                }
                let bytes = self.take(n)?;
                let mut v: i64 = 0;
                for (i, &b) in bytes.iter().enumerate() {
                    v |= i64::from(b) << (8 * i);
                }
                if (1..8).contains(&n) && bytes[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n); // two's complement of n bytes
                }
                self.push(Obj::leaf(Value::Int(v)))?
            }
            b'G' => {
                let bits = u64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                self.push(Obj::leaf(Value::Float(f64::from_bits(bits))))?
            }
            b'X' => {
                let n = self.u32()? as usize;
                let s = self.text(n)?;
                self.push(Obj::leaf(Value::Str(s)))?
            }
            0x8c => {
                let n = self.u8()? as usize;
                let s = self.text(n)?;
                self.push(Obj::leaf(Value::Str(s)))?
            }
            b'c' => {
                let (module, name) = (self.line()?, self.line()?);
                self.global(module, name)?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module.value, name.value) {
                    (Value::Str(m), Value::Str(n)) => self.global(m, n)?,
                    _ => return Err("STACK_GLOBAL without two strings".into()),
                }
            }
            b'}' => self.push(Obj::leaf(Value::Dict(Vec::new())))?,
            b']' => self.push(Obj::leaf(Value::List(Vec::new())))?,
            b')' => self.push(Obj::leaf(Value::Tuple(Vec::new())))?,
            b't' => {
                let items = self.pop_mark()?;
                self.tuple(items)?
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = (0..n).map(|_| self.pop()).collect::<Result<Vec<_>, _>>()?;
                items.reverse();
                self.tuple(items)?
            }
            b'a' => {
                let item = self.pop()?;
                self.extend_top(vec![item])?
            }
            b'e' | b'u' => {
                let items = self.pop_mark()?;
                self.extend_top(items)?
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.extend_top(vec![k, v])?
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                let call = Value::Call(Box::new(callable), Box::new(args));
                self.stack.push(Obj::container(call)?)
            }
            b'b' => {
                // BUILD sets an object's state; tensors and plain data have none worth keeping.
                self.pop()?;
            }
            b'Q' => {
                let id = self.pop()?;
                let pid = Obj::container(Value::PersistentId(Box::new(id)))?;
                self.stack.push(pid)
            }
            b'q' => {
                let k = self.u8()?;
                self.memo_put(k.into())?
            }
            b'r' => {
                let k = self.u32()?;
                self.memo_put(k)?
            }
            0x94 => {
                let k = self.memo.len() as u32;
                self.memo_put(k)?
            }
            b'h' => {
                let k = self.u8()?;
                self.memo_get(k.into())?
            }
            b'j' => {
                let k = self.u32()?;
                self.memo_get(k)?
            }
            other => return Err(format!("opcode {other:#04x} is not read")),
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{"value": 7, "meta": {"name": "x"}}` as Python's pickle protocol 2 writes it.
    const SMALL: &[u8] = b"\x80\x02}q\x00(X\x05\x00\x00\x00valueq\x01K\x07X\x04\x00\x00\x00metaq\x02}q\x03X\x04\x00\x00\x00nameq\x04X\x01\x00\x00\x00xq\x05su.";

    #[test]
    fn plain_data_is_read() {
        let top = read(SMALL).unwrap();
        assert_eq!(top.get("value").and_then(Obj::as_int), Some(7));
        let meta = top.get("meta").unwrap();
        assert_eq!(meta.get("name").and_then(Obj::as_str), Some("x"));
    }

    #[test]
    fn a_class_outside_the_list_is_refused_by_name() {
        let pickled = b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
        let err = read(pickled).unwrap_err();
        assert!(err.contains("names class `posix.system`"), "{err}");
    }

    #[test]
    fn memo_references_that_double_the_data_stop_at_the_budget() {
        // A list, then 60 times: the memoized object twice in a tuple, memoized again.
        let mut bomb = b"\x80\x02]q\x00".to_vec();
        for _ in 0..60 {
            bomb.extend_from_slice(b"h\x00h\x00\x86q\x00");
        }
        bomb.push(b'.');
        let err = read(&bomb).unwrap_err();
        assert!(err.contains("builds more than"), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut deep = b"\x80\x02".to_vec();
        deep.extend(std::iter::repeat_n(b']', 200));
        deep.extend(std::iter::repeat_n(b'a', 199));
        deep.push(b'.');
        let err = read(&deep).unwrap_err();
        assert!(err.contains("nested deeper"), "{err}");
    }

    #[test]
    fn cut_or_mutated_pickles_give_errors_not_panics() {
        for n in 0..SMALL.len() {
            assert!(read(&SMALL[..n]).is_err(), "cut at {n}");
        }
        // A fixed-seed stream of byte changes over the sample (the fuzz target does this
        // without end: fuzz/fuzz_targets/sglang_dump.rs).
        let mut z: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..50_000 {
            let mut bytes = SMALL.to_vec();
            for _ in 0..3 {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let at = (z >> 33) as usize % bytes.len();
                bytes[at] = (z >> 17) as u8;
            }
            let _ = read(&bytes);
        }
    }
}
