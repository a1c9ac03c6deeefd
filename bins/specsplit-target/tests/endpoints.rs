//! The `specsplit-target` binary's HTTP endpoints and start-up checks: `/ready` and `/metrics`
//! on `--metrics-listen`, draining on SIGTERM with NOT_SERVING, and a non-loopback plaintext
//! listen address refused without `--insecure`.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};

/// Starts `specsplit-target` with `args`; returns it, its gRPC address and its HTTP address
/// (both read from its log).
fn spawn(args: &[&str]) -> (Child, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specsplit-target"))
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start specsplit-target");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let field = |line: &str, key: &str| {
        line.find(key).map(|i| {
            line[i + key.len()..]
                .split_whitespace()
                .next()
                .unwrap()
                .to_string()
        })
    };
    let (mut grpc, mut http) = (None, None);
    while grpc.is_none() || http.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("worker log");
        http = http.or_else(|| field(&line, " http="));
        grpc = grpc.or_else(|| field(&line, " addr="));
    }
    (child, grpc.unwrap(), http.unwrap())
}

/// GETs `path` from `addr`: the status code and the body.
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (
        head.split(' ').nth(1).unwrap().parse().unwrap(),
        body.into(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_metrics_and_readiness_and_drains_on_sigterm() {
    let (mut child, grpc, http) = spawn(&[
        "--model",
        "random:tiny:3",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--drain-secs",
        "3",
    ]);
    let url = format!("http://{grpc}");
    let until = Instant::now() + Duration::from_secs(30);
    while get(&http, "/ready").0 != 200 {
        assert!(Instant::now() < until, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&http, "/health"), (200, "live\n".into()));
    let mut client =
        specsplit_proto::target_service_client::TargetServiceClient::connect(url.clone())
            .await
            .unwrap();
    for _ in 0..3 {
        client.ping(specsplit_proto::PingRequest {}).await.unwrap();
    }
    let (status, metrics) = get(&http, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics
            .lines()
            .any(|l| l == "specsplit_rpc_requests_total{rpc=\"Ping\"} 3"),
        "{metrics}"
    );

    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let check = HealthCheckRequest {
        service: "specsplit.TargetService".into(),
    };
    let st = health.check(check.clone()).await.unwrap().into_inner();
    assert_eq!(st.status, ServingStatus::Serving as i32);
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let until = Instant::now() + Duration::from_secs(10);
    while get(&http, "/ready").0 != 503 {
        assert!(Instant::now() < until, "never draining");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&http, "/ready").1, "draining\n");
    let st = health.check(check).await.unwrap().into_inner();
    assert_eq!(st.status, ServingStatus::NotServing as i32);
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "worker exited with {exit}");
}

#[test]
fn a_public_plaintext_listen_address_needs_insecure() {
    let run = |extra: &[&str]| {
        let mut args = vec!["--model", "random:tiny:3", "--listen", "0.0.0.0:0"];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_specsplit-target"))
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start specsplit-target")
    };
    let out = run(&[]).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("is not loopback and the worker has no TLS") && err.contains("--insecure"),
        "{err}"
    );
    // With --insecure it serves.
    let (mut child, grpc, _) = spawn(&[
        "--model",
        "random:tiny:3",
        "--listen",
        "0.0.0.0:0",
        "--insecure",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    assert!(grpc.starts_with("0.0.0.0:"), "{grpc}");
    child.kill().unwrap();
    let _ = child.wait();
}
