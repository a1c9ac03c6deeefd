//! A fuzzer for every request type of both workers: raw bytes, pure random or mutations of
//! valid encoded requests (flipped, inserted and deleted bytes, varints set to extremes, huge
//! repeated fields), decoded as the server decodes them and handed to the services.
//!
//! Each input must be answered without a panic, with OK or one of the status codes a client can
//! act on (never INTERNAL or UNKNOWN), with a status message of at most 512 bytes, and with the
//! heap allocated while handling it below `bound()`, derived from the worker configuration. The
//! worker must still answer a valid request afterwards. A smaller loopback test sends raw bytes
//! through the real gRPC stack (including `grpc.health.v1`).
//!
//! Cases per request type: proptest's default here (2,000), or `PROPTEST_CASES`;
//! `scripts/fuzz.sh` runs the long version (over a million inputs in all).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Buf, BufMut};
use proptest::prelude::*;
use proptest::sample::{select, Index};
use proptest::test_runner::{Config, TestRunner};
use prost::Message;
use specsplit_e2e::config;
use specsplit_proto::draft_service_server::DraftService;
use specsplit_proto::target_service_server::TargetService;
use specsplit_proto::{
    DraftDistribution, DraftRequest, EndSessionRequest, PingRequest, SamplingParams, TokenNode,
    VerifyRequest,
};
use specsplit_workers::config::WorkerConfig;
use specsplit_workers::launch;
use specsplit_workers::service::{DraftWorker, Execution, TargetWorker, WorkPlacement};
use tonic::{Code, Request, Response, Status};

