//! Is CUDA usable here? Checks for the driver, a device and NCCL before anything
//! touches CUDA, so a machine without them gets a clear error instead of a panic.
//!
//! The CUDA driver (`libcuda.so.1`) is found by cudarc. NCCL is loaded here, by the
//! names it actually ships under: `libnccl.so.2` (Debian/Ubuntu `libnccl2`, the NVIDIA
//! wheels and tarballs) and `libnccl.so` (the `-dev` symlink), or the file named by
//! `CKPT_NCCL_LIB`. cudarc's own NCCL loader looks for neither `libnccl.so.2` nor an
//! override and panics when it finds nothing, so the NCCL backend calls NCCL through the
//! handful of functions bound here.

/// Environment variable naming the NCCL library to load (a path or a file name).
pub const NCCL_LIB_VAR: &str = "CKPT_NCCL_LIB";

/// The names NCCL is looked for under, in order (after [`NCCL_LIB_VAR`]).
pub const NCCL_CANDIDATES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Checks that this binary can run on CUDA with NCCL: built with the `cuda` feature,
/// the driver loads, at least one device is visible, and NCCL loads.
///
/// # Errors
/// What is missing, as a sentence for the user (no driver, no device, no NCCL, or a
/// build without the feature).
pub fn cuda_available() -> Result<(), String> {
    imp::available().map(|_| ())
}

#[cfg(not(feature = "cuda-driver"))]
mod imp {
    pub(crate) fn available() -> Result<usize, String> {
        Err("this binary was built without CUDA support; rebuild with `cargo build --release --features cuda`".into())
    }

    pub(crate) fn devices() -> Result<usize, String> {
        available()
    }
}

/// Number of visible CUDA devices after checking the driver, or what is missing.
pub(crate) use imp::devices as gpu_count;

#[cfg(feature = "cuda-driver")]
pub(crate) use imp::{
    available as device_count, nccl, NcclLib, RawComm, UniqueId, NCCL_FLOAT32, NCCL_UINT64,
};

#[cfg(feature = "cuda-driver")]
mod imp {
    use super::{NCCL_CANDIDATES, NCCL_LIB_VAR};
    use std::os::raw::{c_char, c_int, c_void};
    use std::sync::OnceLock;

    /// Number of visible CUDA devices, after checking the driver and NCCL.
    pub(crate) fn available() -> Result<usize, String> {
        let n = devices()?;
        nccl()?;
        Ok(n)
    }

