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
    assert_eq!(b, Bootstrap { rank: 3, world: 8, local_rank: 3, master: "127.0.0.1:29501".into(), timeout: std::time::Duration::from_secs(120) });
    let b = Bootstrap::from_vars(vars(&[("RANK", "9"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "6000")])).unwrap();
    // torchrun's agent store holds MASTER_PORT: the id is served on the next port.
    assert_eq!((b.local_rank, b.master.as_str()), (1, "node0:6001"));
    let b = Bootstrap::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "6000"), ("SHARDC_BOOTSTRAP_PORT", "7000")])).unwrap();
    assert_eq!(b.master, "127.0.0.1:7000");
}

/// Rank 0 serves the id on MASTER_PORT + 1 while something (torchrun's store) holds
/// MASTER_PORT, and every rank gets the same 128 bytes; a rank that reaches a port where
/// nobody sends the id fails within its timeout, naming the address.
#[test]
fn the_nccl_id_is_served_beside_torchruns_store() {
    use std::time::Duration;
    // A stand-in for torchrun's store: it holds MASTER_PORT and never speaks first.
    let (store, master_port) = (1..200)
        .find_map(|i| {
            let port = 20000 + 2 * ((std::process::id() as u16 % 5000) + 37 * i);
            let store = std::net::TcpListener::bind(("127.0.0.1", port)).ok()?;
            std::net::TcpListener::bind(("127.0.0.1", port + 1)).ok().map(|_| (store, port))
        })
        .expect("two free adjacent ports");
    let world = 3;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let port = master_port.to_string();
            std::thread::spawn(move || {
                let b = Bootstrap::from_vars(vars(&[("RANK", &rank.to_string()), ("WORLD_SIZE", &world.to_string()), ("MASTER_PORT", &port)])).unwrap().with_timeout(Duration::from_secs(20));
                b.exchange_id(|| Ok(std::array::from_fn(|i| i as u8 ^ 0x5a)))
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let id = handle.join().unwrap().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(id, std::array::from_fn(|i| i as u8 ^ 0x5a), "rank {rank}");
    }
    // Pointed at the store itself, a rank gives up within its timeout and says where it waited.
    let began = std::time::Instant::now();
    let b = Bootstrap::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SHARDC_BOOTSTRAP_PORT", &master_port.to_string())])).unwrap().with_timeout(Duration::from_secs(1));
    let e = b.exchange_id(|| unreachable!()).unwrap_err().to_string();
    assert!(e.contains(&format!("127.0.0.1:{master_port}")) && e.contains("reading the NCCL id"), "{e}");
    assert!(began.elapsed() < Duration::from_secs(10), "{:?}", began.elapsed());
    drop(store);
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
