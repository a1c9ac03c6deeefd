//! The `specsplit-target` binary under hostile load: sessionless, oversized and concurrent
//! requests neither take its memory past the model plus the session budget (and a bounded
//! slack for passes in flight) nor stall another session's requests.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use prost::bytes::{Buf, BufMut};
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{PingRequest, VerifyRequest};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};

/// Memory a worker may take beyond its model and session budget here: the runtime, the
/// allocator's arenas and the activations of the passes in flight (at most `max_sessions`
/// of them, each bounded by `max_prompt_len`).
const SLACK_MIB: u64 = 64;

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

/// A field of /proc/<pid>/status, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Kills the worker if the test fails half-way.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(args: &[&str]) -> (Worker, String) {
    let (child, url) = common::spawn_target(args);
    (Worker(child), url)
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_stay_within_the_budget_and_do_not_stall_others() {
    const BUDGET_MIB: u64 = 4;
    let (worker, url) = start(&[
        "--model",
        "random:tiny:3",
        "--listen",
        "127.0.0.1:0",
        "--max-context",
        "1024",
        "--max-sessions",
        "4",
        "--memory-budget-mb",
        &BUDGET_MIB.to_string(),
    ]);
    let pid = worker.0.id();
    let mut client = TargetServiceClient::connect(url.clone()).await.unwrap();
    // The model is loaded and the server has answered: the baseline.
    client.ping(PingRequest {}).await.unwrap();
    let base_kib = status_kib(pid, "VmRSS:");
    let prompt: Vec<i32> = (0..1000).map(|i| i * 7 % 500).collect();
    // Another session, warmed up: its small requests must keep being answered promptly.
    let small = |n: i32| VerifyRequest {
        session_id: "other".into(),
        prompt_token_ids: (0..n).collect(),
        ..Default::default()
    };
    client.verify_drafts(small(8)).await.unwrap();

    // Hostile load: 48 concurrent sessionless full-context requests, 3 messages of 120 MB.
    let mut hostile = Vec::new();
    for _ in 0..48 {
        let mut c = client.clone();
        let p = prompt.clone();
        hostile.push(tokio::spawn(async move {
            c.verify_drafts(VerifyRequest {
                prompt_token_ids: p,
                ..Default::default()
            })
            .await
            .map(|_| ())
        }));
    }
    for _ in 0..3 {
        let url = url.clone();
        hostile.push(tokio::spawn(async move {
            let channel = tonic::transport::Channel::from_shared(url)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.unwrap();
            grpc.unary(
                tonic::Request::new(vec![0u8; 120 << 20]),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/specsplit.TargetService/VerifyDrafts",
                ),
                Raw,
            )
            .await
            .map(|_| ())
        }));
    }
    // Meanwhile, pings and the other session's small verifies.
    let mut worst = Duration::ZERO;
    for i in 0..10 {
        let t = Instant::now();
        client.ping(PingRequest {}).await.unwrap();
        let mut r = small(8 + i);
        r.new_token_ids = Vec::new();
        // The session may have been evicted while idle: a full prompt rebuilds it.
        let v = client.verify_drafts(r).await;
        match v {
            Ok(_) => {}
            Err(s) => assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}"),
        }
        worst = worst.max(t.elapsed());
    }
    let (mut ok, mut busy, mut too_long) = (0, 0, 0);
    for h in hostile {
        match h.await.unwrap() {
            Ok(()) => ok += 1,
            Err(s) if s.code() == Code::ResourceExhausted => {
                assert!(s.message().starts_with("all 4 sessions are busy"), "{s:?}");
                busy += 1
            }
            Err(s) if s.message().starts_with("the request is 125829120 bytes") => {
                assert_eq!(s.code(), Code::InvalidArgument);
                too_long += 1
            }
            Err(s) => panic!("unexpected status {s:?}"),
        }
    }
    let peak_kib = status_kib(pid, "VmHWM:");
    eprintln!(
        "baseline {} MiB, peak {} MiB; {ok} served, {busy} busy, {too_long} too long; worst \
         ping+verify {worst:?}",
        base_kib >> 10,
        peak_kib >> 10
    );
    assert_eq!(too_long, 3);
    assert_eq!(ok + busy, 48);
    assert!(
        peak_kib <= base_kib + ((BUDGET_MIB + SLACK_MIB) << 10),
        "peak RSS {} MiB over the baseline {} MiB + budget {BUDGET_MIB} MiB + slack \
         {SLACK_MIB} MiB",
        peak_kib >> 10,
        base_kib >> 10
    );
    assert!(
        worst < Duration::from_secs(5),
        "another session waited {worst:?}"
    );
}
