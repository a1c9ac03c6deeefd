//! The error type of the model layer.

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// Reading a file failed.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A configuration is missing a field or holds an unusable value.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// The model uses a feature this implementation does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A weight tensor is missing or has the wrong shape.
    #[error("bad weights: {0}")]
    Weights(String),
    /// The tokenizer could not be built or used.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The model could not be found from the given specification.
    #[error("model not found: {0}")]
    NotFound(String),
    /// Fetching a model from the Hugging Face Hub failed (access, network, limits).
    #[error("Hugging Face Hub: {0}")]
    Hub(String),
    /// A forward-pass argument is inconsistent (shapes, cache capacity, row indices).
    #[error("invalid forward input: {0}")]
    Input(String),
    /// The session KV cache rejected an operation (capacity, shape).
    #[error("KV cache: {0}")]
    Cache(#[from] specsplit_core::cache::CacheError),
}
