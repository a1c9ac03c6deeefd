//! Every size a worker request can ask for is bounded by configuration: refused with
//! INVALID_ARGUMENT naming the field and the limit (short messages, nothing echoed), oversized
//! messages refused from their length prefix, sessionless requests counted against the
//! session limits, undecodable messages (health included) answered INVALID_ARGUMENT.

use std::time::{Duration, Instant};

use prost::bytes::{Buf, BufMut};
use specsplit_e2e::{config, start_draft, start_target};
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::health::health_client::HealthClient;
use specsplit_proto::health::HealthCheckRequest;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{DraftDistribution, DraftRequest, PingRequest, TokenNode, VerifyRequest};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};

const MODEL: &str = "random:tiny:7";

/// A codec sending and receiving message bytes unchanged.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// Calls `path` on `url` with `body` as the message bytes.
async fn raw_call(url: &str, path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let channel = tonic::transport::Channel::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        Raw,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// The status of a call that must fail with `code`, its message checked to be short.
fn refused<T: std::fmt::Debug>(r: Result<tonic::Response<T>, Status>, code: Code) -> Status {
    let s = r.expect_err("the request must be refused");
    assert_eq!(s.code(), code, "{s:?}");
    assert!(s.message().len() < 200, "message too long: {}", s.message());
    s
}

fn chain(depth: usize, dist: Option<DraftDistribution>) -> Vec<TokenNode> {
    let mut node: Option<TokenNode> = None;
    for i in (0..depth).rev() {
        node = Some(TokenNode {
            token_id: (i % 500) as i32,
            children: node.into_iter().collect(),
            child_distribution: dist.clone(),
            ..Default::default()
        });
    }
    node.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_sizes_are_bounded_before_allocation() {
    let draft = start_draft(&config(MODEL, false)).await;
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    let req = |len: i32, widths: Vec<i32>| DraftRequest {
        prompt_token_ids: vec![1, 2, 3],
        max_draft_len: len,
        tree_widths: widths,
        ..Default::default()
    };
    // Depths that used to allocate gigabytes (or abort the worker) are refused at the limit.
    for len in [i32::MAX, 130_000_000, 1_000_000, 65] {
        let s = refused(
            d.generate_drafts(req(len, vec![])).await,
            Code::InvalidArgument,
        );
        assert_eq!(
            s.message(),
            format!("max_draft_len is {len}; this worker accepts at most 64 (max_tree_depth)")
        );
    }
    let s = refused(
        d.generate_drafts(req(0, vec![1; 120])).await,
        Code::InvalidArgument,
    );
    assert_eq!(
        s.message(),
        "the length of tree_widths is 120; this worker accepts at most 64 (max_tree_depth)"
    );
    let s = refused(
        d.generate_drafts(req(0, vec![1, i32::MAX])).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("tree_widths[1]") && s.message().contains("max_tree_nodes"));
    // Widths whose product overflows a usize.
    let s = refused(
        d.generate_drafts(req(0, vec![128; 64])).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("too many nodes"), "{}", s.message());
    let s = refused(
        d.generate_drafts(req(0, vec![2, 0])).await,
        Code::InvalidArgument,
    );
    assert_eq!(s.message(), "tree_widths[1] is 0; widths must be positive");
    let mut r = req(4, vec![]);
    r.num_beams = i32::MAX;
    refused(d.generate_drafts(r).await, Code::InvalidArgument);
    // Identifiers are bounded and never echoed.
    let mut r = req(4, vec![]);
    r.session_id = "x".repeat(300);
    let s = refused(d.generate_drafts(r).await, Code::InvalidArgument);
    assert_eq!(
        s.message(),
        "session_id is 300 bytes long; at most 256 are accepted"
    );
    // Far beyond: the message is longer than a draft request can be (tokens and widths at
    // the limits, plus 64 KiB), refused from its length prefix.
    let mut r = req(4, vec![]);
    r.session_id = "x".repeat(100_000);
    let s = refused(d.generate_drafts(r).await, Code::InvalidArgument);
    assert!(
        s.message().starts_with("the request is 100")
            && s.message().contains("this worker accepts at most"),
        "{}",
        s.message()
    );
    let mut r = req(4, vec![]);
    r.request_id = "y".repeat(257);
    refused(d.generate_drafts(r).await, Code::InvalidArgument);
    // The deepest tree allowed comes back decodable, sampled (a distribution on every node).
    // A sampled branch ends early where it draws an end-of-sequence token (about one request
    // in three with this model): draw until one reaches the limit.
    let mut deepest = 0;
    for _ in 0..20 {
        let mut r = req(64, vec![]);
        r.temperature = Some(1.0);
        let tree = d.generate_drafts(r).await.unwrap().into_inner().draft_tree;
        let mut depth = 0;
        let mut level = &tree;
        while let Some(n) = level.first() {
            depth += 1;
            level = &n.children;
        }
        assert!(depth <= 64, "a tree of depth {depth}");
        deepest = deepest.max(depth);
        if deepest == 64 {
            break;
        }
    }
    assert_eq!(deepest, 64);
    // The limits are reported.
    let ping = d.ping(PingRequest {}).await.unwrap().into_inner();
    assert_eq!(ping.max_tree_depth, 64);
    assert_eq!(ping.max_tree_nodes, 128);
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_may_carry_a_whole_context_and_no_more() {
    // The draft receives prompt and generated tokens every round: max_prompt_len defaults to
    // the context (the test config's 1024), on both workers.
    let cfg = config(MODEL, false);
    let draft = start_draft(&cfg).await;
    let target = start_target(&config(MODEL, true)).await;
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    for p in [
        d.ping(PingRequest {}).await.unwrap().into_inner(),
        t.ping(PingRequest {}).await.unwrap().into_inner(),
    ] {
        assert_eq!(p.max_prompt_len, 1024, "{p:?}");
        assert_eq!(p.max_context, 1024);
    }
    let tokens = |n: usize| (0..n).map(|i| (i % 400) as i32).collect::<Vec<_>>();
    let r = d
        .generate_drafts(DraftRequest {
            prompt_token_ids: tokens(1000),
            max_draft_len: 4,
            ..Default::default()
        })
        .await;
    assert!(r.is_ok(), "{r:?}");
    // A whole context leaves no room for the draft: refused, not a failure of the worker.
    let s = refused(
        d.generate_drafts(DraftRequest {
            prompt_token_ids: tokens(1024),
            max_draft_len: 4,
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert!(
        s.message()
            .contains("exceeds the draft context of 1024 tokens"),
        "{}",
        s.message()
    );
    let s = refused(
        d.generate_drafts(DraftRequest {
            prompt_token_ids: tokens(1025),
            max_draft_len: 4,
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert_eq!(
        s.message(),
        "prompt_token_ids has 1025 tokens; this worker accepts at most 1024 (max_prompt_len)"
    );
    refused(
        t.verify_drafts(VerifyRequest {
            prompt_token_ids: tokens(1025),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    draft.stop().await;
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_tree_depth_and_message_size_are_bounded() {
    let target = start_target(&config(MODEL, true)).await;
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    let s = refused(
        t.verify_drafts(VerifyRequest {
            prompt_token_ids: vec![1, 2],
            draft_tree: chain(65, None),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("depth limit of 64"), "{}", s.message());
    let ok = t
        .verify_drafts(VerifyRequest {
            prompt_token_ids: vec![1, 2],
            draft_tree: chain(64, None),
            ..Default::default()
        })
        .await;
    assert!(ok.is_ok(), "{ok:?}");
    // The largest request the limits allow passes the transport: max_prompt_len tokens of
    // the longest encoding (negative ids: 10 bytes) in both token lists, a full tree with a
    // full-support sparse distribution on every node. Validation refuses it, not the length.
    let full = DraftDistribution {
        token_ids: (0..512).collect(),
        probs: vec![1.0 / 512.0; 512],
    };
    let wide: Vec<TokenNode> = (0..128)
        .map(|i| TokenNode {
            token_id: i,
            child_distribution: Some(full.clone()),
            ..Default::default()
        })
        .collect();
    let s = refused(
        t.verify_drafts(VerifyRequest {
            prompt_token_ids: vec![-1; 1024],
            new_token_ids: vec![-1; 1024],
            draft_tree: wide,
            root_distribution: Some(full),
            session_id: "s".repeat(256),
            request_id: "r".repeat(256),
            session_secret: "z".repeat(256),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert!(
        s.message().contains("outside the vocabulary"),
        "{}",
        s.message()
    );
    // Distributions larger than the vocabulary (512) are refused before conversion.
    let big = DraftDistribution {
        token_ids: vec![1; 513],
        probs: vec![0.0; 513],
    };
    let s = refused(
        t.verify_drafts(VerifyRequest {
            prompt_token_ids: vec![1, 2],
            draft_tree: chain(2, Some(big.clone())),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert_eq!(
        s.message(),
        "a child_distribution in draft_tree has 513 entries; at most the vocabulary size 512"
    );
    let s = refused(
        t.verify_drafts(VerifyRequest {
            prompt_token_ids: vec![1, 2],
            draft_tree: chain(1, None),
            root_distribution: Some(big),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().starts_with("root_distribution has 513 entries"));
    // A 100 MB message is refused from its length prefix, quickly, with the limit named.
    let started = Instant::now();
    let s = raw_call(
        &target.url,
        "/specsplit.TargetService/VerifyDrafts",
        vec![0u8; 100 << 20],
    )
    .await
    .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().starts_with(&format!(
            "the request is {} bytes; this worker accepts at most ",
            100 << 20
        )),
        "{}",
        s.message()
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // The worker still serves.
    t.ping(PingRequest {}).await.unwrap();
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_are_invalid_argument_and_say_why() {
    let target = start_target(&config(MODEL, true)).await;
    // Field 1 (request_id, a string) holding invalid UTF-8.
    let s = raw_call(
        &target.url,
        "/specsplit.TargetService/VerifyDrafts",
        vec![0x0a, 0x02, 0xff, 0xfe],
    )
    .await
    .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(
        s.message()
            .starts_with("the message could not be decoded: "),
        "{}",
        s.message()
    );
    assert!(!s.message().contains("deep"), "{}", s.message());
    // Garbage to the health service: INVALID_ARGUMENT too, not INTERNAL.
    for path in [
        "/grpc.health.v1.Health/Check",
        "/specsplit.TargetService/Ping",
        "/specsplit.TargetService/EndSession",
    ] {
        let s = raw_call(&target.url, path, vec![0xff; 32])
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{path}: {s:?}");
        assert!(!s.message().contains("deep"), "{}", s.message());
        assert!(s.message().len() < 200);
    }
    // Health still answers well-formed checks.
    let mut h = HealthClient::connect(target.url.clone()).await.unwrap();
    for service in ["", "specsplit.TargetService"] {
        let r = h
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, 1, "SERVING");
    }
    let s = h
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessionless_requests_count_against_the_session_limits() {
    let mut cfg = config(MODEL, true);
    cfg.max_sessions = 5;
    let target = start_target(&cfg).await;
    let mut dcfg = config(MODEL, false);
    dcfg.max_sessions = 5;
    let draft = start_draft(&dcfg).await;
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    let verify = || VerifyRequest {
        prompt_token_ids: vec![1, 2, 3],
        ..Default::default()
    };
    let draft_req = || DraftRequest {
        prompt_token_ids: vec![1, 2, 3],
        max_draft_len: 2,
        ..Default::default()
    };
    // Five sessionless requests in flight (held here) take every slot.
    {
        let held: Vec<_> = (0..5)
            .map(|_| target.sessions.reserve_anonymous(1 << 20).unwrap())
            .collect();
        let s = refused(t.verify_drafts(verify()).await, Code::ResourceExhausted);
        assert_eq!(
            s.message(),
            "all 5 sessions are busy (5 MiB of 4096 MiB used) and none ended within 1000 ms; \
             raise max_sessions (or admission_wait_ms to wait longer), or retry later"
        );
        // Named sessions too.
        let mut named = verify();
        named.session_id = "a".into();
        refused(t.verify_drafts(named).await, Code::ResourceExhausted);
        drop(held);
    }
    {
        let _held: Vec<_> = (0..5)
            .map(|_| draft.sessions.reserve_anonymous(1 << 20).unwrap())
            .collect();
        let s = refused(
            d.generate_drafts(draft_req()).await,
            Code::ResourceExhausted,
        );
        assert!(
            s.message().starts_with("all 5 sessions are busy"),
            "{}",
            s.message()
        );
    }
    // Released: they run again, and 32 at once either run or are refused as busy; none is
    // left holding room afterwards.
    t.verify_drafts(verify()).await.unwrap();
    d.generate_drafts(draft_req()).await.unwrap();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let mut t = t.clone();
            tokio::spawn(async move {
                t.verify_drafts(VerifyRequest {
                    prompt_token_ids: (0..500).map(|i| i % 300).collect(),
                    ..Default::default()
                })
                .await
            })
        })
        .collect();
    for c in calls {
        match c.await.unwrap() {
            Ok(_) => {}
            Err(s) => {
                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                assert!(
                    s.message().starts_with("all 5 sessions are busy"),
                    "{}",
                    s.message()
                );
            }
        }
    }
    assert_eq!(target.sessions.anonymous(), 0);
    assert_eq!(target.sessions.bytes(), 0);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_sets_are_bounded_before_allocation() {
    let draft = start_draft(&config(MODEL, false)).await;
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    // The committed sequence [1, 2, 3] and the path [4, 5] under verification.
    let req = |committed: i32, candidates: i32, lengths: Vec<i32>, widths: Vec<i32>| DraftRequest {
        prompt_token_ids: vec![1, 2, 3, 4, 5],
        tree_widths: widths,
        session_id: "outcomes".into(),
        outcomes: Some(specsplit_proto::OutcomeSet {
            committed_length: committed,
            candidates,
            accepted_lengths: lengths,
        }),
        ..Default::default()
    };
    let cases = [
        (req(0, 1, vec![], vec![1]), "committed_length is 0"),
        (req(6, 1, vec![], vec![1]), "committed_length is 6"),
        (req(3, 0, vec![], vec![1]), "candidates is 0"),
        (req(3, -4, vec![], vec![1]), "candidates is -4"),
        (req(3, 1, vec![1, 0], vec![1]), "accepted_lengths[1] is 0"),
        (req(3, 1, vec![3], vec![1]), "accepted_lengths[0] is 3"),
        (req(3, 1, vec![-1], vec![1]), "accepted_lengths[0] is -1"),
        // 3 outcomes × i32::MAX candidates × a 2-node tree: refused from the sizes alone.
        (req(3, i32::MAX, vec![], vec![1, 1]), "pre-draft nodes"),
        (req(3, 20, vec![], vec![1; 3]), "pre-draft nodes"),
        // A path longer than the deepest tree.
        (
            DraftRequest {
                prompt_token_ids: (1..=70).collect(),
                ..req(1, 1, vec![], vec![1])
            },
            "the path under verification is 69",
        ),
    ];
    for (r, want) in cases {
        let s = refused(d.generate_drafts(r).await, Code::InvalidArgument);
        assert!(s.message().contains(want), "{want}: {}", s.message());
    }
    // A valid set: one pre-draft per (accepted length, candidate), and the worker serves on.
    let ok = d
        .generate_drafts(req(3, 2, vec![], vec![1, 1]))
        .await
        .unwrap()
        .into_inner();
    assert!(ok.draft_tree.is_empty());
    assert_eq!(ok.predrafts.len(), 3 * 2);
    for (i, p) in ok.predrafts.iter().enumerate() {
        assert_eq!(p.accepted_length as usize, i / 2);
        assert_eq!(p.draft_tree.len(), 1, "a chain");
    }
    draft.stop().await;
}
