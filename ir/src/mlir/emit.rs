//! Emission of a [`graph::Module`] as an MLIR module, its verification and printing.
//!
//! Every op is created with melior's generic `OperationBuilder`: `xf` ops are checked by the
//! IRDL verifier, `shard` ops by upstream's verifiers (which check collective shapes).
//! Function arguments carry their role and name as argument attributes, and every op a name
//! location, so a dump reads `loc("layers.3.attn.q")` next to the op.

use melior::ir::attribute::{StringAttribute, TypeAttribute};
use melior::ir::block::BlockLike;
use melior::ir::operation::{OperationBuilder, OperationLike, OperationPrintingFlags};
use melior::ir::r#type::FunctionType;
use melior::ir::{Attribute, Block, Identifier, Location, Module, Region, RegionLike, Type, Value, ValueLike};
use melior::dialect::func;

use std::collections::HashMap;

use super::context::IrContext;
use crate::attrs::AttrValue;
use crate::graph::{self, Func};
use crate::IrError;

/// An emitted MLIR module, borrowing its context.
pub struct MlirModule<'c> {
    module: Module<'c>,
}

impl std::fmt::Debug for MlirModule<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlirModule").finish_non_exhaustive()
    }
}

/// How to print a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrintStyle {
    /// Custom syntax where ops have one (IRDL ops always print generically), with locations.
    WithLocations,
    /// Same without locations (stable, compact).
    Plain,
    /// MLIR's generic form for every op, with locations.
    Generic,
}

impl<'c> MlirModule<'c> {
    /// Runs MLIR's verifier; the error carries MLIR's diagnostics.
    pub fn verify(&self, cx: &IrContext) -> Result<(), IrError> {
        let (ok, diags) = cx.collect(|| self.module.as_operation().verify());
        if ok { Ok(()) } else { Err(IrError::Mlir { what: "verifying the module".into(), diags }) }
    }

    /// Prints the module.
    pub fn print(&self, style: PrintStyle) -> String {
        let flags = match style {
            PrintStyle::WithLocations => {
                crate::ffi::print_name_loc_as_prefix(OperationPrintingFlags::new().enable_debug_info(true, false))
            }
            PrintStyle::Plain => crate::ffi::print_name_loc_as_prefix(OperationPrintingFlags::new()),
            PrintStyle::Generic => OperationPrintingFlags::new().enable_debug_info(true, false).print_generic_operation_form(),
        };
        // Printing only fails on invalid UTF-8, which our names never contain; fall back to
        // the plain printer rather than losing the dump.
        self.module.as_operation().to_string_with_flags(flags).unwrap_or_else(|_| self.module.as_operation().to_string())
    }

    /// The melior module.
    pub fn module(&self) -> &Module<'c> {
        &self.module
    }
}

/// Emits, verifies and prints `module` in one go.
pub fn print_module(cx: &IrContext, module: &graph::Module, style: PrintStyle) -> Result<String, IrError> {
    let mlir = emit(cx, module)?;
    mlir.verify(cx)?;
    Ok(mlir.print(style))
}

/// Builds the MLIR module for `module`. Fails with MLIR's diagnostics if an attribute or type
/// does not parse or an op cannot be built; does not run the verifier.
pub fn emit<'c>(cx: &'c IrContext, module: &graph::Module) -> Result<MlirModule<'c>, IrError> {
    let ctx = cx.mlir();
    let (result, diags) = cx.collect(|| -> Result<MlirModule<'c>, String> {
        let mlir = Module::new(Location::unknown(ctx));
        for grid in &module.grids {
            let shape = i64_array(&grid.shape);
            let axes = grid.axes.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>().join(", ");
            let op = OperationBuilder::new("shard.grid", Location::unknown(ctx))
                .add_attributes(&[
                    (Identifier::new(ctx, "sym_name"), StringAttribute::new(ctx, &grid.name).into()),
                    (Identifier::new(ctx, "shape"), parse_attr(cx, &shape)?),
                    (Identifier::new(ctx, "xf.axes"), parse_attr(cx, &format!("[{axes}]"))?),
                ])
                .build()
                .map_err(|e| format!("shard.grid @{}: {e}", grid.name))?;
            mlir.body().append_operation(op);
        }
        let grid = module.grids.first().map(|g| g.name.as_str());
        let mut parsed = Parsed { cx, attrs: HashMap::new(), types: HashMap::new(), sharding_type: None };
        for func in &module.funcs {
            mlir.body().append_operation(emit_func(&mut parsed, func, grid)?);
        }
        Ok(MlirModule { module: mlir })
    });
    result.map_err(|what| IrError::Mlir { what, diags })
}

fn parse_attr<'c>(cx: &'c IrContext, text: &str) -> Result<Attribute<'c>, String> {
    Attribute::parse(cx.mlir(), text).ok_or_else(|| format!("attribute `{text}` does not parse"))
}

