//! Sessions bound to their creator's `session_secret`, and the original SpecSplit client's
//! recovery after an eviction (`CACHE_EVICTED_DELTA_ONLY`), over loopback gRPC.

use specsplit_e2e::{config, start_draft, start_target};
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{DraftRequest, EndSessionRequest, VerifyRequest};
use tonic::transport::Channel;
use tonic::Code;

const MODEL: &str = "random:tiny:7";
const SESSION: &str = "generation-42";
const OWNER: &str = "owner-secret-0123456789abcdef";
const INTRUDER: &str = "intruder-secret-0123456789abcd";
const PROMPT: [i32; 5] = [5, 17, 3, 42, 8];
const ROUNDS: usize = 6;

fn draft_req(id: &str, secret: &str, seq: &[i32]) -> DraftRequest {
    DraftRequest {
        session_id: id.into(),
        session_secret: secret.into(),
        prompt_token_ids: seq.to_vec(),
        tree_widths: vec![2, 1, 1],
        ..Default::default()
    }
}

/// One greedy round of a generation: draft after `seq`, verify with the delta protocol (full
/// prompt on the first round), append the emitted tokens to `seq`.
async fn round(
    d: &mut DraftServiceClient<Channel>,
    t: &mut TargetServiceClient<Channel>,
    id: &str,
    secret: &str,
    seq: &mut Vec<i32>,
    cached: &mut Option<(i32, i32)>,
) {
    let tree = d
        .generate_drafts(draft_req(id, secret, seq))
        .await
        .unwrap()
        .into_inner();
    let mut req = VerifyRequest {
        session_id: id.into(),
        session_secret: secret.into(),
        draft_tree: tree.draft_tree,
        ..Default::default()
    };
    match *cached {
        None => req.prompt_token_ids = seq.clone(),
        Some((len, pending)) => {
            req.new_token_ids = vec![pending];
            req.expected_prefix_length = len;
        }
    }
    let v = t.verify_drafts(req).await.unwrap().into_inner();
    seq.extend(&v.accepted_token_ids);
    seq.push(v.correction_token_id);
    *cached = Some((v.cached_length, v.correction_token_id));
}