// ------------------------------------------------------------------------------------------
// A counting allocator: current and peak bytes, and a hard cap on single allocations.
// ------------------------------------------------------------------------------------------

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Single allocations above this abort the process with a report (the input that caused it is
/// printed from `INPUT`): the test cannot survive an allocation of many gigabytes.
const HARD_CAP: usize = 1 << 30;
static REPORTING: AtomicBool = AtomicBool::new(false);
/// Hex of the input being handled, for the oversize report.
static INPUT: Mutex<String> = Mutex::new(String::new());

fn added(size: usize) {
    let now = CURRENT.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// Writes the oversize report to stderr without allocating.
fn report_oversize(size: usize) {
    if REPORTING.swap(true, Ordering::Relaxed) {
        return;
    }
    let mut digits = [0u8; 20];
    let mut n = size;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(b"\nfuzz: one allocation of ");
    let _ = err.write_all(&digits[i..]);
    let _ = err.write_all(b" bytes (over the 1 GiB hard cap) while handling input ");
    if let Ok(hex) = INPUT.try_lock() {
        let _ = err.write_all(hex.as_bytes());
    }
    let _ = err.write_all(b"\n");
}

// SAFETY: every method forwards to `System` and only adds bookkeeping on atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_CAP {
            report_oversize(layout.size());
            return std::ptr::null_mut();
        }
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_CAP {
            report_oversize(layout.size());
            return std::ptr::null_mut();
        }
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > HARD_CAP {
            report_oversize(new_size);
            return std::ptr::null_mut();
        }
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Both blocks exist for a moment: count the new one before releasing the old.
            added(new_size);
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

// ------------------------------------------------------------------------------------------
// The workers under test and the per-request heap bound.
// ------------------------------------------------------------------------------------------

const MODEL: &str = "random:tiny:7";
/// Hidden size, MLP width, heads and vocabulary of `random:tiny` (ModelConfig::preset).
const TINY: (usize, usize, usize, usize) = (64, 160, 4, 512);
const SECRET: &str = "fuzz-owner-secret-0123456789";
const SESSION: &str = "fz";
/// Status codes a worker may answer a bad request with.
const ALLOWED: [Code; 6] = [
    Code::InvalidArgument,
    Code::FailedPrecondition,
    Code::ResourceExhausted,
    Code::PermissionDenied,
    Code::NotFound,
    Code::OutOfRange,
];
const MAX_MESSAGE: usize = 512;
/// Largest fuzz input (the generators stay below it).
const MAX_INPUT: usize = 1 << 20;

/// Small limits so that valid-looking inputs run the model quickly.
fn fuzz_config(target: bool) -> WorkerConfig {
    WorkerConfig {
        max_context: 256,
        max_prompt_len: Some(200),
        max_tree_nodes: 64,
        max_sessions: 16,
        memory_budget_mb: 64,
        ..config(MODEL, target)
    }
}

/// The most heap one request may allocate while it is handled, from the configuration:
///
/// - decoding: at most `size_of::<TokenNode>()` bytes per input byte (an empty nested node
///   takes two bytes on the wire and one `TokenNode` in memory, and a vector's growth at most
///   doubles what it holds), plus the input itself;
/// - one new session's KV cache: `2 × layers × kv_heads × head_dim × max_context × 4` bytes,
///   here bounded by the memory budget (`session_bytes`);
/// - the forward pass over at most `max_context` rows: per row its logits, activations and
///   one row of attention scores per head, times 8 for the copies the kernels make;
/// - a fixed slack of 4 MiB (runtime, tracing, the response).
fn bound(cfg: &WorkerConfig, input_len: usize, session_bytes: usize) -> usize {
    let (hidden, inter, heads, vocab) = TINY;
    let decode = input_len * (std::mem::size_of::<TokenNode>() + 1);
    let rows = cfg.max_context + 1;
    let per_row = (vocab + 4 * inter + 8 * hidden + heads * cfg.max_context) * 4;
    decode + session_bytes + 8 * rows * per_row + (4 << 20)
}

struct Workers {
    draft: DraftWorker,
    target: TargetWorker,
    draft_cfg: WorkerConfig,
    target_cfg: WorkerConfig,
    rt: tokio::runtime::Runtime,
    draft_session_bytes: usize,
    target_session_bytes: usize,
}

/// Numbers the fresh sessions of `assert_serving`.
static FRESH: AtomicUsize = AtomicUsize::new(0);

/// One request at a time: heap peaks are process-wide, so fuzz tests must not overlap.
static SERIAL: Mutex<()> = Mutex::new(());

impl Workers {
    fn start() -> Self {
        let inline = || Execution::new(WorkPlacement::Inline, Duration::ZERO);
        let draft_cfg = fuzz_config(false);
        let target_cfg = fuzz_config(true);
        let draft = launch::draft_worker(&draft_cfg, launch::load(&draft_cfg).unwrap())
            .with_execution(inline());
        let target = launch::target_worker(&target_cfg, launch::load(&target_cfg).unwrap())
            .with_execution(inline());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut w = Self {
            draft,
            target,
            draft_cfg,
            target_cfg,
            rt,
            draft_session_bytes: 0,
            target_session_bytes: 0,
        };
        // The owned session the seeds name, and the per-session bytes of each worker.
        w.valid_round(SESSION);
        w.draft_session_bytes = w.draft.sessions().bytes();
        w.target_session_bytes = w.target.sessions().bytes();
        assert!(w.draft_session_bytes > 0 && w.target_session_bytes > 0);
        w
    }

    /// A valid draft and verify of session `id` answer OK.
    fn valid_round(&self, id: &str) {
        let d = self
            .rt
            .block_on(self.draft.generate_drafts(Request::new(DraftRequest {
                session_id: id.into(),
                ..seed_draft()
            })))
            .expect("a valid draft request");
        assert!(!d.get_ref().draft_tree.is_empty());
        self.rt
            .block_on(self.target.verify_drafts(Request::new(VerifyRequest {
                session_id: id.into(),
                ..seed_verify()
            })))
            .expect("a valid verify request");
    }

    /// A valid draft and verify of a session no input could have named answer OK (inputs may
    /// legitimately end the owned session, or bind its id to another secret).
    fn assert_serving(&self) {
        let fresh = format!("after-fuzz-{}", FRESH.fetch_add(1, Ordering::Relaxed));
        self.valid_round(&fresh);
        for r in [
            self.rt
                .block_on(DraftService::ping(
                    &self.draft,
                    Request::new(PingRequest {}),
                ))
                .map(|_| ()),
            self.rt
                .block_on(TargetService::ping(
                    &self.target,
                    Request::new(PingRequest {}),
                ))
                .map(|_| ()),
        ] {
            r.expect("ping after fuzzing");
        }
    }
}

/// The request types, as the server routes them.
#[derive(Clone, Copy, Debug)]
enum Rpc {
    Draft,
    DraftPing,
    DraftEnd,
    Verify,
    TargetPing,
    TargetEnd,
}

/// Decodes `bytes` as the server's codec would (an undecodable message is INVALID_ARGUMENT
/// there) and calls the handler; returns the status, if any, and the heap peak.
fn handle(w: &Workers, rpc: Rpc, bytes: &[u8]) -> (Result<(), Status>, usize) {
    fn decoded<M: Message + Default>(bytes: &[u8]) -> Result<M, Status> {
        M::decode(bytes).map_err(|e| Status::invalid_argument(format!("undecodable: {e}")))
    }
    fn done<T>(r: Result<Response<T>, Status>) -> Result<(), Status> {
        r.map(|_| ())
    }
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = match rpc {
        Rpc::Draft => decoded::<DraftRequest>(bytes)
            .and_then(|m| done(w.rt.block_on(w.draft.generate_drafts(Request::new(m))))),
        Rpc::DraftPing => decoded::<PingRequest>(bytes)
            .and_then(|m| done(w.rt.block_on(DraftService::ping(&w.draft, Request::new(m))))),
        Rpc::DraftEnd => decoded::<EndSessionRequest>(bytes).and_then(|m| {
            done(w.rt.block_on(DraftService::end_session(&w.draft, Request::new(m))))
        }),
        Rpc::Verify => decoded::<VerifyRequest>(bytes)
            .and_then(|m| done(w.rt.block_on(w.target.verify_drafts(Request::new(m))))),
        Rpc::TargetPing => decoded::<PingRequest>(bytes)
            .and_then(|m| done(w.rt.block_on(TargetService::ping(&w.target, Request::new(m))))),
        Rpc::TargetEnd => decoded::<EndSessionRequest>(bytes).and_then(|m| {
            done(w.rt.block_on(TargetService::end_session(&w.target, Request::new(m))))
        }),
    };
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, peak)
}

