//! Message buffers reused across calls. A training step sends the same messages every step
//! (activations between stages, gradient chunks around a ring), and a fresh buffer for each
//! costs the host a page fault per 4 KiB touched: for gpt2-small's 154 MB tied-embedding
//! gradient that was a fifth of a second per step. A buffer the receiver is done with goes
//! back here, and the next message of its type and length takes it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Mutex;

use super::Elem;

/// Buffers smaller than this are left to the allocator (its free lists serve them without
/// page faults).
const SMALLEST: usize = 1 << 16;
/// Spare buffers kept per (type, length): enough for the messages of a ring step in flight
/// on every rank of a host.
const SPARES: usize = 8;
/// Bytes of spare buffers kept in all: a process that runs one program after another (of
/// other message sizes) keeps those of the latest, not of every one it ran.
const SPARE_BYTES: usize = 4 << 30;

type Key = (TypeId, usize);

/// The spare buffers of one (type, length), the bytes of each and when they were last used.
struct Spares {
    buffers: Vec<Box<dyn Any + Send>>,
    bytes: usize,
    used: u64,
}

#[derive(Default)]
struct Pool {
    spares: HashMap<Key, Spares>,
    bytes: usize,
    clock: u64,
}

static SPARE: Mutex<Option<Pool>> = Mutex::new(None);

/// A spare buffer of `len` elements of `T`, if there is one.
fn take<T: Elem>(len: usize) -> Option<Vec<T>> {
    if len.saturating_mul(std::mem::size_of::<T>()) < SMALLEST {
        return None;
    }
    let mut guard = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    let pool = guard.as_mut()?;
    pool.clock += 1;
    let clock = pool.clock;
    let entry = pool.spares.get_mut(&(TypeId::of::<T>(), len))?;
    entry.used = clock;
    let buffer = entry.buffers.pop()?;
    pool.bytes -= entry.bytes;
    buffer.downcast::<Vec<T>>().ok().map(|b| *b)
}

/// A buffer holding a copy of `data`: a spare one when there is one.
pub fn filled<T: Elem>(data: &[T]) -> Vec<T> {
    match take::<T>(data.len()) {
        Some(mut buffer) => {
            buffer.copy_from_slice(data);
            buffer
        }
        None => data.to_vec(),
    }
}

/// A buffer of `len` elements whose values are to be overwritten: a spare one when there is
/// one.
pub fn buffer<T: Elem + Default>(len: usize) -> Vec<T> {
    take(len).unwrap_or_else(|| vec![T::default(); len])
}

/// Gives back a buffer that [`filled`] made (or a received message) once it is read.
pub fn recycle<T: Elem>(buffer: Vec<T>) {
    let bytes = std::mem::size_of_val(buffer.as_slice());
    if bytes < SMALLEST || bytes > SPARE_BYTES || buffer.len() != buffer.capacity() {
        return;
    }
    let mut guard = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    let pool = guard.get_or_insert_with(Pool::default);
    pool.clock += 1;
    let (key, clock) = ((TypeId::of::<T>(), buffer.len()), pool.clock);
    if pool.spares.get(&key).is_some_and(|e| e.buffers.len() >= SPARES) {
        return;
    }
    // Over the budget: the spares of the lengths least recently used go first.
    while pool.bytes + bytes > SPARE_BYTES {
        let Some(oldest) = pool.spares.iter().filter(|(k, e)| **k != key && !e.buffers.is_empty()).min_by_key(|(_, e)| e.used).map(|(k, _)| *k) else {
            return;
        };
        if let Some(evicted) = pool.spares.remove(&oldest) {
            pool.bytes -= evicted.bytes * evicted.buffers.len();
        }
    }
    let entry = pool.spares.entry(key).or_insert_with(|| Spares { buffers: Vec::new(), bytes, used: clock });
    entry.used = clock;
    entry.buffers.push(Box::new(buffer));
    pool.bytes += bytes;
}

/// Bytes held in spare buffers now.
pub fn spare_bytes() -> usize {
    SPARE.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |p| p.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recycled_buffer_is_filled_again_with_the_new_data() {
        let first = filled(&vec![1.0f32; 1 << 15]);
        let address = first.as_ptr() as usize;
        recycle(first);
        let second = filled(&vec![2.0f32; 1 << 15]);
        assert!(second.iter().all(|&x| x == 2.0));
        // Reused (other tests may have taken it first, so only when it is ours).
        if second.as_ptr() as usize == address {
            assert_eq!(second.len(), 1 << 15);
        }
        let small = filled(&[3i32; 4]);
        assert_eq!(small, vec![3; 4]);
        recycle(small);
    }

    #[test]
    fn spares_of_many_lengths_stay_within_the_budget() {
        // A process running one program after another: 64 MB messages of 24 lengths, 8 of
        // each (12 GB; zeroed allocations, so no pages are touched).
        for i in 0..24 {
            let len = (16 << 20) + i;
            let buffers: Vec<Vec<f32>> = (0..SPARES).map(|_| vec![0.0f32; len]).collect();
            buffers.into_iter().for_each(recycle);
            assert!(spare_bytes() <= SPARE_BYTES, "{} bytes of spares after {} lengths", spare_bytes(), i + 1);
        }
        // The latest length is still served from the spares.
        let reused = buffer::<f32>((16 << 20) + 23);
        assert_eq!(reused.len(), (16 << 20) + 23);
    }
}
