//! Deterministic parameter initialisation.
//!
//! Every element's value is a function of (seed, parameter name, element index in the global
//! tensor) only, through a counter-based generator, so the same seed gives the same model
//! whatever order parameters are created in, and whatever mesh later shards them.
//! The scheme is GPT-2's: weights ~ N(0, 0.02), the residual projections (`attn.out`,
//! `mlp.down`) scaled by 1/sqrt(2 layers), norm scales 1, biases 0.

/// Step-like values for timing a kernel alone (calibration, on every backend): floats of
/// order one (special functions take shortcuts near zero; positive, as second moments are),
/// and integers of 1 (a token id, a step count).
pub fn step_like_values(len: usize, dtype: crate::DType) -> Vec<f64> {
    if dtype == crate::DType::I32 {
        return vec![1.0; len];
    }
    (0..len).map(|i| 0.1 + (splitmix64(i as u64) % 2000) as f64 * 1e-3).collect()
}

/// SplitMix64: a bijective 64-bit mixer (Steele, Lea, Flood 2014).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A 64-bit key for a name (FNV-1a), mixed with the seed.
pub fn key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    splitmix64(h ^ splitmix64(seed))
}

/// A uniform number in (0, 1) for counter `i` under `key`.
pub fn uniform(key: u64, i: u64) -> f64 {
    ((splitmix64(key ^ splitmix64(i)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A standard normal number for counter `i` under `key` (Box-Muller on two uniforms).
pub fn normal(key: u64, i: u64) -> f64 {
    let (u1, u2) = (uniform(key, 2 * i), uniform(key, 2 * i + 1));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The initial value of every element of parameter `name` with `len` elements.
pub fn init_param(name: &str, len: usize, seed: u64, layers: usize) -> Vec<f64> {
    use rayon::prelude::*;
    // Every core: a large model's parameters are hundreds of millions of elements.
    let value = element_initializer(name, seed, layers);
    (0..len as u64).into_par_iter().map(value).collect()
}

/// Element `i` (in the global tensor) of parameter `name`'s initial value.
fn element_initializer(name: &str, seed: u64, layers: usize) -> impl Fn(u64) -> f64 + Sync + Send {
    let (constant, std) = if name.ends_with(".bias") {
        (Some(0.0), 0.0)
    } else if name.ends_with("norm.weight") {
        (Some(1.0), 0.0)
    } else if name.ends_with("attn.out.weight") || name.ends_with("mlp.down.weight") || name.ends_with("experts.down.weight") || name.ends_with("shared.down.weight") {
        (None, 0.02 / (2.0 * layers.max(1) as f64).sqrt())
    } else {
        (None, 0.02)
    };
    let k = key(seed, name);
    move |i| constant.unwrap_or_else(|| std * normal(k, i))
}

/// The initial value of `rank`'s shard of the program argument `binding` (global shape
/// `shape`, cut by its layout over `mesh`), element by element from global indices: the
/// shard of [`init_binding`]'s tensor, without making that tensor (a process of a large
/// model holds only its own shards). Without a layout, the whole tensor.
pub fn init_shard(binding: &crate::program::Binding, shape: &[usize], mesh: &crate::collectives::MeshShape, rank: usize, seed: u64, layers: usize) -> Vec<f64> {
    let Some(layout) = &binding.layout else { return init_binding(binding, shape, seed, layers) };
    let logical = binding.logical_shape(shape);
    let name = crate::program::master_of(&binding.name).unwrap_or(&binding.name);
    let value = element_initializer(name, seed, layers);
    // A padded tensor's real elements sit at the start of each dimension; the rest are 0.
    crate::layout::shard_from_par(layout, mesh, rank, |g| {
        let (mut rest, mut unpadded, mut stride) = (g, 0u64, 1u64);
        for (&n, &real) in shape.iter().zip(&logical).rev() {
            let i = rest % n;
            rest /= n;
            if i >= real {
                return 0.0;
            }
            unpadded += i as u64 * stride;
            stride *= real as u64;
        }
        value(unpadded)
    })
}

/// The initial global value of the program argument `binding` (global shape `shape`): the
/// parameter's values at its unpadded shape, so that a padded vocabulary starts with the
/// same real rows as an unpadded one, and zeros in the padding.
/// A master copy (`opt.master.<parameter>`) starts as its parameter.
pub fn init_binding(binding: &crate::program::Binding, shape: &[usize], seed: u64, layers: usize) -> Vec<f64> {
    let logical = binding.logical_shape(shape);
    let name = crate::program::master_of(&binding.name).unwrap_or(&binding.name);
    binding.to_program(&init_param(name, logical.iter().product(), seed, layers), shape)
}
