//! TLS, mutual TLS and bearer tokens on the gRPC links, with certificates made here: the
//! orchestrator generates through workers that require all three; a wrong CA, a missing client
//! certificate, a plaintext client and a wrong or missing token are refused.

use specsplit_e2e::pki::{Pki, TOKEN};
use specsplit_e2e::{config, start_secured_draft, start_secured_target};
use specsplit_orchestrator::{
    AuthToken, ClientTls, ConnectOptions, GenerateConfig, Mode, Orchestrator, OrchestratorError,
};
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::PingRequest;
use specsplit_workers::config::{Secret, WorkerConfig};

const MODEL: &str = "random:tiny:7";

/// A worker config requiring TLS, a client certificate from `good` and the token.
fn secured(pki: &Pki, target: bool) -> WorkerConfig {
    WorkerConfig {
        tls_cert: Some(pki.path("server.pem")),
        tls_key: Some(pki.path("server-key.pem")),
        tls_client_ca: Some(pki.path("good-ca.pem")),
        auth_token: Some(Secret::new(TOKEN)),
        ..config(MODEL, target)
    }
}

fn tls(pki: &Pki, ca: &str, client: Option<&str>) -> ClientTls {
    let (cert, key) = (
        client.map(|c| pki.path(&format!("{c}.pem"))),
        client.map(|c| pki.path(&format!("{c}-key.pem"))),
    );
    ClientTls::from_files(&pki.path(ca), cert.as_deref(), key.as_deref()).unwrap()
}

fn expect_refused(r: Result<Orchestrator, OrchestratorError>, what: &str) -> OrchestratorError {
    match r {
        Ok(_) => panic!("{what}: connected"),
        Err(e) => {
            eprintln!("{what}: {e}");
            e
        }
    }
}

fn is_unauthenticated(e: &OrchestratorError) -> bool {
    matches!(e, OrchestratorError::Rpc { status, .. } if status.code() == tonic::Code::Unauthenticated)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_and_a_token_generate_and_everything_less_is_refused() {
    let pki = Pki::new();
    let target = start_secured_target(&secured(&pki, true)).await;
    let draft = start_secured_draft(&secured(&pki, false)).await;
    let (d, t) = (
        format!("localhost:{}", draft.addr.port()),
        format!("localhost:{}", target.addr.port()),
    );
    let (d, t) = (Some(d.as_str()), t.as_str());
    let good = ConnectOptions {
        tls: Some(tls(&pki, "good-ca.pem", Some("client"))),
        token: Some(AuthToken::from_file(&pki.path("token")).unwrap()),
        ..ConnectOptions::default()
    };

    // Everything right: speculative generation equals target-only generation.
    let orch = Orchestrator::connect_with_options(d, t, &good)
        .await
        .unwrap();
    let prompt = [5u32, 9, 17, 3];
    let ar = GenerateConfig {
        mode: Mode::Ar,
        max_tokens: 12,
        ..Default::default()
    };
    let spec = GenerateConfig {
        mode: Mode::Spec,
        ..ar.clone()
    };
    let reference = orch.generate(&prompt, &ar, |_| {}).await.unwrap();
    let got = orch.generate(&prompt, &spec, |_| {}).await.unwrap();
    assert_eq!(got.token_ids, reference.token_ids);
    assert_eq!(reference.token_ids.len(), 12);
    drop(orch);

    // A CA that did not sign the workers' certificate: the handshake fails.
    let wrong_ca = ConnectOptions {
        tls: Some(tls(&pki, "rogue-ca.pem", Some("client"))),
        ..good.clone()
    };
    let e = expect_refused(
        Orchestrator::connect_with_options(d, t, &wrong_ca).await,
        "wrong CA",
    );
    assert!(matches!(e, OrchestratorError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("certificate"), "{e}");

    // No client certificate, or one from another CA: the worker ends the handshake.
    for client in [None, Some("rogue-client")] {
        let opts = ConnectOptions {
            tls: Some(tls(&pki, "good-ca.pem", client)),
            ..good.clone()
        };
        let e = expect_refused(
            Orchestrator::connect_with_options(d, t, &opts).await,
            &format!("client certificate {client:?}"),
        );
        assert!(
            !is_unauthenticated(&e),
            "a TLS error, not a token error: {e}"
        );
    }

    // Plaintext to a TLS worker: nothing is served.
    let plain = ConnectOptions {
        tls: None,
        ..good.clone()
    };
    expect_refused(
        Orchestrator::connect_with_options(d, t, &plain).await,
        "plaintext",
    );
    let raw = async {
        let mut c = TargetServiceClient::connect(format!("http://{t}")).await?;
        c.ping(PingRequest {}).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    };
    assert!(raw.await.is_err(), "a plaintext ping was answered");

    // The right certificates but a wrong or no token: UNAUTHENTICATED.
    for token in [Some(AuthToken::new("not-the-token").unwrap()), None] {
        let opts = ConnectOptions {
            token: token.clone(),
            ..good.clone()
        };
        let e = expect_refused(
            Orchestrator::connect_with_options(d, t, &opts).await,
            &format!("token {:?}", token.is_some()),
        );
        assert!(is_unauthenticated(&e), "{e}");
    }

    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_token_and_no_client_certificate_serves_token_holders() {
    let pki = Pki::new();
    let cfg = WorkerConfig {
        tls_client_ca: None,
        auth_token: None,
        auth_token_file: Some(pki.path("token")),
        ..secured(&pki, true)
    };
    let target = start_secured_target(&cfg).await;
    let addr = format!("localhost:{}", target.addr.port());
    let good = ConnectOptions {
        tls: Some(tls(&pki, "good-ca.pem", None)),
        token: Some(AuthToken::new(TOKEN).unwrap()),
        ..ConnectOptions::default()
    };
    let orch = Orchestrator::connect_with_options(None, &addr, &good)
        .await
        .unwrap();
    let ar = GenerateConfig {
        mode: Mode::Ar,
        max_tokens: 4,
        ..Default::default()
    };
    assert_eq!(
        orch.generate(&[1, 2, 3], &ar, |_| {})
            .await
            .unwrap()
            .token_ids
            .len(),
        4
    );
    let anonymous = ConnectOptions {
        token: None,
        ..good
    };
    let e = expect_refused(
        Orchestrator::connect_with_options(None, &addr, &anonymous).await,
        "no token",
    );
    assert!(is_unauthenticated(&e), "{e}");
    target.stop().await;
}
