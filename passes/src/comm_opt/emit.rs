//! Emission: the function rebuilt from an extraction, ops in their original order as far as
//! dependencies allow.

use super::*;

/// Rebuilds the function from a choice, ops in their original order as far as dependencies
/// allow.
pub(super) fn emit(func: &Func, egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id], order: &HashMap<Id, f64>, original: &HashMap<(Id, Symbol), usize>, grid_name: &str) -> Result<Func, String> {
    let tables = &egraph.analysis;
    let needed = reachable(egraph, choice, roots).ok_or("the extracted program has a cycle")?;
    let chosen = |c: Id| &choice[&egraph.find(c)];
    let mut waiting: HashMap<Id, usize> = HashMap::default();
    let mut readers: HashMap<Id, Vec<Id>> = HashMap::default();
    for &c in &needed {
        let deps: HashSet<Id> = chosen(c).children.iter().map(|k| egraph.find(*k)).collect();
        waiting.insert(c, deps.len());
        for d in deps {
            readers.entry(d).or_default().push(c);
        }
    }
    let key = |c: Id| std::cmp::Reverse(((order.get(&c).copied().unwrap_or(f64::MAX / 32.0) * 16.0) as i64, usize::from(c)));
    let mut ready: BinaryHeap<(std::cmp::Reverse<(i64, usize)>, Id)> = needed.iter().filter(|c| waiting[c] == 0).map(|&c| (key(c), c)).collect();
    // Original op of each (class, symbol), to keep its attributes and location.
    let original_of: HashMap<(Id, Symbol), usize> = original.iter().map(|((id, s), i)| ((egraph.find(*id), *s), *i)).collect();

    let mut fb = FuncBuilder::new(&func.name);
    for arg in &func.args {
        let v = fb.arg_like(arg, func.ty(arg.value).clone());
        if let Some(layout) = &arg.layout {
            fb.set_layout(v, layout.clone());
        }
    }
    // FuncBuilder numbers arguments in declaration order.
    let arg_values: Vec<Value> = (0..func.args.len() as u32).map(Value).collect();
    let mut value_of: HashMap<Id, Value> = HashMap::default();
    let mut tuple_of: HashMap<Id, Vec<Value>> = HashMap::default();
    // Location and origin of what made each class: a new collective is named after its
    // operand and placed with it.
    let mut loc_of: HashMap<Id, (String, shardc_ir::facts::Origin)> = HashMap::default();
    // Bucket numbers of comm-opt's own buckets, apart from the gradient buckets' (from 0).
    let mut next_bucket: i64 = 1 << 20;
    while let Some((_, c)) = ready.pop() {
        let node = chosen(c);
        let kids: Vec<Value> = node.children.iter().filter_map(|k| value_of.get(&egraph.find(*k)).copied()).collect();
        let ty = || egraph[c].data.ty.clone().map(Type::Tensor).ok_or_else(|| "an extracted value has no type".to_string());
        let results: Vec<Value> = match &tables.kinds[&node.op] {
            Kind::Arg(i) => vec![arg_values[*i]],
            Kind::Opaque(i) => {
                let op = &func.ops[*i];
                fb.clone_op(func, op, &kids, &op.loc)
            }
            Kind::Proj(k) => {
                let tuple = tuple_of.get(&egraph.find(node.children[0])).ok_or("a projection of a value that is not a tuple")?;
                vec![tuple[*k]]
            }
            Kind::Xf { name, attrs, loc } => {
                let types = result_types(egraph, node).ok_or_else(|| format!("{}: `{name}` has no result types", tables.locs[*loc].0))?;
                let attrs = tables.attrs[*attrs].clone();
                fb.set_origin(tables.locs[*loc].1);
                fb.op_typed(name, &kids, attrs, types.into_iter().map(Type::Tensor).collect(), &tables.locs[*loc].0)
            }
            Kind::Coll { op: CollOp::Bucket, axes } => {
                // Both members staged, sent as one message, then awaited (the runtime's
                // gradient-bucket protocol).
                next_bucket += 1;
                let id = AttrValue::Int(next_bucket);
                let (name, base) = collective_attrs(CollOp::Bucket, axes, grid_name);
                let member = |loc: &str| {
                    base.clone()
                        .with("xf.async", AttrValue::Bool(true))
                        .with("xf.bucket", id.clone())
                        .with("xf.bucket_members", AttrValue::Int(2))
                        .with("xf.cause", AttrValue::Str(format!("bucketed by comm-opt with the all-reduce of `{loc}`")))
                };
                let (locs, origins): (Vec<String>, Vec<_>) = node.children.iter().map(|k| loc_of.get(&egraph.find(*k)).cloned().unwrap_or_default()).unzip();
                let types = result_types(egraph, node).ok_or("a bucket of untyped values")?;
                let sent: Vec<Value> = (0..2)
                    .map(|k| {
                        fb.set_origin(origins[k]);
                        fb.op_typed(&name, &[kids[k]], member(&locs[1 - k]), vec![Type::Tensor(types[k].clone())], &format!("{}.all_reduce", locs[k]))[0]
                    })
                    .collect();
                (0..2)
                    .map(|k| {
                        fb.set_origin(origins[k]);
                        fb.op_typed("xf.wait", &[sent[k]], Attrs::new().with("xf.bucket", id.clone()), vec![Type::Tensor(types[k].clone())], &format!("{}.all_reduce.wait", locs[k]))[0]
                    })
                    .collect()
            }
            Kind::Coll { op, axes } => {
                let (name, attrs, loc) = match original_of.get(&(c, node.op)) {
                    Some(&i) => {
                        fb.set_origin(func.ops[i].origin);
                        (func.ops[i].name.clone(), func.ops[i].attrs.clone(), func.ops[i].loc.clone())
                    }
                    None => {
                        let (name, attrs) = collective_attrs(*op, axes, grid_name);
                        let (operand, origin) = loc_of.get(&egraph.find(node.children[0])).cloned().unwrap_or_else(|| ("comm-opt".into(), Default::default()));
                        fb.set_origin(origin);
                        let loc = format!("{operand}.{}", name.trim_start_matches("shard."));
                        (name, attrs.with("xf.cause", AttrValue::Str("chosen by comm-opt".into())), loc)
                    }
                };
                fb.op_typed(&name, &kids, attrs, vec![ty()?], &loc)
            }
        };
        let made_at = match &tables.kinds[&node.op] {
            Kind::Arg(i) => (func.args[*i].name.clone(), shardc_ir::facts::Origin::of(func.args[*i].block)),
            Kind::Opaque(i) => (func.ops[*i].loc.clone(), func.ops[*i].origin),
            Kind::Xf { loc, .. } => tables.locs[*loc].clone(),
            Kind::Proj(_) | Kind::Coll { .. } => node.children.first().and_then(|k| loc_of.get(&egraph.find(*k)).cloned()).unwrap_or_default(),
        };
        loc_of.insert(c, made_at);
        if results.len() == 1 {
            value_of.insert(c, results[0]);
        } else {
            tuple_of.insert(c, results);
        }
        for r in readers.get(&c).cloned().unwrap_or_default() {
            let w = waiting.get_mut(&r).expect("every reader is needed");
            *w -= 1;
            if *w == 0 {
                ready.push((key(r), r));
            }
        }
    }
    let returns: Vec<Value> = roots.iter().map(|r| value_of.get(&egraph.find(*r)).copied().ok_or("a result was not rebuilt")).collect::<Result<_, _>>()?;
    Ok(fb.finish(&returns, &func.result_names))
}
