mod reference_support;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use candle_transformers::models::quantized_llama;
use reference_support::*;
use specsplit_models::transformer::Transformer;

#[test]
fn scratch() {
    let dev = Device::Cpu;
    let path = model_path(SMOLLM2);
    let ours = Transformer::from_gguf(&path, &dev).unwrap();
    let toks: Vec<u32> = vec![1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 253, 1789, 563, 47, 2, 198, 1, 520, 9531, 198, 49, 1789, 563, 314, 253, 6546, 10265, 338, 11304, 260, 10930, 282, 984, 284, 3657, 30, 657, 506, 253, 10265, 338, 11473, 2728, 282, 3657, 28, 984, 28, 284, 2517, 28, 1129, 351, 253, 1593, 335, 5535, 282, 3905, 28, 2517, 28, 284, 260, 1205, 1786, 30, 669, 10265, 553, 719, 8167, 281, 1461, 2717, 1699, 896, 4520];
    let n = toks.len();
    for total in [80usize, 88, 89, 90, 91, 95] {
        let t = &toks[..total];
        // ours full
        let mut c = ours.new_cache(128).unwrap();
        let full = ours.forward(&u32s(t, &dev), &span(0, total, &dev), None, &mut c, &u32s(&[total as u32 - 1], &dev)).unwrap();
        // ours incremental: prefix 36 then one by one
        let mut c2 = ours.new_cache(128).unwrap();
        ours.forward(&u32s(&t[..36], &dev), &span(0, 36, &dev), None, &mut c2, &u32s(&[0], &dev)).unwrap();
        let mut inc = None;
        for i in 36..total {
            inc = Some(ours.forward(&u32s(&t[i..i+1], &dev), &span(i, 1, &dev), None, &mut c2, &u32s(&[0], &dev)).unwrap());
        }
        let inc = inc.unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut r = quantized_llama::ModelWeights::from_gguf(content, &mut file, &dev).unwrap();
        let rfull = r.forward(&u32s(t, &dev).unsqueeze(0).unwrap(), 0).unwrap().reshape(full.dims()).unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut r2 = quantized_llama::ModelWeights::from_gguf(content, &mut file, &dev).unwrap();
        r2.forward(&u32s(&t[..36], &dev).unsqueeze(0).unwrap(), 0).unwrap();
        let mut rinc = None;
        for i in 36..total {
            rinc = Some(r2.forward(&u32s(&t[i..i+1], &dev).unsqueeze(0).unwrap(), i).unwrap());
        }
        let rinc = rinc.unwrap().reshape(full.dims()).unwrap();
        eprintln!("total {total}: ours full-inc {:e}, ref full-inc {:e}, ours-ref full {:e}, ours-ref inc {:e}", max_abs_diff(&full, &inc), max_abs_diff(&rfull, &rinc), max_abs_diff(&full, &rfull), max_abs_diff(&inc, &rinc));
    }
    let _ = n;
}
