fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cfg = ckpt_train::TrainConfig::try_parse_from(args).unwrap();
    let r = ckpt_train::train(&cfg, true).unwrap();
    println!("steps {} acc {:?} ips {:.0} secs {:.1} loss first {:?} last {:?}", r.steps, r.test_accuracy, r.images_per_sec, r.seconds, r.losses.first(), r.losses.last());
}
