//! The `specsplit-target` binary: serves gRPC health, answers Ping, and on SIGTERM finishes
//! in-flight requests before exiting cleanly.

mod common;

use std::process::Command;
use std::time::Duration;

use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{PingRequest, VerifyRequest};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_health_and_stops_gracefully_on_sigterm() {
    let (mut child, url) = common::spawn_target(&[
        "--model",
        "random:tiny:3",
        "--listen",
        "127.0.0.1:0",
        "--max-context",
        "4096",
        "--max-prompt-len",
        "4000",
    ]);
    let channel = tonic::transport::Channel::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let st = health
        .check(HealthCheckRequest {
            service: "specsplit.TargetService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.status, ServingStatus::Serving as i32);
    let mut client = TargetServiceClient::connect(url).await.unwrap();
    let ping = client.ping(PingRequest {}).await.unwrap().into_inner();
    assert_eq!(ping.worker_type, "target");
    assert!(ping.vocab_size > 0);

    // A long prefill in flight when SIGTERM arrives must still complete.
    let mut c2 = client.clone();
    let inflight = tokio::spawn(async move {
        c2.verify_drafts(VerifyRequest {
            session_id: "s".into(),
            prompt_token_ids: (0..3000i32).map(|i| i * 7 % 250).collect(),
            ..Default::default()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let r = inflight.await.unwrap();
    assert!(r.is_ok(), "in-flight request failed: {:?}", r.err());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "worker exited with {exit}");
}
