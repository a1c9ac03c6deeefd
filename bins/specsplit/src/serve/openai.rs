//! The OpenAI API's request, response and error shapes, as far as this server serves them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
    /// A machine-readable code, if there is one.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400: the request is malformed or asks for something unsupported.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
            code: None,
        }
    }

    /// A 404 for a model this server does not serve.
    pub fn unknown_model(model: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist; this server serves `{served}`"),
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// A 413: the request body is larger than the server accepts.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than {limit} bytes"),
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// A 503: the workers cannot serve now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 401: the request carries no API key, or the wrong one.
    pub fn invalid_api_key(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// A 500: something failed that the request did not cause.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// OpenAI's `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND
            | StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::METHOD_NOT_ALLOWED
            | StatusCode::UNAUTHORIZED => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            _ => "server_error",
        }
    }

    /// The error as its JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `prompt` of a completion: text or token ids, alone or as a batch of one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A text.
    Text(String),
    /// Texts (one is served).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Lists of token ids (one is served).
    TokenLists(Vec<Vec<u32>>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints take.
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    /// Most new tokens.
    pub max_tokens: Option<u64>,
    /// Most new tokens (the chat API's newer name).
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature (0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus threshold.
    pub top_p: Option<f32>,
    /// Keep the k likeliest tokens (an extension of the API; 0 or -1 = off).
    pub top_k: Option<i64>,
    /// Seed of the random choices.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Options of the stream.
    pub stream_options: Option<StreamOptions>,
    /// Choices to generate (only 1 is served).
    pub n: Option<u64>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Log probabilities of the sampled tokens (with 0 alternatives; more are not served).
    pub logprobs: Option<serde_json::Value>,
    /// Echo the prompt (not served when true).
    #[serde(default)]
    pub echo: bool,
    /// Sampling and length.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// The content of a chat message: text, or parts of which the text ones are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// `text` (other types are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: String,
}

/// One message of a chat request.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// Its content (absent for some assistant messages).
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The model.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Log probabilities of the sampled tokens.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per token with their log probabilities (only 0 is served).
    pub top_logprobs: Option<u64>,
    /// Sampling and length.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// The counts for a prompt and a completion of these lengths.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}
