//! Property tests of the layout algebra: for random shapes, meshes and placements,
//! pieces tile the tensor, local shapes are nested torch.chunk, slicing then merging
//! gives back every byte, and resharding A to B to A is the identity.

use ckpt_core::engine::copy::{assemble, execute};
use ckpt_core::layout::coverage::check_tiling;
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::plan::{rank_metadata, rank_tensors, CopyPlan, TargetFile, TargetTensor};
use ckpt_core::layout::region::Region;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Dtype, Piece, Placement, TensorLayout};
use ckpt_core::Checkpoint;
use proptest::prelude::{any, prop, prop_assert_eq, prop_assume, proptest, Just, ProptestConfig};
use proptest::strategy::Strategy as _;
use std::path::{Path, PathBuf};

/// A random mesh of 1 to 3 axes and a layout of a random 1- to 3-dim tensor on it.
fn arb_layout() -> impl proptest::strategy::Strategy<Value = (Mesh, TensorLayout)> {
    (
        prop::collection::vec(1u64..=4, 1..=3),
        prop::collection::vec(0u64..=9, 1..=3),
    )
        .prop_flat_map(|(sizes, shape)| {
            let naxes = sizes.len();
            let ndim = shape.len();
            let placement = (0..=ndim, 1u64..=3, 0u32..=1)
                .prop_map(move |(d, blocks, order)| (d, blocks, order));
            (
                Just(sizes),
                Just(shape),
                prop::collection::vec(placement, naxes),
            )
                .prop_map(|(sizes, shape, ps)| {
                    let mesh = Mesh::new(
                        sizes
                            .iter()
                            .enumerate()
                            .map(|(i, &s)| (format!("a{i}"), s))
                            .collect(),
                    )
                    .unwrap();
                    // Blocks must divide the dim and agree across axes on one dim: use the first
                    // axis's choice for a dim, and only when it divides.
                    let mut dim_blocks = vec![None; shape.len()];
                    let placements = ps
                        .iter()
                        .map(|&(d, blocks, order)| {
                            if d == shape.len() {
                                return Placement::Replicate;
                            }
                            let b = *dim_blocks[d].get_or_insert(if shape[d] % blocks == 0 {
                                blocks
                            } else {
                                1
                            });
                            Placement::Shard {
                                dim: d,
                                blocks: b,
                                order,
                            }
                        })
                        .collect();
                    (mesh, TensorLayout::new(shape, Dtype::BF16, placements))
                })
        })
}

/// Reference: nested torch.chunk, axes in (order, mesh order), on one block.
fn reference_local_len(mesh: &Mesh, l: &TensorLayout, rank: u64, dim: usize) -> u64 {
    let c = mesh.coords(rank);
    let mut axes: Vec<(u32, usize)> = l
        .placements
        .iter()
        .enumerate()
        .filter_map(|(a, p)| match *p {
            Placement::Shard { dim: d, order, .. } if d == dim => Some((order, a)),
            _ => None,
        })
        .collect();
    axes.sort();
    let blocks = axes.first().map_or(1, |&(_, a)| match l.placements[a] {
        Placement::Shard { blocks, .. } => blocks,
        Placement::Replicate => 1,
    });
    let mut len = l.shape[dim] / blocks;
    for (_, a) in axes {
        let k = mesh.axes()[a].size;
        let size = len.div_ceil(k);
        let start = (c[a] * size).min(len);
        len = ((c[a] + 1) * size).min(len) - start;
    }
    len * blocks
}

