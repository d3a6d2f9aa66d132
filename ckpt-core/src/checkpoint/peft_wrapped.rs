//! A checkpoint of a PEFT-wrapped model (a `PeftModel`'s own state dict, as verl's FSDP
//! checkpoint manager saves each rank's shard of a LoRA run) seen as the model it
//! stands for: each LoRA-adapted weight merged (`base_layer` plus `scale * B @ A`, the
//! computed tensors `--lora` makes: [`Checkpoint::merge_adapter`]), under the model's
//! own names. The rank and alpha come from verl's `lora_train_meta.json` (or
//! `--lora-alpha`): a merge scaled by an alpha nobody recorded is refused, never written.

use super::computed::{AdapterConfig, PEFT_PREFIX};
use super::Checkpoint;
use crate::error::{Error, Result};
use crate::formats::detect::trainers::LORA_TRAIN_META;
use crate::layout::source::SourceTensor;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The adapter PEFT names `default` (verl's, and `get_peft_model`'s without a name).
const DEFAULT_ADAPTER: &str = "default";

/// What a PEFT-wrapped name is.
enum Part {
    /// A LoRA matrix of the default adapter: its name as PEFT saves an adapter
    /// (`base_model.model.<module>.lora_A.weight`).
    Adapter(String),
    /// The model's own tensor, under its own name.
    Base(String),
}

/// The part a name under [`PEFT_PREFIX`] is; an error for what the merge does not build.
fn part_of(name: &str) -> Result<Part> {
    let rest = &name[PEFT_PREFIX.len()..];
    let refuse = |what: &str| {
        Error::Unsupported {
        problem: format!(
            "tensor `{name}`: {what}: the PEFT-wrapped model is merged for plain LoRA and rsLoRA adapters named `{DEFAULT_ADAPTER}` only"
        ),
    }
    };
    for kind in ["lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"] {
        let Some(at) = rest.find(&format!(".{kind}.")) else {
            continue;
        };
        let module = &rest[..at];
        let tail = &rest[at + kind.len() + 2..];
        let (adapter, suffix) = tail.split_once('.').unwrap_or((tail, ""));
        if adapter != DEFAULT_ADAPTER {
            return Err(refuse(&format!("adapter `{adapter}`")));
        }
        // PEFT's saved adapter drops the adapter's name (`get_peft_model_state_dict`).
        return Ok(Part::Adapter(if suffix.is_empty() {
            format!("{PEFT_PREFIX}{module}.{kind}")
        } else {
            format!("{PEFT_PREFIX}{module}.{kind}.{suffix}")
        }));
    }
    if let Some(what) = [
        "lora_",
        "modules_to_save",
        "original_module",
        "magnitude_vector",
    ]
    .into_iter()
    .find(|w| rest.contains(w))
    {
        return Err(refuse(&format!("`{what}` is not built")));
    }
    Ok(Part::Base(rest.replace(".base_layer.", ".")))
}

/// Whether `names` are a PEFT-wrapped model's: under `base_model.model.`, with LoRA
/// layers (`.lora_A.`) among them.
pub(crate) fn is_peft_wrapped<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|n| {
        n.starts_with(PEFT_PREFIX) && (n.contains(".lora_A.") || n.contains(".lora_embedding_A."))
    })
}

/// `lora_train_meta.json`'s r, lora_alpha and (where a writer adds it) use_rslora.
fn read_meta(path: &Path) -> Result<(Option<u64>, f64, bool)> {
    let bad = |problem: String| Error::Unsupported {
        problem: format!("{}: {problem}", path.display()),
    };
    let bytes = crate::formats::read_small(path)?;
    let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(&bytes) else {
        return Err(bad("not a JSON object".into()));
    };
    let r = match m.get("r") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&r| r > 0)
                .ok_or_else(|| bad(format!("`r` is {v}, not a positive integer")))?,
        ),
    };
    let alpha = match m.get("lora_alpha") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| bad(format!("`lora_alpha` is {v}, not a number")))?,
    };
    let rslora = m
        .get("use_rslora")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok((r, alpha, rslora))
}

impl Checkpoint {
    /// Whether the tensors are a PEFT-wrapped model's ([`is_peft_wrapped`]).
    #[must_use]
    pub fn is_peft_wrapped(&self) -> bool {
        is_peft_wrapped(self.tensors.keys().map(String::as_str))
    }

