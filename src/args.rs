//! The commands' arguments (clap), checked as they are parsed where they can be: a bad
//! glob, mesh, rank or dtype is a usage error (exit 2) before any work.

use anyhow::{Context, Result};
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::select::Selection;
use ckpt_core::layout::Dtype;
use clap::Args;
use lists::{parse_globs, parse_shards, List};
use std::path::PathBuf;

// List options' rule. The Python package compiles this file too, by `#[path]`
// (python/src/lib.rs): a path relative to this file names the same file in both crates.
#[path = "lists.rs"]
pub(crate) mod lists;

/// A usage error found after parsing (exit code 2, like clap's own).
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// `--to N`: a number of ranks, at least 1.
fn parse_to(s: &str) -> std::result::Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("--to must be at least 1 (it is a number of ranks)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("--to `{s}` is not a number of ranks")),
    }
}

fn parse_mesh(s: &str) -> std::result::Result<String, String> {
    Mesh::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// Checks `--data` at parse time, keeping the text.
fn parse_data(s: &str) -> std::result::Result<String, String> {
    ckpt_train::DataSource::parse(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// `auto` or a rank number.
fn parse_rank(s: &str) -> std::result::Result<String, String> {
    if s == "auto" || s.parse::<u64>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!("`{s}` is not a rank number or `auto`"))
    }
}

#[derive(Args, Debug)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) config: ckpt_train::TrainConfig,
    /// Print the summary as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// No progress output.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

#[derive(Args, Debug)]
pub(crate) struct InferArgs {
    /// Checkpoint: integrated, sliced (root with ckpt_*/), or a training --out directory.
    pub(crate) checkpoint: PathBuf,
    /// Data set (default: the one it was trained on): digits, digits:FILE, fashion-mnist[:DIR], cifar10:DIR.
    #[arg(long, value_parser = parse_data)]
    pub(crate) data: Option<String>,
    /// Ranks: a sliced checkpoint's tensor-parallel size (the default) or a multiple of
    /// it, the extra copies data parallel (the test set split over them).
    #[arg(long)]
    pub(crate) ranks: Option<u64>,
    /// Images per forward pass.
    #[arg(long, default_value_t = 256)]
    pub(crate) batch_size: usize,
    /// Predict these test images (7; 3,5,7; 0..10, the end excluded; repeat --predict
    /// for more) or the images in these files (digits: CSV rows of 64 pixel values
    /// 0..16 and the label, as in the data set's own file).
    #[arg(long)]
    pub(crate) predict: Vec<String>,
    /// Evaluate only the first N test images.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
    /// How ranks run: threads of this process, or one process per rank under mpirun.
    #[arg(long, value_enum, default_value_t = ckpt_train::Backend::Threads)]
    pub(crate) backend: ckpt_train::Backend,
    /// Where the model maths runs: the CPU, or CUDA GPUs (needs a build with
    /// `--features cuda-candle`).
    #[arg(long, value_enum, default_value_t = ckpt_train::DeviceKind::Cpu)]
    pub(crate) device: ckpt_train::DeviceKind,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The checkpoint to read, shared by the commands that read one.
#[derive(Args, Debug, Clone)]
pub(crate) struct Inputs {
    /// Rank directories (ckpt_<r>/, MindSpore's rank_<r>/), a sliced checkpoint root or
    /// training --out, rank files, an integrated or DCP checkpoint, MindSpore .ckpt files.
    #[arg(required = true)]
    pub(crate) paths: Vec<PathBuf>,
    /// The source's MindSpore strategy file (protobuf or JSON; one per pipeline stage),
    /// when it is not the only one beside the rank directories; or a strategy file with
    /// a `rules` section: how the tensors of a Megatron or tensor-parallel DeepSpeed
    /// checkpoint are split (docs/strategy.md, "Split rules").
    #[arg(long, value_name = "FILE")]
    pub(crate) source_strategy: Vec<PathBuf>,
    /// Read the checkpoint of this training step where the inputs hold several: a
    /// training output's step_<N>/ (DeepSpeed's global_step<N>/) instead of `latest`,
    /// Megatron's iter_<N>/ instead of the tracker's, MindSpore's
    /// <prefix>-<epoch>_<N>.ckpt in each rank directory instead of the newest.
    #[arg(long, value_name = "N")]
    pub(crate) step: Option<u64>,
}

impl Inputs {
    /// Every input path: the strategy files are inputs too (recognised by content).
    pub(crate) fn all(&self) -> Result<Vec<PathBuf>> {
        let mut strategies = Vec::new();
        for s in &self.source_strategy {
            let bytes =
                std::fs::read(s).with_context(|| format!("--source-strategy {}", s.display()))?;
            if ckpt_core::layout::split_rules::is_split_rules(&bytes) {
                continue;
            }
            if !ckpt_core::formats::mindspore_strategy::looks_like(&bytes) {
                return Err(Usage(format!(
                    "--source-strategy {}: not a MindSpore strategy file (protobuf ParallelStrategyMap or its JSON form), nor a strategy file with a `rules` section",
                    s.display()
                ))
                .into());
            }
            strategies.push(s);
        }
        Ok(self.paths.iter().chain(strategies).cloned().collect())
    }

    /// The split rules of the `--source-strategy` files that have a `rules` section, in
    /// the order given (empty when none has).
    pub(crate) fn rules(&self) -> Result<ckpt_core::layout::split_rules::SplitRules> {
        let mut found = None;
        for s in &self.source_strategy {
            let Ok(bytes) = std::fs::read(s) else {
                continue;
            };
            if !ckpt_core::layout::split_rules::is_split_rules(&bytes) {
                continue;
            }
            if found.is_some() {
                return Err(Usage(format!(
                    "--source-strategy {}: a second file with split rules (give them in one `rules` list)",
                    s.display()
                ))
                .into());
            }
            found = Some(ckpt_core::layout::split_rules::SplitRules::read(s)?);
        }
        Ok(found.unwrap_or_default())
    }
}

/// Renaming, on every command that reads a checkpoint.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct Names {
    /// Remove this prefix from every tensor name that has it (DDP's `module.`).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) strip_prefix: Option<String>,
    /// Put this prefix in front of every tensor name (after --strip-prefix).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) add_prefix: Option<String>,
}

impl Names {
    pub(crate) fn selection(&self) -> Selection {
        Selection::default().with_prefixes(self.strip_prefix.clone(), self.add_prefix.clone())
    }
}

/// Options shared by the commands that copy tensors.
#[derive(Args, Debug, Clone)]
pub(crate) struct CopyArgs {
    /// Cast floating-point tensors while copying (integers are refused): bf16, f16,
    /// f32, f64, or any safetensors dtype name (F8_E4M3, F8_E5M2, ...); with --format
    /// gguf, llama.cpp's types: f32, f16 (the default), bf16 or q8_0.
    #[arg(long, value_parser = parse_copy_cast)]
    pub(crate) dtype: Option<Cast>,
    /// Keep only tensors matching this glob pattern; repeat it (or separate patterns
    /// with commas) for several: --include 'layers.0.*' --include 'embed.*'.
    #[arg(long, value_name = "GLOB", value_parser = parse_globs)]
    pub(crate) include: Vec<List<String>>,
    /// Drop tensors matching this glob pattern (e.g. 'optim.*'); repeat it (or separate
    /// patterns with commas) for several.
    #[arg(long, value_name = "GLOB", value_parser = parse_globs)]
    pub(crate) exclude: Vec<List<String>>,
    #[command(flatten)]
    pub(crate) names: Names,
    /// Replace an existing output.
    #[arg(long)]
    pub(crate) force: bool,
    /// Write compressed .ckptz files (byte-grouped zstd chunks, level 1 to 22, default
    /// 1) that every ckpt command reads: zstd or zstd:LEVEL.
    #[arg(long, value_name = "zstd[:LEVEL]", value_parser = ckpt_core::formats::ckptz::Compression::parse)]
    pub(crate) compress: Option<ckpt_core::formats::ckptz::Compression>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// No progress bar.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Neither check the sources' checksums nor record the output's (to measure what
    /// they cost; benchmarks only).
    #[arg(long, hide = true)]
    pub(crate) no_checksums: bool,
}

#[derive(Args, Debug)]
pub(crate) struct MergeArgs {
    #[command(flatten)]
    pub(crate) inputs: Inputs,
    /// Output directory.
    #[arg(short, long)]
    pub(crate) output: PathBuf,
    /// Split the output into files of at most this size, with an index (e.g. 5GB).
    #[arg(long, value_parser = ckpt_merge::parse_size)]
    pub(crate) max_shard_size: Option<u64>,
    /// Write only this process's share of the output files (with --max-shard-size; no
    /// data crosses processes): `auto` under mpirun, srun or torchrun, or a number N
    /// with --world-size M (files k with k % M == N).
    #[arg(long, value_parser = parse_rank)]
    pub(crate) rank: Option<String>,
    /// With --rank N: how many processes share the output files.
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) world_size: Option<u64>,
    /// Print which source files each output file reads and the bytes, and write nothing
    /// (with --rank: this process's output files).
    #[arg(long)]
    pub(crate) plan: bool,
    /// Output format: `hf` (a Hugging Face model that transformers' from_pretrained
    /// loads: names, config.json and shards of the model family; from Megatron, or from
    /// a source already in HF names), `safetensors` (the tensors as named in the source,
    /// in safetensors files in Hugging Face's layout), `mindspore` (one model.ckpt
    /// that mindspore.load_checkpoint reads), `torch` (one model.pth, a dict of
    /// tensors that torch.load(weights_only=True) reads), `ucp` (DeepSpeed's universal
    /// checkpoint, from a DeepSpeed ZeRO checkpoint: latest_universal and
    /// <tag>_universal/zero/<param>/*.pt, loaded with "load_universal": true),
    /// `orbax` (an Orbax step directory that orbax.checkpoint restores: the names as
    /// nested dict keys, zarr v3 arrays in OCDBT; name it <root>/<step> for a
    /// CheckpointManager) or `gguf` (one GGUF file for llama.cpp, -o model.gguf: a Llama-family model as
    /// llama.cpp's convert_hf_to_gguf.py writes it; --dtype f32|f16|bf16|q8_0).
    #[arg(long, default_value = "safetensors",
          value_parser = clap::builder::PossibleValuesParser::new(ckpt_merge::MergeFormat::NAMES.map(|(n, _)| n)))]
    pub(crate) format: String,
    /// Keep optimizer state (tensors named `optim.*`) in model.safetensors; by default
    /// it goes to optimizer.safetensors beside it, and model.safetensors holds the
    /// weights only (`ckpt infer` and `ckpt train --resume` read both).
    #[arg(long)]
    pub(crate) one_file: bool,
    /// Megatron: split each fused QKV projection (`linear_qkv.weight`/`.bias`) into
    /// `linear_q`, `linear_k` and `linear_v` (megatron-core's per-group order).
    #[arg(long)]
    pub(crate) split_qkv: bool,
    /// Megatron: keep the rows that pad the vocabulary for the TP size (by default a
    /// merge drops them where the checkpoint's args give the real vocab_size).
    #[arg(long)]
    pub(crate) keep_vocab_padding: bool,
    /// Megatron dist_ckpt: one tensor a layer and a tensor an expert, under the legacy
    /// names and global ids (`decoder.layers.3.mlp.experts.local_experts.5.…`), instead
    /// of the stacked `[layers, experts, …]` tensors dist_ckpt stores (always so with
    /// --format hf).
    #[arg(long)]
    pub(crate) per_layer: bool,
    /// With --format hf: a Hugging Face config.json to follow. It names the model
    /// family, fills in what the source does not record (and must agree with what it
    /// does), and is written as the output's config; a generation_config.json beside
    /// it is copied too.
    #[arg(long, value_name = "FILE")]
    pub(crate) hf_config: Option<PathBuf>,
    /// With --format hf: the model family, where the source's args do not settle it:
    /// llama, mistral, qwen2, qwen3 or gpt_bigcode (sizes from the args).
    #[arg(long, value_name = "NAME")]
    pub(crate) hf_arch: Option<String>,
    /// With --format hf: copy the tokenizer files of this directory (tokenizer.json,
    /// tokenizer_config.json, ...) beside the model; with --format gguf: the directory
    /// whose tokenizer.model (and tokenizer_config.json) the GGUF's vocabulary comes
    /// from, where the source has none beside it.
    #[arg(long, value_name = "DIR")]
    pub(crate) tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) orbax: OrbaxItemArg,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    #[command(flatten)]
    pub(crate) copy: CopyArgs,
}