// ------------------------------------------------------------------------------------------
// Inputs: valid seeds per request type, and mutations of them.
// ------------------------------------------------------------------------------------------

fn node(token_id: i32, children: Vec<TokenNode>) -> TokenNode {
    TokenNode {
        token_id,
        log_prob: -0.5,
        children,
        top_k_token_ids: vec![token_id, 7],
        top_k_probs: vec![0.6, 0.2],
        ..Default::default()
    }
}

fn seed_draft() -> DraftRequest {
    DraftRequest {
        request_id: "r1".into(),
        prompt_token_ids: vec![5, 17, 3, 42, 8],
        session_id: SESSION.into(),
        session_secret: SECRET.into(),
        tree_widths: vec![2, 1, 1],
        ..Default::default()
    }
}

fn seed_verify() -> VerifyRequest {
    VerifyRequest {
        request_id: "r2".into(),
        prompt_token_ids: vec![5, 17, 3, 42, 8],
        draft_tree: vec![node(9, vec![node(4, vec![])]), node(11, vec![])],
        session_id: SESSION.into(),
        session_secret: SECRET.into(),
        ..Default::default()
    }
}

/// Valid encoded requests of each type, the material of mutations.
fn seeds(rpc: Rpc) -> Vec<Vec<u8>> {
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        seed: 3,
    };
    match rpc {
        Rpc::Draft => vec![
            seed_draft().encode_to_vec(),
            DraftRequest {
                prompt_token_ids: vec![1, 2, 3],
                max_draft_len: 4,
                num_beams: 2,
                temperature: Some(0.7),
                ..Default::default()
            }
            .encode_to_vec(),
            DraftRequest {
                reset_cache: true,
                sampling: Some(sampling),
                session_id: "other".into(),
                ..seed_draft()
            }
            .encode_to_vec(),
        ],
        Rpc::Verify => vec![
            seed_verify().encode_to_vec(),
            VerifyRequest {
                prompt_token_ids: vec![],
                new_token_ids: vec![6],
                expected_prefix_length: 7,
                ..seed_verify()
            }
            .encode_to_vec(),
            VerifyRequest {
                sampling: Some(sampling),
                draft_tree: vec![node(9, vec![node(4, vec![])])],
                root_distribution: Some(DraftDistribution {
                    token_ids: vec![9, 10],
                    probs: vec![0.5, 0.5],
                }),
                siblings_without_replacement: true,
                session_id: String::new(),
                ..seed_verify()
            }
            .encode_to_vec(),
            VerifyRequest {
                temperature: 1.0,
                session_id: "py".into(),
                session_secret: String::new(),
                ..seed_verify()
            }
            .encode_to_vec(),
        ],
        Rpc::DraftEnd | Rpc::TargetEnd => vec![
            EndSessionRequest {
                session_id: SESSION.into(),
                session_secret: "wrong-secret-0123456789".into(),
            }
            .encode_to_vec(),
            EndSessionRequest {
                session_id: "nobody".into(),
                session_secret: String::new(),
            }
            .encode_to_vec(),
        ],
        Rpc::DraftPing | Rpc::TargetPing => vec![Vec::new(), vec![0x08, 0x01]],
    }
}

