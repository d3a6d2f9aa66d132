//! Trainers' save directories, read as a whole: which step, where its weights are,
//! the model config and tokenizer the trainer kept beside them. A trainer's output
//! directory holds one directory per saved step (`checkpoint-N/`, `global_step_N/`,
//! `step-N/`, `epoch=E-step=N.ckpt/`) among files that are not the model (RNG states,
//! schedulers, optimizer shards, the trainer's own arguments): read as files of the
//! model, those are silently wrong. So a trainer's directory is recognised by what it
//! holds as a whole, the step is chosen as the trainer would resume (its tracker file,
//! else the highest complete step, or `--step N`), and only the weights are handed to
//! the formats' discovery. A directory with a trainer's side files that no row here
//! knows is refused by discovery rather than read file by file ([`side_files`]).
//!
//! Each trainer is one row of [`TRAINERS`]: how its step directories are named, the
//! tracker it writes, how a step directory is told by its files, and where in it the
//! weights, config and tokenizer are (read from each trainer's source: see
//! docs/trainers.md).

use crate::error::{Error, Result};
use crate::formats::megatron::{args_of_run_config, Args, COMMON_FILE, DIST_METADATA_FILE};
use crate::formats::{distcp, list_dir, orbax};
use crate::hf::TOKENIZER_FILES;
use std::path::{Path, PathBuf};

/// The file verl's FSDP checkpoint manager writes beside the shards of a LoRA run
/// (`FSDPCheckpointManager._save_lora_train_meta`: `{"r", "lora_alpha", "task_type"}`).
pub(crate) const LORA_TRAIN_META: &str = "lora_train_meta.json";

/// What a trainer's save holds at the step chosen.
#[derive(Clone, Debug)]
pub(crate) struct StepContents {
    /// The paths discovery reads as the model's weights (a format's directory or files).
    pub(crate) weights: Vec<PathBuf>,
    /// The model's Hugging Face `config.json` the trainer kept, where it keeps one.
    pub(crate) config: Option<PathBuf>,
    /// The tokenizer files the trainer kept.
    pub(crate) tokenizer: Vec<PathBuf>,
    /// The model's sizes the trainer recorded in Megatron's terms (Megatron-Bridge's
    /// `run_config.yaml`, NeMo's `context/model.yaml`), as Megatron-LM's args, and the
    /// file they were read from.
    pub(crate) record: Option<(Args, PathBuf)>,
    /// What else was decided (which subdirectory, what is not read).
    pub(crate) notes: Vec<String>,
    /// The trainer as messages name it, where the step's files say more than the row
    /// (verl's Megatron backend).
    pub(crate) trainer: Option<&'static str>,
    /// Where the trainer records a LoRA run's rank and alpha, where its shards hold a
    /// PEFT-wrapped model (verl's `actor/lora_train_meta.json`; may be missing).
    pub(crate) lora_meta: Option<PathBuf>,
}

/// A trainer's save found at a path.
#[derive(Clone, Debug)]
pub(crate) struct TrainerSave {
    /// The trainer, as messages name it.
    pub(crate) trainer: &'static str,
    /// The step chosen, where its directory's name says it.
    pub(crate) step: Option<u64>,
    /// Its step directory.
    pub(crate) step_dir: PathBuf,
    /// Why that step (`--step`, the tracker, the highest complete one).
    pub(crate) why: String,
    /// What the step holds.
    pub(crate) contents: StepContents,
    /// Whether `--step` chose it.
    pub(crate) step_taken: bool,
}

/// A row of the trainers' table.
struct Trainer {
    /// The trainer, as messages name it.
    name: &'static str,
    /// How its step directories are spelt (for messages).
    spelled: &'static str,
    /// The step a step directory's name says.
    step_of: fn(&str) -> Option<u64>,
    /// The file beside the step directories naming the newest (its text the step).
    tracker: Option<&'static str>,
    /// Whether a directory is one of this trainer's step directories, by its files.
    is_step: fn(&Path) -> bool,
    /// Where the weights, config and tokenizer of a step directory are; an error when
    /// the step is incomplete (a save interrupted) or holds no weights ckpt reads.
    contents: fn(&Path) -> Result<StepContents>,
    /// For a trainer whose step directories' names do not say the step (NeMo): the one
    /// it resumes from among a directory's, and why.
    resumes_from: Option<ResumesFrom>,
}

/// [`Trainer::resumes_from`]: the step directory and why.
type ResumesFrom = fn(&Path) -> Option<(PathBuf, String)>;

/// Step directories by step.
type Steps = Vec<(u64, PathBuf)>;

