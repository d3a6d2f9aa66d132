//! `ckpt inspect --show` and `--html`: the layout pictures (drawn by ckpt-core).

use anyhow::Result;
use ckpt_core::layout::select::Selection;
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
    let (ck, problems) = ckpt_core::engine::verify::verify_selected(
        paths,
        sel,
        ckpt_core::engine::verify::VerifyDepth::default(),
    )?;
    if let Some(pattern) = &show {
        if as_json {
            let tensors = ckpt_core::draw::matching(&ck, pattern)?
                .into_iter()
                .map(|name| {
                    let t = &ck.tensors[&name];
                    Ok(json!({
                        "name": name, "shape": t.shape, "dtype": ckpt_core::layout::strategy::dtype_name(t.dtype),
                        "pieces": ckpt_core::draw::pieces_json(&ck, &name)?,
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
            let canvas = ckpt_core::draw::Canvas {
                color: colour(),
                ..ckpt_core::draw::Canvas::default()
            };
            print!("{}", ckpt_core::draw::show(&ck, pattern, &canvas)?);
        }
    }
    if let Some(dest) = &html {
        let title = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let bytes = ckpt_core::draw::write_html_report(&ck, &problems, &title, dest)?;
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

#[cfg(test)]
mod tests {
    use crate::cli::Cli;
    use clap::Parser;

    #[test]
    fn picture_flags_parse() {
        assert!(Cli::try_parse_from(["ckpt", "inspect", "a", "--show", "layers.*.weight"]).is_ok());
        assert!(
            Cli::try_parse_from(["ckpt", "inspect", "a", "--html", "r.html", "--show", "w"])
                .is_ok()
        );
        // --show needs a tensor; --html a file.
        assert!(Cli::try_parse_from(["ckpt", "inspect", "a", "--show"]).is_err());
        assert!(Cli::try_parse_from(["ckpt", "inspect", "a", "--html"]).is_err());
        // A plan page only with --plan: a reshard that writes must not also draw.
        let base = [
            "ckpt", "reshard", "a", "-o", "b", "--to", "2", "--html", "p.html",
        ];
        assert!(Cli::try_parse_from(base).is_err());
        assert!(Cli::try_parse_from(base.into_iter().chain(["--plan"])).is_ok());
    }
}
