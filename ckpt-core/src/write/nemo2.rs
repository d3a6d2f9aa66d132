//! Writing a Hugging Face model as NeMo 2 imports it (`reshard --format nemo2`): the
//! directory `llm.import_ckpt(model, source="hf://...")` leaves (NeMo
//! `8cfedd7203462cb251a914e700e5605444277561`, 2.6.0rc0: `HFLlamaImporter.apply` /
//! `HFQwen2Importer.apply`, then `ModelConnector.nemo_save`), which NeMo's
//! `load_context` and `MegatronStrategy`'s restore (`RestoreConfig(path=OUT)`) start
//! from:
//!
//! ```text
//! OUT/weights/__<r>_0.distcp, .metadata   the model's dist_ckpt, every key under `module.`
//! OUT/weights/common.pt, metadata.json     Lightning's entries of a trainer that never ran, content_metadata
//! OUT/context/io.json                      fiddle's serialisation of the TrainerContext
//! OUT/context/model.yaml                   its `model`, as NeMo's _io_dump_yaml writes it
//! OUT/context/nemo_tokenizer/              the source's tokenizer files (AutoTokenizer's artifact)
//! ```
//!
//! The dist_ckpt is [`super::megatron_dist`]'s (the same chunks, the layers stacked)
//! under `module.` (`MegatronParallel`'s chunk is megatron-core's DDP around the
//! GPTModel). `io.json` is what `TrainerContext.from_trainer(trainer).io_dump(...)`
//! serialises (`nemo/lightning/io/mixin.py`): each object's captured `__init__`
//! arguments as a fiddle `Config`, written as fiddle's `serialization.dump_json` writes
//! it ([`fiddle_json`]). The model's config holds the arguments the importer passes
//! (`HFLlamaImporter.config`, `HFQwen2Importer.config`), the strategy the `--mesh`
//! sizes (docs/trainers.md, "The way back").

use super::hf_import::{hf_fields, py_float, unsupported, yaml_block, Family, HfSource, Y};
use super::megatron_dist::{MegatronDist, Saver};
use super::ranks::RankOptions;
use super::{TargetLayout, Writer};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::formats::output::write_file_atomic;
use crate::layout::plan::CopyPlan;
use crate::layout::select::Selection;
use crate::layout::strategy::Strategy;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

/// The NeMo 2 checkpoint's config directory.
pub(crate) const CONTEXT_DIR: &str = "context";
/// AutoTokenizer's `pretrained_model_name` artifact: the tokenizer directory
/// `save_hf_tokenizer_assets` saved (`/tmp/nemo_tokenizer`), copied by `DirArtifact`
/// into `context/` under its own name.
pub(crate) const TOKENIZER_DIR: &str = "nemo_tokenizer";

/// `reshard --format nemo2`: a Hugging Face Llama or Qwen2 as NeMo 2's
/// `llm.import_ckpt` saves it (module docs).
#[derive(Clone, Debug)]
pub struct Nemo2 {
    dist: MegatronDist,
    model_yaml: String,
    io_json: String,
    hf: HfSource,
}

impl Nemo2 {
    /// The writer of `source` (a Hugging Face model) as NeMo 2 imports it, on the grid
    /// `target` asks for.
    ///
    /// # Errors
    /// A source that is not a Hugging Face model with its config.json; a model family or
    /// a config field NeMo's importer does not take (named); what [`MegatronDist::new`]
    /// refuses.
    pub fn new(
        source: &mut Checkpoint,
        target: &dyn TargetLayout,
        options: RankOptions,
    ) -> Result<Nemo2> {
        let hf = HfSource::of(source, "nemo2", "NeMo 2's llm.import_ckpt")?;
        // Checked before the weights are looked at.
        let model = NemoModel::of(&hf)?;
        let dist = MegatronDist::saved_by(source, target, options, Saver::Nemo2)?;
        let (tp, pp) = dist.sizes(source)?;
        let tokenizer = !hf.tokenizer.is_empty();
        let config = model.config();
        Ok(Nemo2 {
            dist,
            model_yaml: model.yaml(&config, tokenizer),
            io_json: model.io_json(&config, tokenizer, (tp, pp)),
            hf,
        })
    }
}

