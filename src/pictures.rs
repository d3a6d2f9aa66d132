//! `ckpt inspect --show` and `--html`: the layout pictures (drawn by ckpt-core).

use anyhow::Result;
use ckpt_core::Selection;
use serde_json::json;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Colours only on a terminal, and never when `NO_COLOR` is set to anything
/// (<https://no-color.org>).
fn colour() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Draws the tensors matching `show` and/or writes the HTML report to `html`. Exit 1
/// when the checkpoint has problems (they are drawn, and listed in the report).
pub(crate) fn run(
    paths: &[PathBuf],
    sel: &Selection,
    show: Option<String>,
    html: Option<PathBuf>,
    as_json: bool,
) -> Result<ExitCode> {
    let (ck, problems) = ckpt_core::verify_selected(paths, sel, ckpt_core::VerifyDepth::default())?;
    if let Some(pattern) = &show {
        if as_json {
            let tensors = ckpt_core::matching(&ck, pattern)?
                .into_iter()
                .map(|name| {
                    let t = &ck.tensors[&name];
                    Ok(json!({
                        "name": name, "shape": t.shape, "dtype": ckpt_core::dtype_name(t.dtype),
                        "pieces": ckpt_core::pieces_json(&ck, &name)?,
                    }))
                })
                .collect::<ckpt_core::Result<Vec<_>>>()?;
            let files: Vec<_> = (0..ck.files.len())
                .map(|i| json!({"path": ck.files[i].path(), "rank": ck.ranks[i]}))
                .collect();
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"tensors": tensors, "files": files}))?
            );
        } else {
            let canvas = ckpt_core::Canvas {
                color: colour(),
                ..ckpt_core::Canvas::default()
            };
            print!("{}", ckpt_core::show(&ck, pattern, &canvas)?);
        }
    }
    if let Some(dest) = &html {
        let title = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let bytes = ckpt_core::write_html_report(&ck, &problems, &title, dest)?;
        if !as_json || show.is_none() {
            eprintln!(
                "wrote {} ({} tensors, {})",
                dest.display(),
                ck.tensors.len(),
                crate::report::human_bytes(bytes)
            );
        }
    }
    for p in &problems {
        eprintln!("ckpt: problem: {p}");
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
