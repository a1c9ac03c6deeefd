//! Tokenizers built from GGUF metadata match the reference tokenizers.
//!
//! Needs the catalogue models (fetched by scripts/fetch-models.sh when absent).

use std::path::PathBuf;
use std::process::Command;

use specsplit_models::source::{self, ModelFiles};
use specsplit_models::tokenizer::{ChatFormat, TextTokenizer, QWEN_DEFAULT_SYSTEM_PROMPT};

fn gguf(alias: &str) -> PathBuf {
    match source::resolve(alias)
        .expect("resolve catalogue alias")
        .files
    {
        ModelFiles::Gguf { path, .. } => path,
        other => panic!("{alias} resolved to {other:?}"),
    }
}

fn qwen_reference() -> TextTokenizer {
    let path = source::models_dir().join("qwen2.5-tokenizer.json");
    if !path.is_file() {
        let env = source::ResolveEnv::from_env();
        let script = env.fetch_script.expect("scripts/fetch-models.sh");
        let ok = Command::new("bash")
            .arg(script)
            .arg("qwen-tokenizer")
            .env("SPECSPLIT_MODELS_DIR", source::models_dir())
            .status()
            .expect("run fetch script")
            .success();
        assert!(ok, "fetching the Qwen reference tokenizer failed");
    }
    TextTokenizer::from_file(path).expect("load reference tokenizer.json")
}

/// Strings covering code, prose, unicode, digits, whitespace and special tokens.
const CASES: &[&str] = &[
    "",
    " ",
    "a",
    "Hello, world!",
    "Hello world",
    " Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it, isn't it? You'd think so.",
    "DON'T SHOUT, I'LL HEAR YOU'RE HERE",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 0xFF",
    "2024-06-01T12:34:56Z",
    "1,000,000 and 7/8 and 99.9%",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{v:?}\");\n}\n",
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); return 0; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "const f = async (x) => { await fetch(`/api/${x}`); };",
    "<div class=\"container\"><p>Text &amp; more</p></div>",
    "{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "x+=1;y-=2;z*=3;w/=4;a%=5;b**=6;c//=7",
    "if (a && b || !c) { return a ?? b; }",
    "\tTabbed\tline\twith\ttabs",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    "mixed \n \t \r\n whitespace   \n   ",
    "    indented code block",
    "a\n\n\n\n\n\nb",
    "Ünïcödé çhàràctérs: naïve café résumé",
    "Ελληνικά: Γειά σου Κόσμε",
    "Русский текст: Привет, мир!",
    "中文：你好，世界！今天天气很好。",
    "日本語のテキスト：こんにちは世界",
    "한국어 텍스트: 안녕하세요 세계",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Emoji: 😀🎉🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∞; √2 ≈ 1.414",
    "Combining: e\u{301} vs é, A\u{30a} vs Å",
    "Zero\u{200b}width\u{200d}joiner and\u{a0}nbsp",
    "Symbols: © ® ™ § ¶ † ‡ • … ‰ € £ ¥ ¢",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
    "<|endoftext|>",
    "text<|endoftext|>more text<|im_end|>",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",
    "<|im_start|> spaced <|im_end|>",
    "not special: <|im_start and im_end|>",
    "URL: https://example.com/path?query=1&b=two#frag",
    "email: someone.else+tag@example.org",
    "CamelCaseIdentifiersAndsnake_case_names_and-kebab-case",
    "!!!???...---___***",
    "'quoted' \"double\" `back` ‘curly’ “curly”",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
    "\u{1F600}\u{1F601}\u{1F602}\u{1F923}",
];

#[test]
fn qwen_gguf_tokenizer_matches_reference_tokenizer_json() {
    assert!(CASES.len() >= 50);
    let reference = qwen_reference();
    let built = TextTokenizer::from_gguf_file(gguf("qwen-coder-0.5b")).expect("GGUF tokenizer");
    for case in CASES {
        let want = reference.encode(case, true).unwrap();
        let got = built.encode(case, true).unwrap();
        assert_eq!(got, want, "encoding of {case:?}");
        let back = built.decode(&got, false).unwrap();
        let expected = reference.decode(&want, false).unwrap();
        assert_eq!(back, expected, "decoding of {case:?}");
        // Byte-level BPE is lossless, except that Qwen normalises to NFC first.
        if !case.contains(['\u{301}', '\u{30a}']) {
            assert_eq!(&back, case, "round trip of {case:?}");
        }
    }
    let im_start = built.token_to_id("<|im_start|>").unwrap();
    let im_end = built.token_to_id("<|im_end|>").unwrap();
    assert_eq!((im_start, im_end), (151644, 151645));
    assert!(built.eos_token_ids().contains(&151645));
    assert!(built.eos_token_ids().contains(&151643));
    assert_eq!(built.vocab_size(), 151936);
    assert_eq!(
        built.chat_format(),
        &ChatFormat::ChatMl {
            system_prompt: Some(QWEN_DEFAULT_SYSTEM_PROMPT.to_string())
        }
    );
    assert_eq!(
        built.apply_chat_template("Hi"),
        format!(
            "<|im_start|>system\n{QWEN_DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )
    );
    // Special tokens are dropped on request; user-defined added tokens are kept.
    let ids = built.encode("<|im_start|>hi<tool_call>", false).unwrap();
    assert_eq!(built.decode(&ids, true).unwrap(), "hi<tool_call>");
}

#[test]
fn smollm2_gguf_tokenizer() {
    let tok = TextTokenizer::from_gguf_file(gguf("smollm2")).expect("GGUF tokenizer");
    assert_eq!(
        tok.encode("Hello, world!", true).unwrap(),
        vec![19556, 28, 905, 17]
    );
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(
        tok.encode("<|im_start|><|im_end|>", false).unwrap(),
        vec![1, 2]
    );
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_token_id(), Some(1));
    assert!(tok.is_eos(2));
    assert!(tok.uses_chatml());
    // Digits are split one by one.
    let digits = tok.encode("12345", false).unwrap();
    assert_eq!(digits.len(), 5);
    for case in CASES {
        let ids = tok.encode(case, false).unwrap();
        assert_eq!(
            &tok.decode(&ids, false).unwrap(),
            case,
            "round trip of {case:?}"
        );
    }
    let prompt = tok.apply_chat_template("Hi");
    assert!(prompt.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        prompt.matches("<|im_start|>").count()
    );
}