fn parse_type<'c>(cx: &'c IrContext, ty: &graph::Type) -> Result<Type<'c>, String> {
    let text = ty.to_string();
    Type::parse(cx.mlir(), &text).ok_or_else(|| format!("type `{text}` does not parse"))
}

/// The attributes and types one emission has parsed, by their text (types by our type). A
/// deep model repeats a few dozen types and attribute texts over thousands of ops and
/// annotations, and parsing them again each time is most of what emission costs. MLIR
/// uniques attributes and types in the context, so the handle kept here is the one parsing
/// the text again would return; failures are not kept (they end the emission).
struct Parsed<'c> {
    cx: &'c IrContext,
    attrs: HashMap<String, Attribute<'c>>,
    types: HashMap<graph::Type, Type<'c>>,
    /// `!shard.sharding`, the type of every annotation's sharding.
    sharding_type: Option<Type<'c>>,
}

impl<'c> Parsed<'c> {
    fn attr(&mut self, text: &str) -> Result<Attribute<'c>, String> {
        if let Some(attr) = self.attrs.get(text) {
            return Ok(*attr);
        }
        let attr = parse_attr(self.cx, text)?;
        self.attrs.insert(text.to_string(), attr);
        Ok(attr)
    }

    fn ty(&mut self, ty: &graph::Type) -> Result<Type<'c>, String> {
        if let Some(parsed) = self.types.get(ty) {
            return Ok(*parsed);
        }
        let parsed = parse_type(self.cx, ty)?;
        self.types.insert(ty.clone(), parsed);
        Ok(parsed)
    }
}

/// MLIR syntax of an attribute value: floats always carry a decimal point (MLIR reads `1e-5`
/// as an integer followed by junk), and non-finite floats use MLIR's hex form.
fn attr_text(value: &AttrValue) -> String {
    match value {
        AttrValue::Float(v) if !v.is_finite() => format!("0x{:016X} : f64", v.to_bits()),
        AttrValue::Float(v) => {
            let mut text = format!("{v:?}");
            if !text.contains('.') {
                match text.find('e') {
                    Some(at) => text.insert_str(at, ".0"),
                    None => text.push_str(".0"),
                }
            }
            format!("{text} : f64")
        }
        other => other.to_mlir(),
    }
}

/// `array<i64: 2, 3>`, or `array<i64>` when empty (MLIR rejects `array<i64: >`).
fn i64_array(values: &[i64]) -> String {
    if values.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", values.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
    }
}

fn lookup<'c, 'a>(values: &[Option<Value<'c, 'a>>], v: graph::Value, op: &str) -> Result<Value<'c, 'a>, String> {
    values.get(v.0 as usize).copied().flatten().ok_or_else(|| format!("{op} uses undefined value {v}"))
}

