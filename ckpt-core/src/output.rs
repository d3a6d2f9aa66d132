//! `StagedDir`: an output directory that appears complete or not at all.

use crate::error::{Error, IoContext, Result};
use std::path::{Path, PathBuf};

/// A directory built under a temporary name beside its destination and renamed into
/// place by [`StagedDir::commit`]; dropped uncommitted, it is removed.
#[derive(Debug)]
pub struct StagedDir {
    dest: PathBuf,
    tmp: PathBuf,
    force: bool,
    done: bool,
}

impl StagedDir {
    /// Starts building `dest`.
    ///
    /// # Errors
    /// `dest` exists and `force` is false; I/O errors.
    pub fn new(dest: &Path, force: bool) -> Result<StagedDir> {
        if dest.exists() && !force {
            return Err(Error::OutputExists {
                path: dest.to_path_buf(),
            });
        }
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).at(&parent)?;
        crate::formats::safetensors::remove_stale_temps(dest);
        let tmp = crate::formats::safetensors::temp_name(dest);
        std::fs::create_dir(&tmp).at(&tmp)?;
        Ok(StagedDir {
            dest: dest.to_path_buf(),
            tmp,
            force,
            done: false,
        })
    }

    /// Where to write the contents.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Moves the finished directory into place (replacing an old one when forced).
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn commit(mut self) -> Result<()> {
        std::fs::File::open(&self.tmp)
            .and_then(|d| d.sync_all())
            .at(&self.tmp)?;
        if self.dest.exists() {
            if !self.force {
                return Err(Error::OutputExists {
                    path: self.dest.clone(),
                });
            }
            let old = crate::formats::safetensors::temp_name(&self.dest);
            std::fs::rename(&self.dest, &old).at(&self.dest)?;
            std::fs::rename(&self.tmp, &self.dest).at(&self.dest)?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&self.tmp, &self.dest).at(&self.dest)?;
        }
        self.done = true;
        Ok(())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Refuses an output that lies inside (or is) one of the inputs.
///
/// # Errors
/// [`Error::Unsupported`] naming both paths.
pub fn check_output_outside_inputs(out: &Path, inputs: &[PathBuf]) -> Result<()> {
    let abs = |p: &Path| -> PathBuf {
        std::fs::canonicalize(p).unwrap_or_else(|_| {
            // Not there yet: resolve the parent instead.
            match (p.parent(), p.file_name()) {
                (Some(par), Some(name)) if !par.as_os_str().is_empty() => {
                    std::fs::canonicalize(par)
                        .unwrap_or_else(|_| par.to_path_buf())
                        .join(name)
                }
                _ => std::env::current_dir().unwrap_or_default().join(p),
            }
        })
    };
    let o = abs(out);
    for i in inputs {
        let i_abs = abs(i);
        // A file input only forbids outputs that are it or contain it: a new directory
        // beside it (`merge /data/model.safetensors -o /data/merged`) touches nothing.
        let overlaps = if i_abs.is_file() {
            i_abs.starts_with(&o)
        } else {
            o.starts_with(&i_abs) || i_abs.starts_with(&o)
        };
        if overlaps {
            return Err(Error::Unsupported {
                problem: format!(
                    "output {} overlaps input {}: write it elsewhere",
                    out.display(),
                    i.display()
                ),
            });
        }
    }
    Ok(())
}

/// Copies the carried files (`config.json`, `trainer_state.json`) into `dir`.
///
/// # Errors
/// I/O errors, with the path.
pub fn copy_carried(
    carried: &std::collections::BTreeMap<String, PathBuf>,
    dir: &Path,
) -> Result<()> {
    for (name, from) in carried {
        let bytes = std::fs::read(from).at(from)?;
        crate::formats::safetensors::write_file_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}
