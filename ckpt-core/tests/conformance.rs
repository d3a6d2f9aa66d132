//! The conformance suite: one set of checks every format's writer and reader pass on
//! their own files (as object_store's `integration.rs` is run by every backend). A new
//! format adds one `#[test]` calling [`conform`] with its [`Case`]
//! (docs/architecture.md, "Adding a format").
//!
//! For each format: a round trip through our own reader (names, dtypes, shapes, every
//! byte); coverage (opened as a checkpoint, every element of every tensor held exactly
//! once); the damaged-input catalogue (truncated file, flipped header bytes, a rank's
//! file missing), each a named error that names the file; and a fuzz seed for the
//! format's parser under `fuzz/corpus/`.

use ckpt_core::engine::copy::assemble;
use ckpt_core::formats::ckptz::{CkptzWriter, Compression};
use ckpt_core::formats::detect::create_writer;
use ckpt_core::formats::distcp::{metadata_bytes as distcp_metadata, DistcpChunk};
use ckpt_core::formats::mindspore_ckpt::MindSporeWriter;
use ckpt_core::formats::safetensors::SafetensorsWriter;
use ckpt_core::formats::writer::{TensorSpec, TensorWriter};
use ckpt_core::formats::{FileFormat, ReadCache, TensorFile};
use ckpt_core::layout::coverage::check_tiling;
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use ckpt_core::layout::region::Region;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Dtype, Piece, Placement, TensorLayout};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One format under test.
struct Case {
    /// File name of a written file (its extension picks nothing here: `create` does).
    file: &'static str,
    /// The format the reader must report.
    format: FileFormat,
    /// The fuzz target whose committed seeds exercise this format's parser.
    fuzz_target: &'static str,
    /// Creates the format's writer.
    create: fn(&Path, &[TensorSpec]) -> Box<dyn TensorWriter>,
    /// How a two-rank checkpoint in the format is opened: by its root (discovery finds
    /// the rank files) or by the rank files themselves (discovery looks for a rank
    /// directory's model file only in the formats ckpt writes rank directories in).
    open_by: OpenBy,
}

/// See [`Case::open_by`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenBy {
    Root,
    Files,
}

/// The paths that open a two-rank checkpoint written under `root` with `files`.
fn inputs(case: &Case, root: &Path, files: &[PathBuf]) -> Vec<PathBuf> {
    match case.open_by {
        OpenBy::Root => vec![root.to_path_buf()],
        OpenBy::Files => files.iter().filter(|f| f.exists()).cloned().collect(),
    }
}

/// Tensors of several dtypes and ranks (a scalar among them), with bytes no two
/// positions share.
fn tensors() -> Vec<(TensorSpec, Vec<u8>)> {
    let spec = |name: &str, dtype, shape: &[u64]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let specs = [
        spec("w", Dtype::F32, &[6, 4]),
        spec("b", Dtype::BF16, &[7]),
        spec("steps", Dtype::I64, &[]),
        spec("emb", Dtype::F16, &[4, 3, 2]),
    ];
    specs
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let n = s.shape.iter().product::<u64>() as usize * (s.dtype.bitsize() / 8);
            let bytes = (0..n).map(|i| (i * 7 + k * 31 + 1) as u8).collect();
            (s, bytes)
        })
        .collect()
}

/// Writes `tensors` through the case's writer, each tensor in two positional writes
/// (second half first: writers take bytes in any order).
fn write(case: &Case, path: &Path, tensors: &[(TensorSpec, Vec<u8>)]) {
    let specs: Vec<TensorSpec> = tensors.iter().map(|(s, _)| s.clone()).collect();
    let w = (case.create)(path, &specs);
    for (i, (_, bytes)) in tensors.iter().enumerate() {
        let half = bytes.len() / 2;
        w.write_at(i, half as u64, &bytes[half..]).unwrap();
        w.write_at(i, 0, &bytes[..half]).unwrap();
    }
    w.finish().unwrap();
}

/// Runs every check of the suite on `case`.
fn conform(case: &Case) {
    round_trip(case);
    coverage(case);
    damaged_inputs(case);
    fuzz_seed_present(case);
}