/// Appends `shard.sharding` + `shard.shard` for `value` (annotated `sharding`) to `block`
/// and returns the annotated value, which later uses read instead.
fn annotate<'c, 'a>(
    parsed: &mut Parsed<'c>,
    block: &'a Block<'c>,
    grid: &str,
    value: Value<'c, 'a>,
    sharding: &crate::sharding::Sharding,
    loc: Location<'c>,
) -> Result<Value<'c, 'a>, String> {
    let ctx = parsed.cx.mlir();
    let sharding_type = match parsed.sharding_type {
        Some(ty) => ty,
        None => *parsed.sharding_type.insert(Type::parse(ctx, "!shard.sharding").ok_or("no !shard.sharding type")?),
    };
    let sharding_op = OperationBuilder::new("shard.sharding", loc)
        .add_attributes(&[
            (Identifier::new(ctx, "grid"), parsed.attr(&format!("@{grid}"))?),
            (Identifier::new(ctx, "split_axes"), parsed.attr(&sharding.split_axes_attr())?),
            (Identifier::new(ctx, "operandSegmentSizes"), parsed.attr("array<i32: 0, 0>")?),
            (Identifier::new(ctx, "static_halo_sizes"), parsed.attr("array<i64>")?),
            (Identifier::new(ctx, "static_sharded_dims_offsets"), parsed.attr("array<i64>")?),
        ])
        .add_results(&[sharding_type])
        .build()
        .map_err(|e| format!("shard.sharding: {e}"))?;
    let sharding_op = block.append_operation(sharding_op);
    let sharding_value: Value = sharding_op.result(0).map_err(|e| e.to_string())?.into();
    let mut attrs = Vec::new();
    if !sharding.partial.is_empty() {
        let axes = sharding.partial.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ");
        attrs.push((Identifier::new(ctx, "xf.partial"), parsed.attr(&format!("array<i16: {axes}>"))?));
    }
    let shard_op = OperationBuilder::new("shard.shard", loc)
        .add_operands(&[value, sharding_value])
        .add_results(&[value.r#type()])
        .add_attributes(&attrs)
        .build()
        .map_err(|e| format!("shard.shard: {e}"))?;
    Ok(block.append_operation(shard_op).result(0).map_err(|e| e.to_string())?.into())
}

fn emit_func<'c>(parsed: &mut Parsed<'c>, func: &Func, grid: Option<&str>) -> Result<melior::ir::Operation<'c>, String> {
    let cx = parsed.cx;
    let ctx = cx.mlir();
    let loc = |name: &str| Location::name(ctx, name, Location::unknown(ctx));
    let arg_types = func.args.iter().map(|a| parsed.ty(func.ty(a.value))).collect::<Result<Vec<_>, _>>()?;
    let result_types = func.returns.iter().map(|v| parsed.ty(func.ty(*v))).collect::<Result<Vec<_>, _>>()?;
    let block = Block::new(&arg_types.iter().zip(&func.args).map(|(t, a)| (*t, loc(&a.name))).collect::<Vec<_>>());
    {
        // Maps our value numbers to MLIR values; scoped so the block can move into the region.
        let mut values: Vec<Option<Value<'c, '_>>> = vec![None; func.types.len()];
        let annotation = |v: graph::Value| match (grid, func.shardings.get(&v)) {
            (Some(grid), Some(s)) => Some((grid, s)),
            _ => None,
        };
        for (i, arg) in func.args.iter().enumerate() {
            let mut value: Value = block.argument(i).map_err(|e| e.to_string())?.into();
            if let Some((grid, s)) = annotation(arg.value) {
                value = annotate(parsed, &block, grid, value, s, loc(&arg.name))?;
            }
            values[arg.value.0 as usize] = Some(value);
        }
        for op in &func.ops {
            let operands = op.operands.iter().map(|v| lookup(&values, *v, &op.name)).collect::<Result<Vec<_>, _>>()?;
            let results = op.results.iter().map(|v| parsed.ty(func.ty(*v))).collect::<Result<Vec<_>, _>>()?;
            let attrs = op
                .attrs
                .iter()
                .map(|(name, value)| Ok((Identifier::new(ctx, name), parsed.attr(&attr_text(value))?)))
                .collect::<Result<Vec<_>, String>>()?;
            let built = OperationBuilder::new(&op.name, loc(&op.loc))
                .add_operands(&operands)
                .add_results(&results)
                .add_attributes(&attrs)
                .build()
                .map_err(|e| format!("{} at {}: {e}", op.name, op.loc))?;
            let built = block.append_operation(built);
            for (i, v) in op.results.iter().enumerate() {
                let mut value: Value = built.result(i).map_err(|e| e.to_string())?.into();
                if let Some((grid, s)) = annotation(*v) {
                    value = annotate(parsed, &block, grid, value, s, loc(&op.loc))?;
                }
                values[v.0 as usize] = Some(value);
            }
        }
        let returns = func.returns.iter().map(|v| lookup(&values, *v, "return")).collect::<Result<Vec<_>, _>>()?;
        block.append_operation(func::r#return(&returns, Location::unknown(ctx)));
    }
    let region = Region::new();
    region.append_block(block);
    let arg_attrs: Vec<String> = func
        .args
        .iter()
        .map(|a| {
            // A padded tensor: the real extent inside it.
            let padded = a.unpadded.as_ref().map_or(String::new(), |u| format!(", xf.unpadded_shape = {}", i64_array(u)));
            match &a.layout {
                // A shard of a global tensor: say which, and how it is split.
                Some(l) => format!(
                    "{{{} = {:?}, xf.global_shape = {}, xf.split_axes = {:?}{padded}}}",
                    a.role.attr_name(),
                    a.name,
                    i64_array(&l.global_shape),
                    l.sharding.to_string()
                ),
                None => format!("{{{} = {:?}{padded}}}", a.role.attr_name(), a.name),
            }
        })
        .collect();
    let res_attrs: Vec<String> = (0..func.returns.len())
        .map(|i| format!("{{xf.result = {:?}}}", func.result_names.get(i).map_or("", String::as_str)))
        .collect();
    Ok(func::func(
        ctx,
        StringAttribute::new(ctx, &func.name),
        TypeAttribute::new(FunctionType::new(ctx, &arg_types, &result_types).into()),
        region,
        &[
            (Identifier::new(ctx, "arg_attrs"), parse_attr(cx, &format!("[{}]", arg_attrs.join(", ")))?),
            (Identifier::new(ctx, "res_attrs"), parse_attr(cx, &format!("[{}]", res_attrs.join(", ")))?),
        ],
        Location::unknown(ctx),
    ))
}