/// Varint values at the edges of every integer type.
const EXTREMES: [u64; 11] = [
    0,
    1,
    127,
    128,
    i32::MAX as u64,
    i32::MAX as u64 + 1,
    u32::MAX as u64,
    i64::MAX as u64,
    (-1i64) as u64,
    i64::MIN as u64,
    u64::MAX,
];

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// One edit of an encoded message.
#[derive(Debug, Clone)]
enum Mutation {
    /// XOR one byte.
    Flip(Index, u8),
    /// Insert bytes.
    Insert(Index, Vec<u8>),
    /// Delete up to `n` bytes.
    Delete(Index, usize),
    /// Overwrite the varint starting at a position with an extreme value.
    Varint(Index, usize),
    /// Append a top-level field `f` with an extreme varint (wire type 0).
    ExtremeField(u32, usize),
    /// Append a packed repeated field `f` of `n` copies of an extreme varint.
    HugeRepeated(u32, usize, usize),
    /// Append `n` empty nested messages as field `f` (e.g. empty `TokenNode`s).
    ManyEmpty(u32, usize),
    /// Append a field `f` whose declared length exceeds what follows.
    LyingLength(u32, usize),
    /// Repeat a slice of the message at its end.
    Duplicate(Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let field = 1u32..=12;
    let extreme = 0..EXTREMES.len();
    prop_oneof![
        (any::<Index>(), 1u8..).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<Index>(), extreme.clone()).prop_map(|(i, e)| Mutation::Varint(i, e)),
        (field.clone(), extreme.clone()).prop_map(|(f, e)| Mutation::ExtremeField(f, e)),
        (field.clone(), extreme, 0usize..20_000)
            .prop_map(|(f, e, n)| Mutation::HugeRepeated(f, e, n)),
        (field.clone(), 0usize..20_000).prop_map(|(f, n)| Mutation::ManyEmpty(f, n)),
        (field, 1usize..(1 << 24)).prop_map(|(f, n)| Mutation::LyingLength(f, n)),
        (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
    ]
}

fn apply(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len) };
        match m {
            Mutation::Flip(i, x) => {
                if !b.is_empty() {
                    let k = at(i, b.len());
                    b[k] ^= x;
                }
            }
            Mutation::Insert(i, bytes) => {
                let k = at(i, b.len() + 1);
                b.splice(k..k, bytes.iter().copied());
            }
            Mutation::Delete(i, n) => {
                if !b.is_empty() {
                    let k = at(i, b.len());
                    let end = (k + n).min(b.len());
                    b.drain(k..end);
                }
            }
            Mutation::Varint(i, e) => {
                if !b.is_empty() {
                    let k = at(i, b.len());
                    let mut end = k;
                    while end < b.len() && b[end] & 0x80 != 0 {
                        end += 1;
                    }
                    let end = (end + 1).min(b.len());
                    let mut v = Vec::new();
                    varint(EXTREMES[*e], &mut v);
                    b.splice(k..end, v);
                }
            }
            Mutation::ExtremeField(f, e) => {
                varint(u64::from(f << 3), &mut b);
                varint(EXTREMES[*e], &mut b);
            }
            Mutation::HugeRepeated(f, e, n) => {
                let mut payload = Vec::new();
                for _ in 0..*n {
                    varint(EXTREMES[*e], &mut payload);
                }
                varint(u64::from(f << 3 | 2), &mut b);
                varint(payload.len() as u64, &mut b);
                b.extend(payload);
            }
            Mutation::ManyEmpty(f, n) => {
                for _ in 0..*n {
                    varint(u64::from(f << 3 | 2), &mut b);
                    b.push(0);
                }
            }
            Mutation::LyingLength(f, n) => {
                varint(u64::from(f << 3 | 2), &mut b);
                varint(*n as u64, &mut b);
                b.extend_from_slice(&[1, 2, 3]);
            }
            Mutation::Duplicate(i, n) => {
                if !b.is_empty() {
                    let k = at(i, b.len());
                    let end = (k + n).min(b.len());
                    let copy = b[k..end].to_vec();
                    b.extend(copy);
                }
            }
        }
        b.truncate(MAX_INPUT);
    }
    b
}