/// Every way a client holding the id but not the secret could touch the session; each must be
/// PERMISSION_DENIED with the same short message, which names nothing of the session.
async fn intrude(
    d: &mut DraftServiceClient<Channel>,
    t: &mut TargetServiceClient<Channel>,
    secret: &str,
    seq: &[i32],
    cached_len: i32,
) {
    let mut messages = Vec::new();
    let mut denied = |r: Result<(), tonic::Status>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        for leak in [SESSION, OWNER, "generation"] {
            assert!(!e.message().contains(leak), "{what}: {}", e.message());
        }
        assert!(e.message().len() <= 200, "{what}: {}", e.message());
        messages.push(e.message().to_string());
    };
    // Verify: full prompt (would overwrite the cache), delta (would advance it).
    let full = VerifyRequest {
        session_id: SESSION.into(),
        session_secret: secret.into(),
        prompt_token_ids: vec![1, 2, 3],
        ..Default::default()
    };
    denied(t.verify_drafts(full).await.map(|_| ()), "verify full");
    let delta = VerifyRequest {
        session_id: SESSION.into(),
        session_secret: secret.into(),
        new_token_ids: vec![*seq.last().unwrap()],
        expected_prefix_length: cached_len,
        ..Default::default()
    };
    denied(t.verify_drafts(delta).await.map(|_| ()), "verify delta");
    // Draft, with and without reset_cache.
    denied(
        d.generate_drafts(draft_req(SESSION, secret, &[9, 9]))
            .await
            .map(|_| ()),
        "draft",
    );
    let mut reset = draft_req(SESSION, secret, seq);
    reset.reset_cache = true;
    denied(d.generate_drafts(reset).await.map(|_| ()), "draft reset");
    // End the session on both workers.
    let end = EndSessionRequest {
        session_id: SESSION.into(),
        session_secret: secret.into(),
    };
    denied(t.end_session(end.clone()).await.map(|_| ()), "end target");
    denied(d.end_session(end).await.map(|_| ()), "end draft");
    assert!(messages.windows(2).all(|w| w[0] == w[1]), "{messages:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_serves_only_the_client_holding_its_secret() {
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();

    // The reference: the same generation with nobody interfering, on an open session.
    let mut reference = PROMPT.to_vec();
    let mut cached = None;
    for _ in 0..ROUNDS {
        round(&mut d, &mut t, "reference", "", &mut reference, &mut cached).await;
    }

    // The owner's generation, with a second client attacking the session after every round.
    let mut seq = PROMPT.to_vec();
    let mut cached = None;
    for _ in 0..ROUNDS {
        round(&mut d, &mut t, SESSION, OWNER, &mut seq, &mut cached).await;
        let len = cached.unwrap().0;
        intrude(&mut d, &mut t, INTRUDER, &seq, len).await;
        intrude(&mut d, &mut t, "", &seq, len).await;
    }
    assert_eq!(
        seq, reference,
        "the intruder changed the owner's generation"
    );
    assert!(target.sessions.get(SESSION).is_some());
    assert!(draft.sessions.get(SESSION).is_some());

    // A non-empty secret shorter than 16 bytes is malformed.
    let short = EndSessionRequest {
        session_id: SESSION.into(),
        session_secret: "short".into(),
    };
    let e = t.end_session(short).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = d
        .generate_drafts(draft_req("other", &"x".repeat(257), &PROMPT))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // The owner ends its sessions; a session created without a secret is open to anyone.
    let end = |secret: &str| EndSessionRequest {
        session_id: SESSION.into(),
        session_secret: secret.into(),
    };
    assert!(
        t.end_session(end(OWNER))
            .await
            .unwrap()
            .into_inner()
            .was_active
    );
    assert!(
        d.end_session(end(OWNER))
            .await
            .unwrap()
            .into_inner()
            .was_active
    );
    assert!(target.sessions.get(SESSION).is_none());
    let open = EndSessionRequest {
        session_id: "reference".into(),
        session_secret: INTRUDER.into(),
    };
    assert!(t.end_session(open).await.unwrap().into_inner().was_active);
    target.stop().await;
    draft.stop().await;
}

/// The original SpecSplit client resends its full context only when the status message of a
/// failed delta request contains `CACHE_EVICTED_DELTA_ONLY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resend_answers_carry_the_original_clients_marker() {
    const MARKER: &str = "CACHE_EVICTED_DELTA_ONLY";
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    let mut reference = PROMPT.to_vec();
    let mut cached = None;
    for _ in 0..ROUNDS {
        round(&mut d, &mut t, "reference", "", &mut reference, &mut cached).await;
    }

    let mut seq = PROMPT.to_vec();
    let mut cached = None;
    for r in 0..ROUNDS {
        round(&mut d, &mut t, "python-client-7", "", &mut seq, &mut cached).await;
        let (len, pending) = cached.unwrap();
        let delta = |expected: i32| VerifyRequest {
            session_id: "python-client-7".into(),
            new_token_ids: vec![pending],
            expected_prefix_length: expected,
            ..Default::default()
        };
        // A wrong expected length: the session is kept, the answer says to resend.
        let e = t.verify_drafts(delta(len + 1)).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.message().contains(MARKER), "{}", e.message());
        if r % 2 == 1 {
            // The target evicts every session; the next delta request is refused with the
            // marker, and the client recovers by resending the full context.
            target.sessions.clear();
            let e = t.verify_drafts(delta(len)).await.unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(e.message().contains(MARKER), "{}", e.message());
            assert!(!e.message().contains("python-client"), "{}", e.message());
            cached = None;
        }
    }
    assert_eq!(seq, reference, "recovery changed the generation");
    // A delta request without a session id is answered the same way.
    let e = t
        .verify_drafts(VerifyRequest {
            new_token_ids: vec![1],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains(MARKER), "{}", e.message());
    target.stop().await;
    draft.stop().await;
}
