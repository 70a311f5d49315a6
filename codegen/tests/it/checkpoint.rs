//! Checkpoints read shard by shard: what one process of a multi-process run resumes from
//! (`checkpoint::load_own_shards`, which reads only the rank files holding its shards and
//! never assembles a tensor) equals the shard cut from the whole checkpoint assembled in
//! memory (`load_sharded`), for every rank of every mesh, whatever mesh, padding, ZeRO stage
//! or precision the checkpoint was saved with.

use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::checkpoint::{load_own_shards, load_sharded, save_sharded};
use shardc_runtime::collectives::MeshShape;
use shardc_runtime::program::Role;
use shardc_runtime::train::TrainState;
use shardc_runtime::Program;

use crate::common::*;

/// An AdamW training step of `name` in `dtype` (bf16 keeps fp32 masters) on `mesh`, its
/// vocabulary padded to a multiple of `vocab_multiple` per tensor-parallel rank.
fn program(name: &str, dtype: &str, mesh: Mesh, zero: u8, vocab_multiple: u64) -> Program {
    let mut spec = spec_with_dtype(name, dtype);
    spec.training.micro_batch = 4;
    spec.model.vocab_multiple = vocab_multiple;
    let padded_vocab = spec.model.padded_vocab(mesh.tp);
    let mut module = shardc_ir::spec::lower(&spec, shardc_ir::spec::StepShape { rows: spec.training.micro_batch, padded_vocab, sequence_chunks: 1 }).unwrap();
    let options = CompileOptions {
        optimizer: OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 },
        mesh,
        zero,
        vocab: padded_vocab as i64,
        kv_heads: spec.model.kv_heads() as i64,
        ..Default::default()
    };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {mesh}: {e:?}"));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
}

/// A folder under the system's temporary folder, removed when dropped.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("shardc-it-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A state for `program` whose every element differs (a function of the tensor's name and
/// the element's index), at step 7.
fn distinct_state(program: &Program) -> TrainState {
    let mut tensors = std::collections::BTreeMap::new();
    for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
        let global = a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone());
        let shape = a.logical_shape(&global);
        let salt = a.name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)) % 1000;
        let values = (0..shape.iter().product::<usize>()).map(|i| salt as f64 + i as f64 * 1e-3).collect();
        tensors.insert(a.name.clone(), (shape, values));
    }
    TrainState { step: 7, tensors }
}

#[test]
fn own_shards_equal_the_shards_of_the_assembled_checkpoint() {
    let meshes = [Mesh::default(), Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }];
    // (model, saved with: dtype, mesh, ZeRO stage; resumed with: dtype, ZeRO stage).
    let cases = [
        ("tiny-llama", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 3u8, "f32", 0u8),
        ("tiny-llama", "bf16", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, "f32", 3),
        ("tiny", "f32", Mesh::default(), 0, "bf16", 1),
        ("tiny", "bf16", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 1, "bf16", 0),
    ];
    for (name, saved_dtype, saved_mesh, saved_zero, dtype, zero) in cases {
        // A vocabulary padded per tensor-parallel rank (256 classes: 258 rows at tp=2 with a
        // multiple of 3), so the checkpoint's padding and the resuming program's differ.
        let saved_program = program(name, saved_dtype, saved_mesh, saved_zero, 3);
        let dir = TempDir::new();
        save_sharded(dir.path(), &distinct_state(&saved_program), std::slice::from_ref(&saved_program), serde_json::Value::Null, 1, None, None).unwrap();
        let (_, whole) = load_sharded(dir.path()).unwrap();
        for mesh in meshes {
            let what = format!("{name} saved {saved_dtype} {saved_mesh} ZeRO-{saved_zero}, read {dtype} {mesh} ZeRO-{zero}");
            let program = program(name, dtype, mesh, zero, 3);
            let grid = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
            let ranks: Vec<usize> = (0..grid.ranks()).collect();
            let (manifest, own) = load_own_shards(dir.path(), &program, &grid, &ranks).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(manifest.step, 7, "{what}");
            for (rank, shards) in own.iter().enumerate() {
                for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
                    let global_shape = a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone());
                    let global = whole.for_program(a, &global_shape).unwrap();
                    let expected = match &a.layout {
                        Some(layout) => shardc_runtime::layout::local_shard(&global, layout, &grid, rank),
                        None => global,
                    };
                    assert_eq!(shards.get(&a.name), Some(&expected), "{what}: rank {rank}'s `{}`", a.name);
                }
            }
        }
    }
}

