//! The native part of the `ckpt` Python package (`ckpt._ckpt`): thin wrappers over
//! ckpt-core, ckpt-merge and ckpt-reshard. The Python files in `python/ckpt/` give the
//! public API (`ckpt.load`, `ckpt.torch.load_state_dict`, ...); this module is private.

mod checkpoint;
mod errors;
mod load;
mod names;
mod ops;
mod run_cli;
mod save;

// The `ckpt` command, from the binary's own sources: `ckpt` installed by pip is the same
// CLI as `cargo install`'s, with no second copy of its code.
#[path = "../../src/args.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod args;
#[path = "../../src/cli.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod cli;
#[path = "../../src/commands.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod commands;
#[path = "../../src/demo.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod demo;
#[path = "../../src/pictures.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod pictures;
#[path = "../../src/report.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod report;

use pyo3::prelude::*;

#[pymodule]
fn _ckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<checkpoint::PyCheckpoint>()?;
    m.add_class::<load::LoadPlan>()?;
    m.add_class::<load::Chunks>()?;
    m.add_function(wrap_pyfunction!(ops::merge, m)?)?;
    m.add_function(wrap_pyfunction!(ops::reshard, m)?)?;
    m.add_function(wrap_pyfunction!(ops::verify, m)?)?;
    m.add_function(wrap_pyfunction!(ops::inspect, m)?)?;
    m.add_function(wrap_pyfunction!(ops::convert, m)?)?;
    m.add_function(wrap_pyfunction!(save::strategy_json, m)?)?;
    m.add_function(wrap_pyfunction!(save::write_rank, m)?)?;
    m.add_function(wrap_pyfunction!(save::prepare_remote_output, m)?)?;
    m.add_function(wrap_pyfunction!(save::stream_remote, m)?)?;
    m.add_function(wrap_pyfunction!(save::stage_remote, m)?)?;
    m.add_class::<save::RemoteStream>()?;
    m.add_function(wrap_pyfunction!(save::commit_remote, m)?)?;
    m.add_function(wrap_pyfunction!(run_cli::cli_main, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