fn round_trip(case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(case.file);
    let want = tensors();
    write(case, &path, &want);
    let f = TensorFile::open(&path).unwrap();
    assert_eq!(f.format(), case.format);
    assert_eq!(f.tensors().len(), want.len());
    let mut cache = ReadCache::new();
    for (spec, bytes) in &want {
        let i = f
            .find(&spec.name)
            .unwrap_or_else(|| panic!("{} lost", spec.name));
        let t = &f.tensors()[i];
        assert_eq!(
            (t.dtype, &t.shape),
            (spec.dtype, &spec.shape),
            "{}",
            spec.name
        );
        let got = f.read(i, 0..bytes.len() as u64, &mut cache).unwrap();
        assert_eq!(got, &bytes[..], "bytes of {}", spec.name);
    }
    // Nothing but the file is left in the directory (no temporary).
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

/// A ckpt sliced checkpoint of two ranks in the case's format: `w` sharded on rows,
/// the others replicated.
fn sliced(case: &Case, root: &Path) -> Vec<PathBuf> {
    let all = tensors();
    let mut strategy = Strategy::new(Mesh::parse("tp=2").unwrap());
    for (s, _) in &all {
        let p = if s.name == "w" {
            Placement::shard(0)
        } else {
            Placement::Replicate
        };
        let layout = TensorLayout::new(s.shape.clone(), s.dtype, vec![p]);
        strategy.insert(s.name.clone(), layout).unwrap();
    }
    let mut files = Vec::new();
    for rank in 0..2u64 {
        let d = root.join(format!("ckpt_{rank}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("strategy.json"), strategy.to_json()).unwrap();
        let local: Vec<(TensorSpec, Vec<u8>)> = all
            .iter()
            .map(|(s, b)| {
                if s.name != "w" {
                    return (s.clone(), b.clone());
                }
                // Rows 3r..3r+3 of a [6, 4] F32 tensor.
                let row = 4 * 4;
                let lo = (3 * rank as usize) * row;
                let mut s = s.clone();
                s.shape = vec![3, 4];
                (s, b[lo..lo + 3 * row].to_vec())
            })
            .collect();
        let path = d.join(case.file);
        write(case, &path, &local);
        files.push(path);
    }
    files
}

fn coverage(case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let files = sliced(case, dir.path());
    let ck = ckpt_core::Checkpoint::open(&inputs(case, dir.path(), &files)).unwrap();
    for (spec, _) in tensors() {
        let t = &ck.tensors[&spec.name];
        assert_eq!(t.shape, spec.shape, "{}", spec.name);
        let boxes: Vec<_> = t.pieces.iter().map(|p| p.global.clone()).collect();
        assert_eq!(check_tiling(&t.shape, &boxes), Ok(()), "{}", spec.name);
        let held: u64 = boxes.iter().map(|b| b.shape.iter().product::<u64>()).sum();
        assert_eq!(held, spec.shape.iter().product::<u64>(), "{}", spec.name);
    }
}

/// The error of opening a damaged file names it.
fn refused(path: &Path, what: &str) {
    let e = TensorFile::open(path)
        .map(|_| ())
        .expect_err(&format!("{what}: {} opened", path.display()));
    let text = e.to_string();
    assert!(
        text.contains(&*path.to_string_lossy()),
        "{what}: the error does not name {}: {text}",
        path.display()
    );
}

fn damaged_inputs(case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(case.file);
    write(case, &path, &tensors());
    let good = std::fs::read(&path).unwrap();
    // Truncated: the last tensor's bytes are cut off.
    std::fs::write(&path, &good[..good.len() - good.len() / 3]).unwrap();
    refused(&path, "truncated");
    // Flipped header bytes: the first 8 bytes (magic, length or tag) inverted.
    let mut bad = good.clone();
    for b in &mut bad[..8] {
        *b = !*b;
    }
    std::fs::write(&path, &bad).unwrap();
    refused(&path, "flipped header");
    // A missing piece: rank 1's file of a two-rank checkpoint is gone.
    let dir = tempfile::tempdir().unwrap();
    let files = sliced(case, dir.path());
    std::fs::remove_file(&files[1]).unwrap();
    let e = ckpt_core::Checkpoint::open(&inputs(case, dir.path(), &files))
        .map(|_| ())
        .expect_err("a checkpoint missing rank 1 opened");
    assert!(e.to_string().contains("rank 1 of 2 is missing"), "{e}");
}

fn fuzz_seed_present(case: &Case) {
    fuzz_seed_present_for(case.fuzz_target);
}

#[test]
fn safetensors_conforms() {
    conform(&Case {
        file: "model.safetensors",
        format: FileFormat::Safetensors,
        fuzz_target: "header",
        create: |p, s| Box::new(SafetensorsWriter::create(p, s, &BTreeMap::new()).unwrap()),
        open_by: OpenBy::Root,
    });
}

#[test]
fn ckptz_conforms() {
    conform(&Case {
        file: "model.ckptz",
        format: FileFormat::Ckptz,
        fuzz_target: "ckptz",
        create: |p, s| {
            let c = Compression::parse("zstd").unwrap();
            Box::new(CkptzWriter::create(p, s, &BTreeMap::new(), c).unwrap())
        },
        open_by: OpenBy::Root,
    });
}

#[test]
fn mindspore_ckpt_conforms() {
    conform(&Case {
        file: "model.ckpt",
        format: FileFormat::MindSporeCkpt,
        fuzz_target: "mindspore_ckpt",
        create: |p, s| Box::new(MindSporeWriter::create(p, s).unwrap()),
        open_by: OpenBy::Root,
    });
}

#[test]
fn torch_save_conforms() {
    conform(&Case {
        file: "model.pth",
        format: FileFormat::TorchSave,
        fuzz_target: "torch_save",
        create: |p, s| create_writer(p, s, &BTreeMap::new(), None).unwrap(),
        open_by: OpenBy::Files,
    });
}

// Formats that are a directory of files (DCP), or that ckpt only reads (Megatron,
// DeepSpeed: fixtures written by the real library, tests/fixtures/): the same checks on
// the directory as a whole.

/// A tensor's dtype, shape and bytes, by name.
type Tensors = BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)>;

/// One directory format under test.
struct DirCase {
    /// Makes the checkpoint directory in the scratch directory given and returns it.
    make: fn(&Path) -> PathBuf,
    /// A rank's data file, relative to the directory: the one damaged and removed.
    data_file: &'static str,
    /// What the checkpoint must hold (every tensor named here, equal in dtype, shape
    /// and bytes; the checkpoint may hold more, such as optimizer state).
    expected: fn() -> Tensors,
    /// The format its data files are read as.
    format: FileFormat,
    /// The fuzz target whose committed seeds exercise the format's parser.
    fuzz_target: &'static str,
}

/// Every tensor of a checkpoint, whole: planned as one file holding them all and
/// assembled by the copy engine from the pieces the reader gave.
fn whole_tensors(ck: &ckpt_core::Checkpoint) -> Tensors {
    let target = TargetFile {
        path: "all".into(),
        tensors: ck
            .tensors
            .iter()
            .map(|(name, t)| TargetTensor {
                name: name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                pieces: vec![Piece {
                    global: Region::full(&t.shape),
                    local: Region::full(&t.shape),
                }],
            })
            .collect(),
        metadata: BTreeMap::new(),
    };
    let plan = CopyPlan::build(ck, vec![target]).unwrap();
    plan.files[0]
        .tensors
        .iter()
        .map(|t| {
            let bytes = assemble(t, ck).unwrap();
            let v = (t.target.dtype, t.target.shape.clone(), bytes);
            (t.target.name.clone(), v)
        })
        .collect()
}

/// Every tensor of a safetensors file (a fixture's expected result).
fn file_tensors(path: &Path) -> Tensors {
    let f = TensorFile::open(path).unwrap();
    let mut cache = ReadCache::new();
    f.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let bytes = f.read(i, 0..t.end - t.start, &mut cache).unwrap().to_vec();
            (t.name.clone(), (t.dtype, t.shape.clone(), bytes))
        })
        .collect()
}