/// `--orbax-item`, of `merge` and `reshard`: where in the step an Orbax output's item
/// goes.
#[derive(Args, Debug, Clone)]
pub(crate) struct OrbaxItemArg {
    /// With --format orbax: the item directory's name in the step (default: `default`,
    /// as orbax names a step's one item; MaxText's is `items`, which `reshard --format
    /// maxtext` always writes).
    #[arg(long, value_name = "NAME")]
    pub(crate) orbax_item: Option<String>,
}

/// What a copy computes on the way (LoRA adapters merged, FP8 quantization); `--dtype`
/// on a block-scaled FP8 checkpoint dequantizes it.
#[derive(Args, Debug, Clone)]
pub(crate) struct ComputeArgs {
    /// Merge this PEFT LoRA adapter (a directory with adapter_config.json and
    /// adapter_model.safetensors, or verl's lora_adapter/) into the weights, as
    /// PEFT's merge_and_unload does; repeat it to merge several in turn.
    #[arg(long, value_name = "DIR")]
    pub(crate) lora: Vec<PathBuf>,
    /// The lora_alpha of an adapter whose config records 0 or none (merged as saved it
    /// would change nothing, so it is refused without this).
    #[arg(long, value_name = "ALPHA")]
    pub(crate) lora_alpha: Option<f64>,
    /// Quantize the linear layers' weights: fp8 (E4M3 with a weight_scale_inv per
    /// 128x128 block and the quantization_config vLLM and transformers read).
    #[arg(long, value_name = "fp8", value_parser = ["fp8"])]
    pub(crate) quantize: Option<String>,
}

