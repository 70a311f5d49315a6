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
use melior::ir::{Attribute, Block, Identifier, Location, Module, Region, RegionLike, Type, Value};
use melior::dialect::func;

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
            let shape = grid.shape.iter().map(i64::to_string).collect::<Vec<_>>().join(", ");
            let op = OperationBuilder::new("shard.grid", Location::unknown(ctx))
                .add_attributes(&[
                    (Identifier::new(ctx, "sym_name"), StringAttribute::new(ctx, &grid.name).into()),
                    (Identifier::new(ctx, "shape"), parse_attr(cx, &format!("array<i64: {shape}>"))?),
                ])
                .build()
                .map_err(|e| format!("shard.grid @{}: {e}", grid.name))?;
            mlir.body().append_operation(op);
        }
        for func in &module.funcs {
            mlir.body().append_operation(emit_func(cx, func)?);
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

fn lookup<'c, 'a>(values: &[Option<Value<'c, 'a>>], v: graph::Value, op: &str) -> Result<Value<'c, 'a>, String> {
    values.get(v.0 as usize).copied().flatten().ok_or_else(|| format!("{op} uses undefined value {v}"))
}

fn emit_func<'c>(cx: &'c IrContext, func: &Func) -> Result<melior::ir::Operation<'c>, String> {
    let ctx = cx.mlir();
    let loc = |name: &str| Location::name(ctx, name, Location::unknown(ctx));
    let arg_types = func.args.iter().map(|a| parse_type(cx, func.ty(a.value))).collect::<Result<Vec<_>, _>>()?;
    let result_types = func.returns.iter().map(|v| parse_type(cx, func.ty(*v))).collect::<Result<Vec<_>, _>>()?;
    let block = Block::new(&arg_types.iter().zip(&func.args).map(|(t, a)| (*t, loc(&a.name))).collect::<Vec<_>>());
    {
        // Maps our value numbers to MLIR values; scoped so the block can move into the region.
        let mut values: Vec<Option<Value<'c, '_>>> = vec![None; func.types.len()];
        for (i, arg) in func.args.iter().enumerate() {
            values[arg.value.0 as usize] = Some(block.argument(i).map_err(|e| e.to_string())?.into());
        }
        for op in &func.ops {
            let operands = op.operands.iter().map(|v| lookup(&values, *v, &op.name)).collect::<Result<Vec<_>, _>>()?;
            let results = op.results.iter().map(|v| parse_type(cx, func.ty(*v))).collect::<Result<Vec<_>, _>>()?;
            let attrs = op
                .attrs
                .iter()
                .map(|(name, value)| Ok((Identifier::new(ctx, name), parse_attr(cx, &attr_text(value))?)))
                .collect::<Result<Vec<_>, String>>()?;
            let built = OperationBuilder::new(&op.name, loc(&op.loc))
                .add_operands(&operands)
                .add_results(&results)
                .add_attributes(&attrs)
                .build()
                .map_err(|e| format!("{} at {}: {e}", op.name, op.loc))?;
            let built = block.append_operation(built);
            for (i, v) in op.results.iter().enumerate() {
                values[v.0 as usize] = Some(built.result(i).map_err(|e| e.to_string())?.into());
            }
        }
        let returns = func.returns.iter().map(|v| lookup(&values, *v, "return")).collect::<Result<Vec<_>, _>>()?;
        block.append_operation(func::r#return(&returns, Location::unknown(ctx)));
    }
    let region = Region::new();
    region.append_block(block);
    let arg_attrs: Vec<String> = func.args.iter().map(|a| format!("{{{} = {:?}}}", a.role.attr_name(), a.name)).collect();
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