/// A rank file changed after it was written is refused when a process reads a shard from
/// it, naming the file; one whose header is cut short too.
#[test]
fn own_shards_refuse_a_changed_rank_file() {
    let saved = program("tiny", "f32", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, 1);
    let dir = TempDir::new();
    let folder = save_sharded(dir.path(), &distinct_state(&saved), std::slice::from_ref(&saved), serde_json::Value::Null, 1, None, None).unwrap();
    let file = folder.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let single = program("tiny", "f32", Mesh::default(), 0, 1);
    let error = load_own_shards(dir.path(), &single, &MeshShape(vec![1]), &[0]).unwrap_err().to_string();
    assert!(error.contains("rank-00001.safetensors: the file changed after it was written"), "{error}");
    std::fs::write(&file, &bytes[..20]).unwrap();
    let error = load_own_shards(dir.path(), &single, &MeshShape(vec![1]), &[0]).unwrap_err().to_string();
    assert!(error.contains("rank-00001.safetensors: not a safetensors file"), "{error}");
}

/// Hostile rank files and manifests (CRCs made to match, as a careful forger would) are
/// refused by a process reading its shards, naming the file or field, as the CPU's whole
/// read refuses them: a tensor the manifest does not list, bytes past the data, offsets past
/// the end of memory, an unpadded shape outside the global one.
#[test]
fn own_shards_refuse_forged_rank_files_and_manifests() {
    let saved = program("tiny", "f32", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, 1);
    let single = program("tiny", "f32", Mesh::default(), 0, 1);
    let read = |dir: &std::path::Path| load_own_shards(dir, &single, &MeshShape(vec![1]), &[0]).map(|_| ()).unwrap_err().to_string();
    // Rewrites rank 1's file as `edit` makes it and the manifest's checksum to match; `manifest`
    // edits the manifest too.
    let forge = |edit: &dyn Fn(Vec<u8>) -> Vec<u8>, manifest: &dyn Fn(&mut serde_json::Value)| {
        let dir = TempDir::new();
        let folder = save_sharded(dir.path(), &distinct_state(&saved), std::slice::from_ref(&saved), serde_json::Value::Null, 1, None, None).unwrap();
        let file = folder.join("rank-00001.safetensors");
        let bytes = edit(std::fs::read(&file).unwrap());
        std::fs::write(&file, &bytes).unwrap();
        let path = folder.join("manifest.json");
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["checksums"][1] = serde_json::json!(crc32fast_hash(&bytes));
        manifest(&mut json);
        std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
        dir
    };
    let header_of = |bytes: &[u8]| -> (serde_json::Map<String, serde_json::Value>, Vec<u8>) {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), bytes[8 + n..].to_vec())
    };
    let with_header = |header: &serde_json::Map<String, serde_json::Value>, data: &[u8]| -> Vec<u8> {
        let text = serde_json::to_vec(header).unwrap();
        [&(text.len() as u64).to_le_bytes()[..], &text, data].concat()
    };
    let unlisted = forge(
        &|bytes| {
            let (mut header, mut data) = header_of(&bytes);
            header.insert("bogus".into(), serde_json::json!({"dtype": "F64", "shape": [1], "data_offsets": [data.len(), data.len() + 8]}));
            data.extend(1.0f64.to_le_bytes());
            with_header(&header, &data)
        },
        &|_| {},
    );
    let error = read(unlisted.path());
    assert!(error.contains("rank-00001.safetensors: holds `bogus`, which the manifest does not list"), "{error}");
    let trailing = forge(&|bytes| [bytes, vec![0; 64]].concat(), &|_| {});
    let error = read(trailing.path());
    assert!(error.contains("rank-00001.safetensors: not a safetensors file"), "{error}");
    let wrapping = forge(
        &|bytes| {
            let (mut header, data) = header_of(&bytes);
            let name = header.keys().find(|k| *k != "__metadata__").unwrap().clone();
            header[&name]["data_offsets"] = serde_json::json!([u64::MAX - 2255, u64::MAX - 207]);
            with_header(&header, &data)
        },
        &|_| {},
    );
    let error = read(wrapping.path());
    assert!(error.contains("rank-00001.safetensors: not a safetensors file"), "{error}");
    let outside = forge(&|bytes| bytes, &|json| json["tensors"][0]["unpadded"] = serde_json::json!([1 << 20, 1 << 20]));
    let error = read(outside.path());
    assert!(error.contains("`tensors[0].unpadded`") && error.contains("outside its global shape"), "{error}");
}

fn crc32fast_hash(bytes: &[u8]) -> u32 {
    // CRC-32 (IEEE), as the manifest's checksums are: bit by bit, independent of the crate.
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}
