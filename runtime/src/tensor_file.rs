//! A safetensors file read one tensor at a time: its header parsed and checked by the
//! `safetensors` crate (offsets end to end, sizes matching shapes and dtypes, the data
//! exactly filling the file), the data left on disk until a tensor is asked for. What lets a
//! process take its own shards of a large model without ever holding the whole of it.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use crate::RuntimeError;

/// A tensor read as f64: (shape, values).
pub type Tensor = (Vec<usize>, Vec<f64>);

/// Every tensor of a file: (name, shape, values; `None` for one that is not floating point).
pub type FileTensors = Vec<(String, Vec<usize>, Option<Vec<f64>>)>;

/// Largest safetensors header read (names, dtypes, shapes and offsets: the crate's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An open safetensors file's header.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    /// Where the data begins (after the header's length and the header).
    data_start: u64,
    metadata: Metadata,
}

fn bad(path: &Path, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Binding(format!("{}: {what}", path.display()))
}

impl TensorFile {
    /// Reads and checks the header of the regular file `path`.
    pub fn open(path: &Path) -> Result<TensorFile, RuntimeError> {
        let meta = std::fs::metadata(path).map_err(|e| bad(path, e))?;
        if !meta.is_file() {
            return Err(bad(path, "not a regular file"));
        }
        let mut file = std::fs::File::open(path).map_err(|e| bad(path, e))?;
        let mut length = [0u8; 8];
        file.read_exact(&mut length).map_err(|_| bad(path, "not a safetensors file: shorter than a header"))?;
        let header_len = u64::from_le_bytes(length);
        if header_len > MAX_HEADER_BYTES || header_len.saturating_add(8) > meta.len() {
            return Err(bad(path, format!("not a safetensors file: a header of {header_len} bytes in a file of {}", meta.len())));
        }
        let mut text = vec![0u8; header_len as usize];
        file.read_exact(&mut text).map_err(|e| bad(path, e))?;
        let metadata = check_header(&text, meta.len()).map_err(|e| bad(path, e))?;
        Ok(TensorFile { path: path.to_path_buf(), data_start: 8 + header_len, metadata })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors' names, in the order of their data.
    pub fn names(&self) -> Vec<String> {
        self.metadata.offset_keys()
    }

    /// A tensor's dtype, shape and offsets within the data.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    /// The tensor's bytes in the file (the header's offsets into the data, made absolute).
    pub fn byte_range(&self, name: &str) -> Option<std::ops::Range<u64>> {
        let (begin, end) = self.info(name)?.data_offsets;
        Some(self.data_start + begin as u64..self.data_start + end as u64)
    }

    /// Reads one tensor's bytes.
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>, RuntimeError> {
        let range = self.byte_range(name).ok_or_else(|| bad(&self.path, format!("holds no tensor `{name}`")))?;
        let mut file = std::fs::File::open(&self.path).map_err(|e| bad(&self.path, e))?;
        file.seek(SeekFrom::Start(range.start)).map_err(|e| bad(&self.path, e))?;
        let mut bytes = vec![0u8; (range.end - range.start) as usize];
        file.read_exact(&mut bytes).map_err(|e| bad(&self.path, format!("reading `{name}`: {e}")))?;
        Ok(bytes)
    }

    /// Reads one floating-point tensor (f32, f64, bf16 or f16) as f64: (shape, values).
    /// `None` for a tensor of another dtype. A NaN or infinite value is an error naming the
    /// tensor ([`check_finite`]).
    pub fn read_f64(&self, name: &str) -> Result<Option<Tensor>, RuntimeError> {
        let info = self.info(name).ok_or_else(|| bad(&self.path, format!("holds no tensor `{name}`")))?;
        let (dtype, shape) = (info.dtype, info.shape.clone());
        if !is_float(dtype) {
            return Ok(None);
        }
        let bytes = self.read_bytes(name)?;
        let Some(values) = float_values(dtype, &bytes) else { return Ok(None) };
        check_finite(&self.path, name, &shape, &values)?;
        Ok(Some((shape, values)))
    }
}

/// The header `text` of a safetensors file of `file_len` bytes, parsed and checked: offsets
/// end to end, sizes matching shapes and dtypes, the data filling the rest of the file.
fn check_header(text: &[u8], file_len: u64) -> Result<Metadata, String> {
    let text = std::str::from_utf8(text).map_err(|e| format!("not a safetensors file: {e}"))?;
    let metadata: Metadata = serde_json::from_str(text).map_err(|e| format!("not a safetensors file: {e}"))?;
    let data_start = 8 + text.len() as u64;
    if data_start.saturating_add(metadata.data_len() as u64) != file_len {
        return Err(format!("not a safetensors file: its header places {} bytes of data after itself, and the file holds {}", metadata.data_len(), file_len.saturating_sub(data_start)));
    }
    Ok(metadata)
}

/// Every tensor of a whole safetensors file's `bytes`, checked as [`TensorFile::open`]
/// checks a file: (name, shape, values as f64, `None` for a tensor that is not floating
/// point). What the fuzzer drives.
pub fn tensors_of_bytes(bytes: &[u8]) -> Result<FileTensors, String> {
    let length: [u8; 8] = bytes.get(..8).and_then(|b| b.try_into().ok()).ok_or("not a safetensors file: shorter than a header")?;
    let header_len = u64::from_le_bytes(length);
    if header_len > MAX_HEADER_BYTES || header_len.saturating_add(8) > bytes.len() as u64 {
        return Err(format!("not a safetensors file: a header of {header_len} bytes in a file of {}", bytes.len()));
    }
    let data_start = 8 + header_len as usize;
    let metadata = check_header(&bytes[8..data_start], bytes.len() as u64)?;
    Ok(metadata
        .offset_keys()
        .into_iter()
        .filter_map(|name| {
            let info = metadata.info(&name)?;
            let (begin, end) = info.data_offsets;
            let values = float_values(info.dtype, &bytes[data_start + begin..data_start + end]);
            Some((name, info.shape.clone(), values))
        })
        .collect())
}

/// Refuses tensor `name` of file `path` if one of its `values` is NaN or infinite: whatever
/// reads it starts training from it (`--load`, Hugging Face weights, a checkpoint's state),
/// and a run from it would only fail at its first loss, blamed on the learning rate.
pub fn check_finite(path: &Path, name: &str, shape: &[usize], values: &[f64]) -> Result<(), RuntimeError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(at) => Err(bad(path, format!("tensor `{name}` holds {} at element {at} of its {} (shape {shape:?}): training cannot start from a value that is not finite", values[at], values.len()))),
        None => Ok(()),
    }
}

