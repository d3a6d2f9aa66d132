//! Opening a checkpoint: discovery of the paths' files (the formats' detection table),
//! reading them, choosing how their pieces are placed, and the checks.

use super::{shared_prefix, Checkpoint, Kind, SHARED_PREFIX_NOTE};
use crate::error::{Error, Problems, Result};
use crate::formats::detect::discover::{unknown, Discovery};
use crate::formats::{open_abreast, FileFormat, TensorFile};
use crate::layout::select::{Selection, Views};
use crate::layout::source::SourcePiece;
use crate::layout::split_rules::SplitRules;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

impl Checkpoint {
    /// Opens inputs and checks them; any problem is an error (all problems listed).
    ///
    /// # Errors
    /// Unreadable or malformed files, and every consistency or coverage problem.
    pub fn open(paths: &[PathBuf]) -> Result<Checkpoint> {
        Checkpoint::open_selected(paths, &Selection::default())
    }

    /// Like [`Checkpoint::open`], for the tensors `selection` keeps: the others are
    /// dropped, and their problems (coverage, shapes) do not count, so a merge that
    /// leaves out, say, incomplete optimizer state can go ahead. Patterns that match no
    /// tensor are added to [`Checkpoint::notes`].
    ///
    /// # Errors
    /// As [`Checkpoint::open`], for the kept tensors; a selection that keeps nothing.
    pub fn open_selected(paths: &[PathBuf], selection: &Selection) -> Result<Checkpoint> {
        let (mut ck, mut problems) = Checkpoint::scan_with(
            paths,
            selection.step(),
            selection.views(),
            selection.rules(),
        )?;
        ck.apply_renames(selection, &mut problems)?;
        let warnings = selection.review(ck.tensors.keys().map(String::as_str))?;
        ck.notes.extend(warnings);
        let keep = |name: &str| selection.keeps(name);
        ck.tensors.retain(|name, _| keep(name));
        problems.retain(|e| match e {
            Error::CoverageGap { tensor, .. }
            | Error::Overlap { tensor, .. }
            | Error::InvalidTensor { tensor, .. }
            | Error::Ambiguous { tensor, .. } => keep(tensor),
            _ => true,
        });
        if problems.is_empty() {
            Ok(ck)
        } else {
            Err(Error::Many(Problems(problems)))
        }
    }

    /// Opens inputs, collecting per-file and per-tensor problems instead of stopping at
    /// the first. Fails outright only when the inputs cannot be understood at all.
    ///
    /// # Errors
    /// Inputs that are not a checkpoint, or mixed kinds.
    pub fn scan(paths: &[PathBuf]) -> Result<(Checkpoint, Vec<Error>)> {
        Checkpoint::scan_step(paths, None)
    }

    /// [`Checkpoint::scan`] of the checkpoint of training step `step`, where the inputs
    /// hold several (see [`Selection::with_step`]).
    ///
    /// # Errors
    /// As [`Checkpoint::scan`]; no checkpoint of that step.
    pub fn scan_step(paths: &[PathBuf], step: Option<u64>) -> Result<(Checkpoint, Vec<Error>)> {
        Checkpoint::scan_views(paths, step, Views::default())
    }

    /// [`Checkpoint::scan_step`], with the reader's fused or padded tensors given as
    /// `views` says.
    ///
    /// # Errors
    /// As [`Checkpoint::scan`]; a view asked of inputs that have no such tensors.
    pub fn scan_views(
        paths: &[PathBuf],
        step: Option<u64>,
        views: Views,
    ) -> Result<(Checkpoint, Vec<Error>)> {
        Checkpoint::scan_with(paths, step, views, &SplitRules::default())
    }

    /// [`Checkpoint::scan_views`], placing the tensors of Megatron legacy and
    /// tensor-parallel DeepSpeed checkpoints by the user's `rules` first.
    pub(crate) fn scan_with(
        paths: &[PathBuf],
        step: Option<u64>,
        views: Views,
        rules: &SplitRules,
    ) -> Result<(Checkpoint, Vec<Error>)> {
        // URLs are listed into local trees (their large objects fetched on demand)
        // that discovery walks like directories; the trees live as long as the
        // checkpoint.
        let mut mirrors = Vec::new();
        let mut local = Vec::with_capacity(paths.len());
        for p in paths {
            if ckpt_storage::is_url(p) {
                let m = ckpt_storage::mirror(&ckpt_storage::ObjectUrl::parse(p)?)?;
                local.push(m.path().to_path_buf());
                mirrors.push(m);
            } else {
                local.push(p.clone());
            }
        }
        let (mut ck, problems) = Checkpoint::scan_local(&local, step, views, rules)?;
        ck.mirrors = mirrors;
        Ok((ck, problems))
    }

