//! specsplit-models: one Llama-family transformer whose forward pass takes explicit positions,
//! an additive attention mask (causal or tree) and a session KV cache, and returns logits only
//! for the rows asked for; plus model sourcing (local dir, GGUF, Hugging Face, catalogue
//! aliases) and tokenizers.

pub mod config;
pub mod cpu_attention;
pub mod cpu_quant;
pub mod error;
pub mod fused;
pub mod hub;
pub mod loader;
pub mod source;
pub mod step;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use error::ModelError;
pub use transformer::SessionPass;
