//! Python pickles read as data: the opcode loop of a pickle machine that builds a tree of
//! [`Value`]s and never imports, calls or executes anything. `GLOBAL` becomes a name,
//! `REDUCE` and `NEWOBJ` become a [`Value::Call`] that is recorded, not made, and `BUILD`
//! a [`Value::Build`]; what those mean is up to the format reading the tree (torch's
//! tensor rebuild calls, DCP's dataclasses), and each format accepts only the names it
//! knows.
//!
//! Why ckpt has its own: candle-core's reader stops at protocol 2 (torch.save's data.pkl)
//! but DCP's `.metadata` is protocol 4 (`FRAME`, `SHORT_BINUNICODE`, `MEMOIZE`,
//! `STACK_GLOBAL`), and serde-pickle turns every global into `None` and cannot key a
//! dict by an object (DCP's `storage_data` is keyed by `MetadataIndex` objects). This
//! machine covers protocols 2 to 5 as torch writes them; any other opcode is an error
//! that names it.
//!
//! Hostile input is bounded: reads are checked against the end of the input, the memo
//! copies what it gives back, so the values copied out of it are counted (a few hundred
//! bytes of nested references would otherwise expand exponentially), and nesting is
//! limited (deep trees overflow the stack of any recursive consumer, and of `Drop`).

use std::collections::{HashMap, HashSet};

/// A value built by the pickle machine.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// A module-level name (`GLOBAL`, `STACK_GLOBAL`): a class or function, not loaded.
    Global {
        module: String,
        name: String,
    },
    /// `callable(*args)` (`REDUCE`) or `callable.__new__(callable, *args)` (`NEWOBJ`),
    /// recorded, never made.
    Call {
        callable: Box<Value>,
        args: Box<Value>,
    },
    /// `BUILD`: an object and the state given to it.
    Build {
        object: Box<Value>,
        state: Box<Value>,
    },
    /// `BINPERSID`: a reference the loader resolves (torch: a storage).
    PersistentId(Box<Value>),
}

impl Value {
    /// The global's `(module, name)` when this is one.
    pub(crate) fn global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// The callable's global when this is a call of one (`Size((8, 6))`).
    pub(crate) fn call_of(&self) -> Option<((&str, &str), &Value)> {
        match self {
            Value::Call { callable, args } => Some((callable.global()?, args)),
            _ => None,
        }
    }