/// Where the symbolic link `path` points, as a path from here (links followed to the end, at
/// most 40; the last may name no file yet); `None` when `path` is not a link.
pub fn link_target(path: &Path) -> Option<PathBuf> {
    let mut at = path.to_path_buf();
    let mut followed = false;
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&at).ok()?;
                at = if target.is_absolute() { target } else { at.parent().unwrap_or(Path::new(".")).join(target) };
                followed = true;
            }
            _ => break,
        }
    }
    followed.then_some(at)
}

/// Whether `dtype` is one [`float_values`] reads.
pub fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F64 | Dtype::BF16 | Dtype::F16)
}

/// The values of a floating-point tensor's little-endian bytes as f64; `None` for other
/// dtypes.
pub fn float_values(dtype: Dtype, data: &[u8]) -> Option<Vec<f64>> {
    Some(match dtype {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
        Dtype::F64 => data.chunks_exact(8).map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64).collect(),
        _ => return None,
    })
}

/// Writes the safetensors file `path` a tensor at a time: the header (every tensor's name,
/// dtype and shape, and `metadata`) first, then each tensor's little-endian bytes as
/// `bytes_of(i)` gives them for `tensors[i]`, so that no file is ever assembled in memory.
/// The bytes go to a temporary file beside `path`, synced and renamed over it: an
/// interrupted write leaves no partial `path`. Returns the CRC-32 of the file.
pub fn write_streamed(
    path: &Path,
    tensors: &[(String, Vec<usize>, Dtype)],
    metadata: &[(&str, &str)],
    mut bytes_of: impl FnMut(usize) -> Result<Vec<u8>, RuntimeError>,
) -> Result<u32, RuntimeError> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let entries: serde_json::Map<String, serde_json::Value> = metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(entries));
    }
    let mut at = 0usize;
    let mut sizes = Vec::with_capacity(tensors.len());
    for (name, shape, dtype) in tensors {
        if header.contains_key(name) {
            return Err(bad(path, format!("tensor `{name}` is named twice")));
        }
        let size = shape.iter().try_fold(dtype.bitsize() / 8, |n, &d| n.checked_mul(d)).ok_or_else(|| bad(path, format!("tensor `{name}` of shape {shape:?} is too large")))?;
        let end = at.checked_add(size).ok_or_else(|| bad(path, format!("tensor `{name}` of shape {shape:?} ends past the largest file")))?;
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, end]}));
        sizes.push(size);
        at = end;
    }
    let mut text = serde_json::to_vec(&header).map_err(|e| bad(path, e))?;
    // Padded with spaces to 8 bytes, as the safetensors writer pads it.
    text.resize(text.len().next_multiple_of(8), b' ');
    // Through a link to the file it names (one yet to be made included), as writing the
    // path itself would.
    let resolved = link_target(path);
    let path = resolved.as_deref().unwrap_or(path);
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // What an interrupted write of this file left (another process's id) goes first.
    let stale = format!(".{file_name}.partial-");
    if let Ok(entries) = std::fs::read_dir(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&stale) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let partial = path.with_file_name(format!(".{file_name}.partial-{}", std::process::id()));
    let mut write = || -> Result<u32, RuntimeError> {
        let file = std::fs::File::create(&partial).map_err(|e| bad(&partial, e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let mut hasher = crc32fast::Hasher::new();
        let mut put = |bytes: &[u8], out: &mut std::io::BufWriter<std::fs::File>| -> Result<(), RuntimeError> {
            hasher.update(bytes);
            out.write_all(bytes).map_err(|e| bad(&partial, e))
        };
        put(&(text.len() as u64).to_le_bytes(), &mut out)?;
        put(&text, &mut out)?;
        for (i, ((name, shape, _), &size)) in tensors.iter().zip(&sizes).enumerate() {
            let bytes = bytes_of(i)?;
            if bytes.len() != size {
                return Err(bad(path, format!("tensor `{name}` of shape {shape:?} takes {size} bytes; {} were given", bytes.len())));
            }
            put(&bytes, &mut out)?;
        }
        let file = out.into_inner().map_err(|e| bad(&partial, e.into_error()))?;
        file.sync_all().map_err(|e| bad(&partial, e))?;
        Ok(hasher.finalize())
    };
    let written = write().and_then(|crc| std::fs::rename(&partial, path).map(|_| crc).map_err(|e| bad(path, e)));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exponent = ((h >> 10) & 0x1f) as u32;
    let mantissa = (h & 0x3ff) as u32;
    let bits = match exponent {
        0 if mantissa == 0 => sign,
        0 => {
            // Subnormal: normalise.
            let shift = mantissa.leading_zeros() - 21;
            sign | ((127 - 15 - shift + 1) << 23) | (((mantissa << shift) & 0x3ff) << 13)
        }
        0x1f => sign | 0x7f80_0000 | (mantissa << 13),
        e => sign | ((e + 127 - 15) << 23) | (mantissa << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_bytes() -> Vec<u8> {
        let (a, b): (Vec<u8>, Vec<u8>) = ((0..6).flat_map(|i| (i as f32).to_le_bytes()).collect(), [1.5f32; 4].iter().flat_map(|x| x.to_le_bytes()).collect());
        let views = vec![("a", safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap()), ("b", safetensors::tensor::TensorView::new(Dtype::F32, vec![4], &b).unwrap())];
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn a_file_reads_one_tensor_at_a_time_and_as_its_bytes_say() {
        let path = std::env::temp_dir().join(format!("shardc-tensor-file-{}.safetensors", std::process::id()));
        std::fs::write(&path, file_bytes()).unwrap();
        let file = TensorFile::open(&path).unwrap();
        assert_eq!(file.names(), ["a", "b"]);
        assert_eq!(file.read_f64("b").unwrap(), Some((vec![4], vec![1.5; 4])));
        assert_eq!(file.read_f64("a").unwrap().unwrap().1, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(file.read_f64("c").unwrap_err().to_string().contains("holds no tensor `c`"));
        let whole = tensors_of_bytes(&file_bytes()).unwrap();
        assert_eq!(whole.len(), 2);
        // Cut short, or with data past what the header places: refused when opened.
        let bytes = file_bytes();
        for (edited, says) in [(bytes[..bytes.len() - 1].to_vec(), "places 40 bytes of data after itself, and the file holds 39"), ([&bytes[..], &[0]].concat(), "the file holds 41"), (bytes[..5].to_vec(), "shorter than a header")] {
            std::fs::write(&path, &edited).unwrap();
            let error = TensorFile::open(&path).unwrap_err().to_string();
            assert!(error.contains(says), "{error}");
            assert!(tensors_of_bytes(&edited).unwrap_err().contains(says), "{says}");
        }
        // A header length of 2^63.
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
        std::fs::write(&path, &huge).unwrap();
        assert!(TensorFile::open(&path).unwrap_err().to_string().contains("a header of 9223372036854775808 bytes"));
        assert!(tensors_of_bytes(&huge).is_err());
        std::fs::remove_file(&path).ok();
    }

    /// A NaN or an infinity, in any floating-point dtype, is refused naming its tensor and
    /// element; the file's other tensors still read.
    #[test]
    fn a_value_that_is_not_finite_is_refused_naming_its_tensor() {
        let path = std::env::temp_dir().join(format!("shardc-not-finite-{}.safetensors", std::process::id()));
        let tensors = vec![("ok".to_string(), vec![2], Dtype::F32), ("nan".to_string(), vec![3], Dtype::BF16), ("inf".to_string(), vec![2], Dtype::F16), ("big".to_string(), vec![1], Dtype::F64)];
        let bytes = |i: usize| -> Result<Vec<u8>, RuntimeError> {
            Ok(match i {
                0 => [1.0f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
                1 => [0x3f80u16, 0x7fc0, 0].iter().flat_map(|x| x.to_le_bytes()).collect(),
                2 => [0u16, 0xfc00].iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => f64::INFINITY.to_le_bytes().to_vec(),
            })
        };
        write_streamed(&path, &tensors, &[], bytes).unwrap();
        let file = TensorFile::open(&path).unwrap();
        assert_eq!(file.read_f64("ok").unwrap(), Some((vec![2], vec![1.0, -2.0])));
        for (name, what) in [("nan", "tensor `nan` holds NaN at element 1 of its 3"), ("inf", "tensor `inf` holds -inf at element 1 of its 2"), ("big", "tensor `big` holds inf at element 0 of its 1")] {
            let err = file.read_f64(name).unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
        std::fs::remove_file(&path).ok();
    }

    /// A streamed file is a safetensors file the crate reads (metadata included), its
    /// CRC-32 that of its bytes; a write that fails part way, or is given the wrong number of
    /// bytes, leaves neither the file nor its temporary behind (an earlier file stays).
    #[test]
    fn a_file_written_a_tensor_at_a_time_reads_back_and_a_failed_write_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("shardc-streamed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let tensors = vec![("w".to_string(), vec![2, 3], Dtype::F32), ("d".to_string(), vec![2], Dtype::F64)];
        let values = |i: usize| -> Result<Vec<u8>, RuntimeError> { Ok(if i == 0 { (0..6).flat_map(|x| (x as f32).to_le_bytes()).collect() } else { [0.5f64, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect() }) };
        let crc = write_streamed(&path, &tensors, &[("format", "pt")], values).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(crc, crc32fast::hash(&bytes));
        let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(read.tensor("w").unwrap().shape(), [2, 3]);
        assert_eq!(float_values(Dtype::F64, read.tensor("d").unwrap().data()).unwrap(), [0.5, -2.0]);
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
        let fail = |i: usize| if i == 1 { Err(RuntimeError::Program("the device failed".into())) } else { values(i) };
        assert!(write_streamed(&path, &tensors, &[], fail).unwrap_err().to_string().contains("the device failed"));
        let short = |i: usize| values(i).map(|mut b| { b.pop(); b });
        assert!(write_streamed(&path, &tensors, &[], short).unwrap_err().to_string().contains("takes 24 bytes; 23 were given"));
        let twice = vec![tensors[0].clone(), tensors[0].clone()];
        assert!(write_streamed(&path, &twice, &[], values).unwrap_err().to_string().contains("named twice"));
        let huge = vec![("a".to_string(), vec![1usize << 61], Dtype::F32), ("b".to_string(), vec![1usize << 61], Dtype::F32)];
        assert!(write_streamed(&path, &huge, &[], values).unwrap_err().to_string().contains("ends past the largest file"));
        let left: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(left, ["model.safetensors"], "only the first, whole file");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        // What a killed writer left goes with the next write; a link is written through.
        std::fs::write(dir.join(".model.safetensors.partial-999999"), b"half").unwrap();
        std::os::unix::fs::symlink(&path, dir.join("link.safetensors")).unwrap();
        write_streamed(&dir.join("link.safetensors"), &tensors, &[], values).unwrap();
        assert!(std::fs::symlink_metadata(dir.join("link.safetensors")).unwrap().file_type().is_symlink());
        let mut left: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["link.safetensors", "model.safetensors"]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
