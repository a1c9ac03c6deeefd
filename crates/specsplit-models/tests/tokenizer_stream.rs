//! The streaming detokenizer emits exactly the full decode, never a split character.

use specsplit_models::source::{self, ModelFiles};
use specsplit_models::tokenizer::{StreamDecoder, TextTokenizer};

const TEXTS: &[&str] = &[
    "中文：你好，世界！今天天气很好。",
    "Emoji: 😀🎉🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 done",
    "Ünïcödé çhàràctérs: naïve café résumé",
    "हिन्दी: नमस्ते दुनिया and ไทย: สวัสดีชาวโลก",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∞",
    "plain ascii text with code: fn main() { println!(\"hi\"); }\n",
    "<|im_start|>assistant\n日本語<|im_end|>",
];

fn check_stream(tok: &TextTokenizer, text: &str, skip_special: bool) -> usize {
    let ids = tok.encode(text, false).unwrap();
    let full = tok.decode(&ids, skip_special).unwrap();
    let mut dec = StreamDecoder::new(skip_special);
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        match dec.step(tok, id).unwrap() {
            Some(piece) => {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "partial character in {piece:?}"
                );
                out.push_str(&piece);
            }
            None => held_back += 1,
        }
        assert!(
            full.starts_with(&out),
            "{out:?} is not a prefix of {full:?}"
        );
    }
    out.push_str(&dec.finish(tok).unwrap());
    assert_eq!(out, full, "stream of {text:?}");
    // Same through multi-token pushes (as when several drafted tokens are accepted at once).
    let mut dec = tok.stream_decoder(skip_special);
    let mut out = String::new();
    for chunk in ids.chunks(3) {
        out.push_str(&dec.push(tok, chunk).unwrap());
    }
    out.push_str(&dec.finish(tok).unwrap());
    assert_eq!(out, full);
    held_back
}

fn gguf_tokenizer(alias: &str) -> TextTokenizer {
    match source::resolve(alias).unwrap().files {
        ModelFiles::Gguf { path, .. } => TextTokenizer::from_gguf_file(path).unwrap(),
        other => panic!("{alias} resolved to {other:?}"),
    }
}

#[test]
fn stream_matches_full_decode_byte_level() {
    let tok = TextTokenizer::byte_level(512).unwrap();
    let mut held = 0;
    for text in TEXTS {
        held += check_stream(&tok, text, false);
        held += check_stream(&tok, text, true);
    }
    // One token per byte: multi-byte characters are necessarily split across tokens.
    assert!(held > 0);
}

#[test]
fn stream_matches_full_decode_smollm2_and_qwen() {
    for alias in ["smollm2", "qwen-coder-0.5b"] {
        let tok = gguf_tokenizer(alias);
        let mut held = 0;
        for text in TEXTS {
            held += check_stream(&tok, text, false);
            held += check_stream(&tok, text, true);
        }
        assert!(held > 0, "{alias}: no character was split across tokens");
    }
}

#[test]
fn finish_flushes_incomplete_character() {
    let tok = TextTokenizer::byte_level(300).unwrap();
    // The first two bytes of the three-byte "中".
    let mut dec = StreamDecoder::new(false);
    assert_eq!(dec.step(&tok, 0xE4).unwrap(), None);
    assert_eq!(dec.step(&tok, 0xB8).unwrap(), None);
    assert_eq!(
        dec.finish(&tok).unwrap(),
        tok.decode(&[0xE4, 0xB8], false).unwrap()
    );
}

#[test]
fn byte_level_tokenizer() {
    let tok = TextTokenizer::byte_level(1000).unwrap();
    assert_eq!(tok.vocab_size(), 1000);
    let ids = tok.encode("hé", false).unwrap();
    assert_eq!(ids, vec![b'h' as u32, 0xC3, 0xA9]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hé");
    assert_eq!(tok.eos_token_ids(), &[256]);
    assert_eq!(tok.encode("a<|endoftext|>", false).unwrap(), vec![97, 256]);
    assert_eq!(tok.decode(&[97, 256, 700], true).unwrap(), "a");
    assert_eq!(tok.apply_chat_template("hi"), "hi");
    assert!(TextTokenizer::byte_level(256).is_err());
}