impl ComputeArgs {
    pub(crate) fn computations(&self) -> ckpt_core::checkpoint::Computations {
        ckpt_core::checkpoint::Computations {
            lora: self.lora.clone(),
            lora_alpha: self.lora_alpha,
            quantize_fp8: self.quantize.is_some(),
        }
    }
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "mesh", "strategy"])))]
pub(crate) struct ReshardArgs {
    #[command(flatten)]
    pub(crate) inputs: Inputs,
    /// Output directory.
    #[arg(short, long)]
    pub(crate) output: PathBuf,
    /// Keep placements; the innermost axis of the source's mesh becomes N, the others 1.
    /// Which axis that is, by source: ckpt rank directories, the last axis of their
    /// strategy.json (tp in dp=2,tp=4); Megatron, the tensor-parallel size (pipeline
    /// stages become 1); MindSpore, the innermost axis of its strategy; DeepSpeed ZeRO
    /// (with --format deepspeed), the data-parallel size; an integrated, DCP or
    /// torch.save source (no mesh), N ranks on one axis `tp`, each tensor split along
    /// the dimension --shard gives, else the one its stored pieces divide, else
    /// replicated.
    #[arg(long, value_name = "N", value_parser = parse_to)]
    pub(crate) to: Option<u64>,
    /// New sizes for named axes, e.g. dp=2,tp=2 (Megatron: tp=, pp=, ep=, and etp=1 or
    /// etp=TP for whole or TP-split experts, by default the source's; DeepSpeed with
    /// --format deepspeed: dp=, and ep= for a mixture of experts).
    #[arg(long, value_parser = parse_mesh)]
    pub(crate) mesh: Option<String>,
    /// With --to N on a whole copy (no strategy): split tensors matching NAME_GLOB along
    /// DIM over the N ranks, first matching rule wins, others replicated; one rule per
    /// --shard, repeated (or comma-separated): --shard '*.q_proj.weight=0' --shard
    /// '*.o_proj.weight=1'.
    #[arg(long, value_name = "NAME_GLOB=DIM", value_parser = parse_shards, requires = "to")]
    pub(crate) shard: Vec<List<(String, usize)>>,
    /// A target strategy file: ckpt's strategy.json, or a MindSpore (predict) strategy
    /// file, protobuf or JSON.
    #[arg(long)]
    pub(crate) strategy: Option<PathBuf>,
    /// Build only this target rank (`auto`: from mpirun, Slurm or torchrun variables).
    #[arg(long, value_parser = parse_rank)]
    pub(crate) rank: Option<String>,
    /// Print which files each target rank reads and the bytes, and write nothing.
    #[arg(long)]
    pub(crate) plan: bool,
    /// With --plan: also write the plan as a self-contained HTML page (per tensor the
    /// target pieces over the source pieces; per output file its reads).
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub(crate) html: Option<PathBuf>,
    /// Write replicated tensors on every rank, not only the lowest (always with
    /// `--format mindspore`).
    #[arg(long)]
    pub(crate) keep_all: bool,
    /// Output layout: `ckpt` (ckpt_<r>/ directories), `distcp` (PyTorch DCP's default
    /// format: __<r>_0.distcp + .metadata, loadable by torch.distributed.checkpoint.load;
    /// each chunk stored once), `dcp-safetensors` (DCP's sharded safetensors, loadable
    /// with torch's HuggingFaceStorageReader; `dcp`, its old name, still works and says
    /// so), `mindspore`
    /// (rank_<r>/checkpoint_<r>.ckpt, loadable by mindspore.load_checkpoint) or
    /// `megatron` (a Megatron legacy checkpoint, from a Megatron legacy source or a
    /// Hugging Face model: iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt), `megatron-dist`
    /// (a megatron-core dist_ckpt from the same sources, loadable by
    /// dist_checkpointing.load: iter_*/ with .metadata and __<r>_0.distcp),
    /// `megatron-bridge` (a Hugging Face Llama or Qwen2 as Megatron-Bridge's AutoBridge.import_ckpt
    /// saves it: iter_0000000/ with run_config.yaml, train_state.pt and the trackers,
    /// what Bridge's load_checkpoint starts training from), `nemo2` (a Hugging Face
    /// Llama or Qwen2 as NeMo 2's llm.import_ckpt saves it: weights/, the dist_ckpt under
    /// `module.`, and context/ with io.json, model.yaml and nemo_tokenizer/), `torchtitan`
    /// (DCP in torchtitan's Llama names, from a Hugging Face Llama) or `deepspeed`
    /// (a DeepSpeed ZeRO-1/2/3 checkpoint for --to N data-parallel ranks, from a
    /// DeepSpeed source; a ZeRO-1/2 mixture of experts also at another EP size with
    /// --mesh dp=N,ep=K), or `orbax` (an Orbax step directory, each array a jax.Array
    /// sharded on the target mesh, each device's box one chunk, with `_sharding`:
    /// restored by orbax-checkpoint without a target or onto a JAX mesh), or `maxtext`
    /// (MaxText's scanned parameter tree as an Orbax step, item `items`, from a Hugging
    /// Face Llama, Mistral or Qwen3: MaxText's load_parameters_path=OUT/items).
    #[arg(long, default_value = "ckpt", value_parser = reshard_formats())]
    pub(crate) format: String,
    /// With --format maxtext: `true` (the default) writes the scanned tree (every layer
    /// weight stacked on axis 1, `decoder.layers.*`), `false` the unscanned one
    /// (`decoder.layers_0.*`, ...), for a MaxText run with scan_layers=False.
    #[arg(long, value_name = "BOOL")]
    pub(crate) maxtext_scan_layers: Option<bool>,
    #[command(flatten)]
    pub(crate) orbax: OrbaxItemArg,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    #[command(flatten)]
    pub(crate) copy: CopyArgs,
}

