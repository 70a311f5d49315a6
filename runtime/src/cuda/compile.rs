//! Device modules from CUDA C: NVRTC to PTX (for tests and inspection) and to a GPU's own
//! machine code (cubin), with a cache on disk.
//!
//! A large bf16 module takes NVRTC and ptxas seconds, and a run loads the same module many
//! times (every trainer, every process of a mesh, every calibration kernel). A cubin depends
//! only on the source and the architecture, so it is kept in a cache folder
//! (`SHARDC_KERNEL_CACHE`; by default `$XDG_CACHE_HOME/shardc/kernels` or
//! `~/.cache/shardc/kernels`; `off`, `0`, `false` or `none` turn it off) beside the source it came from: a hit is
//! the same source byte for byte, never only the same hash. `shardc-gpu precompile` fills the
//! cache ahead of time on a machine without a GPU (NVRTC needs none), which is how
//! `scripts/gpu-check.sh prepare` spares the GPU machine every compile.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use super::err;
use crate::RuntimeError;

fn require_nvrtc() -> Result<(), RuntimeError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(err("NVRTC (libnvrtc.so.13) was not found: put pip's nvidia-cuda-nvrtc (nvidia/cu13/lib) on LD_LIBRARY_PATH"));
    }
    Ok(())
}

/// The real architectures (`major * 10 + minor`: 90 for sm_90) this NVRTC compiles for.
pub fn supported_archs() -> Result<Vec<i32>, RuntimeError> {
    require_nvrtc()?;
    let mut count = 0;
    // SAFETY: NVRTC writes one int.
    unsafe { cudarc::nvrtc::sys::nvrtcGetNumSupportedArchs(&mut count) }.result().map_err(|e| err(format!("NVRTC's architectures: {e:?}")))?;
    let mut archs = vec![0; count.max(0) as usize];
    // SAFETY: `archs` holds the `count` ints NVRTC writes.
    unsafe { cudarc::nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result().map_err(|e| err(format!("NVRTC's architectures: {e:?}")))?;
    Ok(archs)
}

/// Compiles a device module to PTX with NVRTC (checks that NVRTC is present first), for
/// NVRTC's default architecture.
pub fn compile_ptx(source: &str) -> Result<String, RuntimeError> {
    compile_ptx_for(source, None)
}

/// Compiles a device module to PTX for a compute capability `(major, minor)` (NVRTC's default
/// architecture when `None`). Kernels take their tensor-core paths (`mma.sync`, sm_80 on) only
/// when compiled for a GPU that has them, so a GPU's module is compiled for that GPU.
pub fn compile_ptx_for(source: &str, capability: Option<(i32, i32)>) -> Result<String, RuntimeError> {
    require_nvrtc()?;
    // Compiled once per process (a GPU whose driver refuses the cubins JITs this PTX for
    // every module it loads).
    type Compiled = HashMap<(String, Option<(i32, i32)>), String>;
    static COMPILED: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let memory = COMPILED.get_or_init(Default::default);
    let key = (source.to_string(), capability);
    if let Some(ptx) = memory.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    let options: Vec<String> = capability.map(|(major, minor)| format!("--gpu-architecture=compute_{major}{minor}")).into_iter().collect();
    let image = nvrtc(source, &options, Output::Ptx)?;
    let ptx = String::from_utf8(image).map_err(|_| err("NVRTC returned PTX that is not text"))?;
    memory.lock().unwrap_or_else(|e| e.into_inner()).insert(key, ptx.clone());
    Ok(ptx)
}

/// The machine code of `source` for a GPU of compute capability `(major, minor)`: from this
/// process's memory, the cache folder, or NVRTC (then kept in both).
pub fn cubin_for(source: &str, capability: (i32, i32)) -> Result<Vec<u8>, RuntimeError> {
    // A cache that cannot be written costs the next run a compile, nothing more.
    cubin_in(source, capability, cache_dir().as_deref(), false).map(|(cubin, _)| cubin)
}

/// Puts the cubin of `source` for `capability` in the cache folder `dir` (compiling it if
/// the folder does not hold it yet): where it came from. Unlike a run, a cache that cannot
/// be written is an error here.
pub fn precompile(source: &str, capability: (i32, i32), dir: &Path) -> Result<Origin, RuntimeError> {
    cubin_in(source, capability, Some(dir), true).map(|(_, origin)| origin)
}

/// Where a cubin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Compiled earlier in this process.
    Memory,
    /// Read from the cache folder.
    Disk,
    /// Compiled by NVRTC now.
    Compiled,
}

/// [`cubin_for`] with an explicit cache folder (none: memory only), saying where the cubin
/// came from; with `strict`, failing to write the folder is an error.
fn cubin_in(source: &str, capability: (i32, i32), dir: Option<&Path>, strict: bool) -> Result<(Vec<u8>, Origin), RuntimeError> {
    // A process loads the same module many times (a check's gradient run after its steps,
    // attention's forward and backward): each (source, architecture) is compiled once.
    type Compiled = HashMap<(String, (i32, i32)), Vec<u8>>;
    static COMPILED: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let memory = COMPILED.get_or_init(Default::default);
    let key = (source.to_string(), capability);
    // `precompile` (strict) is about the folder, so it looks there first.
    if !strict && let Some(cubin) = memory.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok((cubin.clone(), Origin::Memory));
    }
    let entry = dir.map(|d| CacheEntry::new(d, source, capability));
    let (cubin, origin) = match entry.as_ref().and_then(|e| e.read(source)) {
        Some(cubin) => (cubin, Origin::Disk),
        None => {
            require_nvrtc()?;
            let cubin = nvrtc(source, &cubin_options(capability), Output::Cubin)?;
            if let Some(entry) = &entry
                && let Err(e) = entry.write(source, &cubin)
                && strict
            {
                return Err(err(format!("writing the kernel cache {}: {e}", entry.cubin.display())));
            }
            (cubin, Origin::Compiled)
        }
    };
    memory.lock().unwrap_or_else(|e| e.into_inner()).insert(key, cubin.clone());
    Ok((cubin, origin))
}