fn input(rpc: Rpc) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..512),
        3 => (select(seeds(rpc)), prop::collection::vec(mutation(), 1..4))
            .prop_map(|(seed, muts)| apply(seed, &muts)),
        3 => structured(rpc),
        1 => (structured(rpc), prop::collection::vec(mutation(), 1..2))
            .prop_map(|(seed, muts)| apply(seed, &muts)),
    ]
}

/// A nested forest from parent choices: node `i + roots` hangs under an earlier node.
fn forest(roots: usize, extra: &[(Index, i32)], root_tokens: &[i32]) -> Vec<TokenNode> {
    let n = roots + extra.len();
    let mut parent = vec![None; n];
    let mut token = vec![0i32; n];
    for (i, t) in root_tokens.iter().take(roots).enumerate() {
        token[i] = *t;
    }
    for (k, (p, t)) in extra.iter().enumerate() {
        let i = roots + k;
        parent[i] = Some(p.index(i));
        token[i] = *t;
    }
    // Build bottom-up: children are always after their parent.
    let mut built: Vec<Option<TokenNode>> = (0..n).map(|i| Some(node(token[i], vec![]))).collect();
    for i in (0..n).rev() {
        if let Some(p) = parent[i] {
            let child = built[i].take().expect("built once");
            if let Some(pn) = built[p].as_mut() {
                pn.children.insert(0, child);
            }
        }
    }
    built.into_iter().take(roots).flatten().collect()
}