    fn scan_local(
        paths: &[PathBuf],
        step: Option<u64>,
        views: Views,
        rules: &SplitRules,
    ) -> Result<(Checkpoint, Vec<Error>)> {
        let mut x = Discovery::new(step);
        x.per_layer = views.per_layer;
        x.model_only = views.model_only;
        for p in paths {
            x.add(p)?;
        }
        if let (Some(step), false) = (step, x.step_taken) {
            return Err(unknown(format!(
                "--step {step}: {} hold(s) one checkpoint, not several steps to choose from (its step is not recorded where ckpt can check it): pass it without --step",
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let Discovery {
            inputs,
            carried,
            ms,
            mut notes,
            dcp,
            deepspeed,
            ucp,
            megatron,
            orbax,
            record,
            lora_meta,
            ..
        } = x;
        if let Some(dir) = megatron {
            if !inputs.is_empty() || !ms.given.is_empty() {
                return Err(unknown(format!(
                    "{}: a Megatron checkpoint is read on its own, not with other inputs",
                    dir.display()
                )));
            }
            return Checkpoint::read_megatron(&dir, carried, notes, views, rules);
        }
        if views.split_qkv {
            return Err(Error::Unsupported {
                problem: "--split-qkv: only a Megatron legacy checkpoint has fused QKV projections ckpt splits (these inputs are not one)".into(),
            });
        }
        let ms_strategy = match (ms.given.is_empty(), ms.found.len()) {
            (false, _) => ms.given,
            (true, 0) => vec![],
            (true, _) => {
                let found: Vec<PathBuf> = ms.found.into_values().flatten().collect();
                if found.len() > 1 {
                    return Err(unknown(format!(
                        "several MindSpore strategy files beside the rank directories ({}): say which with --source-strategy (several for pipeline stages)",
                        found.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    )));
                }
                notes.push(format!("MindSpore strategy: {}", found[0].display()));
                found
            }
        };
        let mut problems = Vec::new();
        let mut files = Vec::new();
        let mut strategies = Vec::new();
        let opened = open_abreast(&inputs, |input| match &input.dcp {
            Some(dir) => dcp[dir].open(&input.path),
            None => TensorFile::open(&input.path),
        });
        for (input, opened) in inputs.into_iter().zip(opened) {
            match opened {
                Ok(f) => {
                    files.push(f);
                    strategies.push(input.strategy);
                }
                Err(e) => problems.push(e),
            }
        }
        let mut ds = Vec::new();
        for dir in &deepspeed {
            match crate::formats::deepspeed_tp::read_with_rules(dir, rules) {
                Ok(d) => ds.push(d),
                Err(e) => problems.push(e),
            }
        }
        for dir in &ucp {
            match crate::formats::ucp::read(dir) {
                Ok(d) => ds.push(d),
                Err(e) => problems.push(e),
            }
        }
        for d in &mut ds {
            strategies.extend(d.files.iter().map(|_| None));
            files.append(&mut d.files);
            notes.append(&mut d.notes);
        }
        // Orbax items: one file of zarr chunks each; zarr records every array's shape.
        let mut orbax_shapes = BTreeMap::new();
        for dir in &orbax {
            match crate::formats::orbax::read(dir) {
                Ok(o) => {
                    files.push(o.file);
                    strategies.push(None);
                    notes.extend(o.notes);
                    orbax_shapes.extend(o.shapes);
                }
                Err(e) => problems.push(e),
            }
        }
        if files.is_empty() && !problems.is_empty() {
            // Nothing could be read: there is no checkpoint to describe, only why.
            return Err(Error::Many(Problems(problems)));
        }
        let sliced = strategies.iter().filter(|s| s.is_some()).count();
        // (MindSpore's split records carry offsets too, within a file's own tensor.)
        let with_offsets = files
            .iter()
            .filter(|f| f.format() != FileFormat::MindSporeCkpt)
            .filter(|f| f.tensors().iter().any(|t| t.offsets.is_some()))
            .count();
        let kind = if !ms_strategy.is_empty() {
            if sliced > 0 {
                return Err(unknown(
                    "a MindSpore strategy was given for ckpt rank directories, which have their own strategy.json".into(),
                ));
            }
            Kind::Sliced
        } else if sliced > 0 {
            if sliced != strategies.len() {
                return Err(unknown(
                    "inputs mix rank directories (with strategy.json) and other files".into(),
                ));
            }
            Kind::Sliced
        } else if with_offsets > 0 || !dcp.is_empty() {
            Kind::Dcp
        } else {
            Kind::Integrated
        };
        let mut ck = Checkpoint {
            kind,
            ranks: vec![None; files.len()],
            files,
            strategy: None,
            tensors: BTreeMap::new(),
            carried,
            notes,
            imported: None,
            recorded_args: record,
            lora_meta,
            scratch: Vec::new(),
            mirrors: Vec::new(),
        };
        // ZeRO files hold one data-parallel rank's partitions each: labelled by it.
        for (i, f) in ck.files.iter().enumerate() {
            let dp = f.metadata().get(crate::formats::deepspeed::DP_RANK);
            if let Some(r) = dp.and_then(|r| r.parse().ok()) {
                ck.ranks[i] = Some(r);
            }
        }
        let mut raw: BTreeMap<String, Vec<SourcePiece>> = BTreeMap::new();
        match kind {
            Kind::Sliced if !ms_strategy.is_empty() => {
                let refs: Vec<&Path> = ms_strategy.iter().map(PathBuf::as_path).collect();
                let params = crate::formats::mindspore_strategy::read_mindspore_strategies(&refs)?;
                ck.read_mindspore(&params, &mut raw, &mut problems)?;
            }
            Kind::Sliced => ck.read_sliced(&strategies, &mut raw, &mut problems)?,
            Kind::Dcp | Kind::Integrated => ck.read_boxes(&mut raw, &mut problems),
        }
        if kind == Kind::Dcp {
            ck.check_dcp_ranks(&mut problems);
            ck.declare_dcp_shapes(&dcp, &mut problems);
        }
        for d in &ds {
            ck.declare_shapes(&d.shapes, &mut problems);
        }
        ck.declare_shapes(&orbax_shapes, &mut problems);
        ck.declare_dtensor_shapes(&mut problems);
        ck.assemble(raw, &mut problems);
        for (alias, of) in ds.iter().flat_map(|d| &d.aliases) {
            if let Some(t) = ck.tensors.get(of).cloned() {
                ck.tensors.insert(alias.clone(), t);
            }
        }
        for f in &ck.files {
            if let Some(list) = f.metadata().get("torch.non_tensor") {
                let all: Vec<&str> = list.split(',').collect();
                let shown = all.iter().take(8).copied().collect::<Vec<_>>().join(", ");
                let more = if all.len() > 8 { ", ..." } else { "" };
                ck.notes.push(format!(
                    "{}: {} value(s) that are not tensors are not carried: {shown}{more}",
                    f.path().display(),
                    all.len()
                ));
            }
        }
        // A PEFT-wrapped model's `base_model.` is no wrapper to strip: its adapters are
        // merged for --format hf.
        if ck.is_peft_wrapped() && !ck.tensors.keys().any(|n| n.contains(".base_layer.")) {
            ck.notes.push(
                "the tensors are a PEFT-wrapped model's LoRA adapters alone (verl's `save_lora_only`): there are no base weights here to merge them into, so --format hf and gguf refuse: export the adapter with verl's model merger and merge it into the base model with --lora".into(),
            );
        } else if ck.is_peft_wrapped() {
            ck.notes.push(format!(
                "the tensors are a PEFT-wrapped model's (LoRA layers under `base_model.model.`): --format hf and gguf merge the adapters into the base weights (r and lora_alpha from {}, or --lora-alpha); other formats keep them as saved, unmerged",
                ck.lora_meta.as_ref().map_or_else(|| "lora_train_meta.json".into(), |p| p.display().to_string())
            ));
        } else if let Some(p) = shared_prefix(ck.tensors.keys().map(String::as_str)) {
            ck.notes.push(format!(
                "{SHARED_PREFIX_NOTE} `{p}` (DDP's `module.` wrapper, for one): --strip-prefix {p} removes it"
            ));
        }
        Ok((ck, problems))
    }

    /// Applies a selection's renames (`--strip-prefix`, `--add-prefix`) to the tensors
    /// and to the problems found so far, which name them; the note suggesting a strip
    /// goes once it is done.
    ///
    /// # Errors
    /// Two tensors that would get the same name.
    pub fn apply_renames(&mut self, selection: &Selection, problems: &mut [Error]) -> Result<()> {
        if !selection.renames() {
            return Ok(());
        }
        self.rename(|n| selection.rename(n))?;
        for e in problems {
            if let Error::CoverageGap { tensor, .. }
            | Error::Overlap { tensor, .. }
            | Error::InvalidTensor { tensor, .. }
            | Error::Ambiguous { tensor, .. } = e
            {
                *tensor = selection.rename(tensor);
            }
        }
        self.notes.retain(|n| !n.starts_with(SHARED_PREFIX_NOTE));
        Ok(())
    }

    /// Renames every tensor by `rename` (the strategy's layouts too).
    ///
    /// # Errors
    /// Two tensors that would get the same name.
    pub fn rename(&mut self, rename: impl Fn(&str) -> String) -> Result<()> {
        let mut out = BTreeMap::new();
        for (name, t) in std::mem::take(&mut self.tensors) {
            let new = rename(&name);
            if out.insert(new.clone(), t).is_some() {
                return Err(Error::Unsupported {
                    problem: format!(
                        "renaming gives two tensors the name `{new}` (one was `{name}`)"
                    ),
                });
            }
        }
        self.tensors = out;
        if let Some(s) = &mut self.strategy {
            s.tensors = std::mem::take(&mut s.tensors)
                .into_iter()
                .map(|(n, l)| (rename(&n), l))
                .collect();
        }
        Ok(())
    }
}
