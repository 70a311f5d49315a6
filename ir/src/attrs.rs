//! Op attributes as plain data, with typed getters that fail with a message instead of panicking.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::types::DType;

/// One attribute value, typed: each form is parsed (or built) once, and printed as MLIR
/// attribute syntax only when a module goes to MLIR.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AttrValue {
    /// `N : i64`
    Int(i64),
    /// `X : f64`
    Float(f64),
    /// `true` / `false` (an `i1` integer attribute in MLIR)
    Bool(bool),
    /// `"text"`
    Str(String),
    /// `@name`: a symbol, such as the grid a collective runs over.
    Symbol(String),
    /// `N : index`: a tensor dimension (a collective's gather, slice or scatter axis).
    Index(usize),
    /// `array<i16: 0, 1>`: grid axes (of a collective, of a table split over the grid).
    Axes(Vec<u16>),
    /// `array<i64: 2>`: integers, such as a broadcast root's or a send's peer coordinates.
    Ints(Vec<i64>),
    /// `#shard<partial sum>`: how the partial values of a reduction combine.
    Reduction(Reduction),
    /// An element type (`f32`), such as the target of `xf.cast`.
    Type(DType),
    /// `unit`: a flag present or absent (`shard.shift`'s `rotate`).
    Unit,
}

/// How partial values combine (the `shard` dialect's `#shard<partial ...>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reduction {
    /// Summed.
    Sum,
    /// The largest.
    Max,
}

impl Reduction {
    /// The `shard` dialect's name for it.
    pub fn label(self) -> &'static str {
        match self {
            Reduction::Sum => "sum",
            Reduction::Max => "max",
        }
    }
}

fn dense(element: &str, values: impl Iterator<Item = String>) -> String {
    let values: Vec<String> = values.collect();
    if values.is_empty() { format!("array<{element}>") } else { format!("array<{element}: {}>", values.join(", ")) }
}

impl AttrValue {
    /// `array<i16: ...>` over grid axes.
    pub fn axes(axes: &[u16]) -> AttrValue {
        AttrValue::Axes(axes.to_vec())
    }

    /// MLIR attribute syntax for this value.
    pub fn to_mlir(&self) -> String {
        match self {
            AttrValue::Int(v) => format!("{v} : i64"),
            // `{:?}` keeps a decimal point or exponent so MLIR reads a float, and round-trips.
            AttrValue::Float(v) => format!("{v:?} : f64"),
            AttrValue::Bool(v) => v.to_string(),
            AttrValue::Str(s) => format!("{s:?}"),
            AttrValue::Symbol(s) => format!("@{s}"),
            AttrValue::Index(d) => format!("{d} : index"),
            AttrValue::Axes(axes) => dense("i16", axes.iter().map(u16::to_string)),
            AttrValue::Ints(values) => dense("i64", values.iter().map(i64::to_string)),
            AttrValue::Reduction(r) => format!("#shard<partial {}>", r.label()),
            AttrValue::Type(t) => t.mlir().to_string(),
            AttrValue::Unit => "unit".to_string(),
        }
    }
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_mlir())
    }
}

/// Named attributes of one op, sorted by name (as MLIR prints them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Attrs(pub BTreeMap<String, AttrValue>);

impl Attrs {
    /// No attributes.
    pub fn new() -> Self {
        Attrs::default()
    }

    /// Adds or replaces one attribute (builder style).
    pub fn with(mut self, name: &str, value: AttrValue) -> Self {
        self.0.insert(name.to_string(), value);
        self
    }

    /// The attribute called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&AttrValue> {
        self.0.get(name)
    }

    /// An integer attribute, or a message naming it.
    pub fn int(&self, name: &str) -> Result<i64, String> {
        match self.get(name) {
            Some(AttrValue::Int(v)) => Ok(*v),
            Some(other) => Err(format!("attribute `{name}` must be an integer, got {other}")),
            None => Err(format!("missing integer attribute `{name}`")),
        }
    }

    /// A float attribute, or a message naming it.
    pub fn float(&self, name: &str) -> Result<f64, String> {
        match self.get(name) {
            Some(AttrValue::Float(v)) => Ok(*v),
            Some(other) => Err(format!("attribute `{name}` must be a float, got {other}")),
            None => Err(format!("missing float attribute `{name}`")),
        }
    }

    /// A boolean attribute, or a message naming it.
    pub fn bool(&self, name: &str) -> Result<bool, String> {
        match self.get(name) {
            Some(AttrValue::Bool(v)) => Ok(*v),
            Some(other) => Err(format!("attribute `{name}` must be a boolean, got {other}")),
            None => Err(format!("missing boolean attribute `{name}`")),
        }
    }

    /// Grid axes (`array<i16: ...>`), or a message naming the attribute. A rank program keeps
    /// integer lists as one form, so `array<i64: ...>` is read as axes too.
    pub fn axes(&self, name: &str) -> Result<Vec<u16>, String> {
        match self.get(name) {
            Some(AttrValue::Axes(axes)) => Ok(axes.clone()),
            Some(AttrValue::Ints(values)) => values.iter().map(|&v| u16::try_from(v).map_err(|_| format!("attribute `{name}`: {v} is not a grid axis"))).collect(),
            Some(other) => Err(format!("attribute `{name}` must be grid axes, got {other}")),
            None => Err(format!("missing grid-axes attribute `{name}`")),
        }
    }

    /// A list of integers (`array<i64: ...>`, or grid axes), or a message naming it.
    pub fn ints(&self, name: &str) -> Result<Vec<i64>, String> {
        match self.get(name) {
            Some(AttrValue::Ints(values)) => Ok(values.clone()),
            Some(AttrValue::Axes(axes)) => Ok(axes.iter().map(|&a| i64::from(a)).collect()),
            Some(other) => Err(format!("attribute `{name}` must be a list of integers, got {other}")),
            None => Err(format!("missing integer-list attribute `{name}`")),
        }
    }

    /// A dimension (`N : index`, or an integer), or a message naming it.
    pub fn index(&self, name: &str) -> Result<usize, String> {
        match self.get(name) {
            Some(AttrValue::Index(d)) => Ok(*d),
            Some(AttrValue::Int(v)) => usize::try_from(*v).map_err(|_| format!("attribute `{name}` must be a dimension, got {v}")),
            Some(other) => Err(format!("attribute `{name}` must be a dimension, got {other}")),
            None => Err(format!("missing dimension attribute `{name}`")),
        }
    }

    /// A reduction kind, or a message naming the attribute.
    pub fn reduction(&self, name: &str) -> Result<Reduction, String> {
        match self.get(name) {
            Some(AttrValue::Reduction(r)) => Ok(*r),
            Some(other) => Err(format!("attribute `{name}` must be a reduction kind, got {other}")),
            None => Err(format!("missing reduction attribute `{name}`")),
        }
    }

    /// Iterates attributes in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &AttrValue)> {
        self.0.iter()
    }
}