/// Well-formed requests with random contents (sessions, secrets, prompts, trees, sampling), so
/// that many inputs pass decoding and validation and run the model.
fn structured(rpc: Rpc) -> BoxedStrategy<Vec<u8>> {
    let token = prop_oneof![4000 => 0i32..512, 1 => -3i32..0, 1 => 510i32..520];
    let session = select(vec!["", SESSION, "a", "b", "c"]);
    let secret = select(vec!["", SECRET, "short", "another-secret-0123456789abcdef"]);
    let sampling = prop::option::of((0.0f32..2.0, 0i32..40, 0.0f32..1.0, any::<u64>()).prop_map(
        |(temperature, top_k, top_p, seed)| SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        },
    ));
    match rpc {
        Rpc::Draft => (
            prop::collection::vec(token.clone(), 0..120),
            -2i32..12,
            -1i32..4,
            prop::collection::vec(prop_oneof![20 => 1i32..4, 1 => -1i32..1], 0..5),
            (session, secret, any::<bool>(), sampling),
        )
            .prop_map(
                |(prompt, max_draft_len, num_beams, widths, (sid, sec, reset, sampling))| {
                    DraftRequest {
                        request_id: "s".into(),
                        prompt_token_ids: prompt,
                        max_draft_len,
                        num_beams,
                        tree_widths: widths,
                        session_id: sid.into(),
                        session_secret: sec.into(),
                        reset_cache: reset,
                        sampling,
                        ..Default::default()
                    }
                    .encode_to_vec()
                },
            )
            .boxed(),
        Rpc::Verify => (
            prop::collection::vec(token.clone(), 0..120),
            (
                1usize..5,
                prop::collection::vec((any::<Index>(), token.clone()), 0..70),
            ),
            prop::collection::vec(token.clone(), 0..5),
            (prop::collection::vec(token, 0..3), -1i32..300),
            (session, secret, sampling, any::<bool>()),
            prop::option::weighted(0.2, prop::collection::vec((0i32..512, 0.0f32..1.0), 0..6)),
        )
            .prop_map(
                |(
                    prompt,
                    (roots, extra),
                    root_tokens,
                    (new, expected),
                    (sid, sec, sampling, wr),
                    dist,
                )| {
                    let mut roots_tok = root_tokens;
                    roots_tok.resize(roots, 1);
                    VerifyRequest {
                        request_id: "s".into(),
                        prompt_token_ids: prompt,
                        draft_tree: forest(roots, &extra, &roots_tok),
                        session_id: sid.into(),
                        session_secret: sec.into(),
                        new_token_ids: new,
                        expected_prefix_length: expected,
                        sampling,
                        siblings_without_replacement: wr,
                        root_distribution: dist.map(|d| DraftDistribution {
                            token_ids: d.iter().map(|x| x.0).collect(),
                            probs: d.iter().map(|x| x.1).collect(),
                        }),
                        ..Default::default()
                    }
                    .encode_to_vec()
                },
            )
            .boxed(),
        Rpc::DraftEnd | Rpc::TargetEnd => (session, secret)
            .prop_map(|(sid, sec)| {
                EndSessionRequest {
                    session_id: sid.into(),
                    session_secret: sec.into(),
                }
                .encode_to_vec()
            })
            .boxed(),
        Rpc::DraftPing | Rpc::TargetPing => Just(Vec::new()).boxed(),
    }
}

/// Distinct failures (a class key: request type, kind, the start of the message), each with the
/// smallest input seen. A run goes on after a failure and reports them all at its end, so one
/// long run finds every distinct failure.
#[derive(Default)]
struct Failures(Mutex<BTreeMap<String, (Vec<u8>, String)>>);

impl Failures {
    fn add(&self, key: String, bytes: &[u8], detail: String) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let e = f
            .entry(key)
            .or_insert_with(|| (bytes.to_vec(), detail.clone()));
        if bytes.len() < e.0.len() {
            *e = (bytes.to_vec(), detail);
        }
    }

    /// Checks one answer: an allowed code and a short message.
    fn check(&self, what: &str, out: &Result<(), Status>, bytes: &[u8]) {
        let Err(s) = out else { return };
        let class = class_of(s.message());
        if !ALLOWED.contains(&s.code()) {
            self.add(
                format!("{what}: status {:?}: {class}", s.code()),
                bytes,
                short(s.message()),
            );
        }
        if s.message().len() > MAX_MESSAGE {
            self.add(
                format!("{what}: message over {MAX_MESSAGE} bytes: {class}"),
                bytes,
                format!("{} bytes: {}", s.message().len(), short(s.message())),
            );
        }
    }

    /// Panics with every failure recorded, if any.
    fn assert_none(self) {
        let failures = self.0.into_inner().unwrap_or_else(|e| e.into_inner());
        if failures.is_empty() {
            return;
        }
        let mut report = format!("{} distinct failures:\n", failures.len());
        for (key, (bytes, detail)) in &failures {
            report += &format!(
                "- {key}\n  {detail}\n  smallest input ({} bytes): {}\n",
                bytes.len(),
                hex(&bytes[..bytes.len().min(256)])
            );
        }
        panic!("{report}");
    }
}