impl Writer for Nemo2 {
    fn name(&self) -> &'static str {
        "nemo2"
    }

    fn plan(&self, source: &Checkpoint, selection: &Selection) -> Result<CopyPlan> {
        self.dist.plan(source, selection)
    }

    fn shares_files(&self) -> bool {
        false
    }

    fn strategy(&self) -> Option<&Strategy> {
        self.dist.strategy()
    }

    fn finish(&self, src: &Checkpoint, sel: &Selection, plan: &CopyPlan, dir: &Path) -> Result<()> {
        self.dist.finish(src, sel, plan, dir)?;
        let context = dir.join(CONTEXT_DIR);
        std::fs::create_dir_all(&context).map_err(|source| crate::error::Error::Io {
            path: context.clone(),
            source,
        })?;
        write_file_atomic(&context.join("io.json"), self.io_json.as_bytes())?;
        write_file_atomic(&context.join("model.yaml"), self.model_yaml.as_bytes())?;
        self.hf.copy_tokenizer(&context.join(TOKENIZER_DIR))
    }
}

const LLAMA: &str = "nemo.collections.llm.gpt.model.llama";
const QWEN2: &str = "nemo.collections.llm.gpt.model.qwen2";
const AUTO_TOKENIZER: (&str, &str) = (
    "nemo.collections.common.tokenizers.huggingface.auto_tokenizer",
    "AutoTokenizer",
);

