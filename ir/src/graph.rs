//! Functions as plain Rust data: the form passes read and rewrite.
//!
//! A [`Module`] mirrors the MLIR module op for op (`xf` ops, and the `shard` ops that later
//! passes insert); [`crate::mlir`] turns it into a real MLIR module, which is verified and
//! printed after every pass. Keeping passes on owned data means no MLIR handle outlives a
//! rewrite (see STYLE.md section 8), and a pass is ordinary Rust that can be unit-tested.
//!
//! Values are numbered in definition order within a function: arguments first, then op
//! results. A function is in SSA form; [`crate::verify`] checks it.

use std::collections::HashSet;
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::attrs::Attrs;
use crate::facts::{Block, Origin, ParamKind};
use crate::ops;
use crate::types::TensorTy;

/// An SSA value of one function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Value(pub u32);

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Type of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Type {
    /// A static ranked tensor.
    Tensor(TensorTy),
    /// `!shard.sharding`, the result of `shard.sharding`.
    Sharding,
}

impl Type {
    /// The tensor type, if this is one.
    pub fn as_tensor(&self) -> Option<&TensorTy> {
        match self {
            Type::Tensor(t) => Some(t),
            Type::Sharding => None,
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Tensor(t) => t.fmt(f),
            Type::Sharding => f.write_str("!shard.sharding"),
        }
    }
}

/// What a function argument is; printed as an argument attribute (`{xf.param = "name"}`) so
/// the role and name survive a round trip through MLIR text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgRole {
    /// A trainable parameter.
    Param,
    /// Data fed per step (tokens, targets, the step counter).
    Input,
    /// Optimizer state (Adam moments), updated in place by the training step.
    OptState,
    /// The fp32 master copy of a bf16 parameter (mixed precision), named
    /// `opt.master.<parameter>`: it starts as the parameter's value, the optimizer updates it,
    /// and the parameter is its rounded copy.
    Master,
}

impl ArgRole {
    /// Whether the argument is state a run carries from step to step (and checkpoints
    /// keep): parameters, their master copies, optimizer state.
    pub fn is_state(self) -> bool {
        matches!(self, ArgRole::Param | ArgRole::OptState | ArgRole::Master)
    }

    /// Name of the argument attribute that carries this role.
    pub fn attr_name(self) -> &'static str {
        match self {
            ArgRole::Param => "xf.param",
            ArgRole::Input => "xf.input",
            ArgRole::OptState => "xf.opt_state",
            ArgRole::Master => "xf.master",
        }
    }
}

/// One function argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FuncArg {
    /// The SSA value of the argument.
    pub value: Value,
    /// Stable name, e.g. `layers.3.attn.q.weight` or `tokens`.
    pub name: String,
    /// Parameter or input.
    pub role: ArgRole,
    /// In a partitioned function: the global tensor this argument is this rank's shard of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<ArgLayout>,
    /// For a tensor padded beyond the model's own size (a vocabulary padded for tensor
    /// parallelism): the real tensor's extent in each dimension of the global shape, at its
    /// start. The rest is padding: zero in parameters and never read as data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpadded: Option<Vec<i64>>,
    /// The part of the model a parameter (or its optimizer state) belongs to.
    #[serde(default)]
    pub block: Block,
    /// How tensor parallelism may split a parameter, as the model declares it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ParamKind>,
}

/// The global shape and sharding of a partitioned argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArgLayout {
    /// Shape of the whole tensor.
    pub global_shape: Vec<i64>,
    /// How it is split over the grid.
    pub sharding: crate::sharding::Sharding,
}

/// One operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Full op name, e.g. `xf.matmul` or `shard.all_reduce`.
    pub name: String,
    /// Operands, in order.
    pub operands: Vec<Value>,
    /// Results, in order.
    pub results: Vec<Value>,
    /// Attributes.
    pub attrs: Attrs,
    /// Where in the model the op comes from, e.g. `layers.3.attn.q` (an MLIR name location),
    /// for people: passes read [`Op::origin`].
    pub loc: String,
    /// Where it comes from, as facts passes read.
    #[serde(default)]
    pub origin: Origin,
}