/// The start of a status message up to its first number or list: one failure class.
fn class_of(msg: &str) -> String {
    msg.chars()
        .take_while(|c| !c.is_ascii_digit() && *c != '[' && *c != '-')
        .take(60)
        .collect()
}

/// At most 200 characters of a message.
fn short(msg: &str) -> String {
    msg.chars().take(200).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Cases per request type: `PROPTEST_CASES` when set, else 2,000.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Fuzzes one request type with proptest's configured number of cases.
fn fuzz(rpc: Rpc) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let w = Workers::start();
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        // Failures are collected and reported below; no regression files.
        failure_persistence: None,
        ..Config::default()
    });
    let peak_seen = AtomicUsize::new(0);
    let errors = AtomicUsize::new(0);
    let failures = Failures::default();
    let classes: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());
    let result = runner.run(&input(rpc), |bytes| {
        if let Ok(mut s) = INPUT.lock() {
            *s = hex(&bytes[..bytes.len().min(4096)]);
        }
        let (out, peak) = handle(&w, rpc, &bytes);
        let session_bytes = match rpc {
            Rpc::Draft | Rpc::DraftPing | Rpc::DraftEnd => w.draft_session_bytes,
            _ => w.target_session_bytes,
        };
        let cfg = match rpc {
            Rpc::Draft | Rpc::DraftPing | Rpc::DraftEnd => &w.draft_cfg,
            _ => &w.target_cfg,
        };
        let limit = bound(cfg, bytes.len(), session_bytes);
        if peak > limit {
            failures.add(
                format!("{rpc:?}: heap peak over the bound"),
                &bytes,
                format!(
                    "{peak} bytes allocated for {} input bytes (bound {limit})",
                    bytes.len()
                ),
            );
        }
        peak_seen.fetch_max(peak, Ordering::Relaxed);
        if let Err(s) = &out {
            errors.fetch_add(1, Ordering::Relaxed);
            let key = format!("{:?}: {}", s.code(), class_of(s.message()));
            *classes.lock().unwrap().entry(key).or_insert(0) += 1;
        }
        failures.check(&format!("{rpc:?}"), &out, &bytes);
        Ok(())
    });
    result.expect("the fuzz runner itself failed");
    eprintln!(
        "{rpc:?}: {} cases, {} answered with an error, largest heap peak {} bytes",
        runner.config().cases,
        errors.into_inner(),
        peak_seen.into_inner()
    );
    // Where the inputs stopped: the most frequent answers.
    let mut classes: Vec<(String, usize)> = classes.into_inner().unwrap().into_iter().collect();
    classes.sort_by_key(|c| std::cmp::Reverse(c.1));
    for (class, n) in classes.iter().take(8) {
        eprintln!("  {n:>8}  {class}");
    }
    // The worker still serves.
    w.assert_serving();
    failures.assert_none();
}

#[test]
fn fuzz_draft_requests() {
    fuzz(Rpc::Draft);
}

#[test]
fn fuzz_draft_ping() {
    fuzz(Rpc::DraftPing);
}

#[test]
fn fuzz_draft_end_session() {
    fuzz(Rpc::DraftEnd);
}

#[test]
fn fuzz_verify_requests() {
    fuzz(Rpc::Verify);
}

#[test]
fn fuzz_target_ping() {
    fuzz(Rpc::TargetPing);
}

#[test]
fn fuzz_target_end_session() {
    fuzz(Rpc::TargetEnd);
}

// ------------------------------------------------------------------------------------------
// Loopback: raw bytes through the real gRPC stack.
// ------------------------------------------------------------------------------------------