/// `reshard --format`'s names; the old `dcp` is accepted but not listed.
fn reshard_formats() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        ckpt_reshard::OutputFormat::NAMES.map(|(n, _)| {
            clap::builder::PossibleValue::new(n).hide(n == ckpt_reshard::OLD_DCP_NAME)
        }),
    )
}

#[derive(Args, Debug)]
pub(crate) struct ConvertArgs {
    /// A tensor file, or a checkpoint directory (converted with everything under it).
    pub(crate) source: PathBuf,
    /// The output file or directory.
    #[arg(short, long)]
    pub(crate) output: PathBuf,
    /// zstd level (compress only).
    #[arg(long, default_value_t = ckpt_core::formats::ckptz::DEFAULT_LEVEL, value_parser = clap::value_parser!(i32).range(1..=22))]
    pub(crate) level: i32,
    /// Raw bytes per compressed chunk (tests: small chunks make small tensors span
    /// several).
    #[arg(long, hide = true, value_parser = ckpt_merge::parse_size)]
    pub(crate) chunk_bytes: Option<u64>,
    /// Replace an existing output.
    #[arg(long)]
    pub(crate) force: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct ExampleArgs {
    /// Output directory (a sliced checkpoint root).
    pub(crate) output: PathBuf,
    /// Mesh, e.g. tp=4 or dp=2,tp=4 (innermost axis is tensor parallel).
    #[arg(long, default_value = "tp=4", value_parser = parse_mesh)]
    pub(crate) mesh: String,
    /// Hidden size.
    #[arg(long, default_value_t = 64)]
    pub(crate) hidden: u64,
    /// Layers.
    #[arg(long, default_value_t = 2)]
    pub(crate) layers: u64,
    /// Vocabulary rows (odd sizes shard unevenly).
    #[arg(long, default_value_t = 1000)]
    pub(crate) vocab: u64,
    /// Element type.
    #[arg(long, default_value = "BF16", value_parser = parse_cast)]
    pub(crate) dtype: Dtype,
    /// Add ZeRO-sharded F32 optimizer moments (`optim.*.exp_avg`).
    #[arg(long)]
    pub(crate) optimizer: bool,
    /// Replace an existing output.
    #[arg(long)]
    pub(crate) force: bool,
}

/// A `--dtype` value: a dtype, or ggml's Q8_0 blocks (`--format gguf` only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cast {
    /// Elements of a dtype.
    Dtype(Dtype),
    /// ggml's Q8_0.
    Q8_0,
}

impl Cast {
    /// The dtype, where it is one.
    pub(crate) fn dtype(self) -> Option<Dtype> {
        match self {
            Cast::Dtype(d) => Some(d),
            Cast::Q8_0 => None,
        }
    }
}

pub(crate) fn parse_copy_cast(s: &str) -> std::result::Result<Cast, String> {
    if s.eq_ignore_ascii_case("q8_0") {
        return Ok(Cast::Q8_0);
    }
    parse_cast(s).map(Cast::Dtype)
}

pub(crate) fn parse_cast(s: &str) -> std::result::Result<Dtype, String> {
    match s.to_ascii_lowercase().as_str() {
        "bf16" => Ok(Dtype::BF16),
        "f16" | "fp16" => Ok(Dtype::F16),
        "f32" | "fp32" => Ok(Dtype::F32),
        "f64" => Ok(Dtype::F64),
        _ => ckpt_core::layout::strategy::parse_dtype(&s.to_ascii_uppercase()),
    }
}