/// A function: arguments, a straight-line body and returned values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Func {
    /// Symbol name, e.g. `forward`.
    pub name: String,
    /// Arguments, in order.
    pub args: Vec<FuncArg>,
    /// Body ops in program order.
    pub ops: Vec<Op>,
    /// Returned values.
    pub returns: Vec<Value>,
    /// Name of each returned value (`loss`, `layers.0.attn.q.weight`, ...), printed as
    /// result attributes so that a caller can match results to state.
    pub result_names: Vec<String>,
    /// Type of each value, indexed by `Value.0`.
    pub types: Vec<Type>,
    /// How values are laid out over the grid, once a sharding pass has annotated them
    /// (printed as `shard.sharding` + `shard.shard` after each annotated value).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shardings: BTreeMap<Value, crate::sharding::Sharding>,
    /// Layouts a strategy demands for op results (sequence parallelism pins the residual
    /// stream); propagation honours them and partitioning reshards right after the op.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub constraints: BTreeMap<Value, crate::sharding::Sharding>,
}

impl Func {
    /// Type of a value.
    pub fn ty(&self, value: Value) -> &Type {
        &self.types[value.0 as usize]
    }

    /// Tensor type of a value; `None` for non-tensor values (and unknown ones).
    pub fn tensor(&self, value: Value) -> Option<&TensorTy> {
        self.types.get(value.0 as usize).and_then(Type::as_tensor)
    }

    /// The arguments with the given role.
    pub fn args_with(&self, role: ArgRole) -> impl Iterator<Item = &FuncArg> {
        self.args.iter().filter(move |a| a.role == role)
    }

    /// Number of scalar parameters of the model (elements of every `Param` argument; of a
    /// padded one, its real elements). In a partitioned function, per rank: a shard of a
    /// padded table counts its share of the real elements (local x real / padded global).
    pub fn parameter_count(&self) -> u64 {
        let product = |shape: &[i64]| shape.iter().map(|&d| d.max(0) as u64).fold(1u64, u64::saturating_mul);
        self.args_with(ArgRole::Param)
            .filter_map(|a| {
                let local = self.tensor(a.value).map(TensorTy::num_elements);
                match (&a.unpadded, &a.layout, local) {
                    (Some(real), Some(layout), Some(local)) => {
                        let global = product(&layout.global_shape).max(1);
                        Some((local as u128 * product(real) as u128 / global as u128) as u64)
                    }
                    (Some(real), _, _) => Some(product(real)),
                    (None, _, local) => local,
                }
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Parameters one token's forward pass uses: [`Func::parameter_count`] less the experts a
    /// router does not choose. Each MoE layer's expert weights (`[experts, in, out]`, read by
    /// `xf.expert_matmul`) count `top_k / experts` of themselves, read from the layer's
    /// `xf.moe_route`; the model FLOPs of MoE models count these (Mixtral-8x7B: 12.9 of 46.7
    /// billion).
    pub fn active_parameter_count(&self) -> u64 {
        let total = self.parameter_count();
        let route = self.ops.iter().find(|o| o.name == "xf.moe_route");
        let Some((top_k, experts)) = route.and_then(|o| Some((o.attrs.int("top_k").ok()?, self.tensor(o.operands[0])?.shape.get(2).copied()?))) else {
            return total;
        };
        let expert_weights: HashSet<Value> = self.ops.iter().filter(|o| o.name == "xf.expert_matmul").filter_map(|o| o.operands.get(1).copied()).collect();
        let unchosen: u128 = self
            .args_with(ArgRole::Param)
            .filter(|a| expert_weights.contains(&a.value))
            .filter_map(|a| self.tensor(a.value).map(|t| t.num_elements() as u128 * (experts - top_k).max(0) as u128 / experts.max(1) as u128))
            .sum();
        total.saturating_sub(u64::try_from(unchosen).unwrap_or(u64::MAX))
    }

    /// How many ops of each name the body holds.
    pub fn op_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for op in &self.ops {
            *counts.entry(op.name.clone()).or_insert(0) += 1;
        }
        counts
    }

    /// Summed cost of every registered op of the body (`shard` ops have none here).
    pub fn cost(&self) -> ops::Cost {
        let mut total = ops::Cost::default();
        for op in &self.ops {
            let Some(def) = ops::lookup(&op.name) else { continue };
            let inputs: Vec<&TensorTy> = op.operands.iter().filter_map(|v| self.tensor(*v)).collect();
            let outputs: Vec<TensorTy> = op.results.iter().filter_map(|v| self.tensor(*v).cloned()).collect();
            total += def.cost(&inputs, &outputs, &op.attrs);
        }
        total
    }
}

/// A `shard.grid`: a named device mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grid {
    /// Symbol name, e.g. `mesh`.
    pub name: String,
    /// Extent of each grid axis.
    pub shape: Vec<i64>,
    /// Name of each axis (`dp`, `tp`, `pp`), printed as the grid's `xf.axes` attribute.
    #[serde(default)]
    pub axes: Vec<String>,
}

/// A module: grids, then functions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Module {
    /// Device meshes.
    pub grids: Vec<Grid>,
    /// Functions.
    pub funcs: Vec<Func>,
    /// Reports passes leave for the user (pass name -> JSON), e.g. what `comm-opt` saved.
    /// Not part of the IR: MLIR never sees them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub notes: BTreeMap<String, String>,
}

