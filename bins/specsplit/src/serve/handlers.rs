//! The endpoints: `/v1/models`, `/v1/completions` and `/v1/chat/completions`, answered as one
//! JSON object or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use specsplit_models::tokenizer::ChatMessage;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::generation::{Event, Scored, Server};
use super::metrics::ServerMetrics;
use super::openai::{
    ApiError, ChatRequest, CompletionRequest, Content, Message, Prompt, Sampling, Usage,
};

/// `GET /v1/models`: the one model served.
pub async fn models(State(server): State<Arc<Server>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": server.model,
            "object": "model",
            "created": server.created,
            "owned_by": "specsplit",
        }],
    }))
}

/// Any other path: a 404 in OpenAI's error shape.
pub async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint; this server serves /v1/models, /v1/completions, \
                  /v1/chat/completions, /health, /ready and /metrics"
            .into(),
        param: None,
        code: None,
    }
}

/// A known path with another method: a 405 in OpenAI's error shape.
pub async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed: /v1/models takes GET, the completions endpoints POST".into(),
        param: None,
        code: None,
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    State(server): State<Arc<Server>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(server, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(server): State<Arc<Server>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    chat(server, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The request body as `T`: 413 beyond the body limit, 400 where it is not such a request.
fn parse<T: DeserializeOwned>(
    server: &Server,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(server.max_body_bytes)
        } else {
            ApiError::bad_request(e.body_text(), None)
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(
            format!("the request body is not a valid request: {e}"),
            None,
        )
    })
}

async fn complete(
    server: Arc<Server>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut req: CompletionRequest = parse(&server, body)?;
    server.check_model(&req.model)?;
    let logprobs = match &req.logprobs {
        None | Some(Value::Null) => false,
        Some(v) if v.as_u64() == Some(0) => true,
        Some(v) if v.as_u64().is_some() => return Err(top_logprobs_unsupported("logprobs")),
        Some(_) => {
            return Err(ApiError::bad_request(
                "logprobs must be a number of alternatives (0 to 5)",
                Some("logprobs"),
            ))
        }
    };
    if req.echo {
        return Err(ApiError::bad_request("echo is not supported", Some("echo")));
    }
    let prompt = match req.prompt {
        Prompt::Text(t) => server.encode(&t, true)?,
        Prompt::Texts(v) => server.encode(&one(v)?, true)?,
        Prompt::Tokens(ids) => ids,
        Prompt::TokenLists(v) => one(v)?,
    };
    generate(
        &server,
        prompt,
        &mut req.sampling,
        "prompt",
        false,
        logprobs,
    )
    .await
}

async fn chat(
    server: Arc<Server>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut req: ChatRequest = parse(&server, body)?;
    server.check_model(&req.model)?;
    if req.top_logprobs.is_some_and(|n| n > 0) {
        return Err(top_logprobs_unsupported("top_logprobs"));
    }
    let messages = req
        .messages
        .into_iter()
        .map(chat_message)
        .collect::<Result<Vec<_>, _>>()?;
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            "messages must hold at least one message",
            Some("messages"),
        ));
    }
    let text = server
        .tokenizer
        .render_chat(&messages, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
    let prompt = server.encode(&text, false)?;
    let logprobs = req.logprobs;
    generate(
        &server,
        prompt,
        &mut req.sampling,
        "messages",
        true,
        logprobs,
    )
    .await
}

/// Checks `prompt` and `sampling` (`prompt_param` names the prompt's field in errors), starts
/// the generation and answers it as a completion or a chat completion, streamed or not.
async fn generate(
    server: &Arc<Server>,
    prompt: Vec<u32>,
    sampling: &mut Sampling,
    prompt_param: &'static str,
    chat: bool,
    logprobs: bool,
) -> Result<Response, ApiError> {
    let job = server.job(prompt, sampling, prompt_param, logprobs)?;
    let usage = sampling
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let shape = Shape {
        id: server.new_id(if chat { "chatcmpl" } else { "cmpl" }),
        created: server.created,
        model: server.model.clone(),
        chat,
        logprobs,
    };
    let metrics = server.metrics.clone();
    respond(server.start(job), shape, sampling.stream, usage, metrics).await
}

/// The one prompt of a batch.
fn one<T>(mut batch: Vec<T>) -> Result<T, ApiError> {
    if batch.len() == 1 {
        Ok(batch.remove(0))
    } else {
        Err(ApiError::bad_request(
            "give one prompt per request",
            Some("prompt"),
        ))
    }
}

/// A 400 for alternatives per token: the target reports the sampled tokens' only.
fn top_logprobs_unsupported(param: &'static str) -> ApiError {
    ApiError {
        code: Some("top_logprobs_not_supported"),
        ..ApiError::bad_request(
            "alternative tokens' log probabilities are not supported: the target reports those \
             of the sampled tokens only (completions: logprobs 0; chat: logprobs true without \
             top_logprobs)",
            Some(param),
        )
    }
}