/// The model NeMo's importer builds: `LlamaModel(config, tokenizer=...)` (or Qwen2's),
/// its config class and the arguments the importer gives it.
struct NemoModel {
    /// The model's and its config's classes (module, name).
    model: (&'static str, &'static str),
    config: (&'static str, &'static str),
    qwen2: bool,
    /// The importer's arguments but the vocabulary's divisor, in the config class's
    /// signature order (the order `inspect.signature(...).bind_partial` keeps).
    given: Vec<(&'static str, Y)>,
    vocab: i64,
    /// The class's defaults that define the architecture, written into model.yaml
    /// beside the given ones (NeMo's dump lists every argument of the signature).
    defaults: Vec<(&'static str, Y)>,
}

impl NemoModel {
    /// What `HFLlamaImporter.config` / `HFQwen2Importer.config` make of the config.json.
    ///
    /// # Errors
    /// Another family; a field NeMo's config class would drop (biases, a tied Qwen2, a
    /// RoPE scaling other than Llama 3.1's), named with the file.
    fn of(hf: &HfSource) -> Result<NemoModel> {
        let f = hf_fields(&hf.config, &hf.config_path, "nemo2")?;
        let bad = |field: &str, problem: String| {
            unsupported(format!(
                "{}: `{field}` {problem} (--format nemo2)",
                hf.config_path.display()
            ))
        };
        let get = |k: &str| f.fields.get(k).cloned().unwrap_or(Y::Null);
        for (field, name) in [
            ("add_qkv_bias", "attention_bias"),
            ("add_bias_linear", "mlp_bias"),
        ] {
            if get(field) == Y::Bool(true) {
                return Err(bad(
                    name,
                    "is true: NeMo's LlamaConfig and Qwen2Config have no such bias (their importers would drop it)".into(),
                ));
            }
        }
        let tied = get("share_embeddings_and_output_weights");
        if f.family == Family::Qwen2 && tied == Y::Bool(true) {
            return Err(bad(
                "tie_word_embeddings",
                "is true: NeMo's Qwen2 importer writes share_embeddings_and_output_weights=False and reads `lm_head.weight`".into(),
            ));
        }
        let mut scale_factor = None;
        if let Some(s) = &f.scaling {
            let kind = s["rope_type"].as_str().or_else(|| s["type"].as_str());
            match (f.family, kind) {
                (Family::Llama, Some("llama3")) => {
                    scale_factor = Some(Y::Float(s["factor"].as_f64().unwrap_or(8.0)));
                }
                _ => {
                    return Err(bad(
                        "rope_scaling",
                        format!(
                        "is {s}: NeMo's importers keep Llama 3.1's scaling (Llama31Config) only"
                    ),
                    ))
                }
            }
        }
        let mut given = vec![
            ("fp16", get("fp16")),
            ("bf16", get("bf16")),
            ("params_dtype", get("params_dtype")),
            ("num_layers", get("num_layers")),
            ("hidden_size", get("hidden_size")),
            ("num_attention_heads", get("num_attention_heads")),
            ("num_query_groups", get("num_query_groups")),
            ("ffn_hidden_size", get("ffn_hidden_size")),
        ];
        if f.family == Family::Llama {
            // `kv_channels=getattr(source, "head_dim", None)`.
            given.push(("kv_channels", get("kv_channels")));
        }
        given.extend([
            ("layernorm_epsilon", get("layernorm_epsilon")),
            ("gated_linear_unit", Y::Bool(true)),
            ("init_method_std", get("init_method_std")),
            ("share_embeddings_and_output_weights", tied),
            ("make_vocab_size_divisible_by", Y::Null),
            ("rotary_base", Y::Float(f.theta)),
            ("seq_length", get("seq_length")),
            // A GenerationConfig object in NeMo's; not carried.
            ("generation_config", Y::Null),
            ("vocab_size", get("vocab_size")),
        ]);
        let (model, config) = match (f.family, &scale_factor) {
            (Family::Llama, None) => ((LLAMA, "LlamaModel"), (LLAMA, "LlamaConfig")),
            (Family::Llama, Some(_)) => ((LLAMA, "LlamaModel"), (LLAMA, "Llama31Config")),
            (Family::Qwen2, _) => ((QWEN2, "Qwen2Model"), (QWEN2, "Qwen2Config")),
            // hf_fields refuses the mixtures of experts.
            (Family::Qwen3Moe, _) => {
                return Err(unsupported(format!(
                    "{}: a mixture of experts is not written as NeMo 2's import yet",
                    hf.config_path.display()
                )))
            }
        };
        let mut defaults = vec![
            ("normalization", Y::Str("RMSNorm".into())),
            ("activation_func", Y::Target("torch.nn.functional.silu")),
            ("position_embedding_type", Y::Str("rope".into())),
            ("add_bias_linear", Y::Bool(false)),
            ("add_qkv_bias", Y::Bool(f.family == Family::Qwen2)),
            ("qk_layernorm", Y::Bool(false)),
            ("attention_dropout", Y::Float(0.0)),
            ("hidden_dropout", Y::Float(0.0)),
            ("rotary_percent", Y::Float(1.0)),
        ];
        if let Some(s) = scale_factor {
            given.push(("scale_factor", s));
            defaults.extend([
                ("low_freq_factor", Y::Float(1.0)),
                ("high_freq_factor", Y::Float(4.0)),
                ("old_context_len", Y::Int(8192)),
            ]);
        }
        Ok(NemoModel {
            model,
            config,
            qwen2: f.family == Family::Qwen2,
            vocab: f.int("vocab_size"),
            given,
            defaults,
        })
    }

    /// The config's arguments: the importer's, with its vocabulary divisor (Llama's
    /// `make_vocab_size_divisible_by(vocab_size)`: the largest power of 2, at most 128,
    /// dividing the vocabulary; Qwen2's 128). With `vocab_size` given, NeMo builds the
    /// embedding with exactly that many rows at any TP (`GPTConfig.configure_model`:
    /// "Use preset vocab_size"; the divisor pads only a vocabulary taken from the
    /// tokenizer).
    fn config(&self) -> Vec<(&'static str, Y)> {
        let d = if self.qwen2 {
            128
        } else {
            let mut d = 128;
            while d > 1 && self.vocab % d != 0 {
                d /= 2;
            }
            d
        };
        self.given
            .iter()
            .map(|(k, v)| match *k {
                "make_vocab_size_divisible_by" => (*k, Y::Int(d)),
                _ => (*k, v.clone()),
            })
            .collect()
    }

    /// `context/model.yaml`: `yaml.safe_dump` of the model's Config as NeMo's
    /// `_io_dump_yaml` writes it (every argument of the model's signature, its
    /// config's given arguments and the class's architecture defaults, keys sorted).
    fn yaml(&self, config: &[(&'static str, Y)], tokenizer: bool) -> String {
        let target = |(m, n): (&str, &str)| Y::Str(format!("{m}.{n}"));
        let mut c: BTreeMap<String, Y> = self
            .defaults
            .iter()
            .chain(config)
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect();
        c.insert("_target_".into(), target(self.config));
        let mut top = BTreeMap::new();
        top.insert("_target_".to_string(), target(self.model));
        top.insert("config".into(), Y::Map(c));
        top.insert("optim".into(), Y::Null);
        top.insert("model_transform".into(), Y::Null);
        top.insert("model_context_managers".into(), Y::EmptyList);
        let tok = if tokenizer {
            // AutoTokenizer's signature, the artifact's path given.
            let mut t: BTreeMap<String, Y> = [
                "vocab_file",
                "merges_file",
                "mask_token",
                "bos_token",
                "eos_token",
                "pad_token",
                "sep_token",
                "cls_token",
                "unk_token",
                "chat_template",
            ]
            .into_iter()
            .map(|k| (k.to_string(), Y::Null))
            .collect();
            t.insert("_target_".into(), target(AUTO_TOKENIZER));
            t.insert("pretrained_model_name".into(), Y::Str(TOKENIZER_DIR.into()));
            t.insert("additional_special_tokens".into(), Y::EmptyList);
            t.insert("use_fast".into(), Y::Bool(true));
            t.insert("trust_remote_code".into(), Y::Bool(false));
            t.insert("include_special_tokens".into(), Y::Bool(false));
            Y::Map(t)
        } else {
            Y::Null
        };
        top.insert("tokenizer".into(), tok);
        let mut out = String::new();
        yaml_block(&mut out, 0, &top);
        out
    }

    /// `context/io.json`: `TrainerContext(model=..., trainer=..., extra={})` as
    /// `serialization.dump_json` writes it. The trainer is the importer's
    /// (`Trainer(devices=1, accelerator="cpu", strategy=MegatronStrategy(ckpt_save_optimizer=False))`)
    /// with the `--mesh` sizes in the strategy (the importer's `always_save_context`,
    /// which reaches only the strategy's `**kwargs`, is left out).
    fn io_json(
        &self,
        config: &[(&'static str, Y)],
        tokenizer: bool,
        (tp, pp): (u64, u64),
    ) -> String {
        let int = |v: u64| Node::Leaf(Y::Int(i64::try_from(v).unwrap_or(i64::MAX)));
        let config = Node::Config(
            self.config,
            config
                .iter()
                .map(|(k, v)| {
                    let node = match v {
                        Y::Target(t) => {
                            let (m, n) = t.rsplit_once('.').unwrap_or(("", t));
                            Node::PyRef(m.to_string(), n.to_string())
                        }
                        y => Node::Leaf(y.clone()),
                    };
                    (*k, node)
                })
                .collect(),
        );
        let mut model_args = vec![("config", config)];
        if tokenizer {
            model_args.push((
                "tokenizer",
                Node::Config(
                    AUTO_TOKENIZER,
                    vec![(
                        "pretrained_model_name",
                        Node::Leaf(Y::Str(TOKENIZER_DIR.into())),
                    )],
                ),
            ));
        }
        let strategy = Node::Config(
            (
                "nemo.lightning.pytorch.strategies.megatron_strategy",
                "MegatronStrategy",
            ),
            vec![
                ("tensor_model_parallel_size", int(tp)),
                ("pipeline_model_parallel_size", int(pp)),
                ("ckpt_save_optimizer", Node::Leaf(Y::Bool(false))),
            ],
        );
        let trainer = Node::Config(
            ("nemo.lightning.pytorch.trainer", "Trainer"),
            vec![
                ("accelerator", Node::Leaf(Y::Str("cpu".into()))),
                ("strategy", strategy),
                ("devices", int(1)),
            ],
        );
        let root = Node::Config(
            ("nemo.lightning.io.pl", "TrainerContext"),
            vec![
                ("model", Node::Config(self.model, model_args)),
                ("trainer", trainer),
                ("extra", Node::Dict(vec![])),
            ],
        );
        fiddle_json(&root)
    }
}

/// A value of the config graph fiddle serialises.
#[derive(Clone, Debug)]
pub(crate) enum Node {
    /// A JSON primitive (`Y::Null`, `Bool`, `Int`, `Float`, `Str`).
    Leaf(Y),
    /// An importable function, class or constant (module, name).
    PyRef(String, String),
    /// `fdl.Config(module.name, **args)`, its arguments in their captured order.
    Config((&'static str, &'static str), Vec<(&'static str, Node)>),
    /// A dict of such values.
    Dict(Vec<(String, Node)>),
}

/// A JSON value as Python's `json.dumps` writes it (keys in insertion order).
#[derive(Clone, Debug)]
enum J {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<J>),
    Obj(Vec<(&'static str, J)>),
}

impl J {
    fn write(&self, out: &mut String) {
        match self {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Int(v) => {
                let _ = write!(out, "{v}");
            }
            J::Float(f) => out.push_str(&py_float(*f)),
            J::Str(s) => py_json_str(out, s),
            J::List(v) => {
                out.push('[');
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    x.write(out);
                }
                out.push(']');
            }
            J::Obj(v) => {
                out.push('{');
                for (i, (k, x)) in v.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_json_str(out, k);
                    out.push_str(": ");
                    x.write(out);
                }
                out.push('}');
            }
        }
    }
}

/// A string as `json.dumps` writes it (`ensure_ascii`: non-ASCII as `\uXXXX`).
fn py_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// fiddle's `Serialization` (fiddle 0.3, `_src/experimental/serialization.py`) of a
/// tree with no shared objects: every memoizable value (a Config, a dict, a non-empty
/// tuple, each Config's `BuildableTraverserMetadata`) stored once under `objects` by its
/// type's snake-case name and a count, children before their parent, the metadata after
/// the items; leaves and Python references inline with the paths that reach them;
/// `refcounts` in the order the references were made.
struct Fiddle {
    objects: Vec<(String, J)>,
    counts: HashMap<String, u32>,
    refcounts: Vec<(String, u32)>,
}

const CONFIG_MODULE: &str = "fiddle._src.config";

fn pyref(module: &str, name: &str) -> J {
    J::Obj(vec![
        ("type", J::Str("pyref".into())),
        ("module", J::Str(module.into())),
        ("name", J::Str(name.into())),
    ])
}

fn with_paths(j: J, path: &str) -> J {
    match j {
        J::Obj(mut v) => {
            v.push(("paths", J::List(vec![J::Str(path.into())])));
            J::Obj(v)
        }
        j => j,
    }
}

/// `_to_snake_case`: `_` before each capital that follows neither `_` nor a capital.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    let mut prev: Option<char> = None;
    for c in name.chars() {
        if c.is_ascii_uppercase() && prev.is_some_and(|p| p != '_' && !p.is_ascii_uppercase()) {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
        prev = Some(c);
    }
    out
}

fn leaf(y: &Y) -> J {
    match y {
        Y::Bool(b) => J::Bool(*b),
        Y::Int(v) => J::Int(*v),
        Y::Float(f) => J::Float(*f),
        Y::Str(s) => J::Str(s.clone()),
        Y::Target(t) => J::Str((*t).to_string()),
        Y::Null | Y::Map(_) | Y::EmptyList => J::Null,
    }
}

impl Fiddle {
    /// Stores `output` under a new name for `hint` and returns a reference to it.
    fn store(&mut self, hint: &str, output: J) -> J {
        let hint = snake_case(hint);
        let n = self.counts.entry(hint.clone()).or_insert(0);
        *n += 1;
        let key = format!("{hint}_{n}");
        self.objects.push((key.clone(), output));
        self.refcounts.push((key.clone(), 1));
        J::Obj(vec![("type", J::Str("ref".into())), ("key", J::Str(key))])
    }

    /// A tuple of strings (metadata: no paths); the empty tuple is not memoizable.
    fn tuple(&mut self, items: &[&str]) -> J {
        let out = J::Obj(vec![
            ("type", pyref("builtins", "tuple")),
            (
                "items",
                J::List(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, s)| {
                            J::List(vec![
                                J::Str(format!("Index(index={i})")),
                                J::Str((*s).into()),
                            ])
                        })
                        .collect(),
                ),
            ),
            ("metadata", J::Null),
        ]);
        if items.is_empty() {
            out
        } else {
            self.store("tuple", out)
        }
    }

    /// A dict: its items, then its keys' tuple, then itself.
    fn dict(&mut self, items: Vec<J>, keys: &[&str], path: Option<&str>) -> J {
        let metadata = self.tuple(keys);
        let mut out = J::Obj(vec![
            ("type", pyref("builtins", "dict")),
            ("items", J::List(items)),
            ("metadata", metadata),
        ]);
        if let Some(p) = path {
            out = with_paths(out, p);
        }
        self.store("dict", out)
    }

    fn serialize(&mut self, node: &Node, path: &str) -> J {
        match node {
            Node::Leaf(y) => with_paths(
                J::Obj(vec![("type", J::Str("leaf".into())), ("value", leaf(y))]),
                path,
            ),
            Node::PyRef(m, n) => with_paths(pyref(m, n), path),
            Node::Config((module, name), args) => {
                let items: Vec<J> = args
                    .iter()
                    .map(|(k, v)| {
                        let child = self.serialize(v, &format!("{path}.{k}"));
                        J::List(vec![J::Str(format!("Attr(name='{k}')")), child])
                    })
                    .collect();
                let names: Vec<&str> = args.iter().map(|(k, _)| *k).collect();
                let names = self.tuple(&names);
                let tags = self.dict(vec![], &[], None);
                let history = self.dict(vec![], &[], None);
                let meta = J::Obj(vec![
                    ("type", pyref(CONFIG_MODULE, "BuildableTraverserMetadata")),
                    (
                        "items",
                        J::List(vec![
                            J::List(vec![
                                J::Str("Attr(name='fn_or_cls')".into()),
                                pyref(module, name),
                            ]),
                            J::List(vec![J::Str("Attr(name='argument_names')".into()), names]),
                            J::List(vec![J::Str("Attr(name='argument_tags')".into()), tags]),
                            J::List(vec![
                                J::Str("Attr(name='argument_history')".into()),
                                history,
                            ]),
                        ]),
                    ),
                    (
                        "metadata",
                        pyref(CONFIG_MODULE, "BuildableTraverserMetadata"),
                    ),
                ]);
                let meta = self.store("BuildableTraverserMetadata", meta);
                let out = with_paths(
                    J::Obj(vec![
                        ("type", pyref(CONFIG_MODULE, "Config")),
                        ("items", J::List(items)),
                        ("metadata", meta),
                    ]),
                    path,
                );
                self.store(name, out)
            }
            Node::Dict(entries) => {
                let items: Vec<J> = entries
                    .iter()
                    .map(|(k, v)| {
                        let child = self.serialize(v, &format!("{path}['{k}']"));
                        J::List(vec![J::Str(format!("Key(key='{k}')")), child])
                    })
                    .collect();
                let keys: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
                self.dict(items, &keys, Some(path))
            }
        }
    }
}

/// `serialization.dump_json(root)` of a tree (no object reached twice).
pub(crate) fn fiddle_json(root: &Node) -> String {
    let mut f = Fiddle {
        objects: Vec::new(),
        counts: HashMap::new(),
        refcounts: Vec::new(),
    };
    let root = f.serialize(root, "<root>");
    let doc = J::Obj(vec![
        ("root", root),
        ("objects", J::Null),
        ("refcounts", J::Null),
        ("version", J::Str("0.0.1".into())),
    ]);
    // The objects' and refcounts' keys are names, not static: written by hand.
    let mut out = String::new();
    let J::Obj(parts) = doc else { return out };
    out.push('{');
    for (i, (k, v)) in parts.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        py_json_str(&mut out, k);
        out.push_str(": ");
        match *k {
            "objects" => {
                out.push('{');
                for (j, (name, o)) in f.objects.iter().enumerate() {
                    if j > 0 {
                        out.push_str(", ");
                    }
                    py_json_str(&mut out, name);
                    out.push_str(": ");
                    o.write(&mut out);
                }
                out.push('}');
            }
            "refcounts" => {
                out.push('{');
                for (j, (name, n)) in f.refcounts.iter().enumerate() {
                    if j > 0 {
                        out.push_str(", ");
                    }
                    py_json_str(&mut out, name);
                    let _ = write!(out, ": {n}");
                }
                out.push('}');
            }
            _ => v.write(&mut out),
        }
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fiddles_snake_case() {
        assert_eq!(snake_case("Llama31Config"), "llama31_config");
        assert_eq!(
            snake_case("BuildableTraverserMetadata"),
            "buildable_traverser_metadata"
        );
        assert_eq!(snake_case("AutoTokenizer"), "auto_tokenizer");
        assert_eq!(snake_case("tuple"), "tuple");
    }

    #[test]
    fn a_config_is_serialised_children_first_metadata_after_items() {
        let root = Node::Config(
            ("m", "Outer"),
            vec![
                (
                    "inner",
                    Node::Config(("m", "Inner"), vec![("x", Node::Leaf(Y::Float(1e-5)))]),
                ),
                ("extra", Node::Dict(vec![])),
            ],
        );
        let text = fiddle_json(&root);
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(
            text.starts_with(
                r#"{"root": {"type": "ref", "key": "outer_1"}, "objects": {"tuple_1": "#
            ),
            "{text}"
        );
        assert!(text.contains(r#"[["Attr(name='x')", {"type": "leaf", "value": 1e-05, "paths": ["<root>.inner.x"]}]]"#), "{text}");
        let order = [
            "tuple_1",
            "dict_1",
            "dict_2",
            "buildable_traverser_metadata_1",
            "inner_1",
            "dict_3",
            "tuple_2",
            "dict_4",
            "dict_5",
            "buildable_traverser_metadata_2",
            "outer_1",
        ];
        let mut at = 0;
        for k in order {
            let i = text
                .find(&format!("\"{k}\": {{\"type\""))
                .unwrap_or_else(|| panic!("{k}: {text}"));
            assert!(i > at, "{k} out of order");
            at = i;
        }
        assert_eq!(doc["refcounts"].as_object().unwrap().len(), order.len());
        assert_eq!(
            doc["objects"]["dict_3"]["paths"],
            serde_json::json!(["<root>.extra"])
        );
        assert_eq!(
            doc["objects"]["dict_3"]["metadata"]["items"],
            serde_json::json!([])
        );
    }
}
