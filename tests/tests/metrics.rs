//! The workers' HTTP endpoints: `/metrics` parses as Prometheus text and its counters agree
//! with the generations run; `/health` and `/ready` follow the worker's lifecycle, and while a
//! worker drains its gRPC health reports NOT_SERVING.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use specsplit_e2e::config;
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, Pipeline};
use specsplit_proto::health::health_check_response::ServingStatus;
use specsplit_proto::health::health_client::HealthClient;
use specsplit_proto::health::HealthCheckRequest;
use specsplit_workers::config::WorkerConfig;
use specsplit_workers::endpoints::{serve_endpoints, EndpointState};
use specsplit_workers::launch;
use specsplit_workers::service::{serve_draft_with, serve_target_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

const MODEL: &str = "random:tiny:7";

/// A worker with its HTTP endpoints, stopped by `stop`.
struct Worker {
    grpc: SocketAddr,
    http: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// Starts a worker for `cfg` and its endpoints; the endpoints answer before the model loads.
async fn start(cfg: &WorkerConfig, target: bool) -> Worker {
    let state = EndpointState::default();
    let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = http_listener.local_addr().unwrap();
    tokio::spawn(serve_endpoints(
        http_listener,
        state.clone(),
        std::future::pending(),
    ));
    let (status, body) = get(http, "/ready").await;
    assert_eq!((status, body.as_str()), (503, "loading\n"));
    let opts = launch::serve_options(cfg, state.lifecycle.clone()).unwrap();
    let model = launch::load(cfg).unwrap();
    let listener = TcpListener::bind(&cfg.listen).await.unwrap();
    let grpc = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let stop = async {
        let _ = rx.await;
    };
    let task = if target {
        let w = launch::target_worker(cfg, model);
        let _ = state.scrape.set(w.scrape());
        tokio::spawn(async move { serve_target_with(w, listener, stop, opts).await.unwrap() })
    } else {
        let w = launch::draft_worker(cfg, model);
        let _ = state.scrape.set(w.scrape());
        tokio::spawn(async move { serve_draft_with(w, listener, stop, opts).await.unwrap() })
    };
    Worker {
        grpc,
        http,
        stop: Some(tx),
        task,
    }
}

/// GETs `path` from `addr`: the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// Waits up to 10 s for `/ready` to answer `status`.
async fn ready_becomes(http: SocketAddr, status: u16) -> (u16, String) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let r = get(http, "/ready").await;
        if r.0 == status || Instant::now() > until {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The parsed `/metrics` of a worker.
struct Metrics(prometheus_parse::Scrape);

impl Metrics {
    async fn scrape(http: SocketAddr) -> Self {
        let (status, body) = get(http, "/metrics").await;
        assert_eq!(status, 200);
        let lines = body.lines().map(|l| Ok(l.to_string()));
        Self(prometheus_parse::Scrape::parse(lines).expect("Prometheus text"))
    }

    /// The value of the sample `name` whose labels include `labels` (0 when there is none).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        use prometheus_parse::Value;
        let found: Vec<f64> = self
            .0
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                ref other => panic!("{name}: unexpected {other:?}"),
            })
            .collect();
        assert!(found.len() <= 1, "{name} {labels:?}: {found:?}");
        found.first().copied().unwrap_or(0.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_generations_run() {
    let target = start(&config(MODEL, true), true).await;
    let draft = start(&config(MODEL, false), false).await;
    assert_eq!(ready_becomes(target.http, 200).await.0, 200);
    assert_eq!(get(target.http, "/health").await, (200, "live\n".into()));
    let orch = Orchestrator::connect(
        Some(&format!("http://{}", draft.grpc)),
        &format!("http://{}", target.grpc),
    )
    .await
    .unwrap();
    let cfg = GenerateConfig {
        mode: Mode::Spec,
        pipeline: Pipeline::Sequential,
        widths: vec![2, 1, 1],
        adaptive_depth: false,
        max_tokens: 20,
        ..Default::default()
    };
    let mut rounds = Vec::new();
    for prompt in [[3u32, 8, 1].as_slice(), &[40, 2], &[7, 7, 7, 9, 11]] {
        let g = orch.generate(prompt, &cfg, |_| {}).await.unwrap();
        rounds.extend(g.rounds);
    }
    // A bad request counts as an error of its RPC.
    let mut raw = specsplit_proto::target_service_client::TargetServiceClient::connect(format!(
        "http://{}",
        target.grpc
    ))
    .await
    .unwrap();
    let bad = specsplit_proto::VerifyRequest {
        request_id: "x".repeat(10_000),
        ..Default::default()
    };
    assert!(raw.verify_drafts(bad).await.is_err());

    let m = Metrics::scrape(target.http).await;
    let drafted: Vec<_> = rounds.iter().filter(|r| r.tree_nodes > 0).collect();
    assert!(!drafted.is_empty());
    let model = [("model_name", MODEL)];
    let spec = |name: &str| m.value(&format!("specsplit_spec_decode_{name}_total"), &model);
    assert_eq!(spec("num_drafts"), drafted.len() as f64);
    let nodes: usize = drafted.iter().map(|r| r.tree_nodes).sum();
    assert_eq!(spec("num_draft_tokens"), nodes as f64);
    let accepted: usize = drafted.iter().map(|r| r.accepted).sum();
    assert!(
        accepted > 0,
        "the draft is the target: it should be accepted"
    );
    assert_eq!(spec("num_accepted_tokens"), accepted as f64);
    let per_pos: Vec<f64> = (0..3)
        .map(|p| {
            let p = p.to_string();
            m.value(
                "specsplit_spec_decode_num_accepted_tokens_per_pos_total",
                &[("model_name", MODEL), ("position", &p)],
            )
        })
        .collect();
    for (p, &n) in per_pos.iter().enumerate() {
        let want = drafted.iter().filter(|r| r.accepted > p).count() as f64;
        assert_eq!(n, want, "position {p}");
    }
    let verify = [("rpc", "VerifyDrafts")];
    let calls = m.value("specsplit_rpc_requests_total", &verify);
    // One verification a round, and the bad request.
    assert_eq!(calls, rounds.len() as f64 + 1.0);
    assert_eq!(
        m.value(
            "specsplit_rpc_errors_total",
            &[("rpc", "VerifyDrafts"), ("code", "InvalidArgument")]
        ),
        1.0
    );
    assert_eq!(
        m.value("specsplit_rpc_requests_total", &[("rpc", "Ping")]),
        1.0
    );
    assert!(m.value("specsplit_kv_cache_budget_bytes", &[]) > 0.0);
    let used = m.value("specsplit_kv_cache_used_bytes", &[]);
    let held = m.value("specsplit_sessions", &[]);
    assert_eq!(
        held == 0.0,
        used == 0.0,
        "{held} sessions hold {used} bytes"
    );

    let dm = Metrics::scrape(draft.http).await;
    let passes = dm.value("specsplit_rpc_requests_total", &[("rpc", "GenerateDrafts")]);
    assert!(passes >= drafted.len() as f64, "{passes} draft passes");
    assert_eq!(
        dm.value("specsplit_spec_decode_num_drafts_total", &model),
        0.0
    );
    drop(orch);
    for w in [target, draft] {
        let _ = w.stop.unwrap().send(());
        w.task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_reports_not_serving_then_stops() {
    let cfg = WorkerConfig {
        drain_secs: 2,
        ..config(MODEL, true)
    };
    let mut target = start(&cfg, true).await;
    assert_eq!(ready_becomes(target.http, 200).await.0, 200);
    let mut health = HealthClient::connect(format!("http://{}", target.grpc))
        .await
        .unwrap();
    let check = HealthCheckRequest {
        service: String::new(),
    };
    let status = health
        .check(check.clone())
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    let mut watch = health.watch(check.clone()).await.unwrap().into_inner();
    let first = watch.message().await.unwrap().unwrap().status;
    assert_eq!(first, ServingStatus::Serving as i32);

    let _ = target.stop.take().unwrap().send(());
    let next = watch.message().await.unwrap().unwrap().status;
    assert_eq!(
        next,
        ServingStatus::NotServing as i32,
        "a watcher learns of the drain"
    );
    assert!(
        watch.message().await.unwrap().is_none(),
        "then the stream ends"
    );
    assert_eq!(
        ready_becomes(target.http, 503).await,
        (503, "draining\n".into())
    );
    let status = health.check(check).await.unwrap().into_inner().status;
    assert_eq!(status, ServingStatus::NotServing as i32);
    assert_eq!(get(target.http, "/health").await.0, 200, "still live");
    tokio::time::timeout(Duration::from_secs(30), target.task)
        .await
        .expect("the worker stops after draining")
        .unwrap();
}