/// Sends and receives message bodies as raw bytes.
#[derive(Clone, Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

async fn raw_call(
    ch: &tonic::transport::Channel,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(
        Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        RawCodec,
    )
    .await
    .map(Response::into_inner)
}

/// Raw-byte inputs for every method of both workers and the health service, sent over
/// loopback; a smaller number of cases (the per-request checks are those of the tests above,
/// less the heap bound, which cannot be attributed to one request across the server's threads).
#[test]
fn fuzz_over_loopback() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (draft, target) = rt.block_on(async {
        (
            specsplit_e2e::start_draft(&fuzz_config(false)).await,
            specsplit_e2e::start_target(&fuzz_config(true)).await,
        )
    });
    let connect = |url: String| {
        rt.block_on(tonic::transport::Endpoint::new(url).unwrap().connect())
            .unwrap()
    };
    let (dch, tch) = (connect(draft.url.clone()), connect(target.url.clone()));
    let health = |service: &str| {
        let mut b = Vec::new();
        if !service.is_empty() {
            b.push(0x0a);
            varint(service.len() as u64, &mut b);
            b.extend_from_slice(service.as_bytes());
        }
        b
    };
    let routes: Vec<(Rpc, bool, &'static str)> = vec![
        (Rpc::Draft, true, "/specsplit.DraftService/GenerateDrafts"),
        (Rpc::DraftPing, true, "/specsplit.DraftService/Ping"),
        (Rpc::DraftEnd, true, "/specsplit.DraftService/EndSession"),
        (Rpc::Verify, false, "/specsplit.TargetService/VerifyDrafts"),
        (Rpc::TargetPing, false, "/specsplit.TargetService/Ping"),
        (Rpc::TargetEnd, false, "/specsplit.TargetService/EndSession"),
        (Rpc::DraftPing, true, "/grpc.health.v1.Health/Check"),
        (Rpc::TargetPing, false, "/grpc.health.v1.Health/Check"),
    ];
    let cases = cases().div_ceil(10);
    let failures = Failures::default();
    for (rpc, on_draft, path) in routes {
        let ch = if on_draft { &dch } else { &tch };
        let strategy = if path.starts_with("/grpc.health") {
            select(vec![
                health(""),
                health("specsplit.DraftService"),
                health("specsplit.TargetService"),
                health("no.such.Service"),
            ])
            .prop_flat_map(|seed| {
                prop_oneof![
                    1 => prop::collection::vec(any::<u8>(), 0..64),
                    4 => prop::collection::vec(mutation(), 0..4)
                        .prop_map(move |m| apply(seed.clone(), &m)),
                ]
            })
            .boxed()
        } else {
            input(rpc).boxed()
        };
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(&strategy, |bytes| {
            if let Ok(mut s) = INPUT.lock() {
                *s = hex(&bytes[..bytes.len().min(4096)]);
            }
            let out = rt.block_on(raw_call(ch, path, bytes.clone())).map(|_| ());
            failures.check(path, &out, &bytes);
            Ok(())
        });
        result.expect("the fuzz runner itself failed");
        // Still serving: a valid request answers OK.
        let fresh = format!("after-fuzz-{path}");
        let valid = if on_draft {
            let r = DraftRequest {
                session_id: fresh,
                ..seed_draft()
            };
            raw_call(
                ch,
                "/specsplit.DraftService/GenerateDrafts",
                r.encode_to_vec(),
            )
        } else {
            let r = VerifyRequest {
                session_id: fresh,
                ..seed_verify()
            };
            raw_call(
                ch,
                "/specsplit.TargetService/VerifyDrafts",
                r.encode_to_vec(),
            )
        };
        rt.block_on(valid).expect("a valid request after fuzzing");
        let serving = rt
            .block_on(raw_call(ch, "/grpc.health.v1.Health/Check", health("")))
            .expect("health check");
        assert_eq!(serving, vec![0x08, 0x01], "SERVING");
    }
    rt.block_on(async {
        draft.stop().await;
        target.stop().await;
    });
    failures.assert_none();
}