    /// Where the tensors are a PEFT-wrapped model's (verl's LoRA shards), makes them
    /// the merged model: each `<module>.base_layer.weight` plus `scale * B @ A` under
    /// `<module>.weight`, every other tensor under its name without PEFT's
    /// `base_model.model.` prefix. `alpha` (`--lora-alpha`) is taken where
    /// `lora_train_meta.json` records 0 or is missing. Nothing changes for other
    /// tensors.
    ///
    /// # Errors
    /// No alpha recorded or given (named: `--lora-alpha`); a save of the LoRA
    /// parameters alone (verl's `save_lora_only`: the base model is not there); an
    /// adapter other than `default`, or a variant the merge does not build; an adapter
    /// that does not fit its base (as `--lora`).
    pub fn merge_peft_wrapped(&mut self, alpha: Option<f64>) -> Result<()> {
        if !self.is_peft_wrapped() {
            return Ok(());
        }
        let meta = self.lora_meta.clone();
        let shown = meta.as_ref().map_or_else(
            || format!("the PEFT-wrapped model's shards (no {LORA_TRAIN_META} beside them)"),
            |p| p.display().to_string(),
        );
        // The shards' directory (where the trainer records the run), for messages.
        let shards = meta.as_ref().and_then(|p| p.parent()).map_or_else(
            || "the PEFT-wrapped model's shards".into(),
            |d| d.display().to_string(),
        );
        let mut adapter = BTreeMap::new();
        let mut base: BTreeMap<String, SourceTensor> = BTreeMap::new();
        let mut renames = BTreeMap::new();
        let mut base_layers = 0;
        for (name, t) in std::mem::take(&mut self.tensors) {
            let part = if name.starts_with(PEFT_PREFIX) {
                part_of(&name)?
            } else {
                Part::Base(name.clone())
            };
            match part {
                Part::Adapter(n) => {
                    adapter.insert(n, t);
                }
                Part::Base(n) => {
                    base_layers += usize::from(name.contains(".base_layer."));
                    renames.insert(name.clone(), n.clone());
                    if base.insert(n.clone(), t).is_some() {
                        return Err(Error::Unsupported {
                            problem: format!(
                                "tensor `{name}`: without PEFT's wrapper it is `{n}`, which another tensor is too"
                            ),
                        });
                    }
                }
            }
        }
        if base_layers == 0 {
            return Err(Error::Unsupported {
                problem: format!(
                    "{shards}: the shards hold only the LoRA parameters ({} tensors, verl's checkpoint.save_lora_only), not the base model's weights: the base model is needed to merge them; save with save_lora_only off, or export the adapter with verl's model merger and give the base model with --lora",
                    adapter.len()
                ),
            });
        }
        let (meta_r, recorded, rslora) = match &meta {
            Some(p) if p.is_file() => read_meta(p)?,
            _ => (None, 0.0, false),
        };
        let lora_alpha = match alpha {
            Some(a) if recorded == 0.0 => a,
            _ if recorded != 0.0 => recorded,
            _ => {
                let why = match &meta {
                    Some(p) if p.is_file() => {
                        format!("{}: lora_alpha is 0 or missing", p.display())
                    }
                    Some(p) => format!(
                        "{}: missing (verl writes it with a LoRA run's shards)",
                        p.display()
                    ),
                    None => format!("no {LORA_TRAIN_META} beside the PEFT-wrapped model's shards"),
                };
                return Err(Error::Unsupported {
                    problem: format!(
                        "{why}: the LoRA adapters' scale (lora_alpha / r) is unknown, and merged without it the export would be wrong; give the alpha it was trained with: --lora-alpha N"
                    ),
                });
            }
        };
        // The rank: the meta's, else the adapters' (A is r x in); the merge checks
        // every module's A and B against it.
        let r = match meta_r {
            Some(r) => r,
            None => adapter
                .iter()
                .find(|(n, _)| n.ends_with(".lora_A.weight"))
                .and_then(|(_, t)| t.shape.first().copied())
                .ok_or_else(|| Error::Unsupported {
                    problem: format!("{shards}: no lora_A matrix to read the rank from"),
                })?,
        };
        self.tensors = base;
        if let Some(s) = &mut self.strategy {
            s.tensors = std::mem::take(&mut s.tensors)
                .into_iter()
                .filter_map(|(n, l)| renames.get(&n).map(|new| (new.clone(), l)))
                .collect();
        }
        let from = meta
            .clone()
            .unwrap_or_else(|| PathBuf::from(LORA_TRAIN_META));
        let config = AdapterConfig::plain(r, lora_alpha, rslora, from);
        let dir = meta
            .as_ref()
            .and_then(|p| p.parent())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        let merged = self.merge_adapter(&config, adapter, &dir)?;
        self.notes.push(format!(
            "the PEFT-wrapped model's LoRA adapters merged into {merged} weights (r {r}, lora_alpha {lora_alpha}{}, from {}), names without PEFT's `base_model.model.` and `.base_layer`",
            if rslora { ", rsLoRA" } else { "" },
            if recorded != 0.0 { shown } else { "--lora-alpha".to_string() }
        ));
        Ok(())
    }
}