/// The trainers whose saves ckpt reads as a whole. A directory is one trainer's at
/// most: the step directories' names and files tell them apart (a test checks this on
/// every committed fixture).
static TRAINERS: [Trainer; 7] = [
    Trainer {
        name: "Hugging Face Trainer",
        spelled: "checkpoint-<N>/",
        step_of: hf_trainer_step,
        tracker: None,
        is_step: is_hf_trainer_step,
        contents: hf_trainer_contents,
        resumes_from: None,
    },
    Trainer {
        name: "verl",
        spelled: "global_step_<N>/",
        step_of: verl_step,
        tracker: Some("latest_checkpointed_iteration.txt"),
        is_step: is_verl_step,
        contents: verl_contents,
        resumes_from: None,
    },
    Trainer {
        name: "torchtitan",
        spelled: "step-<N>/",
        step_of: torchtitan_step,
        tracker: None,
        is_step: is_torchtitan_step,
        contents: dcp_step_contents,
        resumes_from: None,
    },
    Trainer {
        name: "Lightning",
        spelled: "<...>step=<N>.ckpt/",
        step_of: lightning_step,
        tracker: None,
        is_step: is_lightning_step,
        contents: lightning_contents,
        resumes_from: None,
    },
    Trainer {
        name: "Megatron-Bridge",
        spelled: "iter_<NNNNNNN>/",
        step_of: bridge_step,
        tracker: Some("latest_checkpointed_iteration.txt"),
        is_step: is_bridge_step,
        contents: bridge_contents,
        resumes_from: None,
    },
    Trainer {
        name: "NeMo 2",
        spelled: "<name>--<metrics>-step=<N>.../",
        step_of: nemo_step,
        tracker: None,
        is_step: is_nemo_step,
        contents: nemo_contents,
        resumes_from: Some(nemo_resumes_from),
    },
    // Last: its step names (`<N>/`, `<prefix>_<N>/`) are the most general; its step
    // directories are told by orbax's `_CHECKPOINT_METADATA` or an item's `_METADATA`.
    Trainer {
        name: "Orbax CheckpointManager",
        spelled: "<N>/",
        step_of: orbax::step_of,
        tracker: None,
        is_step: orbax::is_step_dir,
        contents: orbax_contents,
        resumes_from: None,
    },
];

/// Files trainers keep beside their weights that are not the model: RNG states,
/// schedulers, optimizer states, the trainer's arguments and progress. A directory
/// that holds one of them is a trainer's save, never loose files of a model.
pub(crate) fn side_files(dir: &Path) -> Vec<PathBuf> {
    list_dir(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.is_file() && is_side_file(p))
        .collect()
}

/// Whether `path` is one of the files [`side_files`] lists (by name).
fn is_side_file(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    // Hugging Face Trainer: rng_state[_<rank>].pth, scheduler.pt, optimizer.pt,
    // training_args.bin, scaler.pt; verl: extra_state_*_rank_*.pt; Lightning: meta.pt;
    // Megatron-Bridge: train_state.pt. (verl's and FSDP1's per-rank optimizer shards,
    // `optim_world_size_*_rank_*.pt`, are tensors ckpt reads: given alone they merge.)
    (name.starts_with("rng_state") && name.ends_with(".pth"))
        || matches!(
            name,
            "scheduler.pt"
                | "optimizer.pt"
                | "optimizer.bin"
                | "training_args.bin"
                | "scaler.pt"
                | "meta.pt"
                | "train_state.pt"
                | "latest_train_state.pt"
        )
        || (name.starts_with("extra_state_") && name.ends_with(".pt"))
}

fn unknown(problem: String) -> Error {
    Error::UnknownInput { problem }
}

