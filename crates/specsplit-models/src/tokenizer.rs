//! Text tokenization: a [`TextTokenizer`] built from a `tokenizer.json`, from the tokenizer
//! metadata embedded in a GGUF file, or as a plain byte-level tokenizer for random-weight test
//! models; chat prompt formatting; and [`StreamDecoder`], an incremental detokenizer that only
//! ever emits complete UTF-8 text.

use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::ModelError;

/// The system prompt Qwen2.5 chat templates insert when the conversation has none.
pub const QWEN_DEFAULT_SYSTEM_PROMPT: &str =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

/// The split regex of Qwen2 tokenizers (`tokenizer.ggml.pre = "qwen2"`).
pub const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex of Llama 3 tokenizers (`tokenizer.ggml.pre = "llama-bpe"`).
pub const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The end-of-text token of [`TextTokenizer::byte_level`] tokenizers.
pub const BYTE_LEVEL_EOS: &str = "<|endoftext|>";

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// How a user message is wrapped into a prompt for generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<|im_start|>role\n...<|im_end|>\n` turns (Qwen, SmolLM2), with an optional default
    /// system turn.
    ChatMl {
        /// The system message inserted before the user turn, if any.
        system_prompt: Option<String>,
    },
    /// Llama 3 header turns (`<|start_header_id|>user<|end_header_id|>\n\n...<|eot_id|>`).
    Llama3,
    /// No template: the message is used as the prompt as is.
    Plain,
}

/// A tokenizer plus what generation needs to know about its special tokens.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    chat_format: ChatFormat,
    /// The model's own Jinja chat template, when it ships one.
    chat_template: Option<String>,
    vocab_size: usize,
}

/// One message of a conversation, as chat templates see it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` with `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{context}: {e}"))
}

/// The GPT-2 byte-to-character table of byte-level BPE: printable Latin-1 bytes map to
/// themselves, every other byte to the next free code point from U+0100 upwards.
fn byte_to_char_table() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("code points 256..512 are valid");
            next += 1;
            c
        };
    }
    table
}

fn value_as_i64(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    Some(match v {
        V::U8(x) => *x as i64,
        V::I8(x) => *x as i64,
        V::U16(x) => *x as i64,
        V::I16(x) => *x as i64,
        V::U32(x) => *x as i64,
        V::I32(x) => *x as i64,
        V::U64(x) => i64::try_from(*x).ok()?,
        V::I64(x) => *x,
        _ => return None,
    })
}

fn meta_u32(ct: &gguf_file::Content, key: &str) -> Option<u32> {
    ct.metadata
        .get(key)
        .and_then(value_as_i64)
        .and_then(|x| u32::try_from(x).ok())
}

fn meta_str<'a>(ct: &'a gguf_file::Content, key: &str) -> Option<&'a str> {
    ct.metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
}

fn meta_string_array<'a>(
    ct: &'a gguf_file::Content,
    key: &str,
) -> Result<Vec<&'a str>, ModelError> {
    let arr = ct
        .metadata
        .get(key)
        .ok_or_else(|| ModelError::Tokenizer(format!("GGUF metadata has no `{key}`")))?
        .to_vec()
        .map_err(|e| tok_err(key, e))?;
    arr.iter()
        .map(|v| {
            v.to_string()
                .map(String::as_str)
                .map_err(|e| tok_err(key, e))
        })
        .collect()
}

/// Finds a literal default system message (`<|im_start|>system\n TEXT <|im_end|>`) in a Jinja
/// chat template; placeholders, string concatenations and quotes disqualify a candidate.
pub fn default_system_prompt_from_template(template: &str) -> Option<String> {
    const START: &str = "<|im_start|>system";
    let mut rest = template;
    while let Some(pos) = rest.find(START) {
        rest = &rest[pos + START.len()..];
        let body = if let Some(b) = rest.strip_prefix("\\n") {
            b
        } else if let Some(b) = rest.strip_prefix('\n') {
            b
        } else {
            continue;
        };
        let Some(end) = body.find("<|im_end|>") else {
            continue;
        };
        let text = &body[..end];
        if !text.is_empty() && !text.contains(['\'', '"', '{', '}', '+', '\\', '\n']) {
            return Some(text.to_string());
        }
    }
    None
}

