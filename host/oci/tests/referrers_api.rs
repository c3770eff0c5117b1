//! The referrers API path of a pull, against a registry that has the API (Debian's registry has
//! not: the tag schema is tested against it in `registry.rs`). The registry here is a replay:
//! `referrers-api/answers.json` lists the answers such a registry gives for one module with a
//! signature, vectors and an unrelated referrer (an SBOM), written by `referrers-api/make.py`,
//! and a loopback HTTP server serves exactly those, 404 for anything else, noting every path it
//! was asked.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Response, StatusCode, Uri, header};
use pluglet_oci::layout::sha256_digest;
use pluglet_oci::{OciRef, Outcome, Registry, RegistryOptions};

/// One recorded answer.
#[derive(serde::Deserialize)]
struct Answer {
    path: String,
    status: u16,
    content_type: String,
    body: String,
}

#[derive(serde::Deserialize)]
struct Answers {
    repository: String,
    manifest_digest: String,
    answers: Vec<Answer>,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/referrers-api")
}

fn body(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("bodies").join(name)).unwrap()
}

/// A replay of the recorded answers on a loopback port; `replace` swaps the body of the answer
/// at a path for another recorded body.
struct Replay {
    host: String,
    asked: Arc<Mutex<Vec<String>>>,
    answers: Answers,
}

impl Replay {
    async fn start(replace: Option<(&str, &str)>) -> Replay {
        let answers: Answers =
            serde_json::from_slice(&std::fs::read(fixtures().join("answers.json")).unwrap())
                .unwrap();
        let mut served: BTreeMap<String, (u16, String, Vec<u8>)> = answers
            .answers
            .iter()
            .map(|a| {
                (
                    a.path.clone(),
                    (a.status, a.content_type.clone(), body(&a.body)),
                )
            })
            .collect();
        if let Some((path, name)) = replace {
            let entry = served.get_mut(path).expect("a recorded path");
            entry.2 = body(name);
        }
        let served = Arc::new(served);
        let asked = Arc::new(Mutex::new(Vec::new()));
        let noted = asked.clone();
        let app = axum::Router::new().fallback(move |uri: Uri| {
            let served = served.clone();
            let noted = noted.clone();
            async move {
                let path = uri.path().to_owned();
                noted.lock().unwrap().push(path.clone());
                let Some((status, content_type, bytes)) = served.get(&path) else {
                    return Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Body::from(
                            r#"{"errors":[{"code":"NAME_UNKNOWN","message":"not recorded"}]}"#,
                        ))
                        .unwrap();
                };
                Response::builder()
                    .status(*status)
                    .header(header::CONTENT_TYPE, content_type)
                    .header("Docker-Content-Digest", sha256_digest(bytes))
                    .body(Body::from(bytes.clone()))
                    .unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Replay {
            host,
            asked,
            answers,
        }
    }

    fn client(&self) -> Registry {
        Registry::new(RegistryOptions {
            insecure: vec![self.host.clone()],
            ..RegistryOptions::default()
        })
    }

    fn reference(&self, tag_or_digest: &str) -> OciRef {
        let sep = if tag_or_digest.starts_with("sha256:") {
            "@"
        } else {
            ":"
        };
        OciRef::parse(&format!(
            "oci://{}/{}{sep}{tag_or_digest}",
            self.host, self.answers.repository
        ))
        .unwrap()
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn signature_and_vectors_come_from_the_referrers_api() {
    let replay = Replay::start(None).await;
    let pulled = replay.client().pull(&replay.reference("v1")).await.unwrap();
    assert_eq!(pulled.digest, replay.answers.manifest_digest);
    assert_eq!(pulled.module, body("module.wasm"));
    assert_eq!(
        pulled.signatures,
        vec![String::from_utf8(body("module.wasm.minisig")).unwrap()]
    );
    assert_eq!(pulled.vectors, Some(body("module.vectors.json")));

    let asked = replay.asked();
    let referrers = format!(
        "/v2/{}/referrers/{}",
        replay.answers.repository, replay.answers.manifest_digest
    );
    assert!(asked.contains(&referrers), "{asked:#?}");
    // The API answered: the tag schema was not asked, nor the SBOM (another artifact type).
    let tag = replay.answers.manifest_digest.replace(':', "-");
    assert!(!asked.iter().any(|p| p.ends_with(&tag)), "{asked:#?}");
    let sbom = sha256_digest(&body("sbom-manifest.json"));
    assert!(!asked.iter().any(|p| p.ends_with(&sbom)), "{asked:#?}");

    // By digest, the same answer.
    let again = replay
        .client()
        .pull(&replay.reference(&replay.answers.manifest_digest))
        .await
        .unwrap();
    assert_eq!(again.module, pulled.module);
    assert_eq!(again.signatures, pulled.signatures);
}

#[tokio::test]
async fn a_listed_referrer_of_another_subject_is_refused() {
    let answers: Answers =
        serde_json::from_slice(&std::fs::read(fixtures().join("answers.json")).unwrap()).unwrap();
    let path = format!(
        "/v2/{}/referrers/{}",
        answers.repository, answers.manifest_digest
    );
    let replay = Replay::start(Some((&path, "referrers-stray.json"))).await;
    let e = replay
        .client()
        .pull(&replay.reference("v1"))
        .await
        .unwrap_err();
    assert_eq!(e.outcome(), Outcome::BadReferrer, "{e}");
    assert!(
        e.to_string()
            .contains("its subject is not this module's manifest"),
        "{e}"
    );
}