/// A request's message as the chat template sees it (`developer` is `system`; text parts
/// are joined).
fn chat_message(m: Message) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "developer" => "system",
        r @ ("system" | "user" | "assistant") => r,
        other => {
            return Err(ApiError::bad_request(
                format!("message role {other:?} is not supported (system, user, assistant)"),
                Some("messages"),
            ))
        }
    };
    let content = match m.content {
        None => String::new(),
        Some(Content::Text(t)) => t,
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::bad_request(
                        format!("content parts of type {:?} are not supported", p.kind),
                        Some("messages"),
                    ));
                }
                text.push_str(&p.text);
            }
            text
        }
    };
    Ok(ChatMessage::new(role, &content))
}

/// What the response objects of one request share.
struct Shape {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    /// Whether choices carry the tokens' log probabilities.
    logprobs: bool,
}

impl Shape {
    /// The endpoint the request came to.
    fn endpoint(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value, usage: Option<Usage>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }

    /// The `logprobs` of a choice holding `scored`, `offset` characters into the text.
    fn logprobs(&self, scored: &[Scored], mut offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        if self.chat {
            let content: Vec<Value> = scored
                .iter()
                .map(|s| json!({"token": s.token, "logprob": s.logprob, "bytes": null, "top_logprobs": []}))
                .collect();
            return json!({"content": content});
        }
        let text_offset: Vec<usize> = scored
            .iter()
            .map(|s| {
                let at = offset;
                offset += s.token.chars().count();
                at
            })
            .collect();
        json!({
            "tokens": scored.iter().map(|s| s.token.as_str()).collect::<Vec<_>>(),
            "token_logprobs": scored.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            "top_logprobs": vec![Value::Null; scored.len()],
            "text_offset": text_offset,
        })
    }

    /// The whole answer.
    fn full(&self, text: String, scored: &[Scored], finish_reason: &str, usage: Usage) -> Value {
        let logprobs = self.logprobs(scored, 0);
        let choice = if self.chat {
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            })
        } else {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        };
        self.wrap(false, json!([choice]), Some(usage))
    }

    /// One streamed chunk: `text` (chat: with the role first) and the scores of its tokens,
    /// `offset` characters into the text; or the end.
    fn chunk(
        &self,
        text: Option<&str>,
        scored: &[Scored],
        offset: usize,
        role: bool,
        finish_reason: Option<&str>,
    ) -> Value {
        let logprobs = if scored.is_empty() {
            Value::Null
        } else {
            self.logprobs(scored, offset)
        };
        let choice = if self.chat {
            let mut delta = json!({});
            if role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        } else {
            json!({
                "index": 0,
                "text": text.unwrap_or_default(),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            })
        };
        self.wrap(true, json!([choice]), None)
    }
}

/// Answers with the generation's events: one object, or server-sent events. An error before
/// any text is answered with its HTTP status in either case.
async fn respond(
    mut events: mpsc::UnboundedReceiver<Event>,
    shape: Shape,
    stream: bool,
    include_usage: bool,
    metrics: Arc<ServerMetrics>,
) -> Result<Response, ApiError> {
    let first = events
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the generation ended without an answer"))?;
    if let Event::Failed(e) = first {
        return Err(e);
    }
    if !stream {
        let (mut text, mut all) = (String::new(), Vec::new());
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Piece { text: t, scored } => {
                    text.push_str(&t);
                    all.extend(scored);
                }
                Event::Done {
                    finish_reason,
                    usage,
                } => return Ok(Json(shape.full(text, &all, finish_reason, usage)).into_response()),
                Event::Failed(e) => return Err(e),
            }
            next = events.recv().await;
        }
        return Err(ApiError::internal("the generation ended without an answer"));
    }
    let (tx, rx) = mpsc::unbounded_channel::<Result<Sse, Infallible>>();
    tokio::spawn(async move {
        let send = |v: Value| tx.send(Ok(Sse::default().data(v.to_string()))).is_ok();
        if shape.chat && !send(shape.chunk(Some(""), &[], 0, true, None)) {
            return;
        }
        let mut offset = 0;
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Piece { text, scored } => {
                    if !send(shape.chunk(Some(&text), &scored, offset, false, None)) {
                        // The client went away: dropping `events` stops the generation.
                        return;
                    }
                    offset += scored
                        .iter()
                        .map(|s| s.token.chars().count())
                        .sum::<usize>();
                }
                Event::Done {
                    finish_reason,
                    usage,
                } => {
                    send(shape.chunk(None, &[], 0, false, Some(finish_reason)));
                    if include_usage {
                        send(shape.wrap(true, json!([]), Some(usage)));
                    }
                    break;
                }
                Event::Failed(e) => {
                    metrics.observe_stream_error(shape.endpoint(), e.status.as_u16());
                    send(e.body());
                    break;
                }
            }
            next = events.recv().await;
        }
        let _ = tx.send(Ok(Sse::default().data("[DONE]")));
    });
    Ok(axum::response::Sse::new(UnboundedReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response())
}