fn name_of(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

fn number_after(name: &str, prefix: &str) -> Option<u64> {
    let rest = name.strip_prefix(prefix)?;
    (!rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        .then(|| rest.parse().ok())
        .flatten()
}

fn hf_trainer_step(name: &str) -> Option<u64> {
    number_after(name, "checkpoint-")
}

fn verl_step(name: &str) -> Option<u64> {
    number_after(name, "global_step_")
}

fn torchtitan_step(name: &str) -> Option<u64> {
    number_after(name, "step-")
}

/// Lightning's ModelCheckpoint names a save `<filename>.ckpt`, its default filename
/// `epoch={epoch}-step={step}`: the number after the last `step=`.
fn lightning_step(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".ckpt")?;
    let at = stem.rfind("step=")?;
    let digits: String = stem[at + 5..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn bridge_step(name: &str) -> Option<u64> {
    number_after(name, "iter_")
}

/// NeMo's ModelCheckpoint names a checkpoint by its filename template; the step is in
/// the name only where the template has `{step}`.
fn nemo_step(name: &str) -> Option<u64> {
    let at = name.rfind("step=")?;
    let digits: String = name[at + 5..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Megatron-Bridge's `save_checkpoint` writes `run_config.yaml` into each
/// `iter_<NNNNNNN>/` dist_ckpt (Megatron-LM's own saves have none).
fn is_bridge_step(dir: &Path) -> bool {
    bridge_step(name_of(dir)).is_some() && dir.join("run_config.yaml").is_file() && has_dcp(dir)
}

/// NeMo 2's checkpoint: `weights/` (a megatron-core dist_ckpt) and `context/` (its
/// model and trainer config, serialised by NeMo's io).
fn is_nemo_step(dir: &Path) -> bool {
    dir.join("context").is_dir() && dir.join("weights").is_dir()
}

/// A Megatron-Bridge iteration: the dist_ckpt itself (no Megatron-LM args in its
/// common.pt; the model's sizes in `run_config.yaml`'s `model`, in Megatron's terms).
fn bridge_contents(dir: &Path) -> Result<StepContents> {
    let mut c = dcp_step_contents(dir)?;
    record(&mut c, &dir.join("run_config.yaml"), "model");
    Ok(c)
}

/// A NeMo 2 checkpoint: `weights/` (its tensors under NeMo's `module.` prefix), and
/// the model's config in `context/model.yaml`'s `config`.
fn nemo_contents(dir: &Path) -> Result<StepContents> {
    let mut c = dcp_step_contents(&dir.join("weights"))?;
    record(&mut c, &dir.join("context/model.yaml"), "config");
    Ok(c)
}

/// How the note of a record that could not be read begins (a `--format hf` refusal
/// quotes it).
pub(crate) const RECORD_NOT_READ: &str = "the model's record not read";

/// The model's record in the run config at `path`, where it can be read; else a note
/// saying why (the weights are read all the same; `--format hf` then needs a config).
fn record(c: &mut StepContents, path: &Path, section: &str) {
    match args_of_run_config(path, section) {
        Ok(args) => c.record = Some((args, path.to_path_buf())),
        Err(e) => c.notes.push(format!("{RECORD_NOT_READ}: {e}")),
    }
}

/// NeMo's resume rule (`nemo.lightning.resume.AutoResume`): the checkpoint whose name
/// ends in `-end`, else the one ending in `-last` (the newest where several), never one
/// marked `<name>-unfinished`.
fn nemo_resumes_from(dir: &Path) -> Option<(PathBuf, String)> {
    let entries = list_dir(dir).ok()?;
    let finished =
        |p: &PathBuf| is_nemo_step(p) && !dir.join(format!("{}-unfinished", name_of(p))).exists();
    for suffix in ["-end", "-last"] {
        let mut found: Vec<&PathBuf> = entries
            .iter()
            .filter(|p| name_of(p).ends_with(suffix) && finished(p))
            .collect();
        found.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        if let Some(p) = found.last() {
            return Some((
                (*p).clone(),
                format!("NeMo's resume rule: the `*{suffix}` checkpoint"),
            ));
        }
    }
    None
}

/// `transformers.Trainer._save_checkpoint` writes `trainer_state.json` into every
/// `checkpoint-<N>/` (after the model and optimizer).
fn is_hf_trainer_step(dir: &Path) -> bool {
    hf_trainer_step(name_of(dir)).is_some() && dir.join("trainer_state.json").is_file()
}

/// verl's `global_step_<N>/` holds one directory per role (`actor/`, `critic/`).
fn is_verl_step(dir: &Path) -> bool {
    verl_step(name_of(dir)).is_some() && dir.join("actor").is_dir()
}

/// torchtitan's CheckpointManager saves each step as a DCP directory `step-<N>/`.
fn is_torchtitan_step(dir: &Path) -> bool {
    torchtitan_step(name_of(dir)).is_some() && has_dcp(dir)
}

/// Lightning saves a sharded checkpoint as a directory named like its checkpoint file:
/// the FSDP strategy a DCP save with `meta.pt` (the non-tensor state) beside the
/// shards; the DeepSpeed strategy (`DeepSpeedStrategy.save_checkpoint`:
/// `deepspeed_engine.save_checkpoint(filepath, client_state=..., tag="checkpoint")`)
/// DeepSpeed's save, whose `latest` the engine writes last.
fn is_lightning_step(dir: &Path) -> bool {
    lightning_step(name_of(dir)).is_some()
        && (dir.join("meta.pt").is_file() || dir.join(DEEPSPEED_LATEST).is_file())
}

/// A Lightning step: its DCP save (FSDP), or DeepSpeed's tag directory (the model
/// states and every rank's ZeRO partition, Lightning's own state among the model
/// states' entries).
fn lightning_contents(dir: &Path) -> Result<StepContents> {
    if dir.join("meta.pt").is_file() {
        return dcp_step_contents(dir);
    }
    let (tag_dir, note) = deepspeed_tag(dir)?;
    Ok(StepContents {
        weights: vec![tag_dir],
        config: None,
        tokenizer: vec![],
        record: None,
        notes: vec![note],
        trainer: None,
        lora_meta: None,
    })
}

/// The file DeepSpeed's `engine.save_checkpoint` writes last, naming the tag directory
/// it saved into.
const DEEPSPEED_LATEST: &str = "latest";

/// DeepSpeed's save in `dir`: the tag directory `latest` names (a ZeRO-3 run may have
/// saved the gathered 16-bit model beside it too: DeepSpeed's fp32 weights are read),
/// and a note saying so.
fn deepspeed_tag(dir: &Path) -> Result<(PathBuf, String)> {
    let latest = dir.join(DEEPSPEED_LATEST);
    let tag = String::from_utf8_lossy(&crate::formats::read_small(&latest)?)
        .trim()
        .to_string();
    let tag_dir = dir.join(&tag);
    if tag.is_empty() || tag.contains('/') || !tag_dir.is_dir() {
        return Err(unknown(format!(
            "{}: names `{tag}`, which is not a DeepSpeed tag directory beside it",
            latest.display()
        )));
    }
    let note = format!(
        "{}: the model (DeepSpeed's save, tag named by latest)",
        tag_dir.display()
    );
    Ok((tag_dir, note))
}

fn has_dcp(dir: &Path) -> bool {
    dir.join(distcp::METADATA_FILE).is_file()
}

/// An Orbax step directory: committed (else the error says why, and the step is
/// skipped), its item holding the arrays read (docs/orbax.md). JAX keeps no Hugging
/// Face config or tokenizer beside it.
fn orbax_contents(dir: &Path) -> Result<StepContents> {
    let (item, notes) = orbax::step_item(dir)?;
    Ok(StepContents {
        weights: vec![item],
        config: None,
        tokenizer: vec![],
        record: None,
        notes,
        trainer: None,
        lora_meta: None,
    })
}

/// The tokenizer files in `dir`.
fn tokenizer_in(dir: &Path) -> Vec<PathBuf> {
    TOKENIZER_FILES
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.is_file())
        .collect()
}

/// The transformers `config.json` of a Hugging Face model directory (one with
/// `model_type` or `architectures`; ckpt's own config.json has another schema).
fn hf_config_in(dir: &Path) -> Option<PathBuf> {
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    (v.get("model_type").is_some() || v.get("architectures").is_some()).then_some(p)
}

/// A step directory that is one DCP save of the trainer's whole state (torchtitan,
/// Lightning): the model's tensors are read from it; the model config is not kept.
fn dcp_step_contents(dir: &Path) -> Result<StepContents> {
    if !has_dcp(dir) {
        return Err(unknown(format!(
            "{}: incomplete: no {} (DCP writes it last)",
            dir.display(),
            distcp::METADATA_FILE
        )));
    }
    Ok(StepContents {
        weights: vec![dir.to_path_buf()],
        config: None,
        tokenizer: vec![],
        record: None,
        notes: vec![],
        trainer: None,
        lora_meta: None,
    })
}

/// A Hugging Face Trainer's `checkpoint-<N>/`: the model as `Trainer.save_model` wrote
/// it (accelerate's FSDP `pytorch_model_fsdp_<i>/` DCP, DeepSpeed's `latest` and
/// `global_step<N>/`, or `save_pretrained`'s files), its config and tokenizer there or
/// in the output directory above (where the final `save_model` puts them).
fn hf_trainer_contents(dir: &Path) -> Result<StepContents> {
    let entries = list_dir(dir)?;
    let fsdp: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| p.is_dir() && name_of(p).starts_with("pytorch_model_fsdp_"))
        .collect();
    let mut notes = vec![];
    let weights = if let Some(first) = fsdp.first() {
        if fsdp.len() > 1 {
            return Err(unknown(format!(
                "{}: holds {} FSDP models ({}): pass the one meant",
                dir.display(),
                fsdp.len(),
                fsdp.iter()
                    .map(|p| name_of(p))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if !has_dcp(first) {
            return Err(unknown(format!(
                "{}: incomplete: no {} (DCP writes it last)",
                first.display(),
                distcp::METADATA_FILE
            )));
        }
        notes.push(format!(
            "{}: the model (accelerate's FSDP save); the optimizer's directory beside it is not read",
            first.display()
        ));
        vec![(*first).clone()]
    } else if dir.join(DEEPSPEED_LATEST).is_file() {
        let (tag_dir, note) = deepspeed_tag(dir)?;
        notes.push(note);
        vec![tag_dir]
    } else if let Some(p) = [
        "model.safetensors.index.json",
        "model.safetensors",
        "pytorch_model.bin",
        "pytorch_model_fsdp.bin",
    ]
    .iter()
    .map(|f| dir.join(f))
    .find(|p| p.is_file())
    {
        if name_of(&p) == "model.safetensors.index.json" {
            vec![dir.to_path_buf()]
        } else {
            vec![p]
        }
    } else if dir.join("adapter_model.safetensors").is_file() {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: holds a PEFT adapter (adapter_model.safetensors), not the model's weights: merge it into its base model first",
                dir.display()
            ),
        });
    } else {
        return Err(unknown(format!(
            "{}: incomplete: none of the model files a Trainer saves (pytorch_model_fsdp_0/, model.safetensors, its index, pytorch_model.bin, DeepSpeed's latest)",
            dir.display()
        )));
    };
    let up = dir.parent().unwrap_or(Path::new("."));
    let config = hf_config_in(dir).or_else(|| hf_config_in(up));
    let mut tokenizer = tokenizer_in(dir);
    if tokenizer.is_empty() {
        tokenizer = tokenizer_in(up);
    }
    Ok(StepContents {
        weights,
        config,
        tokenizer,
        record: None,
        notes,
        trainer: None,
        lora_meta: None,
    })
}

/// verl's `global_step_<N>/actor/` (FSDP backend): each rank's model shard
/// `model_world_size_<W>_rank_<R>.pt` (DTensors), its optimizer and extra state beside
/// (not read), and `huggingface/` with the model's config and tokenizer. In a LoRA run
/// the shards hold the PEFT-wrapped model (only its LoRA parameters with
/// `save_lora_only`) and `lora_train_meta.json` its rank and alpha: the checkpoint
/// merges them for `--format hf` ([`crate::checkpoint::Checkpoint::merge_peft_wrapped`]).
fn verl_contents(step: &Path) -> Result<StepContents> {
    let actor = step.join("actor");
    let mut shards: Vec<(u64, u64, PathBuf)> = list_dir(&actor)?
        .into_iter()
        .filter_map(|p| {
            let name = name_of(&p).strip_suffix(".pt")?;
            let rest = name.strip_prefix("model_world_size_")?;
            let (w, r) = rest.split_once("_rank_")?;
            Some((w.parse().ok()?, r.parse().ok()?, p.clone()))
        })
        .collect();
    shards.sort();
    let mut notes = vec![];
    let weights = if let Some(&(world, _, _)) = shards.first() {
        if let Some((w, _, p)) = shards.iter().find(|s| s.0 != world) {
            return Err(unknown(format!(
                "{}: shards of two world sizes ({world} and {w}, {})",
                actor.display(),
                p.display()
            )));
        }
        let ranks: Vec<u64> = shards.iter().map(|s| s.1).collect();
        let want: Vec<u64> = (0..world).collect();
        if ranks != want {
            let missing: Vec<String> = want
                .iter()
                .filter(|r| !ranks.contains(r))
                .map(|r| format!("model_world_size_{world}_rank_{r}.pt"))
                .collect();
            return Err(unknown(format!(
                "{}: incomplete: {} of {world} ranks' model shards (missing {})",
                actor.display(),
                ranks.len(),
                missing.join(", ")
            )));
        }
        notes.push(format!(
            "{}: the actor's {world} model shards (FSDP); its optimizer and extra state are not read",
            actor.display()
        ));
        shards.into_iter().map(|s| s.2).collect()
    } else {
        return verl_megatron_contents(step, &actor);
    };
    if step.join("critic").is_dir() {
        notes.push(format!(
            "{}: not read (the actor is the model)",
            step.join("critic").display()
        ));
    }
    // A LoRA run (peft): the shards hold the PeftModel's own state dict, and rank 0
    // records its rank and alpha beside them (`_save_lora_train_meta`).
    let meta = actor.join(LORA_TRAIN_META);
    if meta.is_file() {
        notes.push(
            match crate::formats::read_small(&meta)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            {
                Some(m) => format!(
                    "{}: a LoRA run (r {}, lora_alpha {})",
                    meta.display(),
                    m.get("r").unwrap_or(&serde_json::Value::Null),
                    m.get("lora_alpha").unwrap_or(&serde_json::Value::Null)
                ),
                None => format!("{}: not JSON", meta.display()),
            },
        );
    }
    let hf = actor.join("huggingface");
    Ok(StepContents {
        weights,
        config: hf_config_in(&hf),
        tokenizer: tokenizer_in(&hf),
        record: None,
        notes,
        trainer: None,
        lora_meta: Some(meta),
    })
}

/// verl's Megatron backend, as messages name it.
const VERL_MEGATRON: &str = "verl (Megatron backend)";

/// A megatron-core dist_ckpt of verl's, complete (its `.metadata` and `metadata.json`
/// there), else an error naming the file missing.
fn verl_dist_ckpt(dir: &Path) -> Result<PathBuf> {
    // megatron-core's `dist_checkpointing.save` writes `common.pt` before the shards and
    // their `.metadata`, and `metadata.json` last (`save_config`). DCP's `.metadata`
    // without either is no megatron-core save cut off but another writer's: verl's
    // Megatron-FSDP (`use_megatron_fsdp`) saves DTensor checkpoints in `dist_ckpt/`
    // (Megatron's `fsdp_dtensor` format), whose names and layout ckpt has no fixture of.
    if dir.join(distcp::METADATA_FILE).is_file()
        && !dir.join(DIST_METADATA_FILE).exists()
        && !dir.join(COMMON_FILE).exists()
    {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: a DCP save without megatron-core's common.pt and metadata.json: verl's Megatron-FSDP layout (use_megatron_fsdp, DTensor checkpoints in dist_ckpt/), not read yet; export its Hugging Face weights with verl (checkpoint.save_contents with hf_model) or save with use_dist_checkpointing",
                dir.display()
            ),
        });
    }
    for f in [distcp::METADATA_FILE, DIST_METADATA_FILE] {
        if !dir.join(f).is_file() {
            return Err(unknown(format!(
                "{}: incomplete: no {f} (megatron-core's dist_checkpointing.save writes .metadata, then metadata.json last)",
                dir.display()
            )));
        }
    }
    Ok(dir.to_path_buf())
}

/// verl's `global_step_<N>/actor/` written by its Megatron backend
/// (`verl/utils/checkpoint/megatron_checkpoint_manager.py`), in the layout of the verl
/// that wrote it:
/// - 0.4.1 to 0.8: `dist_ckpt/`, one megatron-core dist_ckpt of the model, the
///   optimizer, the LR scheduler and the RNG states; `huggingface/` with the model's
///   config and tokenizer; `transformer_config.json`;
/// - 0.9: `model/dist_ckpt/` (the model, with `use_dist_checkpointing`) or
///   `model/huggingface/` (the model's Hugging Face weights through mbridge, with its
///   config and tokenizer), `optimizer/dist_ckpt/`, `extra/dist_ckpt/`,
///   `transformer_config.json`, and `ckpt_contents.json` written last;
/// - before 0.4.1: per-rank `torch.save` files under `model/mp_rank_<TT>[_<PPP>]/`
///   (refused, named).
///
/// The dist_ckpt's tensors carry megatron-core's own names (`model.sharded_state_dict()`
/// of the unwrapped GPTModel: no prefix); the optimizer's entries beside them are left
/// out of `--format hf` by the dist_ckpt reader.
fn verl_megatron_contents(step: &Path, actor: &Path) -> Result<StepContents> {
    let v1 = actor.join("dist_ckpt");
    let model = actor.join("model");
    let v2 = ["model", "optimizer", "extra"]
        .iter()
        .map(|d| actor.join(d))
        .filter(|p| p.join("dist_ckpt").is_dir() || p.join("huggingface").is_dir())
        .collect::<Vec<_>>();
    let mut notes = vec![];
    let (weights, hf) = if actor.join("hf_config_and_tokenizer").is_dir()
        || (model.is_dir()
            && list_dir(&model)?
                .iter()
                .any(|p| p.is_dir() && name_of(p).starts_with("mp_rank_")))
    {
        return Err(Error::Unsupported {
            problem: format!(
                "{}: verl's Megatron layout before 0.4.1 (per-rank torch.save files under model/mp_rank_<TT>/, hf_config_and_tokenizer/): not read",
                actor.display()
            ),
        });
    } else if v1.is_dir() && !v2.is_empty() {
        return Err(unknown(format!(
            "{}: holds both verl's 0.4.1-0.8 Megatron layout (dist_ckpt/) and 0.9's ({}): pass the dist_ckpt meant",
            actor.display(),
            v2.iter()
                .map(|p| format!("{}/", name_of(p)))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    } else if v1.is_dir() {
        let dist = verl_dist_ckpt(&v1)?;
        notes.push(format!(
            "{}: the actor's model (verl 0.4.1-0.8 layout: one megatron-core dist_ckpt of the model, optimizer, LR scheduler and RNG states; only the model is exported)",
            dist.display()
        ));
        (dist, actor.join("huggingface"))
    } else if !v2.is_empty() {
        let manifest = actor.join("ckpt_contents.json");
        if !manifest.is_file() {
            return Err(unknown(format!(
                "{}: incomplete: no ckpt_contents.json (verl 0.9 writes it last)",
                actor.display()
            )));
        }
        let hf = model.join("huggingface");
        let weights = if model.join("dist_ckpt").is_dir() {
            let dist = verl_dist_ckpt(&model.join("dist_ckpt"))?;
            notes.push(format!(
                "{}: the actor's model (verl 0.9 layout, a megatron-core dist_ckpt)",
                dist.display()
            ));
            dist
        } else if ["model.safetensors", "model.safetensors.index.json"]
            .iter()
            .any(|f| hf.join(f).is_file())
        {
            notes.push(format!(
                "{}: the actor's model (verl 0.9 layout, Hugging Face weights written through mbridge)",
                hf.display()
            ));
            hf.clone()
        } else {
            return Err(unknown(format!(
                "{}: no model weights: neither model/dist_ckpt/ nor Hugging Face weights in model/huggingface/ (a save without `model` in checkpoint.save_contents)",
                actor.display()
            )));
        };
        for d in ["optimizer", "extra"] {
            if actor.join(d).is_dir() {
                notes.push(format!(
                    "{}: not read (the optimizer, LR scheduler and RNG states)",
                    actor.join(d).display()
                ));
            }
        }
        (weights, hf)
    } else {
        return Err(unknown(format!(
            "{}: incomplete: no model shards (model_world_size_<W>_rank_<R>.pt: FSDP), dist_ckpt/ or model/ (Megatron)",
            actor.display()
        )));
    };
    if step.join("critic").is_dir() {
        notes.push(format!(
            "{}: not read (the actor is the model; the critic, a value model, is read by giving its dist_ckpt itself)",
            step.join("critic").display()
        ));
    }
    Ok(StepContents {
        weights: vec![weights],
        config: hf_config_in(&hf),
        tokenizer: tokenizer_in(&hf),
        record: None,
        notes,
        trainer: Some(VERL_MEGATRON),
        lora_meta: None,
    })
}

/// Whether `dir` is one of the trainers' step directories; the trainer's row if so.
fn step_trainer(dir: &Path) -> Option<&'static Trainer> {
    TRAINERS.iter().find(|t| (t.is_step)(dir))
}

/// `dir`'s step directories of one trainer, by step.
fn steps_in(dir: &Path) -> Result<Option<(&'static Trainer, Steps)>> {
    let entries = list_dir(dir)?;
    for t in &TRAINERS {
        let mut steps: Vec<(u64, PathBuf)> = entries
            .iter()
            .filter(|p| p.is_dir())
            .filter_map(|p| Some(((t.step_of)(name_of(p))?, p.clone())))
            .filter(|(_, p)| (t.is_step)(p) || step_like_incomplete(t, p))
            .collect();
        if steps.iter().any(|(_, p)| (t.is_step)(p)) {
            steps.sort();
            return Ok(Some((t, steps)));
        }
    }
    Ok(None)
}

/// A directory named as `t`'s step that does not hold a whole step (a save cut off).
fn step_like_incomplete(t: &Trainer, p: &Path) -> bool {
    (t.step_of)(name_of(p)).is_some() && !(t.is_step)(p)
}

/// The trainer's save at `path`: a step directory, or a directory of step directories
/// (the step chosen: `step`, the tracker's, else the highest complete one), or, where
/// `path` itself is neither, one such directory found a few levels below it (a
/// Lightning `lightning_logs/version_0/checkpoints/`, torchtitan's `checkpoint/`).
/// `None` where `path` is no trainer's.
///
/// # Errors
/// A step asked for that is not there; a tracker naming a step that is not there or
/// is incomplete; no complete step; trainers' saves found in several places below.
pub(crate) fn find(
    path: &Path,
    step: Option<u64>,
    search_below: bool,
) -> Result<Option<TrainerSave>> {
    if !path.is_dir() {
        return Ok(None);
    }
    // verl's role directory given for its step.
    if let Some(parent) = path
        .parent()
        .filter(|p| name_of(path) == "actor" && is_verl_step(p))
    {
        return find(parent, step, false);
    }
    if let Some(t) = step_trainer(path) {
        let here = (t.step_of)(name_of(path));
        if let (Some(s), Some(h)) = (step, here) {
            if s != h {
                return Err(unknown(format!(
                    "{}: --step {s}, but this is {}'s checkpoint of step {h}: pass the directory above it",
                    path.display(),
                    t.name
                )));
            }
        }
        let contents = (t.contents)(path)?;
        return Ok(Some(TrainerSave {
            trainer: contents.trainer.unwrap_or(t.name),
            step: here,
            step_dir: path.to_path_buf(),
            why: "the step directory given".into(),
            contents,
            step_taken: step.is_some(),
        }));
    }
    for t in &TRAINERS {
        if let Some((p, why)) = t.resumes_from.and_then(|f| f(path)) {
            if let Some(s) = step {
                if (t.step_of)(name_of(&p)).is_none() {
                    return Err(unknown(format!(
                        "{}: --step {s}, but {}'s checkpoint names here do not say their step: pass the checkpoint directory meant",
                        path.display(),
                        t.name
                    )));
                }
                // Names that say the step: chosen by it below.
                break;
            }
            let contents = (t.contents)(&p)?;
            return Ok(Some(TrainerSave {
                trainer: contents.trainer.unwrap_or(t.name),
                step: (t.step_of)(name_of(&p)),
                step_dir: p,
                why,
                contents,
                step_taken: false,
            }));
        }
    }
    if let Some((t, steps)) = steps_in(path)? {
        return choose_step(path, t, &steps, step).map(Some);
    }
    if !search_below {
        return Ok(None);
    }
    let mut found = vec![];
    below(path, 3, &mut found)?;
    match &found[..] {
        [] => Ok(None),
        [one] => {
            let mut save = find(one, step, false)?
                .ok_or_else(|| unknown(format!("{}: no trainer's save", one.display())))?;
            save.contents.notes.insert(
                0,
                format!(
                    "{}: the trainer's checkpoints, found below {}",
                    one.display(),
                    path.display()
                ),
            );
            Ok(Some(save))
        }
        many => Err(unknown(format!(
            "{}: holds trainers' checkpoints in {} places ({}): pass the one meant",
            path.display(),
            many.len(),
            many.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Directories below `dir` (at most `depth` levels) that hold trainers' step
/// directories or are one.
fn below(dir: &Path, depth: u32, found: &mut Vec<PathBuf>) -> Result<()> {
    if depth == 0 {
        return Ok(());
    }
    for p in list_dir(dir)? {
        if !p.is_dir() || name_of(&p).starts_with('.') {
            continue;
        }
        if step_trainer(&p).is_some() {
            // A step directory: its parent holds the steps.
            if !found.contains(&dir.to_path_buf()) {
                found.push(dir.to_path_buf());
            }
            continue;
        }
        let resumable = TRAINERS
            .iter()
            .any(|t| t.resumes_from.is_some_and(|f| f(&p).is_some()));
        if resumable || steps_in(&p)?.is_some() {
            found.push(p);
        } else {
            below(&p, depth - 1, found)?;
        }
    }
    Ok(())
}

/// The step of `dir`'s step directories to read: `step` when asked, else the one the
/// trainer's tracker names, else the highest complete one (incomplete ones above it
/// said in a note).
fn choose_step(
    dir: &Path,
    t: &'static Trainer,
    steps: &[(u64, PathBuf)],
    step: Option<u64>,
) -> Result<TrainerSave> {
    let listed = || {
        steps
            .iter()
            .map(|(s, _)| s.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let pick = |s: u64, why: String, taken: bool| -> Result<TrainerSave> {
        let Some((_, p)) = steps.iter().find(|(n, _)| *n == s) else {
            return Err(unknown(format!(
                "{}: no {} checkpoint of step {s} ({}); steps here: {}",
                dir.display(),
                t.name,
                t.spelled.replace("<N>", &s.to_string()),
                listed()
            )));
        };
        if !(t.is_step)(p) {
            return Err(unknown(format!(
                "{}: the checkpoint of step {s} ({why}) is incomplete (not every file its trainer writes is there)",
                p.display()
            )));
        }
        let contents = (t.contents)(p)?;
        Ok(TrainerSave {
            trainer: contents.trainer.unwrap_or(t.name),
            step: Some(s),
            step_dir: p.clone(),
            why,
            contents,
            step_taken: taken,
        })
    };
    if let Some(s) = step {
        return pick(s, "--step".into(), true);
    }
    if let Some(tracker) = t.tracker.map(|f| dir.join(f)).filter(|p| p.is_file()) {
        let text = String::from_utf8_lossy(&crate::formats::read_small(&tracker)?).into_owned();
        let s: u64 = text.trim().parse().map_err(|_| {
            unknown(format!(
                "{}: `{}` is not a step number",
                tracker.display(),
                text.trim()
            ))
        })?;
        return pick(s, format!("named by {}", tracker.display()), false);
    }
    let mut skipped = vec![];
    for (s, p) in steps.iter().rev() {
        let complete = if (t.is_step)(p) {
            (t.contents)(p)
        } else {
            Err(unknown(format!(
                "{}: incomplete (not every file its trainer writes is there)",
                p.display()
            )))
        };
        match complete {
            Ok(contents) => {
                let mut save = TrainerSave {
                    trainer: contents.trainer.unwrap_or(t.name),
                    step: Some(*s),
                    step_dir: p.clone(),
                    why: "the highest complete step".into(),
                    contents,
                    step_taken: false,
                };
                save.contents.notes.extend(skipped);
                return Ok(save);
            }
            Err(e) => skipped.push(format!("step {s} skipped: {e}")),
        }
    }
    Err(unknown(format!(
        "{}: {}'s checkpoints ({}), none complete: {}",
        dir.display(),
        t.name,
        listed(),
        skipped.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_numbers_are_read_from_each_trainers_names() {
        assert_eq!(hf_trainer_step("checkpoint-500"), Some(500));
        assert_eq!(hf_trainer_step("checkpoint-"), None);
        assert_eq!(hf_trainer_step("checkpoint-5a"), None);
        assert_eq!(verl_step("global_step_2"), Some(2));
        assert_eq!(verl_step("global_step2"), None);
        assert_eq!(torchtitan_step("step-10"), Some(10));
        assert_eq!(lightning_step("epoch=0-step=2.ckpt"), Some(2));
        assert_eq!(lightning_step("last-step=12-v1.ckpt"), Some(12));
        assert_eq!(lightning_step("epoch=0-step=2"), None);
    }

    /// A step directory is one trainer's at most: every directory of every committed
    /// fixture is offered to every row.
    #[test]
    fn no_fixture_directory_is_two_trainers_step() {
        let dirs = super::super::fixture_dirs();
        let mut steps = 0;
        for d in &dirs {
            let rows: Vec<&str> = TRAINERS
                .iter()
                .filter(|t| (t.is_step)(d))
                .map(|t| t.name)
                .collect();
            assert!(rows.len() <= 1, "{}: {rows:?}", d.display());
            steps += rows.len();
        }
        // Two steps of each of the seven trainers' fixtures at least (NeMo: -last too).
        assert!(steps >= 13, "only {steps} step directories recognised");
    }

    #[test]
    fn side_files_are_told_by_name() {
        for side in [
            "rng_state_0.pth",
            "rng_state.pth",
            "scheduler.pt",
            "training_args.bin",
            "optimizer.pt",
            "extra_state_world_size_2_rank_0.pt",
            "meta.pt",
        ] {
            assert!(is_side_file(Path::new(side)), "{side}");
        }
        for model in [
            "pytorch_model.bin",
            "model.pt",
            "model_world_size_2_rank_0.pt",
            "optim_world_size_2_rank_0.pt",
            "consolidated.00.pth",
        ] {
            assert!(!is_side_file(Path::new(model)), "{model}");
        }
    }
}