impl Module {
    /// The function called `name`.
    pub fn func(&self, name: &str) -> Option<&Func> {
        self.funcs.iter().find(|f| f.name == name)
    }
}

/// Error from building an op whose operands break its shape rule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{loc}: `{op}`: {reason}")]
pub struct BuildError {
    /// Location name of the op being built.
    pub loc: String,
    /// Op name.
    pub op: String,
    /// What is wrong.
    pub reason: String,
}

/// Builds a [`Func`] op by op, inferring result types from the op registry.
#[derive(Debug)]
pub struct FuncBuilder {
    func: Func,
    /// The origin of the ops and the block of the arguments added next.
    origin: Origin,
}

impl FuncBuilder {
    /// Starts an empty function.
    pub fn new(name: &str) -> Self {
        FuncBuilder {
            func: Func {
                name: name.to_string(),
                args: Vec::new(),
                ops: Vec::new(),
                returns: Vec::new(),
                result_names: Vec::new(),
                types: Vec::new(),
                shardings: BTreeMap::new(),
                constraints: BTreeMap::new(),
            },
            origin: Origin::default(),
        }
    }

    /// Sets the origin of the ops (and the block of the arguments) added from now on.
    pub fn set_origin(&mut self, origin: Origin) {
        self.origin = origin;
    }

    /// The origin ops added now get.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// Declares how tensor parallelism may split the argument `value` (searched from the
    /// end, as [`FuncBuilder::set_layout`]).
    pub fn set_kind(&mut self, value: Value, kind: ParamKind) {
        if let Some(arg) = self.func.args.iter_mut().rev().find(|a| a.value == value) {
            arg.kind = Some(kind);
        }
    }

    fn fresh(&mut self, ty: Type) -> Value {
        self.func.types.push(ty);
        Value(self.func.types.len() as u32 - 1)
    }

    /// Adds an argument.
    pub fn arg(&mut self, name: &str, ty: TensorTy, role: ArgRole) -> Value {
        let value = self.fresh(Type::Tensor(ty));
        self.func.args.push(FuncArg { value, name: name.to_string(), role, layout: None, unpadded: None, block: self.origin.block, kind: None });
        value
    }

    /// Adds a registered `xf` op with one result; its type comes from the op's shape rule.
    pub fn op(&mut self, name: &str, operands: &[Value], attrs: Attrs, loc: &str) -> Result<Value, BuildError> {
        let results = self.op_multi(name, operands, attrs, loc)?;
        match results[..] {
            [result] => Ok(result),
            _ => Err(BuildError { loc: loc.to_string(), op: name.to_string(), reason: format!("has {} results; use op_multi", results.len()) }),
        }
    }