/// Picks the chat format from the vocabulary, the chat template (if any) and a family hint
/// (GGUF `general.architecture` or config.json `model_type`).
fn detect_chat_format(tok: &Tokenizer, template: Option<&str>, family: Option<&str>) -> ChatFormat {
    let has = |t: &str| tok.token_to_id(t).is_some();
    if has("<|im_start|>") && has("<|im_end|>") {
        let system_prompt = match template {
            Some(t) => default_system_prompt_from_template(t),
            None if family.is_some_and(|f| f.starts_with("qwen")) => {
                Some(QWEN_DEFAULT_SYSTEM_PROMPT.to_string())
            }
            None => None,
        };
        ChatFormat::ChatMl { system_prompt }
    } else if has("<|start_header_id|>") && has("<|end_header_id|>") && has("<|eot_id|>") {
        ChatFormat::Llama3
    } else {
        ChatFormat::Plain
    }
}

/// Reads a `tokenizer_config.json` token field, which is a string or `{"content": ...}`.
fn config_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A `tokenizer_config.json` `chat_template`: a string, or a list of `{name, template}` of
/// which the one named `default` is used.
fn config_template(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => items
            .iter()
            .find(|i| i.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|i| i.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

impl TextTokenizer {
    /// Wraps an existing tokenizer with explicit special-token information.
    pub fn new(
        inner: Tokenizer,
        bos_token_id: Option<u32>,
        eos_token_ids: Vec<u32>,
        chat_format: ChatFormat,
    ) -> Self {
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut t = Self {
            inner,
            bos_token_id,
            eos_token_ids: Vec::new(),
            chat_format,
            chat_template: None,
            vocab_size,
        };
        t.add_eos_token_ids(&eos_token_ids);
        t
    }

    /// Loads a Hugging Face `tokenizer.json`. Special tokens and the chat template come from a
    /// sibling `tokenizer_config.json` when present (the model family from `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let inner = Tokenizer::from_file(path)
            .map_err(|e| tok_err(&format!("cannot load {}", path.display()), e))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let cfg = read_json(&dir.join("tokenizer_config.json"));
        let model_type = read_json(&dir.join("config.json")).and_then(|c| {
            c.get("model_type")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        });
        let id_of = |key: &str| {
            cfg.as_ref()
                .and_then(|c| config_token(c, key))
                .and_then(|t| inner.token_to_id(&t))
        };
        let bos = id_of("bos_token");
        let eos: Vec<u32> = id_of("eos_token").into_iter().collect();
        let template = cfg
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(config_template);
        let chat_format = detect_chat_format(&inner, template.as_deref(), model_type.as_deref());
        let mut t = Self::new(inner, bos, eos, chat_format);
        t.chat_template = template;
        t.add_conventional_eos();
        Ok(t)
    }

    /// Builds the tokenizer from the metadata of a GGUF file (`tokenizer.ggml.*`).
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let ct = gguf_file::Content::read(&mut file)?;
        Self::from_gguf(&ct)
    }

    /// Builds a byte-level BPE tokenizer from GGUF metadata: tokens of type NORMAL, CONTROL and
    /// USER_DEFINED at their ids, CONTROL tokens registered as special added tokens and
    /// USER_DEFINED ones as plain added tokens, the merges as given, and the pre-tokenizer named
    /// by `tokenizer.ggml.pre`.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, ModelError> {
        let model = meta_str(ct, "tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(ModelError::Unsupported(format!(
                "GGUF tokenizer model `{model}` (only byte-level BPE `gpt2` is built from GGUF \
                 metadata; put the model's tokenizer.json beside the .gguf file instead)"
            )));
        }
        let tokens = meta_string_array(ct, "tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|e| tok_err("tokenizer.ggml.token_type", e))?
                .iter()
                .map(|v| value_as_i64(v).unwrap_or(TOKEN_TYPE_NORMAL))
                .collect(),
            None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "GGUF has {} tokens but {} token types",
                tokens.len(),
                types.len()
            )));
        }
        let merges: Vec<(String, String)> = match ct.metadata.get("tokenizer.ggml.merges") {
            Some(_) => meta_string_array(ct, "tokenizer.ggml.merges")?
                .into_iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge `{m}`")))
                })
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };

        let mut vocab = Vocab::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
            if matches!(
                ty,
                TOKEN_TYPE_NORMAL | TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED
            ) {
                vocab.insert(tok.to_string(), id as u32);
                if ty != TOKEN_TYPE_NORMAL {
                    added.push(
                        AddedToken::from(tok.to_string(), ty == TOKEN_TYPE_CONTROL)
                            .normalized(false),
                    );
                }
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tok_err("building BPE from GGUF", e))?;
        let mut inner = Tokenizer::new(bpe);

        let pre = meta_str(ct, "tokenizer.ggml.pre").unwrap_or("default");
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "qwen2" => {
                inner.with_normalizer(Some(NFC));
                regex_then_byte_level(QWEN2_SPLIT_REGEX)?
            }
            "llama-bpe" | "llama3" => regex_then_byte_level(LLAMA3_SPLIT_REGEX)?,
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "default" | "gpt-2" | "gpt2" => ByteLevel::new(false, true, true).into(),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF pre-tokenizer `{other}` (supported: qwen2, smollm, llama-bpe, gpt-2, \
                     default); put the model's tokenizer.json beside the .gguf file instead"
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevel::new(false, false, false)));
        inner.add_tokens(&added);

        let bos = meta_u32(ct, "tokenizer.ggml.bos_token_id");
        let add_bos = ct
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        match (add_bos, bos.and_then(|id| inner.id_to_token(id))) {
            (true, Some(bos_tok)) => {
                let processor = TemplateProcessing::builder()
                    .try_single(format!("{bos_tok} $A"))
                    .and_then(|b| b.try_pair(format!("{bos_tok} $A {bos_tok}:1 $B:1")))
                    .map_err(|e| tok_err("BOS template", e))?
                    .special_tokens(vec![(bos_tok.clone(), bos.unwrap_or(0))])
                    .build()
                    .map_err(|e| tok_err("BOS template", e))?;
                inner.with_post_processor(Some(processor));
            }
            _ => {
                inner.with_post_processor(Some(ByteLevel::new(false, false, false)));
            }
        }

        let eos: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| meta_u32(ct, k))
            .collect();
        let template = meta_str(ct, "tokenizer.chat_template");
        let family = meta_str(ct, "general.architecture");
        let chat_format = detect_chat_format(&inner, template, family);
        let mut t = Self::new(inner, bos, eos, chat_format);
        t.chat_template = template.map(str::to_string);
        t.vocab_size = t.vocab_size.max(tokens.len());
        t.add_conventional_eos();
        Ok(t)
    }

    /// A byte-level tokenizer for random-weight models: ids 0..=255 are the bytes, 256 is
    /// [`BYTE_LEVEL_EOS`] (the only EOS), and the vocabulary is reported as `vocab_size` (the
    /// ids above 256 decode to nothing).
    pub fn byte_level(vocab_size: usize) -> Result<Self, ModelError> {
        if vocab_size < 257 {
            return Err(ModelError::Config(format!(
                "a byte-level tokenizer needs vocab_size >= 257, got {vocab_size}"
            )));
        }
        let vocab: Vocab = byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, c)| (c.to_string(), b as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .map_err(|e| tok_err("building byte-level BPE", e))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        inner.with_decoder(Some(ByteLevel::new(false, false, false)));
        inner.add_special_tokens(&[AddedToken::from(BYTE_LEVEL_EOS, true)]);
        let eos = inner.token_to_id(BYTE_LEVEL_EOS).ok_or_else(|| {
            ModelError::Tokenizer("byte-level EOS token was not registered".into())
        })?;
        let mut t = Self::new(inner, None, vec![eos], ChatFormat::Plain);
        t.vocab_size = vocab_size;
        Ok(t)
    }

    /// Adds `<|im_end|>`/`<|endoftext|>` (ChatML) or `<|eot_id|>` (Llama 3) to the EOS set:
    /// instruct models end a turn with them whatever their metadata names as EOS.
    fn add_conventional_eos(&mut self) {
        let names: &[&str] = match self.chat_format {
            ChatFormat::ChatMl { .. } => &["<|im_end|>", "<|endoftext|>"],
            ChatFormat::Llama3 => &["<|eot_id|>", "<|end_of_text|>"],
            ChatFormat::Plain => &[],
        };
        let ids: Vec<u32> = names
            .iter()
            .filter_map(|n| self.inner.token_to_id(n))
            .collect();
        self.add_eos_token_ids(&ids);
    }

    /// Adds end-of-sequence ids (e.g. from the model configuration), keeping the set unique.
    pub fn add_eos_token_ids(&mut self, ids: &[u32]) {
        for &id in ids {
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
    }

    /// Sets the BOS id (used by [`TextTokenizer::bos_token_id`]; encoding is unaffected).
    pub fn set_bos_token_id(&mut self, id: Option<u32>) {
        self.bos_token_id = id;
    }

    /// Replaces the chat format (e.g. to change the system prompt).
    pub fn set_chat_format(&mut self, format: ChatFormat) {
        self.chat_format = format;
    }

    /// Encodes text; special-token strings such as `<|im_start|>` become their ids.
    /// `add_special_tokens` adds the model's BOS where its tokenizer asks for one.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| tok_err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, dropping special tokens if `skip_special`; ids outside the
    /// vocabulary decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| tok_err("decode", e))
    }

    /// The token string of an id (byte-level form, e.g. `Ġworld`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce or accept: highest id + 1 (for GGUF the full
    /// token table length, padding included; for byte-level the requested size).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Whether an id ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The chat format used by [`TextTokenizer::apply_chat_template`].
    pub fn chat_format(&self) -> &ChatFormat {
        &self.chat_format
    }

    /// Whether prompts use the ChatML template.
    pub fn uses_chatml(&self) -> bool {
        matches!(self.chat_format, ChatFormat::ChatMl { .. })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// The model's own Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replaces the model's Jinja chat template (`None`: use the built-in [`ChatFormat`]).
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template;
    }

    /// Formats one user message as a generation prompt: [`TextTokenizer::render_chat`] of that
    /// message, or the built-in format where the model's template fails to render, e.g. for
    /// ChatML `<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n
    /// <|im_start|>assistant\n`.
    pub fn apply_chat_template(&self, user_message: &str) -> String {
        let messages = [ChatMessage::new("user", user_message)];
        self.render_chat(&messages, true)
            .unwrap_or_else(|_| self.render_builtin(&messages, true))
    }

    /// Renders a conversation as a prompt: with the model's own Jinja template (rendered as
    /// Hugging Face does, with `messages`, `add_generation_prompt`, `bos_token` and
    /// `eos_token`, blocks trimmed), else in the built-in [`ChatFormat`]. With
    /// `add_generation_prompt` the prompt ends where the assistant's reply begins.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        match &self.chat_template {
            Some(template) => self.render_jinja(template, messages, add_generation_prompt),
            None => Ok(self.render_builtin(messages, add_generation_prompt)),
        }
    }

    fn render_jinja(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let err = |e: minijinja::Error| tok_err("chat template", e);
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, _> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        });
        env.add_template("chat", template).map_err(err)?;
        let token = |id: Option<u32>| id.and_then(|i| self.id_to_token(i)).unwrap_or_default();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => token(self.bos_token_id),
            eos_token => token(self.eos_token_ids.first().copied()),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(err)
    }

    /// A conversation in the built-in [`ChatFormat`] (for models without a template).
    fn render_builtin(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut s = String::new();
        match &self.chat_format {
            ChatFormat::ChatMl { system_prompt } => {
                if let Some(sys) = system_prompt {
                    if messages.first().is_none_or(|m| m.role != "system") {
                        s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                    }
                }
                for m in messages {
                    s.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m.role, m.content
                    ));
                }
                if add_generation_prompt {
                    s.push_str("<|im_start|>assistant\n");
                }
            }
            ChatFormat::Llama3 => {
                s.push_str("<|begin_of_text|>");
                for m in messages {
                    s.push_str(&format!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        m.role, m.content
                    ));
                }
                if add_generation_prompt {
                    s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                }
            }
            ChatFormat::Plain => {
                let parts: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                s = parts.join("\n\n");
            }
        }
        s
    }

    /// A fresh incremental detokenizer for this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(skip_special)
    }
}

