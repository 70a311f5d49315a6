//! Initialisation by global index: a rank's shard made element by element equals the shard
//! of the whole initialised tensor, on every layout (split over one axis or two, replicated,
//! a padded vocabulary, a master copy), so a process of a large model need not make the
//! whole tensor.

use shardc_runtime::collectives::MeshShape;
use shardc_runtime::init::{init_binding, init_shard};
use shardc_runtime::layout::local_shard;
use shardc_runtime::program::{Binding, Layout, Role};

#[test]
fn shards_made_from_global_indices_equal_shards_of_the_whole_tensor() {
    let mesh = MeshShape(vec![2, 2, 2]);
    let cases: Vec<(&str, Role, Vec<usize>, Vec<Vec<usize>>, Option<Vec<usize>>)> = vec![
        ("layers.0.attn.q.weight", Role::Param, vec![8, 12], vec![vec![], vec![1]], None),
        ("layers.1.mlp.down.weight", Role::Param, vec![16, 8], vec![vec![1, 0], vec![]], None),
        ("layers.0.ln1.norm.weight", Role::Param, vec![8], vec![vec![0]], None),
        ("layers.0.attn.q.bias", Role::Param, vec![12], vec![vec![1]], None),
        ("embed.weight", Role::Param, vec![12, 4], vec![vec![1], vec![0]], Some(vec![10, 4])),
        ("opt.master.embed.weight", Role::Master, vec![12, 4], vec![vec![1, 0], vec![]], Some(vec![9, 3])),
        ("head.weight", Role::Param, vec![6, 4], vec![vec![], vec![]], None),
    ];
    for (name, role, shape, split, unpadded) in cases {
        let binding = Binding { name: name.into(), buffer: 0, role: Some(role), layout: Some(Layout { global_shape: shape.clone(), split }), unpadded: unpadded.map(|mut u| {
            u.truncate(shape.len());
            u
        }), block: Default::default() };
        let whole = init_binding(&binding, &shape, 7, 3);
        for rank in 0..mesh.ranks() {
            let expected = local_shard(&whole, binding.layout.as_ref().unwrap(), &mesh, rank);
            assert_eq!(init_shard(&binding, &shape, &mesh, rank, 7, 3), expected, "{name} rank {rank}");
        }
    }
}