    /// Adds a registered `xf` op with any number of results.
    pub fn op_multi(&mut self, name: &str, operands: &[Value], attrs: Attrs, loc: &str) -> Result<Vec<Value>, BuildError> {
        let error = |reason: String| BuildError { loc: loc.to_string(), op: name.to_string(), reason };
        let def = ops::lookup(name).ok_or_else(|| error("not a registered xf op".into()))?;
        let inputs = operands
            .iter()
            .map(|v| self.func.tensor(*v).ok_or_else(|| error(format!("operand {v} is not a tensor"))))
            .collect::<Result<Vec<_>, _>>()?;
        let types = def.infer(&inputs, &attrs).map_err(error)?;
        let results: Vec<Value> = types.into_iter().map(|t| self.fresh(Type::Tensor(t))).collect();
        self.func.ops.push(Op { name: name.to_string(), operands: operands.to_vec(), results: results.clone(), attrs, loc: loc.to_string(), origin: self.origin });
        Ok(results)
    }

    /// Copies `op` (any op) with new operands and location, and its origin; result types
    /// are copied from `source`, the function `op` belongs to.
    pub fn clone_op(&mut self, source: &Func, op: &Op, operands: &[Value], loc: &str) -> Vec<Value> {
        let types = op.results.iter().map(|v| source.ty(*v).clone()).collect();
        let current = std::mem::replace(&mut self.origin, op.origin);
        let results = self.op_typed(&op.name, operands, op.attrs.clone(), types, loc);
        self.origin = current;
        results
    }

    /// Adds an argument of any type and role.
    pub fn arg_typed(&mut self, name: &str, ty: Type, role: ArgRole) -> Value {
        let value = self.fresh(ty);
        self.func.args.push(FuncArg { value, name: name.to_string(), role, layout: None, unpadded: None, block: self.origin.block, kind: None });
        value
    }

    /// Adds an argument like `arg` (its name, role, padding, block and kind; not its layout)
    /// of type `ty`: how a pass that rebuilds a function carries its arguments over.
    pub fn arg_like(&mut self, arg: &FuncArg, ty: Type) -> Value {
        let value = self.arg_typed(&arg.name, ty, arg.role);
        self.set_unpadded(value, arg.unpadded.clone());
        if let Some(new) = self.func.args.last_mut() {
            new.block = arg.block;
            new.kind = arg.kind;
        }
        value
    }

    /// Marks the argument `value` as padded beyond `unpadded` (see [`FuncArg::unpadded`]);
    /// searched from the end, as [`FuncBuilder::set_layout`].
    pub fn set_unpadded(&mut self, value: Value, unpadded: Option<Vec<i64>>) {
        if let Some(arg) = self.func.args.iter_mut().rev().find(|a| a.value == value) {
            arg.unpadded = unpadded;
        }
    }

    /// Sets the layout of the argument `value`. Searched from the end: callers set it right
    /// after adding the argument, which keeps building a function linear in its arguments.
    pub fn set_layout(&mut self, value: Value, layout: ArgLayout) {
        if let Some(arg) = self.func.args.iter_mut().rev().find(|a| a.value == value) {
            arg.layout = Some(layout);
        }
    }

    /// Adds an op with explicit result types (ops outside the registry, such as `shard` ops).
    pub fn op_typed(&mut self, name: &str, operands: &[Value], attrs: Attrs, results: Vec<Type>, loc: &str) -> Vec<Value> {
        let results: Vec<Value> = results.into_iter().map(|t| self.fresh(t)).collect();
        self.func.ops.push(Op { name: name.to_string(), operands: operands.to_vec(), results: results.clone(), attrs, loc: loc.to_string(), origin: self.origin });
        results
    }

    /// Tensor type of a value built so far.
    pub fn tensor(&self, value: Value) -> Option<&TensorTy> {
        self.func.tensor(value)
    }

    /// Finishes the function, returning `values` under `names` (one per value).
    pub fn finish(mut self, values: &[Value], names: &[String]) -> Func {
        debug_assert_eq!(values.len(), names.len());
        self.func.returns = values.to_vec();
        self.func.result_names = names.to_vec();
        // Arguments read parameters first, then optimizer state, then per-step inputs,
        // whatever order they were declared in; value numbers do not depend on it.
        self.func.args.sort_by_key(|a| match a.role {
            ArgRole::Param => 0,
            ArgRole::Master | ArgRole::OptState => 1,
            ArgRole::Input => 2,
        });
        self.func
    }
}