    /// `Some(items)` for a tuple or a list.
    pub(crate) fn items(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// `Some(items)` for a tuple or a list, to change them.
    pub(crate) fn items_mut(&mut self) -> Option<&mut [Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// The value under a string key of a dict (or of a dict given a state by `BUILD`:
    /// an `OrderedDict` with attributes, such as a module's state dict).
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Build { object, .. } => object.get(key),
            Value::Dict(kv) => kv
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// Every global named anywhere in the tree, once per occurrence.
    pub(crate) fn globals<'a>(&'a self, out: &mut Vec<(&'a str, &'a str)>) {
        match self {
            Value::Global { module, name } => out.push((module, name)),
            _ => self.for_each_child(|c| c.globals(out)),
        }
    }

    /// Calls `f` on this value and, depth first, on every value it holds (a dict: key,
    /// then value), each before its children; `f` may change what it is given.
    pub(crate) fn visit_mut(&mut self, f: &mut impl FnMut(&mut Value)) {
        f(self);
        match self {
            Value::Tuple(v) | Value::List(v) => v.iter_mut().for_each(|c| c.visit_mut(f)),
            Value::Dict(kv) => kv.iter_mut().for_each(|(k, v)| {
                k.visit_mut(f);
                v.visit_mut(f);
            }),
            Value::Call {
                callable: a,
                args: b,
            }
            | Value::Build {
                object: a,
                state: b,
            } => {
                a.visit_mut(f);
                b.visit_mut(f);
            }
            Value::PersistentId(v) => v.visit_mut(f),
            _ => {}
        }
    }

    /// Calls `f` on each value this one holds directly, in order (a dict: key, then
    /// value); the one walk that [`Value::globals`] and the size bound share.
    fn for_each_child<'a>(&'a self, mut f: impl FnMut(&'a Value)) {
        match self {
            Value::Tuple(v) | Value::List(v) => v.iter().for_each(f),
            Value::Dict(kv) => kv.iter().for_each(|(k, v)| {
                f(k);
                f(v);
            }),
            Value::Call {
                callable: a,
                args: b,
            }
            | Value::Build {
                object: a,
                state: b,
            } => {
                f(a);
                f(b);
            }
            Value::PersistentId(v) => f(v),
            _ => {}
        }
    }
}

/// Why a pickle could not be read (the caller adds which file and entry).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PickleError(pub(crate) String);

impl std::fmt::Display for PickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type Result<T> = std::result::Result<T, PickleError>;

/// The most values memo reads may copy while parsing one pickle (torch.save copies a
/// few per tensor: the rebuild function, the storage tag, the location).
const MAX_COPIED: u64 = 1 << 21;
/// The deepest nesting accepted (a state dict nests a handful of levels).
const MAX_DEPTH: u32 = 128;

/// A value on the machine's stack, with how deeply it nests.
#[derive(Clone)]
struct Item {
    value: Value,
    depth: u32,
    /// The memo key this object was last stored under: Python's memo holds the object
    /// itself, so what `SETITEMS`, `APPENDS` and `BUILD` do to it later is seen by every
    /// later `GET` (a `DeviceMesh` made once, built with its state, then referred to by
    /// every DTensor).
    memo: Option<u32>,
}

enum Slot {
    Item(Item),
    Mark,
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    memo: HashMap<u32, Item>,
    /// Memo keys whose object was changed after it was stored; the memo's copy is
    /// brought up to date when the object leaves the stack or the key is read.
    stale: HashSet<u32>,
    copied: u64,
}

fn leaf(value: Value) -> Item {
    Item {
        value,
        depth: 0,
        memo: None,
    }
}

/// The number of values in `v`, counted up to `limit`.
fn size(v: &Value, limit: u64) -> u64 {
    let mut n = 1;
    v.for_each_child(|c| {
        if n < limit {
            n += size(c, limit - n);
        }
    });
    n
}

impl<'a> Machine<'a> {
    fn fail<T>(&self, what: impl std::fmt::Display) -> Result<T> {
        Err(PickleError(format!("at byte {}: {what}", self.pos)))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.input.len() => {
                let s = &self.input[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => self.fail(format!("truncated: {n} more bytes needed")),
        }
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N]> {
        let b = self.take(N)?;
        Ok(b.try_into().expect("take returned N bytes"))
    }

    fn len_u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len_u64(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.le()?);
        match usize::try_from(n) {
            Ok(n) => Ok(n),
            Err(_) => self.fail(format!("a length of {n} bytes")),
        }
    }