fn regex_then_byte_level(regex: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let split = Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| tok_err("split regex", e))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])
    .into())
}

/// Incremental detokenizer: feed accepted token ids, get back only complete text.
///
/// It decodes a small window of recent ids and emits the difference from the previous decode
/// of that window, holding text back while it ends in an incomplete UTF-8 sequence (U+FFFD).
/// The concatenation of everything returned by [`StreamDecoder::step`] and
/// [`StreamDecoder::finish`] equals the decode of all the ids at once.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the decode window in `ids`.
    prefix_offset: usize,
    /// End of the part of `ids` whose text has been emitted.
    read_offset: usize,
    skip_special: bool,
}

impl StreamDecoder {
    /// A new decoder; `skip_special` drops special tokens from the text.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            ..Self::default()
        }
    }

    /// Adds one id; returns the newly completed text, if any.
    pub fn step(&mut self, tok: &TextTokenizer, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let prev = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let now = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if now.len() > prev.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&prev) {
            let text = now[prev.len()..].to_string();
            // Keep only the ids the next window needs.
            self.ids.drain(..self.read_offset);
            self.prefix_offset = 0;
            self.read_offset = self.ids.len();
            // The new window starts at the old read offset, which is now 0.
            Ok(Some(text))
        } else {
            Ok(None)
        }
    }

    /// Adds several ids (e.g. the tokens accepted in one verification step); returns the text
    /// they complete (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, ids: &[u32]) -> Result<String, ModelError> {
        let mut out = String::new();
        for &id in ids {
            if let Some(t) = self.step(tok, id)? {
                out.push_str(&t);
            }
        }
        Ok(out)
    }

    /// Returns whatever text is still held back (an incomplete character decodes as U+FFFD)
    /// and resets the decoder.
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, ModelError> {
        let prev = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let now = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let skip = self.skip_special;
        *self = Self::new(skip);
        Ok(match now.strip_prefix(prev.as_str()) {
            Some(rest) => rest.to_string(),
            None => now,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of Qwen2.5's template: a default system turn unless the conversation opens
    /// with one, ChatML turns, Python string methods (`strip`) and `raise_exception`.
    const QWEN_STYLE_TEMPLATE: &str = r#"{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'].strip() + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    fn with_template(template: Option<&str>) -> TextTokenizer {
        let mut t = TextTokenizer::byte_level(300).unwrap();
        t.set_chat_template(template.map(str::to_string));
        t
    }

    #[test]
    fn a_qwen_style_template_renders_system_and_multi_turn_conversations() {
        let t = with_template(Some(QWEN_STYLE_TEMPLATE));
        let chat = [
            ChatMessage::new("system", "  Be brief.  "),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "2+2?"),
        ];
        assert_eq!(
            t.render_chat(&chat, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(
            t.render_chat(&chat[1..2], false).unwrap(),
            format!(
                "<|im_start|>system\n{QWEN_DEFAULT_SYSTEM_PROMPT}<|im_end|>\n\
                 <|im_start|>user\nHi<|im_end|>\n"
            )
        );
        assert_eq!(
            t.apply_chat_template("Hi"),
            t.render_chat(&chat[1..2], true).unwrap()
        );
    }

    #[test]
    fn a_template_that_raises_is_an_error_naming_its_message() {
        let t = with_template(Some(QWEN_STYLE_TEMPLATE));
        let err = t
            .render_chat(&[ChatMessage::new("tool", "x")], true)
            .unwrap_err();
        assert!(err.to_string().contains("unknown role tool"), "{err}");
        let broken = with_template(Some("{% if %}"));
        assert!(broken
            .render_chat(&[ChatMessage::new("user", "x")], true)
            .is_err());
    }

    #[test]
    fn without_a_template_the_builtin_format_is_used() {
        let mut t = with_template(None);
        let chat = [
            ChatMessage::new("system", "S"),
            ChatMessage::new("user", "U"),
        ];
        assert_eq!(t.render_chat(&chat, true).unwrap(), "S\n\nU");
        t.set_chat_format(ChatFormat::ChatMl {
            system_prompt: Some("D".into()),
        });
        assert_eq!(
            t.render_chat(&chat, true).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render_chat(&chat[1..], false).unwrap(),
            "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }
}