/// The names under `dir`, recursively (to see that a refusal wrote nothing).
fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(listing(&p));
        }
        out.push(p);
    }
    out.sort();
    out
}

fn conform_dir(case: &DirCase) {
    dir_round_trip_and_coverage(case);
    dir_damaged_inputs(case);
    fuzz_seed_present_for(case.fuzz_target);
}

fn dir_round_trip_and_coverage(case: &DirCase) {
    let scratch = tempfile::tempdir().unwrap();
    let dir = (case.make)(scratch.path());
    let before = listing(scratch.path());
    let ck = ckpt_core::Checkpoint::open(std::slice::from_ref(&dir)).unwrap();
    assert!(
        ck.files.iter().all(|f| f.format() == case.format),
        "{:?}",
        ck.files.iter().map(|f| f.format()).collect::<Vec<_>>()
    );
    // Coverage: every element of every tensor held by exactly one piece.
    for (name, t) in &ck.tensors {
        let boxes: Vec<_> = t.pieces.iter().map(|p| p.global.clone()).collect();
        assert_eq!(check_tiling(&t.shape, &boxes), Ok(()), "{name}");
        let held: u64 = boxes.iter().map(|b| b.shape.iter().product::<u64>()).sum();
        assert_eq!(held, t.shape.iter().product::<u64>(), "{name}");
    }
    // Round trip: the tensors read are the tensors written.
    let want = (case.expected)();
    assert!(!want.is_empty());
    let got = whole_tensors(&ck);
    for (name, (dtype, shape, bytes)) in &want {
        let (d, s, b) = got
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` not read from {}", dir.display()));
        assert_eq!((d, s), (dtype, shape), "{name}");
        assert!(b == bytes, "bytes of {name}");
    }
    assert_eq!(listing(scratch.path()), before, "reading wrote something");
}

/// Opening the directory fails with an error naming `what` (a file, a rank), and
/// writes nothing.
fn dir_refused(dir: &Path, what: &str, damage: &str) {
    let before = listing(dir);
    let e = ckpt_core::Checkpoint::open(&[dir.to_path_buf()])
        .map(|_| ())
        .expect_err(&format!("{damage}: {} opened", dir.display()));
    let text = e.to_string();
    assert!(
        text.contains(what),
        "{damage}: the error does not name {what}: {text}"
    );
    assert_eq!(listing(dir), before, "{damage}: something was written");
}

fn dir_damaged_inputs(case: &DirCase) {
    let scratch = tempfile::tempdir().unwrap();
    let dir = (case.make)(scratch.path());
    let file = dir.join(case.data_file);
    let named = file.display().to_string();
    let good = std::fs::read(&file).unwrap();
    // Truncated: the end of the file cut off.
    std::fs::write(&file, &good[..good.len() - good.len() / 3]).unwrap();
    dir_refused(&dir, &named, "truncated");
    // Flipped header bytes: the first 8 bytes (a zip's signature) inverted.
    let mut bad = good.clone();
    for b in &mut bad[..8] {
        *b = !*b;
    }
    std::fs::write(&file, &bad).unwrap();
    dir_refused(&dir, &named, "flipped header");
    // A missing piece: the rank's file is gone.
    std::fs::remove_file(&file).unwrap();
    dir_refused(&dir, &named, "missing file");
}

fn fuzz_seed_present_for(target: &str) {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let seeds = std::fs::read_dir(&corpus)
        .unwrap_or_else(|e| panic!("{}: {e}", corpus.display()))
        .count();
    assert!(seeds > 0, "no fuzz seed in {}", corpus.display());
}

/// The suite's tensors as a two-rank DCP checkpoint in DCP's default format, written by
/// ckpt's writer: `w` split on rows between the ranks, the others on rank 0 only.
fn dcp_dir(scratch: &Path) -> PathBuf {
    let dir = scratch.join("dcp");
    std::fs::create_dir_all(&dir).unwrap();
    let all = tensors();
    let mut files = Vec::new();
    for rank in 0..2u64 {
        let mut specs = Vec::new();
        let mut chunks = Vec::new();
        let mut data = Vec::new();
        for (s, b) in &all {
            let (offsets, sizes, bytes) = if s.name == "w" {
                let row = 4 * 4;
                let lo = 3 * rank as usize * row;
                (vec![3 * rank, 0], vec![3, 4], b[lo..lo + 3 * row].to_vec())
            } else if rank == 0 {
                (vec![0; s.shape.len()], s.shape.clone(), b.clone())
            } else {
                continue;
            };
            specs.push(TensorSpec {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: sizes.clone(),
            });
            chunks.push(DistcpChunk {
                fqn: s.name.clone(),
                offsets,
                sizes,
            });
            data.push(bytes);
        }
        let name = format!("__{rank}_0.distcp");
        let w = create_writer(&dir.join(&name), &specs, &BTreeMap::new(), None).unwrap();
        for (i, bytes) in data.iter().enumerate() {
            w.write_at(i, 0, bytes).unwrap();
        }
        w.finish().unwrap();
        files.push((name, chunks));
    }
    let global = all
        .iter()
        .map(|(s, _)| (s.name.clone(), (s.dtype, s.shape.clone())))
        .collect();
    let meta = distcp_metadata(&global, &files, &[]).unwrap();
    std::fs::write(dir.join(".metadata"), meta).unwrap();
    dir
}

#[test]
fn dcp_conforms() {
    conform_dir(&DirCase {
        make: dcp_dir,
        data_file: "__1_0.distcp",
        expected: || {
            tensors()
                .into_iter()
                .map(|(s, b)| (s.name, (s.dtype, s.shape, b)))
                .collect()
        },
        format: FileFormat::Distcp,
        fuzz_target: "distcp",
    });
}

/// A fixture directory of tests/fixtures/, copied into the scratch directory (the
/// damaged-input checks damage the copy).
fn fixture_copy(scratch: &Path, fixture: &str) -> PathBuf {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let p = e.unwrap().path();
            let dst = to.join(p.file_name().unwrap());
            if p.is_dir() {
                copy(&p, &dst);
            } else {
                std::fs::copy(&p, &dst).unwrap();
            }
        }
    }
    let dst = scratch.join("fixture");
    copy(&fixture_path(fixture), &dst);
    dst
}

fn fixture_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

/// Megatron legacy (tp=2, pp=2), written by Megatron itself; `full.safetensors` holds
/// the full tensors by Megatron's own parameter attributes
/// (scripts/fixtures/, tests/fixtures/megatron/).
#[test]
fn megatron_legacy_conforms() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "megatron/tp2pp2/legacy"),
        data_file: "iter_0000001/mp_rank_01_001/model_optim_rng.pt",
        expected: || file_tensors(&fixture_path("megatron/tp2pp2/full.safetensors")),
        format: FileFormat::TorchSave,
        fuzz_target: "megatron",
    });
}

/// Per-rank torch.save files of DTensors (2 ranks: Shard(0) uneven, Shard(1),
/// Replicate), written by torch itself; `ws2_expected.safetensors` holds their
/// `full_tensor()`s (scripts/fixtures/dtensor_pickles.py, tests/fixtures/dtensor/).
#[test]
fn dtensor_pickles_conform() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "dtensor/ws2"),
        data_file: "model_world_size_2_rank_1.pt",
        expected: || file_tensors(&fixture_path("dtensor/ws2_expected.safetensors")),
        format: FileFormat::TorchSave,
        fuzz_target: "torch_save",
    });
}

/// Megatron legacy (tp=2, pp=2, dp=2) with the distributed optimizer's state
/// (`distrib_optim.pt`), written by megatron-core's own DistributedOptimizer;
/// `optim_full.safetensors` holds the weights and the optimizer's own fp32 master
/// weights and Adam moments (scripts/fixtures/megatron_distopt.py).
#[test]
fn megatron_distributed_optimizer_conforms() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "megatron/tp2pp2dp2_distopt/legacy"),
        data_file: "iter_0000001/mp_rank_01_001/distrib_optim.pt",
        expected: || {
            file_tensors(&fixture_path(
                "megatron/tp2pp2dp2_distopt/optim_full.safetensors",
            ))
        },
        format: FileFormat::TorchSave,
        fuzz_target: "megatron_optim",
    });
}

/// DeepSpeed ZeRO-2 and ZeRO-3 (two data-parallel ranks), written by DeepSpeed;
/// `expected.safetensors` is its own zero_to_fp32 result (tests/fixtures/deepspeed/).
#[test]
fn deepspeed_conforms() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "deepspeed/zero2_fp32/ckpt/global_step2"),
        data_file: "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        expected: || file_tensors(&fixture_path("deepspeed/zero2_fp32/expected.safetensors")),
        format: FileFormat::DeepSpeed,
        fuzz_target: "deepspeed",
    });
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "deepspeed/zero3_bf16/ckpt/global_step2"),
        data_file: "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        expected: || file_tensors(&fixture_path("deepspeed/zero3_bf16/expected.safetensors")),
        format: FileFormat::DeepSpeed,
        fuzz_target: "deepspeed",
    });
}

/// Orbax (JAX): a CheckpointManager root written by orbax 0.12.8 (zarr v3 in OCDBT,
/// two committed steps and two that are not), read at its latest committed step;
/// `reference.safetensors` holds that step's arrays (tests/fixtures/orbax/). The data
/// file damaged is the item's OCDBT B+tree (every key is found through it).
#[test]
fn orbax_conforms() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "orbax/ocdbt_zarr3/ckpt"),
        data_file: "2/items/d/f1464c0c7d532011419559e1a73c7f43",
        expected: || file_tensors(&fixture_path("orbax/ocdbt_zarr3/reference.safetensors")),
        format: FileFormat::Orbax,
        fuzz_target: "orbax_metadata",
    });
}

/// Mixtures of experts, written by the libraries themselves (tests/fixtures/moe/,
/// scripts/fixtures/moe_*.py): Megatron's legacy expert-parallel rank directories (EP 2,
/// `mp_rank_00_00E`) and DeepSpeed's MoE without ZeRO (stage 0: `module` and one file
/// per expert). `reference.safetensors` holds every tensor of the model under its
/// global expert id, gathered by the generators from every rank's own state dict.
#[test]
fn mixture_of_experts_conforms() {
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "moe/megatron/ep2tp1/legacy"),
        data_file: "iter_0000001/mp_rank_00_001/model_optim_rng.pt",
        expected: || file_tensors(&fixture_path("moe/megatron/ep2tp1/reference.safetensors")),
        format: FileFormat::TorchSave,
        fuzz_target: "megatron",
    });
    conform_dir(&DirCase {
        make: |s| fixture_copy(s, "moe/deepspeed/ep2_zero0/ckpt/global_step2"),
        data_file: "layer_1_expert_2_mp_rank_00_model_states.pt",
        expected: || {
            file_tensors(&fixture_path(
                "moe/deepspeed/ep2_zero0/reference.safetensors",
            ))
        },
        format: FileFormat::DeepSpeed,
        fuzz_target: "deepspeed",
    });
}

/// A directory format (DeepSpeed's universal checkpoint, which ckpt writes only from a
/// ZeRO checkpoint, through `merge --format ucp`): the suite's checks on trees written
/// by the real library (tests/fixtures/deepspeed/zero{2,3}_fp32/ucp, ds_to_universal's):
/// every file read in the format, every element of every tensor held once, each damage
/// (truncated file, flipped header bytes, a parameter's file missing) a named error
/// naming the file, fuzz seeds present.
#[test]
fn ucp_conforms() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspeed");
    for v in ["zero2_fp32", "zero3_fp32"] {
        let tree = fixtures.join(v).join("ucp");
        let ck = ckpt_core::Checkpoint::open(std::slice::from_ref(&tree)).unwrap();
        assert!(
            ck.files.iter().all(|f| f.format() == FileFormat::Ucp),
            "{v}"
        );
        assert!(ck.tensors.len() >= 15, "{v}: {}", ck.tensors.len());
        for (name, t) in &ck.tensors {
            let boxes: Vec<_> = t.pieces.iter().map(|p| p.global.clone()).collect();
            assert_eq!(check_tiling(&t.shape, &boxes), Ok(()), "{v}: {name}");
        }
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("ucp");
        copy_tree(&tree, &copy);
        let file = copy.join("zero/fc1.weight/exp_avg.pt");
        let good = std::fs::read(&file).unwrap();
        let named = |what: &str, path: &Path| {
            let e = ckpt_core::Checkpoint::open(std::slice::from_ref(&copy))
                .map(|_| ())
                .expect_err(&format!("{v}: {what} opened"));
            assert!(
                e.to_string().contains(&*path.to_string_lossy()),
                "{v}: {what}: the error does not name {}: {e}",
                path.display()
            );
        };
        std::fs::write(&file, &good[..good.len() - good.len() / 3]).unwrap();
        named("truncated", &file);
        let mut bad = good.clone();
        for b in &mut bad[..8] {
            *b = !*b;
        }
        std::fs::write(&file, &bad).unwrap();
        named("flipped header", &file);
        std::fs::write(&file, &good).unwrap();
        let fp32 = copy.join("zero/fc2.bias/fp32.pt");
        std::fs::remove_file(&fp32).unwrap();
        named("missing fp32.pt", &fp32);
    }
    fuzz_seed_present_for("ucp");
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_tree(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}