    fn text(&mut self, n: usize) -> Result<String> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => self.fail("a string that is not UTF-8"),
        }
    }

    /// A `\n`-terminated line (`GLOBAL`'s operands).
    fn line(&mut self) -> Result<String> {
        let rest = &self.input[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return self.fail("truncated: a line without its end");
        };
        let s = self.text(n)?;
        self.pos += 1;
        Ok(s)
    }

    fn push(&mut self, item: Item) -> Result<()> {
        if item.depth > MAX_DEPTH {
            return self.fail(format!("values nested more than {MAX_DEPTH} deep"));
        }
        self.stack.push(Slot::Item(item));
        Ok(())
    }

    fn pop(&mut self) -> Result<Item> {
        match self.stack.pop() {
            Some(Slot::Item(i)) => {
                self.settle(&i);
                Ok(i)
            }
            Some(Slot::Mark) => self.fail("a mark where a value was expected"),
            None => self.fail("the stack is empty"),
        }
    }

    fn top(&mut self) -> Result<&mut Item> {
        match self.stack.last_mut() {
            Some(Slot::Item(i)) => Ok(i),
            _ => Err(PickleError(format!(
                "at byte {}: no value on the stack",
                self.pos
            ))),
        }
    }

    /// The values down to the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Item>> {
        let Some(at) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            return self.fail("no mark on the stack");
        };
        let items = self
            .stack
            .split_off(at + 1)
            .into_iter()
            .map(|s| match s {
                Slot::Item(i) => i,
                Slot::Mark => unreachable!("the topmost mark is at `at`"),
            })
            .collect::<Vec<_>>();
        self.stack.pop();
        for i in &items {
            self.settle(i);
        }
        Ok(items)
    }

    /// Brings the memo's copy of `item` up to date if the object changed after it was
    /// stored (once, when it leaves the stack).
    fn settle(&mut self, item: &Item) {
        if let Some(k) = item.memo {
            if self.stale.remove(&k) {
                self.memo.insert(k, item.clone());
            }
        }
    }

    /// Marks the object on the top of the stack as changed since it was stored.
    fn touched(&mut self) {
        if let Some(Slot::Item(Item { memo: Some(k), .. })) = self.stack.last() {
            self.stale.insert(*k);
        }
    }

    fn memo_get(&mut self, key: u32) -> Result<()> {
        if self.stale.remove(&key) {
            // Still on the stack (a GET inside the object's own state): its current form.
            let live = self.stack.iter().rev().find_map(|s| match s {
                Slot::Item(i) if i.memo == Some(key) => Some(i.clone()),
                _ => None,
            });
            if let Some(i) = live {
                self.memo.insert(key, i);
            }
        }
        let Some(item) = self.memo.get(&key) else {
            return self.fail(format!("memo {key} was never stored"));
        };
        let n = size(&item.value, MAX_COPIED);
        self.count_copy(n)?;
        let item = self.memo[&key].clone();
        self.push(item)
    }

    /// Counts a copy of `n` values (a memo read, `DUP`) against [`MAX_COPIED`], before
    /// it is made.
    fn count_copy(&mut self, n: u64) -> Result<()> {
        self.copied += n;
        if self.copied >= MAX_COPIED {
            return self.fail(format!(
                "memo references expand to more than {MAX_COPIED} values (a pickle bomb, not a checkpoint)"
            ));
        }
        Ok(())
    }

    fn memo_put(&mut self, key: u32) -> Result<()> {
        let top = self.top()?;
        top.memo = Some(key);
        let item = top.clone();
        self.memo.insert(key, item);
        self.stale.remove(&key);
        Ok(())
    }

    fn container(&mut self, items: Vec<Item>, make: fn(Vec<Value>) -> Value) -> Result<()> {
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(0);
        let value = make(items.into_iter().map(|i| i.value).collect());
        self.push(Item {
            value,
            depth,
            memo: None,
        })
    }

    fn pair(&mut self, a: Item, b: Item, make: fn(Box<Value>, Box<Value>) -> Value) -> Result<()> {
        let depth = a.depth.max(b.depth) + 1;
        self.push(Item {
            value: make(Box::new(a.value), Box::new(b.value)),
            depth,
            memo: None,
        })
    }

    /// Adds `(key, value)` pairs to the dict on the top of the stack.
    fn set_items(&mut self, items: Vec<Item>) -> Result<()> {
        if !items.len().is_multiple_of(2) {
            return self.fail("SETITEMS with an odd number of values");
        }
        let pos = self.pos;
        let dict = self.top()?;
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(0);
        let Value::Dict(kv) = &mut dict.value else {
            return Err(PickleError(format!(
                "at byte {pos}: SETITEM(S) on something that is not a dict"
            )));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            kv.push((k.value, v.value));
        }
        dict.depth = dict.depth.max(depth);
        if dict.depth > MAX_DEPTH {
            return self.fail(format!("values nested more than {MAX_DEPTH} deep"));
        }
        self.touched();
        Ok(())
    }

    fn append(&mut self, items: Vec<Item>) -> Result<()> {
        let pos = self.pos;
        let list = self.top()?;
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(0);
        let Value::List(v) = &mut list.value else {
            return Err(PickleError(format!(
                "at byte {pos}: APPEND(S) on something that is not a list"
            )));
        };
        v.extend(items.into_iter().map(|i| i.value));
        list.depth = list.depth.max(depth);
        if list.depth > MAX_DEPTH {
            return self.fail(format!("values nested more than {MAX_DEPTH} deep"));
        }
        self.touched();
        Ok(())
    }

    /// `REDUCE`/`NEWOBJ`. `collections.OrderedDict()` is the one call made: it is an
    /// empty dict that `SETITEMS` then fills.
    fn call(&mut self, callable: Item, args: Item) -> Result<()> {
        let ordered_dict = callable.value.global() == Some(("collections", "OrderedDict"))
            && args.value == Value::Tuple(vec![]);
        if ordered_dict {
            return self.push(leaf(Value::Dict(vec![])));
        }
        self.pair(callable, args, |c, a| Value::Call {
            callable: c,
            args: a,
        })
    }

    /// Runs one opcode; `true` at `STOP`.
    fn step(&mut self) -> Result<bool> {
        let op = self.u8()?;
        match op {
            0x80 => {
                // PROTO
                let p = self.u8()?;
                if p > 5 {
                    return self.fail(format!("pickle protocol {p}"));
                }
            }
            0x95 => {
                // FRAME: a length prefix for buffering; the opcodes simply follow.
                self.take(8)?;
            }
            b'.' => return Ok(true),
            b'(' => self.stack.push(Slot::Mark),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let n = size(&self.top()?.value, MAX_COPIED);
                self.count_copy(n)?;
                let top = self.top()?.clone();
                self.push(top)?;
            }
            b'N' => self.push(leaf(Value::None))?,
            0x88 => self.push(leaf(Value::Bool(true)))?,
            0x89 => self.push(leaf(Value::Bool(false)))?,
            b'J' => {
                let v = i32::from_le_bytes(self.le()?);
                self.push(leaf(Value::Int(i64::from(v))))?;
            }
            b'K' => {
                let v = self.u8()?;
                self.push(leaf(Value::Int(i64::from(v))))?;
            }
            b'M' => {
                let v = u16::from_le_bytes(self.le()?);
                self.push(leaf(Value::Int(i64::from(v))))?;
            }
            0x8a => {
                // LONG1: a little-endian two's-complement integer of n bytes.
                let n = self.u8()? as usize;
                let b = self.take(n)?;
                if n > 8 {
                    return self.fail(format!("an integer of {n} bytes"));
                }
                let mut v: i64 = 0;
                for (i, &x) in b.iter().enumerate() {
                    v |= i64::from(x) << (8 * i);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                self.push(leaf(Value::Int(v)))?;
            }
            b'G' => {
                let v = f64::from_be_bytes(self.le()?);
                self.push(leaf(Value::Float(v)))?;
            }
            b'X' => {
                let n = self.len_u32()?;
                let s = self.text(n)?;
                self.push(leaf(Value::Str(s)))?;
            }
            0x8c => {
                let n = self.u8()? as usize;
                let s = self.text(n)?;
                self.push(leaf(Value::Str(s)))?;
            }
            0x8d => {
                let n = self.len_u64()?;
                let s = self.text(n)?;
                self.push(leaf(Value::Str(s)))?;
            }
            b'C' => {
                let n = self.u8()? as usize;
                let b = self.take(n)?.to_vec();
                self.push(leaf(Value::Bytes(b)))?;
            }
            b'B' => {
                let n = self.len_u32()?;
                let b = self.take(n)?.to_vec();
                self.push(leaf(Value::Bytes(b)))?;
            }
            0x8e => {
                let n = self.len_u64()?;
                let b = self.take(n)?.to_vec();
                self.push(leaf(Value::Bytes(b)))?;
            }
            b')' => self.push(leaf(Value::Tuple(vec![])))?,
            b't' => {
                let items = self.pop_mark()?;
                self.container(items, Value::Tuple)?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                self.container(items, Value::Tuple)?;
            }
            b']' => self.push(leaf(Value::List(vec![])))?,
            b'l' => {
                let items = self.pop_mark()?;
                self.container(items, Value::List)?;
            }
            b'a' => {
                let item = self.pop()?;
                self.append(vec![item])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            b'}' => self.push(leaf(Value::Dict(vec![])))?,
            b'd' => {
                let items = self.pop_mark()?;
                self.push(leaf(Value::Dict(vec![])))?;
                self.set_items(items)?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![k, v])?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.push(leaf(Value::Global { module, name }))?;
            }
            0x93 => {
                let name = self.pop()?.value;
                let module = self.pop()?.value;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return self.fail("STACK_GLOBAL on values that are not strings");
                };
                self.push(leaf(Value::Global { module, name }))?;
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                if !matches!(args.value, Value::Tuple(_)) {
                    return self.fail("REDUCE/NEWOBJ with arguments that are not a tuple");
                }
                self.call(callable, args)?;
            }
            b'b' => {
                let state = self.pop()?;
                let object = self.pop()?;
                let memo = object.memo;
                self.pair(object, state, |o, s| Value::Build {
                    object: o,
                    state: s,
                })?;
                // BUILD changes the object in place: the memo's copy is the built one.
                if let Some(Slot::Item(built)) = self.stack.last_mut() {
                    built.memo = memo;
                }
                self.touched();
            }
            b'Q' => {
                let id = self.pop()?;
                let depth = id.depth + 1;
                self.push(Item {
                    value: Value::PersistentId(Box::new(id.value)),
                    depth,
                    memo: None,
                })?;
            }
            b'h' => {
                let k = self.u8()?;
                self.memo_get(u32::from(k))?;
            }
            b'j' => {
                let k = u32::from_le_bytes(self.le()?);
                self.memo_get(k)?;
            }
            b'q' => {
                let k = self.u8()?;
                self.memo_put(u32::from(k))?;
            }
            b'r' => {
                let k = u32::from_le_bytes(self.le()?);
                self.memo_put(k)?;
            }
            0x94 => {
                // MEMOIZE: the next free index.
                let k = u32::try_from(self.memo.len()).unwrap_or(u32::MAX);
                self.memo_put(k)?;
            }
            other => {
                self.pos -= 1;
                return self.fail(format!("opcode 0x{other:02x}, which ckpt does not read"));
            }
        }
        Ok(false)
    }
}