    /// Number of visible CUDA devices, after checking the driver (not NCCL: candle's
    /// device needs none).
    pub(crate) fn devices() -> Result<usize, String> {
        // SAFETY: only tries to dlopen the driver's library names. (With `cuda-candle`,
        // cudarc links libcuda, which is then present whenever the program runs.)
        #[cfg(not(feature = "cuda-candle"))]
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver: libcuda.so.1 cannot be loaded (install the NVIDIA driver, or train with --backend threads or mpi)".into());
        }
        let n = cudarc::driver::CudaContext::device_count()
            .map_err(|e| format!("no usable CUDA device: the driver says {e}"))?;
        if n <= 0 {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").map_or_else(
                |_| String::new(),
                |v| format!(" (CUDA_VISIBLE_DEVICES={v})"),
            );
            return Err(format!("no CUDA device is visible{visible}"));
        }
        Ok(n as usize)
    }

    /// `ncclUniqueId`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub(crate) struct UniqueId {
        pub(crate) internal: [c_char; 128],
    }

    pub(crate) type RawComm = *mut c_void;
    type Res = c_int;

    /// The NCCL entry points the backend uses.
    pub(crate) struct NcclLib {
        _lib: libloading::Library,
        pub(crate) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
        pub(crate) comm_init_rank:
            unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> Res,
        pub(crate) all_gather: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            c_int,
            RawComm,
            *mut c_void,
        ) -> Res,
        pub(crate) broadcast: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            c_int,
            c_int,
            RawComm,
            *mut c_void,
        ) -> Res,
        pub(crate) comm_destroy: unsafe extern "C" fn(RawComm) -> Res,
        pub(crate) comm_abort: unsafe extern "C" fn(RawComm) -> Res,
        pub(crate) comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Res) -> Res,
        get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    }

    /// `ncclUint64`, `ncclFloat32`.
    pub(crate) const NCCL_UINT64: c_int = 5;
    pub(crate) const NCCL_FLOAT32: c_int = 7;

    impl NcclLib {
        /// NCCL's text for a result code.
        pub(crate) fn error_string(&self, r: c_int) -> String {
            // SAFETY: NCCL returns a static C string for any code.
            let p = unsafe { (self.get_error_string)(r) };
            if p.is_null() {
                return format!("NCCL error {r}");
            }
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        }
    }

    fn load(name: &str) -> Result<NcclLib, String> {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($s:literal) => {
                // SAFETY: the symbol's type is NCCL's documented C signature.
                *unsafe { lib.get(concat!($s, "\0").as_bytes()) }
                    .map_err(|e| format!("{name}: no `{}`: {e}", $s))?
            };
        }
        Ok(NcclLib {
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            all_gather: sym!("ncclAllGather"),
            broadcast: sym!("ncclBroadcast"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            get_error_string: sym!("ncclGetErrorString"),
            _lib: lib,
        })
    }

    /// NCCL, loaded once.
    pub(crate) fn nccl() -> Result<&'static NcclLib, String> {
        static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
        LIB.get_or_init(|| {
            if let Ok(path) = std::env::var(NCCL_LIB_VAR) {
                return load(&path).map_err(|e| format!("NCCL from {NCCL_LIB_VAR}={path} cannot be loaded: {e}"));
            }
            let mut tried = Vec::new();
            for name in NCCL_CANDIDATES {
                match load(name) {
                    Ok(l) => return Ok(l),
                    Err(e) => tried.push(e),
                }
            }
            Err(format!(
                "no NCCL: none of {} can be loaded ({}); install NCCL (libnccl2) or set {NCCL_LIB_VAR} to its path",
                NCCL_CANDIDATES.join(", "),
                tried.join("; ")
            ))
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a library loads here, by the dynamic loader alone.
    #[cfg(feature = "cuda-driver")]
    fn loads(name: &str) -> bool {
        // SAFETY: test probe of system libraries.
        unsafe { libloading::Library::new(name) }.is_ok()
    }

    #[test]
    fn missing_cuda_is_a_clear_error_not_a_panic() {
        let r = std::panic::catch_unwind(cuda_available).expect("cuda_available never panics");
        #[cfg(not(feature = "cuda-driver"))]
        assert!(r.unwrap_err().contains("--features cuda"));
        #[cfg(feature = "cuda-driver")]
        {
            if !loads("libcuda.so.1") && !loads("libcuda.so") {
                let e = r.unwrap_err();
                assert!(
                    e.starts_with("no CUDA driver: libcuda.so.1 cannot be loaded"),
                    "{e}"
                );
            } else if r.is_err() {
                let e = r.unwrap_err();
                assert!(
                    e.starts_with("no usable CUDA device")
                        || e.starts_with("no CUDA device")
                        || e.starts_with("no NCCL"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn nccl_is_looked_for_under_its_soname() {
        assert_eq!(NCCL_CANDIDATES[0], "libnccl.so.2");
    }

    #[cfg(feature = "cuda-driver")]
    #[test]
    fn missing_nccl_names_the_candidates() {
        if loads("libnccl.so.2") || loads("libnccl.so") || std::env::var(NCCL_LIB_VAR).is_ok() {
            return;
        }
        let e = nccl().err().expect("no NCCL here");
        assert!(
            e.starts_with("no NCCL: none of libnccl.so.2, libnccl.so can be loaded"),
            "{e}"
        );
        assert!(e.contains(NCCL_LIB_VAR), "{e}");
    }
}
