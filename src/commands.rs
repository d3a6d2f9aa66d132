//! One function per subcommand: the parsed arguments turned into the library's typed
//! request, the library called, and what the library says about the result printed.
//! No checkpoint logic and no report wording lives here (`ckpt_core::present::inspect_text`,
//! `verify_text`, `CopySummary`, `TrainReport::summary_text`, `InferReport::text`, ...).

use crate::args::lists::flat;
use crate::args::{
    ConvertArgs, CopyArgs, ExampleArgs, InferArgs, Inputs, MergeArgs, ReshardArgs, TrainArgs, Usage,
};
use crate::report::bytes_bar;
use anyhow::{bail, Context, Result};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::plan::CopyPlan;
use ckpt_core::layout::select::Selection;
use ckpt_core::Checkpoint;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Problems printed are problems found: the exit code says so too.
fn found(problems: &[ckpt_core::Error]) -> ExitCode {
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

pub(crate) fn inspect(paths: &[PathBuf], sel: &Selection, as_json: bool) -> Result<ExitCode> {
    let (ck, problems) = ckpt_core::engine::verify::verify_selected(
        paths,
        sel,
        ckpt_core::engine::verify::VerifyDepth::default(),
    )?;
    if as_json {
        let doc = ckpt_core::present::inspect_json(&ck, &problems);
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", ckpt_core::present::inspect_text(&ck, &problems));
    }
    ck.drop_at_exit();
    Ok(found(&problems))
}

pub(crate) fn verify(
    paths: &[PathBuf],
    sel: &Selection,
    depth: ckpt_core::engine::verify::VerifyDepth,
    as_json: bool,
) -> Result<ExitCode> {
    let (ck, problems) = match ckpt_core::engine::verify::verify_selected(paths, sel, depth) {
        Ok(x) => x,
        Err(e) => {
            // (Objects of a bucket are read through local trees: named as objects.)
            let e = ckpt_core::storage::unmirror_text(&e.to_string());
            if as_json {
                println!("{}", json!({"ok": false, "problems": [e]}));
            } else {
                println!("{e}");
            }
            return Ok(ExitCode::from(1));
        }
    };
    if as_json {
        let doc = ckpt_core::present::verify_json(&ck, &problems);
        let text = serde_json::to_string_pretty(&doc)?;
        println!("{}", ckpt_core::storage::unmirror_text(&text));
    } else {
        let text = ckpt_core::present::verify_text(&ck, &problems, depth);
        print!("{}", ckpt_core::storage::unmirror_text(&text));
    }
    ck.drop_at_exit();
    Ok(found(&problems))
}

/// Runs a copying command with a byte progress bar (sized once the plan is known) and
/// prints its summary.
fn with_progress(
    verb: &str,
    out: &std::path::Path,
    copy: &CopyArgs,
    run: impl FnOnce(
        &(dyn Fn(u64) + Sync),
        &dyn Fn(&Checkpoint, &CopyPlan),
    ) -> ckpt_core::Result<ckpt_core::engine::copy::CopyStats>,
) -> Result<ExitCode> {
    if copy.no_checksums {
        ckpt_core::formats::checksum::set_checksums_enabled(false);
    }
    let t = Instant::now();
    let bar = std::sync::OnceLock::new();
    // Distinct tensors and files of the plan: a reshard writes several pieces of a tensor.
    let shape = std::sync::OnceLock::new();
    let stats = run(
        &|n| {
            if let Some(b) = bar.get() {
                indicatif::ProgressBar::inc(b, n);
            }
        },
        &|source: &Checkpoint, p: &CopyPlan| {
            for note in &source.notes {
                eprintln!("ckpt: note: {note}");
            }
            let _ = bar.set(bytes_bar(p.bytes_written(), copy.quiet || copy.json));
            let names: std::collections::BTreeSet<&str> = p
                .files
                .iter()
                .flat_map(|f| f.tensors.iter().map(|t| t.target.name.as_str()))
                .collect();
            let _ = shape.set((names.len() as u64, p.files.len() as u64));
        },
    );
    if let Some(b) = bar.get() {
        b.finish_and_clear();
    }
    let (names, files) = shape.get().copied().unwrap_or((0, 0));
    let summary = ckpt_core::present::CopySummary {
        verb,
        stats: &stats?,
        names,
        files,
        seconds: t.elapsed().as_secs_f64(),
        output: out,
    };
    if copy.json {
        println!("{}", summary.json());
    } else {
        print!("{}", summary.text());
    }
    Ok(ExitCode::SUCCESS)
}

/// The tensors a copy keeps, and their names.
fn selection(copy: &CopyArgs, inputs: &Inputs) -> Result<Selection> {
    // `--include A B in`: B, read as an input, was meant as a second pattern.
    if let Some(p) = inputs.paths.iter().find(|p| {
        std::fs::symlink_metadata(p).is_err()
            && p.to_str().is_some_and(|s| s.contains(['*', '?', '[', '{']))
    }) {
        return Err(Usage(format!(
            "{}: no such file or directory, and it looks like a pattern: a list option takes one value each time, so repeat it (--include A --include B) or separate the values with commas (--include A,B)",
            p.display()
        ))
        .into());
    }
    let (include, exclude) = (flat(&copy.include), flat(&copy.exclude));
    let cast = match copy.dtype {
        Some(crate::args::Cast::Q8_0) => {
            return Err(Usage("--dtype q8_0 goes with --format gguf".into()).into())
        }
        c => c.and_then(crate::args::Cast::dtype),
    };
    Ok(Selection::new(&include, &exclude, cast)?
        .with_prefixes(
            copy.names.strip_prefix.clone(),
            copy.names.add_prefix.clone(),
        )
        .with_step(inputs.step)
        .with_rules(inputs.rules()?))
}

pub(crate) fn merge(mut a: MergeArgs) -> Result<ExitCode> {
    let output = ckpt_core::output_at(&a.output, a.copy.force)?;
    let gguf = a.format == "gguf";
    // --format gguf: --dtype names the GGUF's type (the writer keeps norms F32).
    let gguf_type = if gguf {
        let ty = match a.copy.dtype {
            None => None,
            Some(crate::args::Cast::Q8_0) => Some(ckpt_core::formats::gguf::GgmlType::Q8_0),
            Some(crate::args::Cast::Dtype(d)) => Some(
                ckpt_core::formats::gguf::GgmlType::from_name(
                    &ckpt_core::layout::strategy::dtype_name(d).to_ascii_lowercase(),
                )
                .ok_or_else(|| {
                    Usage(format!(
                        "--format gguf: --dtype {} is not a type it writes (f32, f16, bf16, q8_0)",
                        ckpt_core::layout::strategy::dtype_name(d)
                    ))
                })?,
            ),
        };
        if ty == Some(ckpt_core::formats::gguf::GgmlType::Q8_0) {
            a.copy.dtype = None;
        }
        ty
    } else {
        None
    };
    let req = ckpt_merge::MergeRequest {
        inputs: a.inputs.all()?,
        output: output.path().to_path_buf(),
        max_shard_size: a.max_shard_size,
        selection: selection(&a.copy, &a.inputs)?.with_views(ckpt_core::layout::select::Views {
            split_qkv: a.split_qkv,
            unpad_vocab: !a.keep_vocab_padding,
            // A Hugging Face model has a tensor a layer.
            per_layer: a.per_layer || a.format == "hf" || gguf,
            model_only: a.format == "hf" || gguf,
        }),
        force: a.copy.force,
        one_file: a.one_file,
        format: ckpt_merge::MergeFormat::from_name(&a.format)
            .ok_or_else(|| Usage(format!("--format `{}`", a.format)))?,
        compression: a.copy.compress,
        share: merge_share(a.rank.as_deref(), a.world_size)?,
        hf: ckpt_core::checkpoint::HfTarget {
            config: a.hf_config,
            arch: a.hf_arch,
        },
        tokenizer: a.tokenizer,
        computations: a.compute.computations(),
        orbax_item: a.orbax.item_for(&a.format)?,
        gguf_type,
    };
    if req.format == ckpt_merge::MergeFormat::Hf && a.split_qkv {
        return Err(Usage(
            "--split-qkv does not apply to --format hf: the model family's table splits the QKV projection as the Hugging Face model needs".into(),
        )
        .into());
    }
    if !matches!(
        req.format,
        ckpt_merge::MergeFormat::Hf | ckpt_merge::MergeFormat::Gguf
    ) && (req.hf.config.is_some() || req.hf.arch.is_some() || req.tokenizer.is_some())
    {
        return Err(Usage(
            "--hf-config, --hf-arch and --tokenizer go with --format hf or gguf".into(),
        )
        .into());
    }
    if a.plan {
        let (source, plan) = ckpt_merge::prepare(&req)?;
        if a.copy.json {
            let doc = ckpt_core::present::merge_plan_json(&source, &plan);
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            print!("{}", ckpt_core::present::merge_plan_text(&source, &plan));
        }
        return Ok(ExitCode::SUCCESS);
    }
    with_progress("merged", &a.output, &a.copy, |progress, on_plan| {
        let stats = ckpt_merge::merge(&req, progress, on_plan)?;
        output.publish()?;
        Ok(stats)
    })
}

impl crate::args::OrbaxItemArg {
    /// The item name for an output of `--format format` (merge's or reshard's), or the
    /// usage error where `--orbax-item` does not go with it: only `orbax` takes one;
    /// `maxtext` always writes MaxText's item and takes that name alone.
    fn item_for(&self, format: &str) -> Result<Option<String>> {
        match (format, self.orbax_item.as_deref()) {
            (_, None) => Ok(None),
            ("orbax", Some(item)) => Ok(Some(item.to_string())),
            ("maxtext", Some(item)) if item == ckpt_core::checkpoint::MAXTEXT_ITEM => Ok(None),
            ("maxtext", Some(item)) => Err(Usage(format!(
                "--format maxtext writes MaxText's item `{}` (its load_parameters_path is OUT/{}): --orbax-item `{item}` does not apply",
                ckpt_core::checkpoint::MAXTEXT_ITEM,
                ckpt_core::checkpoint::MAXTEXT_ITEM
            ))
            .into()),
            (_, Some(_)) => Err(Usage("--orbax-item goes with --format orbax".into()).into()),
        }
    }
}

/// `merge --rank`: this process's share of the output files, `(rank, world size)`, from
/// the launcher (`auto`) or from `--rank N --world-size M`.
fn merge_share(rank: Option<&str>, world_size: Option<u64>) -> Result<Option<(u64, u64)>> {
    match (rank, world_size) {
        (None, None) => Ok(None),
        (None, Some(m)) => Err(Usage(format!(
            "--world-size {m} goes with --rank N (which share of the output files this process writes)"
        ))
        .into()),
        (Some("auto"), None) => Ok(Some(launch_share()?)),
        (Some("auto"), Some(m)) => Err(Usage(format!(
            "--world-size {m} goes with --rank N; --rank auto takes it from the launcher"
        ))
        .into()),
        (Some(r), None) => Err(Usage(format!(
            "--rank {r}: give --world-size M too (how many processes share the output files), or --rank auto under mpirun, srun or torchrun"
        ))
        .into()),
        (Some(r), Some(m)) => {
            // Checked by parse_rank.
            let n: u64 = r.parse().map_err(|_| Usage(format!("--rank `{r}`")))?;
            if n >= m {
                return Err(Usage(format!(
                    "--rank {n} with --world-size {m}: ranks are 0 to {}",
                    m - 1
                ))
                .into());
            }
            Ok(Some((n, m)))
        }
    }
}

/// This process's share of partitioned work: `(rank, world size)` from the launcher.
fn launch_share() -> Result<(u64, u64)> {
    let env = ckpt_core::launch::LaunchEnv::from_env()?.context(
        "--rank auto: no launcher variables (OMPI_COMM_WORLD_RANK, PMI_RANK, RANK or SLURM_PROCID) are set",
    )?;
    Ok((env.rank as u64, env.world_size as u64))
}

pub(crate) fn reshard(a: ReshardArgs) -> Result<ExitCode> {
    let target = if let Some(n) = a.to {
        ckpt_reshard::Target::To(n)
    } else if let Some(m) = &a.mesh {
        ckpt_reshard::Target::from_mesh(m)?
    } else if let Some(s) = &a.strategy {
        ckpt_reshard::Target::from_strategy_file(s).context("--strategy")?
    } else {
        bail!("give --to, --mesh or --strategy");
    };
    let ranks = match a.rank.as_deref() {
        None => ckpt_reshard::Ranks::All,
        // One share per process of the job that started this one.
        Some("auto") => {
            let (index, count) = launch_share()?;
            ckpt_reshard::Ranks::Share { index, count }
        }
        // Checked by parse_rank.
        Some(r) => ckpt_reshard::Ranks::One(r.parse().map_err(|_| Usage(format!("--rank `{r}`")))?),
    };
    if a.format == ckpt_reshard::OLD_DCP_NAME {
        eprintln!("ckpt: note: {}", ckpt_reshard::OLD_DCP_NOTE);
    }
    let output = ckpt_core::output_at(&a.output, a.copy.force)?;
    let req = ckpt_reshard::ReshardRequest {
        inputs: a.inputs.all()?,
        output: output.path().to_path_buf(),
        target,
        ranks,
        selection: selection(&a.copy, &a.inputs)?,
        // MindSpore loads each rank's parameters from that rank's file alone.
        keep_all: a.keep_all || a.format == "mindspore",
        force: a.copy.force,
        shard: flat(&a.shard),
        compression: a.copy.compress,
        format: ckpt_reshard::OutputFormat::from_name(&a.format)
            .ok_or_else(|| Usage(format!("--format `{}`", a.format)))?,
        computations: a.compute.computations(),
        orbax_item: a.orbax.item_for(&a.format)?,
        maxtext_unscanned: match (a.maxtext_scan_layers, a.format.as_str()) {
            (None, _) => false,
            (Some(scan), "maxtext") => !scan,
            (Some(_), _) => {
                return Err(Usage("--maxtext-scan-layers goes with --format maxtext".into()).into())
            }
        },
    };
    if req.format == ckpt_reshard::OutputFormat::DeepSpeed && !a.plan {
        let t = Instant::now();
        let s = ckpt_reshard::reshard_deepspeed(&req)?;
        output.publish()?;
        let seconds = t.elapsed().as_secs_f64();
        if a.copy.json {
            println!(
                "{}",
                json!({"files": s.files, "tensors": s.tensors, "bytes_written": s.bytes,
                       "seconds": seconds, "output": a.output})
            );
        } else {
            println!(
                "wrote {} optimizer-states file(s) of {} tensors, {} in {seconds:.2} s into {}",
                s.files,
                s.tensors,
                ckpt_core::present::human_bytes(s.bytes),
                a.output.display()
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if a.plan {
        let (source, strategy, plan) = ckpt_reshard::prepare(&req)?;
        if a.copy.json {
            let doc = ckpt_core::present::plan_json(&source, &strategy, &plan);
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            print!(
                "{}",
                ckpt_core::present::plan_text(&source, &strategy, &plan)
            );
        }
        if let Some(dest) = &a.html {
            let title = req
                .inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" ");
            ckpt_core::draw::write_plan_html(
                &source,
                &plan,
                &strategy.mesh.to_string(),
                &title,
                dest,
            )?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    with_progress("resharded", &a.output, &a.copy, |progress, on_plan| {
        let stats = ckpt_reshard::reshard(&req, progress, on_plan)?;
        output.publish()?;
        Ok(stats)
    })
}

pub(crate) fn convert(
    a: ConvertArgs,
    how: ckpt_core::engine::convert::Conversion,
) -> Result<ExitCode> {
    let t = Instant::now();
    let output = ckpt_core::output_at(&a.output, a.force)?;
    let s = ckpt_core::engine::convert::convert(&a.source, output.path(), how, a.force)?;
    output.publish()?;
    let secs = t.elapsed().as_secs_f64();
    if a.json {
        println!("{}", ckpt_core::present::convert_json(&s, secs, &a.output));
    } else {
        print!(
            "{}",
            ckpt_core::present::convert_text(how, &s, secs, &a.output)
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn example(a: ExampleArgs) -> Result<ExitCode> {
    let mesh = Mesh::parse(&a.mesh)?;
    let model = ckpt_core::engine::example::ExampleModel {
        hidden: a.hidden,
        layers: a.layers,
        vocab: a.vocab,
        dtype: a.dtype,
        optimizer: a.optimizer,
    };
    let output = ckpt_core::output_at(&a.output, a.force)?;
    let staged = ckpt_core::formats::output::StagedDir::new(output.path(), a.force)?;
    let s = ckpt_core::engine::example::write_example(staged.path(), &model, &mesh)?;
    staged.commit()?;
    output.publish()?;
    println!(
        "wrote a {}-rank example checkpoint ({} tensors, mesh {}) to {}",
        mesh.world_size(),
        s.tensors.len(),
        mesh,
        a.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Whether this process prints the results: always, unless a launcher (mpirun, srun,
/// torchrun) started it as a rank other than 0.
fn is_lead() -> Result<bool> {
    Ok(ckpt_core::launch::LaunchEnv::from_env()?.is_none_or(|e| e.rank == 0))
}

pub(crate) fn train(a: TrainArgs) -> Result<ExitCode> {
    ckpt_train::configure_cpu_threads(ckpt_train::ranks_in_process(
        a.config.backend,
        a.config.mesh.as_deref(),
        a.config.ranks,
    ));
    let report = ckpt_train::train(&a.config, !(a.quiet || a.json))?;
    if !is_lead()? {
        return Ok(ExitCode::SUCCESS);
    }
    // TensorBoard's curves beside the checkpoints (written during the run):
    // `tensorboard --logdir OUT`.
    let events = report.events.clone();
    if a.json {
        println!("{}", report.summary_json(events.as_deref()));
    } else {
        print!("{}", report.summary_text(events.as_deref()));
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn infer(a: InferArgs) -> Result<ExitCode> {
    ckpt_train::configure_cpu_threads(ckpt_train::ranks_in_process(a.backend, None, a.ranks));
    let req = ckpt_infer::InferRequest {
        checkpoint: a.checkpoint,
        data: a.data,
        ranks: a.ranks,
        batch_size: a.batch_size,
        predict: if a.predict.is_empty() {
            None
        } else {
            Some(
                ckpt_infer::parse_predict(&a.predict)
                    .map_err(|e| Usage(format!("--predict {e}")))?,
            )
        },
        limit: a.limit,
        backend: a.backend,
        device: a.device,
    };
    let r = ckpt_infer::infer(&req)?;
    if !is_lead()? {
        return Ok(ExitCode::SUCCESS);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.text());
    }
    Ok(ExitCode::SUCCESS)
}
