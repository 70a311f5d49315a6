//! Op attributes as plain data, with typed getters that fail with a message instead of panicking.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// One attribute value. `Raw` holds MLIR attribute syntax for attributes that have no plain
/// Rust form (symbol references, dense arrays of the `shard` dialect).
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
    /// Verbatim MLIR attribute syntax.
    Raw(String),
}

impl AttrValue {
    /// MLIR attribute syntax for this value.
    pub fn to_mlir(&self) -> String {
        match self {
            AttrValue::Int(v) => format!("{v} : i64"),
            // `{:?}` keeps a decimal point or exponent so MLIR reads a float, and round-trips.
            AttrValue::Float(v) => format!("{v:?} : f64"),
            AttrValue::Bool(v) => v.to_string(),
            AttrValue::Str(s) => format!("{s:?}"),
            AttrValue::Raw(s) => s.clone(),
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

    /// Iterates attributes in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &AttrValue)> {
        self.0.iter()
    }
}