/// Parses a whole pickle: one value, then `STOP`, then nothing.
pub(crate) fn parse(input: &[u8]) -> Result<Value> {
    let mut m = Machine {
        input,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        stale: HashSet::new(),
        copied: 0,
    };
    while !m.step()? {}
    if m.pos != input.len() {
        return m.fail(format!(
            "{} bytes after the pickle's STOP",
            input.len() - m.pos
        ));
    }
    match (m.stack.pop(), m.stack.is_empty()) {
        (Some(Slot::Item(i)), true) => Ok(i.value),
        _ => m.fail("the pickle does not leave exactly one value"),
    }
}

/// Writes a protocol-2 pickle, opcode by opcode: the inverse of [`parse`] for the
/// values ckpt writes (torch.save's `data.pkl`, DCP's `.metadata`). Python's unpickler
/// (and torch's `weights_only` one) read it; nothing is memoized, so the bytes depend
/// only on the calls made.
#[derive(Debug)]
pub(crate) struct Emitter {
    out: Vec<u8>,
}

impl Emitter {
    pub(crate) fn new() -> Emitter {
        Emitter { out: vec![0x80, 2] }
    }

    /// `module.name` (`GLOBAL`).
    pub(crate) fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        self
    }

    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.out.push(b'X');
        let n = u32::try_from(s.len()).expect("names are far shorter than 4 GiB");
        self.out.extend_from_slice(&n.to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        self
    }

    pub(crate) fn int(&mut self, v: u64) -> &mut Self {
        if v < 256 {
            self.out.extend_from_slice(&[b'K', v as u8]);
        } else if v < 65536 {
            self.out.push(b'M');
            self.out.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v < (1 << 31) {
            self.out.push(b'J');
            self.out.extend_from_slice(&(v as u32).to_le_bytes());
        } else {
            // LONG1: 8 bytes of little-endian two's complement. Sizes and offsets stay
            // below 2^63 (checked arithmetic on i64-sized files), so the sign is clear.
            debug_assert!(v < 1 << 63);
            self.out.extend_from_slice(&[0x8a, 8]);
            self.out.extend_from_slice(&v.to_le_bytes());
        }
        self
    }

    pub(crate) fn bool(&mut self, b: bool) -> &mut Self {
        self.out.push(if b { 0x88 } else { 0x89 });
        self
    }

    pub(crate) fn none(&mut self) -> &mut Self {
        self.out.push(b'N');
        self
    }

    pub(crate) fn mark(&mut self) -> &mut Self {
        self.out.push(b'(');
        self
    }

    /// The values since the mark, as a tuple.
    pub(crate) fn tuple(&mut self) -> &mut Self {
        self.out.push(b't');
        self
    }

    /// A tuple of integers.
    pub(crate) fn ints(&mut self, v: &[u64]) -> &mut Self {
        self.mark();
        for &x in v {
            self.int(x);
        }
        self.tuple()
    }

    pub(crate) fn empty_tuple(&mut self) -> &mut Self {
        self.out.push(b')');
        self
    }

    pub(crate) fn empty_dict(&mut self) -> &mut Self {
        self.out.push(b'}');
        self
    }

    pub(crate) fn empty_list(&mut self) -> &mut Self {
        self.out.push(b']');
        self
    }

    /// Appends the values since the mark to the list below it.
    pub(crate) fn appends(&mut self) -> &mut Self {
        self.out.push(b'e');
        self
    }

    /// Sets the key/value pairs since the mark in the dict below it.
    pub(crate) fn set_items(&mut self) -> &mut Self {
        self.out.push(b'u');
        self
    }

    /// `callable(*args)` for the callable and argument tuple on the stack.
    pub(crate) fn reduce(&mut self) -> &mut Self {
        self.out.push(b'R');
        self
    }

    /// `cls.__new__(cls, *args)` for the class and argument tuple on the stack.
    pub(crate) fn new_obj(&mut self) -> &mut Self {
        self.out.push(0x81);
        self
    }

    /// Gives the object below the state on the stack that state.
    pub(crate) fn build(&mut self) -> &mut Self {
        self.out.push(b'b');
        self
    }

    /// The value on the stack as a persistent id.
    pub(crate) fn persistent_id(&mut self) -> &mut Self {
        self.out.push(b'Q');
        self
    }

    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.out.push(b'.');
        self.out
    }

    /// The opcodes so far, without the protocol header or `STOP`: a fragment to splice
    /// into another pickle (it uses no memo, so it fits anywhere).
    pub(crate) fn fragment(self) -> Vec<u8> {
        self.out[2..].to_vec()
    }

    /// Opcodes spliced in as they are (a [`Emitter::fragment`]).
    pub(crate) fn raw(&mut self, ops: &[u8]) -> &mut Self {
        self.out.extend_from_slice(ops);
        self
    }

    /// A float (`BINFLOAT`: 8 bytes, big-endian).
    pub(crate) fn float(&mut self, v: f64) -> &mut Self {
        self.out.push(b'G');
        self.out.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Any `i64` (`LONG1` of 8 bytes for the negative ones).
    pub(crate) fn signed(&mut self, v: i64) -> &mut Self {
        match u64::try_from(v) {
            Ok(u) => self.int(u),
            Err(_) => {
                self.out.extend_from_slice(&[0x8a, 8]);
                self.out.extend_from_slice(&v.to_le_bytes());
                self
            }
        }
    }

    /// `bytes` (`BINBYTES`, protocol 3: Python's unpickler takes it whatever the
    /// header's protocol).
    pub(crate) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.push(b'B');
        let n = u32::try_from(b.len()).expect("carried byte strings are far below 4 GiB");
        self.out.extend_from_slice(&n.to_le_bytes());
        self.out.extend_from_slice(b);
        self
    }

    /// A parsed [`Value`] written back: calls and objects as `REDUCE` and `BUILD`
    /// (what loading them gives is the same for the plain classes ckpt carries:
    /// `argparse.Namespace`, enums, dtypes, RNG states), persistent ids as they are.
    pub(crate) fn value(&mut self, v: &Value) -> std::result::Result<&mut Self, String> {
        match v {
            Value::None => self.none(),
            Value::Bool(b) => self.bool(*b),
            Value::Int(i) => self.signed(*i),
            Value::Float(f) => self.float(*f),
            Value::Str(s) => self.str(s),
            Value::Tuple(items) => {
                self.mark();
                for i in items {
                    self.value(i)?;
                }
                self.tuple()
            }
            Value::List(items) => {
                self.empty_list().mark();
                for i in items {
                    self.value(i)?;
                }
                self.appends()
            }
            Value::Dict(kv) => {
                self.empty_dict().mark();
                for (k, v) in kv {
                    self.value(k)?;
                    self.value(v)?;
                }
                self.set_items()
            }
            Value::Global { module, name } => self.global(module, name),
            Value::Call { callable, args } => {
                self.value(callable)?;
                self.value(args)?;
                self.reduce()
            }
            Value::Build { object, state } => {
                self.value(object)?;
                self.value(state)?;
                self.build()
            }
            Value::Bytes(b) => self.bytes(b),
            // A storage reference: the caller has made its key name a storage of the
            // archive being written (see `torch_write::Wrap`'s storages).
            Value::PersistentId(id) => {
                self.value(id)?;
                self.persistent_id()
            }
        };
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::Str(x.into())
    }

    #[test]
    fn protocol_4_frames_memoize_and_stack_global() {
        // What `pickle.dumps(Point(1, -2), 4)` of a dataclass writes: FRAME, then
        // STACK_GLOBAL from memoized strings, NEWOBJ and a dict state BUILT into it.
        let mut p = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00".to_vec();
        p.extend_from_slice(b"\x8c\x08__main__\x94\x8c\x05Point\x94\x93\x94)\x81\x94}\x94(");
        p.extend_from_slice(b"\x8c\x01x\x94K\x01\x8c\x01y\x94J\xfe\xff\xff\xffub.");
        let v = parse(&p).unwrap();
        let Value::Build { object, state } = v else {
            panic!("{v:?}")
        };
        assert_eq!(
            object.call_of().unwrap().0,
            ("__main__", "Point"),
            "{object:?}"
        );
        assert_eq!(state.get("x"), Some(&Value::Int(1)));
        assert_eq!(state.get("y"), Some(&Value::Int(-2)));
    }

    #[test]
    fn a_memoized_object_changed_later_is_read_changed() {
        // (m, m) where m = C() is memoized before BUILD gives it {"a": 1}, and
        // (d, d) where d = {} is memoized before SETITEMS fills it: Python's memo holds
        // the object, so both copies are the finished ones.
        let mut e = Emitter::new();
        e.mark();
        e.global("mod", "C").empty_tuple().new_obj().raw(b"q\x01");
        e.empty_dict().str("a").int(1).raw(b"s").build();
        e.raw(b"h\x01");
        e.empty_dict().raw(b"q\x02").str("k").int(2).raw(b"s");
        e.raw(b"h\x02");
        e.tuple();
        let v = parse(&e.finish()).unwrap();
        let items = v.items().unwrap();
        assert_eq!(items.len(), 4);
        assert!(matches!(&items[1], Value::Build { .. }), "{:?}", items[1]);
        assert_eq!(items[0], items[1]);
        assert_eq!(items[2], items[3]);
        assert_eq!(items[3].get("k"), Some(&Value::Int(2)));
    }

    #[test]
    fn memo_gets_copy_and_long1_is_signed() {
        // ('a', 'a', -129, 2**40): MEMOIZE then BINGET 0; LONG1 of 2 and 6 bytes.
        let p = b"\x80\x04\x8c\x01a\x94h\x00\x8a\x02\x7f\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x94(h\x00h\x01h\x02h\x03t.";
        // The stack holds a, a, -129, 2**40 under the tuple: not one value.
        assert!(parse(p).is_err());
        let p = b"\x80\x04(\x8c\x01a\x94h\x00\x8a\x02\x7f\xff\x8a\x06\x00\x00\x00\x00\x00\x01t.";
        let v = parse(p).unwrap();
        assert_eq!(
            v,
            Value::Tuple(vec![s("a"), s("a"), Value::Int(-129), Value::Int(1 << 40)])
        );
    }

    #[test]
    fn ordered_dict_is_a_dict_filled_by_setitems() {
        let p = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00kK\x07u.";
        assert_eq!(
            parse(p).unwrap(),
            Value::Dict(vec![(s("k"), Value::Int(7))])
        );
    }

    #[test]
    fn what_the_emitter_writes_parses_back() {
        let mut e = Emitter::new();
        e.global("collections", "OrderedDict")
            .empty_tuple()
            .reduce();
        e.mark()
            .str("w")
            .ints(&[0, 255, 256, 65536, 1 << 31, u64::MAX >> 1]);
        e.str("b").bool(false).str("n").none().set_items();
        let v = parse(&e.finish()).unwrap();
        let ints = [0, 255, 256, 65536, 1 << 31, i64::MAX];
        assert_eq!(
            v,
            Value::Dict(vec![
                (
                    s("w"),
                    Value::Tuple(ints.iter().map(|&i| Value::Int(i)).collect())
                ),
                (s("b"), Value::Bool(false)),
                (s("n"), Value::None),
            ])
        );
    }

    #[test]
    fn a_pickle_bomb_is_refused() {
        // EMPTY_LIST, MEMO 0; then 60 times: GET 0, GET 0, TUPLE2, PUT 0 (doubling).
        let mut p = b"\x80\x02]q\x00".to_vec();
        for _ in 0..60 {
            p.extend_from_slice(b"h\x00h\x00\x86q\x00");
        }
        p.push(b'.');
        let e = parse(&p).unwrap_err().to_string();
        assert!(e.contains("pickle bomb"), "{e}");
        // The same doubling with DUP: EMPTY_LIST, then 60 times DUP, TUPLE2.
        let mut p = b"\x80\x02]".to_vec();
        for _ in 0..60 {
            p.extend_from_slice(b"2\x86");
        }
        p.push(b'.');
        let e = parse(&p).unwrap_err().to_string();
        assert!(e.contains("pickle bomb"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        // 100,000 empty lists, then as many APPENDs: each list goes into the one below.
        let n = 100_000;
        let mut p = b"\x80\x02".to_vec();
        p.extend(std::iter::repeat_n(b']', n));
        p.extend(std::iter::repeat_n(b'a', n - 1));
        p.push(b'.');
        let e = parse(&p).unwrap_err().to_string();
        assert!(e.contains("nested more than"), "{e}");
    }

    #[test]
    fn errors_name_the_problem_and_where() {
        let cases: &[(&[u8], &str)] = &[
            (b"\x80\x02X\x05\x00\x00", "truncated"),
            (b"\x80\x02K\x01.junk", "after the pickle's STOP"),
            (b"\x80\x02K\x01K\x02.", "exactly one value"),
            (b"\x80\x02h\x03.", "memo 3 was never stored"),
            (b"\x80\x02i__main__\nX\n.", "opcode 0x69"),
            (b"\x80\x02K\x01K\x02u.", "no mark"),
            (b"\x80\x02K\x01(K\x02K\x03u.", "not a dict"),
            (b"\x80\x09.", "protocol 9"),
        ];
        for (p, want) in cases {
            let e = parse(p).unwrap_err().to_string();
            assert!(e.contains(want), "{p:?}: {e}");
            assert!(e.starts_with("at byte "), "{e}");
        }
    }
}
