//! The torchrun-style bootstrap of the CUDA backend's NCCL mode reads its variables with
//! defaults and clear errors.
#![cfg(feature = "cuda")]

use shardc_runtime::cuda::nccl::Bootstrap;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

#[test]
fn torchrun_variables_with_defaults() {
    let b = Bootstrap::from_vars(vars(&[("RANK", "3"), ("WORLD_SIZE", "8")])).unwrap();
    assert_eq!(b, Bootstrap { rank: 3, world: 8, local_rank: 3, master: "127.0.0.1:29500".into(), timeout: std::time::Duration::from_secs(120) });
    let b = Bootstrap::from_vars(vars(&[("RANK", "9"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "6000")])).unwrap();
    assert_eq!((b.local_rank, b.master.as_str()), (1, "node0:6000"));
}

#[test]
fn bad_variables_are_named() {
    let e = Bootstrap::from_vars(vars(&[("WORLD_SIZE", "2")])).unwrap_err().to_string();
    assert!(e.contains("RANK is not set"), "{e}");
    let e = Bootstrap::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err().to_string();
    assert!(e.contains("below WORLD_SIZE"), "{e}");
    let e = Bootstrap::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err().to_string();
    assert!(e.contains("RANK=x"), "{e}");
}