fn full_bytes(l: &TensorLayout, seed: u8) -> Vec<u8> {
    let n = ckpt_core::layout::plan::bytes_of(l.dtype, l.shape.iter().product()) as usize;
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Writes the sliced checkpoint of `full` under layout `l` on `mesh` into `dir`.
fn slice(dir: &Path, mesh: &Mesh, l: &TensorLayout, full: &[u8]) -> Strategy {
    slice_with(dir, mesh, l, full, None)
}

/// [`slice`], compressed (`.ckptz`) when `compression` is given.
fn slice_with(
    dir: &Path,
    mesh: &Mesh,
    l: &TensorLayout,
    full: &[u8],
    compression: Option<ckpt_core::formats::ckptz::Compression>,
) -> Strategy {
    let mut s = Strategy::new(mesh.clone());
    s.insert("t", l.clone()).unwrap();
    for r in 0..mesh.world_size() {
        let shape = l.local_shape(mesh, r).unwrap();
        let mut local =
            vec![0u8; ckpt_core::layout::plan::bytes_of(l.dtype, shape.iter().product()) as usize];
        for p in l.pieces(mesh, r) {
            for run in ckpt_core::layout::region::Runs::new(
                &p.global.shape,
                &l.shape,
                &p.global.start,
                &shape,
                &p.local.start,
            ) {
                let (s0, d0, n) = (
                    run.src as usize * 2,
                    run.dst as usize * 2,
                    run.len as usize * 2,
                );
                local[d0..d0 + n].copy_from_slice(&full[s0..s0 + n]);
            }
        }
        ckpt_core::engine::save::write_rank_with(dir, &s, r, &[("t", &local)], false, compression)
            .unwrap();
    }
    s
}

fn merge_in_memory(dir: &Path) -> Vec<u8> {
    let (ck, plan) = merge_plan(dir);
    assemble(&plan.files[0].tensors[0], &ck).unwrap()
}

/// The sliced checkpoint in `dir` and the plan of its tensor `t` whole.
fn merge_plan(dir: &Path) -> (Checkpoint, CopyPlan) {
    let ck = Checkpoint::open(&[dir.to_path_buf()]).unwrap();
    let t = &ck.tensors["t"];
    let full = Region::full(&t.shape);
    let target = TargetTensor {
        name: "t".into(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        pieces: vec![Piece {
            global: full.clone(),
            local: full,
        }],
    };
    let plan = CopyPlan::build(
        &ck,
        vec![TargetFile {
            path: PathBuf::new(),
            tensors: vec![target],
            metadata: Default::default(),
        }],
    )
    .unwrap();
    (ck, plan)
}

fn reshard(src: &Path, to: &Strategy, out: &Path) {
    let ck = Checkpoint::open(&[src.to_path_buf()]).unwrap();
    let files = (0..to.mesh.world_size())
        .map(|r| {
            let tensors = rank_tensors(to, r, false, &|_, l| Some(l.dtype));
            TargetFile {
                path: format!("ckpt_{r}/model.safetensors").into(),
                metadata: rank_metadata(to, &to.hash(), r, &tensors),
                tensors,
            }
        })
        .collect();
    let plan = CopyPlan::build(&ck, files).unwrap();
    std::fs::create_dir_all(out).unwrap();
    execute(&plan, &ck, out, &|_| {}).unwrap();
    for r in 0..to.mesh.world_size() {
        std::fs::write(out.join(format!("ckpt_{r}/strategy.json")), to.to_json()).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn owned_pieces_tile_and_local_shapes_are_nested_chunks((mesh, l) in arb_layout()) {
        l.validate("t", &mesh).unwrap();
        let mut boxes = vec![];
        for r in 0..mesh.world_size() {
            let shape = l.local_shape(&mesh, r).unwrap();
            for (d, &len) in shape.iter().enumerate() {
                prop_assert_eq!(len, reference_local_len(&mesh, &l, r, d));
            }
            let pieces = l.pieces(&mesh, r);
            let local_total: u64 = pieces.iter().map(|p| p.global.numel()).sum();
            prop_assert_eq!(local_total, shape.iter().product::<u64>());
            if l.is_owner(&mesh, r) {
                boxes.extend(pieces.into_iter().map(|p| p.global));
            }
        }
        prop_assert_eq!(check_tiling(&l.shape, &boxes), Ok(()));
        prop_assert_eq!(boxes.iter().map(Region::numel).sum::<u64>(), l.shape.iter().product::<u64>());
    }

    #[test]
    fn rows_of_a_plan_assemble_to_those_rows_of_the_tensor(
        (mesh, l) in arb_layout(),
        seed in any::<u8>(),
        (a, b) in (0u64..40, 0u64..40),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let full = full_bytes(&l, seed);
        slice(dir.path(), &mesh, &l, &full);
        let (ck, plan) = merge_plan(dir.path());
        let whole = &plan.files[0].tensors[0];
        let rows = l.shape[0];
        let (lo, hi) = (a.min(b) % (rows + 1), a.max(b) % (rows + 1));
        prop_assume!(lo < hi);
        let row_bytes = full.len() as u64 / rows;
        let cut = whole.rows(lo..hi);
        prop_assert_eq!(cut.target.shape[0], hi - lo);
        prop_assert_eq!(
            assemble(&cut, &ck).unwrap(),
            full[(lo * row_bytes) as usize..(hi * row_bytes) as usize].to_vec()
        );
    }

    #[test]
    fn slice_then_merge_gives_back_every_byte((mesh, l) in arb_layout(), seed in any::<u8>()) {
        let dir = tempfile::tempdir().unwrap();
        let full = full_bytes(&l, seed);
        slice(dir.path(), &mesh, &l, &full);
        prop_assert_eq!(merge_in_memory(dir.path()), full);
    }

    #[test]
    fn reshard_a_to_b_to_a_is_identity((mesh_a, a) in arb_layout(), (mesh_b, b) in arb_layout(), seed in any::<u8>()) {
        // B takes A's shape: keep B's mesh and placements where they still fit.
        let mut b = b;
        b.shape = a.shape.clone();
        for p in &mut b.placements {
            if let Placement::Shard { dim, blocks, .. } = p {
                if *dim >= a.shape.len() || a.shape[*dim] % *blocks != 0 {
                    *p = Placement::Replicate;
                }
            }
        }
        prop_assume!(b.validate("t", &mesh_b).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let full = full_bytes(&a, seed);
        let sa = slice(&dir.path().join("a"), &mesh_a, &a, &full);
        let mut sb = Strategy::new(mesh_b.clone());
        sb.insert("t", b).unwrap();
        reshard(&dir.path().join("a"), &sb, &dir.path().join("b"));
        prop_assert_eq!(merge_in_memory(&dir.path().join("b")), full.clone());
        // A to B equals merge-then-split: slicing the full tensor with B directly.
        let lb = sb.tensors["t"].clone();
        slice(&dir.path().join("b_direct"), &mesh_b, &lb, &full);
        for r in 0..mesh_b.world_size() {
            let x = std::fs::read(dir.path().join(format!("b/ckpt_{r}/model.safetensors"))).unwrap();
            let y = std::fs::read(dir.path().join(format!("b_direct/ckpt_{r}/model.safetensors"))).unwrap();
            prop_assert_eq!(x, y, "rank {} of B", r);
        }
        reshard(&dir.path().join("b"), &sa, &dir.path().join("a2"));
        for r in 0..mesh_a.world_size() {
            let x = std::fs::read(dir.path().join(format!("a/ckpt_{r}/model.safetensors"))).unwrap();
            let y = std::fs::read(dir.path().join(format!("a2/ckpt_{r}/model.safetensors"))).unwrap();
            prop_assert_eq!(x, y, "rank {}", r);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A regathered tensor (blocks of rows in any order: a fused projection's parts, a
    /// vocabulary without padding) is held once per element by the cut pieces, and each
    /// element reads the stored row its block maps it from.
    #[test]
    fn regather_reads_each_element_from_the_row_its_block_names(
        rows in 1u64..24,
        cols in 1u64..4,
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..5),
        segs in prop::collection::vec(any::<prop::sample::Index>(), 0..5),
        keep in prop::collection::vec(any::<bool>(), 6),
        order in any::<prop::sample::Index>(),
    ) {
        use ckpt_core::layout::source::Block;
        use ckpt_core::layout::source::SourcePiece;
        use ckpt_core::layout::source::SourceTensor;
        // Stored pieces: rows cut at random points, one file each.
        let mut edges: Vec<u64> = cuts.iter().map(|i| i.index(rows as usize) as u64).collect();
        edges.extend([0, rows]);
        edges.sort_unstable();
        edges.dedup();
        let pieces: Vec<SourcePiece> = edges.windows(2).enumerate().map(|(f, w)| SourcePiece {
            file: f,
            tensor: 0,
            global: Region::from_ranges(&[w[0]..w[1], 0..cols]),
            local: Region::from_ranges(&[0..w[1] - w[0], 0..cols]),
            view: None,
            compute: None,
        }).collect();
        let starts: Vec<u64> = pieces.iter().map(|p| p.global.start[0]).collect();
        let t = SourceTensor { dtype: Dtype::F32, shape: vec![rows, cols], pieces, copies: vec![] };
        // Blocks: consecutive segments of the rows, some kept, in a rotated order.
        let mut b: Vec<u64> = segs.iter().map(|i| i.index(rows as usize) as u64).collect();
        b.extend([0, rows]);
        b.sort_unstable();
        b.dedup();
        let mut kept: Vec<(u64, u64)> = b.windows(2).enumerate()
            .filter(|(i, _)| keep[i % keep.len()])
            .map(|(_, w)| (w[0], w[1] - w[0]))
            .collect();
        prop_assume!(!kept.is_empty());
        let n = kept.len();
        kept.rotate_left(order.index(n));
        let mut to = 0;
        let blocks: Vec<Block> = kept.iter().map(|&(from, len)| {
            let blk = Block { from, len, to };
            to += len;
            blk
        }).collect();
        let v = t.regather(0, &blocks, to);
        prop_assert_eq!(v.shape.clone(), vec![to, cols]);
        // Where each new row comes from, by the blocks; and by the pieces.
        let want: Vec<u64> = blocks.iter().flat_map(|b| b.from..b.from + b.len).collect();
        let mut got = vec![Vec::new(); to as usize];
        for p in &v.pieces {
            prop_assert_eq!(p.global.shape.clone(), p.local.shape.clone());
            prop_assert_eq!(p.global.shape[1], cols);
            for r in 0..p.global.shape[0] {
                let stored = starts[p.file] + p.local.start[0] + r;
                got[(p.global.start[0] + r) as usize].push(stored);
            }
        }
        let got: Vec<Vec<u64>> = got;
        prop_assert_eq!(got, want.iter().map(|&r| vec![r]).collect::<Vec<_>>());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// A transposed run (GroupedMLP's expert `g`: elements `g*R*C..` of the grouped
    /// weight read as `[R, C]`, transposed) read from a tensor stored in row blocks of
    /// whole experts over several files: every element is the stored element at the
    /// transposed place, read whole or in parts of a few rows, in the stored dtype or
    /// cast to f32, from mapped files or compressed ones.
    #[test]
    fn a_transposed_run_reads_the_transpose_of_the_stored_elements(
        r in 1u64..7,
        c in 1u64..6,
        per_file in 1u64..3,
        files in 1u64..4,
        pick in any::<prop::sample::Index>(),
        part_rows in 1u64..4,
        cast in any::<bool>(),
        compressed in any::<bool>(),
        seed in any::<u8>(),
    ) {
        let experts = per_file * files;
        let mesh = Mesh::new(vec![("dp".into(), files)]).unwrap();
        let l = TensorLayout::new(vec![experts * r, c], Dtype::BF16, vec![Placement::shard(0)]);
        let full = full_bytes(&l, seed);
        let dir = tempfile::tempdir().unwrap();
        // Mapped (read in place) or compressed (gathered by runs first).
        slice_with(dir.path(), &mesh, &l, &full, compressed.then(ckpt_core::formats::ckptz::Compression::default));
        let mut ck = Checkpoint::open(&[dir.path().to_path_buf()]).unwrap();
        prop_assert_eq!(ck.files[0].is_compressed(), compressed);
        let g = pick.index(experts as usize) as u64;
        let view = {
            let stored = |f: usize, i: usize| ck.files[f].tensors()[i].shape.clone();
            ck.tensors["t"].transposed_run(g * r * c, r, c, stored).unwrap()
        };
        prop_assert_eq!(view.shape.clone(), vec![c, r]);
        ck.tensors.insert("u".into(), view);
        let dtype = if cast { Dtype::F32 } else { Dtype::BF16 };
        let full_region = Region::full(&[c, r]);
        let target = TargetTensor {
            name: "u".into(),
            dtype,
            shape: vec![c, r],
            pieces: vec![Piece { global: full_region.clone(), local: full_region }],
        };
        let plan = CopyPlan::build(
            &ck,
            vec![TargetFile { path: PathBuf::new(), tensors: vec![target], metadata: Default::default() }],
        )
        .unwrap();
        let t = &plan.files[0].tensors[0];
        let esize = ckpt_core::layout::plan::bytes_of(dtype, 1) as usize;
        let mut got = vec![0u8; (c * r) as usize * esize];
        for part in ckpt_core::engine::copy::tensor_parts(t, part_rows * r * esize as u64) {
            let at = part.offset as usize;
            ckpt_core::engine::copy::assemble_part_into(t, &ck, &part.region, &mut got[at..at + part.bytes as usize])
                .unwrap();
        }
        // Element (i, j) of the view is element (j, i) of expert g's [R, C] run.
        for i in 0..c as usize {
            for j in 0..r as usize {
                let s = (g * r * c) as usize + j * c as usize + i;
                let bits = [full[2 * s], full[2 * s + 1]];
                let d = (i * r as usize + j) * esize;
                if cast {
                    let want = half::bf16::from_le_bytes(bits).to_f32().to_le_bytes();
                    prop_assert_eq!(&got[d..d + 4], &want[..], "({}, {})", i, j);
                } else {
                    prop_assert_eq!(&got[d..d + 2], &bits[..], "({}, {})", i, j);
                }
            }
        }
    }
}
