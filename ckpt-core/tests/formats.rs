//! Every safetensors dtype carried byte for byte through slicing and merging, and the
//! parsers never panic on arbitrary input.

use ckpt_core::engine::copy::assemble;
use ckpt_core::engine::save::write_rank;
use ckpt_core::formats::safetensors::parse_header as parse_safetensors_header;
use ckpt_core::layout::mesh::Mesh;
use ckpt_core::layout::plan::{CopyPlan, TargetFile, TargetTensor};
use ckpt_core::layout::region::Region;
use ckpt_core::layout::strategy::Strategy;
use ckpt_core::layout::{Dtype, Piece, Placement, TensorLayout};
use ckpt_core::Checkpoint;
use proptest::prelude::{any, prop, proptest, ProptestConfig};

const ALL: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

#[test]
fn every_dtype_round_trips_through_slices() {
    let mesh = Mesh::parse("tp=2").unwrap();
    for dtype in ALL {
        for placement in [Placement::shard(0), Placement::shard(1)] {
            let dir = tempfile::tempdir().unwrap();
            let l = TensorLayout::new(vec![6, 8], dtype, vec![placement]);
            let mut s = Strategy::new(mesh.clone());
            s.insert("t", l.clone()).unwrap();
            let bits = dtype.bitsize();
            let nbytes = 48 * bits / 8;
            let full: Vec<u8> = (0..nbytes).map(|i| (i * 37 + 11) as u8).collect();
            // Slice by bytes: rows of 8 elements are 8*bits/8 bytes; columns 4 elements.
            let row = 8 * bits / 8;
            for r in 0..2u64 {
                let local: Vec<u8> = match placement {
                    Placement::Shard { dim: 0, .. } => {
                        full[(r as usize) * 3 * row..(r as usize + 1) * 3 * row].to_vec()
                    }
                    _ => (0..6)
                        .flat_map(|i| {
                            full[i * row + (r as usize) * row / 2
                                ..i * row + (r as usize + 1) * row / 2]
                                .to_vec()
                        })
                        .collect(),
                };
                write_rank(dir.path(), &s, r, &[("t", &local)], false).unwrap();
            }
            let ck = Checkpoint::open(&[dir.path().to_path_buf()]).unwrap();
            let fullr = Region::full(&[6, 8]);
            let target = TargetTensor {
                name: "t".into(),
                dtype,
                shape: vec![6, 8],
                pieces: vec![Piece {
                    global: fullr.clone(),
                    local: fullr,
                }],
            };
            let plan = CopyPlan::build(
                &ck,
                vec![TargetFile {
                    path: "m".into(),
                    tensors: vec![target],
                    metadata: Default::default(),
                }],
            )
            .unwrap();
            assert_eq!(
                assemble(&plan.files[0].tensors[0], &ck).unwrap(),
                full,
                "{dtype:?} {placement}"
            );
        }
    }
}

#[test]
fn sub_byte_split_inside_a_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = Mesh::parse("tp=2").unwrap();
    let mut s = Strategy::new(mesh.clone());
    // 6 F4 columns over 2 ranks: 3 columns each, 1.5 bytes: not expressible.
    s.insert(
        "t",
        TensorLayout::new(vec![2, 6], Dtype::F4, vec![Placement::shard(1)]),
    )
    .unwrap();
    write_rank(dir.path(), &s, 0, &[("t", &[0u8; 3])], false).unwrap();
    write_rank(dir.path(), &s, 1, &[("t", &[0u8; 3])], false).unwrap();
    let ck = Checkpoint::open(&[dir.path().to_path_buf()]).unwrap();
    let fullr = Region::full(&[2, 6]);
    let target = TargetTensor {
        name: "t".into(),
        dtype: Dtype::F4,
        shape: vec![2, 6],
        pieces: vec![Piece {
            global: fullr.clone(),
            local: fullr,
        }],
    };
    let e = CopyPlan::build(
        &ck,
        vec![TargetFile {
            path: "m".into(),
            tensors: vec![target],
            metadata: Default::default(),
        }],
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("tensor `t`: F4 packs 2 elements per byte group"),
        "{e}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn header_parser_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256), n in 0u64..300) {
        let mut b = n.to_le_bytes().to_vec();
        b.extend_from_slice(&bytes);
        let _ = parse_safetensors_header(&b);
        let _ = parse_safetensors_header(&bytes);
    }

    #[test]
    fn header_parser_never_panics_on_near_valid_json(shape in prop::collection::vec(0u64..5, 0..3), s in 0u64..40, e in 0u64..40, dt in "[A-Z0-9_]{1,8}", extra in 0usize..40) {
        let h = format!(r#"{{"t":{{"dtype":"{dt}","shape":{shape:?},"data_offsets":[{s},{e}]}}}}"#);
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        b.extend(std::iter::repeat_n(0, extra));
        let _ = parse_safetensors_header(&b);
    }

    #[test]
    fn strategy_parser_never_panics(text in "\\PC{0,200}", dims in prop::collection::vec(0u64..6, 0..3), p in "(Replicate|Shard\\([0-9],?(blocks|order)?=?[0-9]?\\))") {
        let _ = Strategy::from_json(&text);
        let doc = format!(r#"{{"format":"ckpt-strategy","version":1,"mesh":{{"axes":[{{"name":"tp","size":3}}]}},"tensors":{{"w":{{"shape":{dims:?},"dtype":"F32","placements":["{p}"]}}}}}}"#);
        let _ = Strategy::from_json(&doc);
    }
}