/// NVRTC's options for a cubin for compute capability `(major, minor)`.
fn cubin_options((major, minor): (i32, i32)) -> Vec<String> {
    vec![format!("--gpu-architecture=sm_{major}{minor}")]
}

/// The cache folder: `SHARDC_KERNEL_CACHE` (empty, `off`, `0`, `false` or `none`: none), else
/// the user's cache.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("SHARDC_KERNEL_CACHE") {
        Some(v) if v.is_empty() || ["off", "0", "false", "none"].iter().any(|off| v.eq_ignore_ascii_case(off)) => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| Path::new(&h).join(".cache")))
            .map(|c| c.join("shardc").join("kernels")),
    }
}

/// One module's files in the cache: `sm_XY-HASH.cubin` and the source it came from.
struct CacheEntry {
    cubin: PathBuf,
    source: PathBuf,
}

impl CacheEntry {
    fn new(dir: &Path, source: &str, (major, minor): (i32, i32)) -> CacheEntry {
        // FNV-1a: stable across builds and Rust versions (std's hasher is not promised to be),
        // over NVRTC's options too, so a cubin compiled otherwise is another entry.
        let options = cubin_options((major, minor)).join(" ");
        let hash = options.bytes().chain([0]).chain(source.bytes()).fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
        let stem = format!("sm_{major}{minor}-{hash:016x}-{}", source.len());
        CacheEntry { cubin: dir.join(format!("{stem}.cubin")), source: dir.join(format!("{stem}.cu")) }
    }

    /// The cubin, if the cache holds one compiled from exactly `source`.
    fn read(&self, source: &str) -> Option<Vec<u8>> {
        let cached = std::fs::read(&self.source).ok()?;
        if cached != source.as_bytes() {
            return None;
        }
        std::fs::read(&self.cubin).ok().filter(|c| whole_elf(c))
    }

    /// Writes both files through temporary names, the source last, so a reader that finds the
    /// source finds a whole cubin beside it (processes of one run fill the cache together).
    fn write(&self, source: &str, cubin: &[u8]) -> std::io::Result<()> {
        let dir = self.cubin.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let unique = format!("{}.{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], "");
        for (path, bytes) in [(&self.cubin, cubin), (&self.source, source.as_bytes())] {
            let partial = path.with_extension(format!("partial-{unique}"));
            if let Err(e) = std::fs::write(&partial, bytes).and_then(|()| std::fs::rename(&partial, path)) {
                let _ = std::fs::remove_file(&partial);
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Whether `image` is a whole 64-bit ELF file (what NVRTC writes for a cubin): a truncated or
/// damaged entry is compiled again and rewritten, not handed to the driver (which would refuse
/// it and JIT the PTX in every process, leaving the entry as it is).
fn whole_elf(image: &[u8]) -> bool {
    let u16_at = |at: usize| image.get(at..at + 2).map(|b| u64::from(u16::from_le_bytes([b[0], b[1]])));
    let u64_at = |at: usize| image.get(at..at + 8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_le_bytes);
    let table_fits = |offset: Option<u64>, size: Option<u64>, count: Option<u64>| {
        matches!((offset, size, count), (Some(o), Some(s), Some(n)) if o.checked_add(s * n).is_some_and(|end| end <= image.len() as u64))
    };
    image.len() >= 64
        && image.starts_with(b"\x7fELF\x02\x01")
        && table_fits(u64_at(0x20), u16_at(0x36), u16_at(0x38))
        && table_fits(u64_at(0x28), u16_at(0x3a), u16_at(0x3c))
}

#[derive(Clone, Copy)]
enum Output {
    Ptx,
    Cubin,
}

/// One NVRTC compile of `source` with `options`, returning PTX text or a cubin.
fn nvrtc(source: &str, options: &[String], output: Output) -> Result<Vec<u8>, RuntimeError> {
    use cudarc::nvrtc::{result, sys};
    let c_source = std::ffi::CString::new(source).map_err(|_| err("the device module contains a NUL byte"))?;
    let name = c"shardc.cu";
    let program = result::create_program(&c_source, Some(name)).map_err(|e| err(format!("NVRTC could not create a program: {e:?}")))?;
    // Destroys the program on every path out.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created by create_program, destroyed once.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let program = Program(program);
    // SAFETY: a live program; options are plain strings.
    if let Err(e) = unsafe { result::compile_program(program.0, options) } {
        // SAFETY: a live program.
        let log = unsafe { result::get_program_log(program.0) }.map(|l| text(&l)).unwrap_or_default();
        return Err(err(format!("NVRTC rejected the module ({e:?}):\n{log}")));
    }
    match output {
        // SAFETY: a compiled program.
        Output::Ptx => unsafe { result::get_ptx(program.0) }.map(|p| text(&p).into_bytes()).map_err(|e| err(format!("NVRTC's PTX: {e:?}"))),
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: a compiled program; `size` is written by NVRTC.
            unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }.result().map_err(|e| err(format!("NVRTC's cubin size: {e:?}")))?;
            if size == 0 {
                return Err(err("NVRTC produced no cubin (the architecture must be a real one, sm_XY)"));
            }
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds `size` bytes, as NVRTC asked.
            unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }.result().map_err(|e| err(format!("NVRTC's cubin: {e:?}")))?;
            Ok(cubin)
        }
    }
}

/// A NUL-terminated C string from NVRTC, as text.
fn text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
