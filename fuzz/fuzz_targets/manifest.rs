//! Checkpoint manifests (`manifest.json`): parsing and checking never panic, and a manifest
//! that checks has layouts the loader can follow: every split names an existing grid axis
//! and cuts its dimension into equal parts, so shards tile each tensor exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_runtime::checkpoint::parse_manifest;
use shardc_runtime::collectives::MeshShape;
use shardc_runtime::layout::{local_shape, shard_count, shard_index};
use shardc_runtime::program::Layout;

fuzz_target!(|data: &[u8]| {
    let Ok(manifest) = parse_manifest(data) else { return };
    let mesh = MeshShape(manifest.mesh.clone());
    let ranks = mesh.ranks();
    assert_eq!(ranks, manifest.files.len());
    for t in &manifest.tensors {
        let layout = Layout { global_shape: t.global_shape.clone(), split: t.split.clone() };
        let local: usize = local_shape(&layout, &mesh).iter().product();
        let global: usize = t.global_shape.iter().product();
        assert_eq!(local * shard_count(&layout, &mesh), global, "{}: shards do not tile the tensor", t.name);
        // The loader asks each rank which shard it holds (a sample of ranks: meshes may have
        // a million).
        for rank in (0..ranks).step_by(ranks.div_ceil(64).max(1)) {
            assert_eq!(shard_index(&layout, &mesh, rank).len(), t.global_shape.len());
        }
    }
});
