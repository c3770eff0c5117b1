//! The pipeline with the built-in handler modules and recording plugin kinds.

use std::sync::{Arc, Mutex};

use pluglet_core::events::{EventKind, EventLog};
use pluglet_core::{PluginKey, PluginType};
use pluglet_handler_runtime::{PluginInfo, RefusalKind, RegistrationFacts, Runtime, RuntimeConfig};
use pluglet_handlers::{Builtins, Handlers, Trust};
use pluglet_registration::{
    Candidate, Door, EndReason, Facts, KindError, Pipeline, PipelineEvent, PluginKind,
    Registration, Stage,
};
use tokio::sync::broadcast;

fn pipeline() -> Pipeline {
    let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
    Pipeline::new(Handlers::builtins_only(runtime).unwrap(), "node-1")
}

/// What a kind was asked to do, in order.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<String>>,
    fail_activation: Mutex<bool>,
    alongside: bool,
}

impl Recorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.log.lock().unwrap())
    }
}

#[async_trait::async_trait]
impl PluginKind for Recorder {
    async fn gather_facts(&self, candidate: &Candidate) -> Result<Facts, KindError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("facts {}", candidate.info.name));
        // Give another registration of the same name every chance to run meanwhile.
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        let hook = RegistrationFacts {
            node_id: Some("node-1".into()),
            ..Default::default()
        };
        Ok(Facts::with_detail(hook, candidate.info.endpoint.clone()))
    }

    fn facts_alongside_validate(&self) -> bool {
        self.alongside
    }

    async fn activate(&self, registration: &Arc<Registration>) -> Result<(), KindError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("activate {}", registration.id));
        if *self.fail_activation.lock().unwrap() {
            return Err("endpoint does not answer".into());
        }
        Ok(())
    }

    async fn deactivate(&self, registration: &Registration) {
        self.log
            .lock()
            .unwrap()
            .push(format!("deactivate {}", registration.id));
    }
}

fn csi(endpoint: &str) -> Candidate {
    Candidate {
        info: PluginInfo {
            plugin_type: "CSIPlugin".into(),
            name: "hostpath.csi.k8s.io".into(),
            endpoint: endpoint.into(),
            supported_versions: vec!["1.0.0".into()],
        },
        door: Door::KubeletSock,
        connection: None,
    }
}

fn device_plugin(endpoint: &str) -> Candidate {
    Candidate {
        info: PluginInfo {
            plugin_type: "DevicePlugin".into(),
            name: "vendor.com/gpu".into(),
            endpoint: endpoint.into(),
            supported_versions: vec!["v1beta1".into()],
        },
        door: Door::KubeletSock,
        connection: None,
    }
}

fn deregistrations(events: &mut broadcast::Receiver<PipelineEvent>) -> Vec<(u64, EndReason)> {
    let mut out = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let PipelineEvent::Deregistered { id, reason, .. } = event {
            out.push((id, reason));
        }
    }
    out
}

#[tokio::test]
async fn two_registrations_of_one_name_at_once_are_validated_one_after_the_other() {
    let pipeline = pipeline();
    let kind = Arc::new(Recorder::default());
    pipeline.set_kind(PluginType::Csi, kind.clone());
    // The built-in CSI handler accepts a second driver of one name only with a higher version:
    // the second of two identical registrations must see the first and be refused.
    let (a, b) = tokio::join!(
        pipeline.register(csi("/a.sock")),
        pipeline.register(csi("/b.sock"))
    );
    let (ok, refused) = match (a, b) {
        (Ok(ok), Err(err)) | (Err(err), Ok(ok)) => (ok, err),
        (a, b) => panic!("exactly one may pass: {a:?} / {b:?}"),
    };
    assert_eq!(refused.stage(), Stage::Validate, "{refused}");
    assert_eq!(
        refused.refusal().map(|r| r.kind),
        Some(RefusalKind::AlreadyRegistered),
        "{refused}"
    );
    assert_eq!(
        kind.take(),
        [
            "facts hostpath.csi.k8s.io".to_string(),
            format!("activate {}", ok.id)
        ],
        "the refused one never reached the native steps"
    );
    assert_eq!(
        ok.facts.detail::<String>().map(String::as_str),
        Some("/a.sock")
    );
    let key = PluginKey::new(PluginType::Csi, "hostpath.csi.k8s.io");
    assert_eq!(pipeline.current(&key).await.map(|r| r.id), Some(ok.id));
}

#[tokio::test]
async fn facts_gathered_alongside_validate_never_override_its_refusal() {
    let pipeline = pipeline();
    let kind = Arc::new(Recorder {
        alongside: true,
        ..Default::default()
    });
    pipeline.set_kind(PluginType::Csi, kind.clone());
    let ok = pipeline.register(csi("/a.sock")).await.unwrap();
    assert_eq!(
        ok.facts.detail::<String>().map(String::as_str),
        Some("/a.sock")
    );
    // Same name and version again: the validate hook refuses, whatever the facts said.
    let refused = pipeline.register(csi("/b.sock")).await.unwrap_err();
    assert_eq!(refused.stage(), Stage::Validate, "{refused}");
    assert_eq!(
        kind.take(),
        [
            "facts hostpath.csi.k8s.io".to_string(),
            format!("activate {}", ok.id),
            "facts hostpath.csi.k8s.io".to_string(),
        ],
        "the refused one was asked for its facts, and went no further"
    );
    let key = PluginKey::new(PluginType::Csi, "hostpath.csi.k8s.io");
    assert_eq!(pipeline.current(&key).await.map(|r| r.id), Some(ok.id));
}

#[tokio::test]
async fn registrations_refusals_and_deregistrations_are_in_the_event_log() {
    let log = EventLog::default();
    let pipeline = pipeline().with_events(log.clone());
    pipeline.set_kind(PluginType::Csi, Arc::new(Recorder::default()));
    let ok = pipeline.register(csi("/a.sock")).await.unwrap();
    pipeline.register(csi("/b.sock")).await.unwrap_err();
    pipeline.deregister(&ok, EndReason::SocketGone).await;
    let events = log.recent();
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::Registered,
            EventKind::Refused,
            EventKind::Deregistered
        ]
    );
    assert!(
        events
            .iter()
            .all(|e| e.subject == "CSIPlugin hostpath.csi.k8s.io"),
        "{events:?}"
    );
    assert!(
        events[0]
            .message
            .starts_with("registered through kubelet.sock by builtin:csi"),
        "{events:?}"
    );
    assert!(events[1].message.contains("at validate"), "{events:?}");
    assert_eq!(events[2].message, "deregistered: socket gone");
}

#[tokio::test]
async fn a_registration_ends_once_however_often_it_is_deregistered() {
    let pipeline = pipeline();
    let kind = Arc::new(Recorder::default());
    pipeline.set_kind(PluginType::DevicePlugin, kind.clone());
    let mut events = pipeline.subscribe();
    let registration = pipeline.register(device_plugin("gpu.sock")).await.unwrap();
    pipeline
        .deregister(&registration, EndReason::GracePeriodOver)
        .await;
    pipeline
        .deregister(&registration, EndReason::SocketGone)
        .await;
    assert!(registration.has_ended());
    assert_eq!(
        deregistrations(&mut events),
        [(registration.id, EndReason::GracePeriodOver)]
    );
    let id = registration.id;
    assert_eq!(kind.take()[2..], [format!("deactivate {id}")]);
    let key = PluginKey::new(PluginType::DevicePlugin, "vendor.com/gpu");
    assert!(pipeline.current(&key).await.is_none());
}

#[tokio::test]
async fn a_newer_registration_replaces_and_ends_the_older_one() {
    let pipeline = pipeline();
    let kind = Arc::new(Recorder::default());
    pipeline.set_kind(PluginType::DevicePlugin, kind.clone());
    let mut events = pipeline.subscribe();
    let first = pipeline
        .register(device_plugin("gpu-1.sock"))
        .await
        .unwrap();
    let second = pipeline
        .register(device_plugin("gpu-2.sock"))
        .await
        .unwrap();
    assert!(first.has_ended() && !second.has_ended());
    let deregistered: Vec<PipelineEvent> = {
        let mut out = Vec::new();
        while let Ok(event) = events.try_recv() {
            if matches!(event, PipelineEvent::Deregistered { .. }) {
                out.push(event);
            }
        }
        out
    };
    let [
        PipelineEvent::Deregistered {
            id,
            reason,
            logs,
            hook_error,
            ..
        },
    ] = &deregistered[..]
    else {
        panic!("one deregistration expected: {deregistered:?}");
    };
    assert_eq!((*id, *reason), (first.id, EndReason::Replaced));
    assert_eq!(hook_error, &None);
    assert!(
        logs.iter()
            .any(|l| l.message == "device plugin vendor.com/gpu deregistered"),
        "the built-in handler's deregister hook ran: {logs:?}"
    );
    // The socket of the first going away later changes nothing.
    pipeline.deregister(&first, EndReason::SocketGone).await;
    assert!(deregistrations(&mut events).is_empty());
    let key = PluginKey::new(PluginType::DevicePlugin, "vendor.com/gpu");
    assert_eq!(pipeline.current(&key).await.map(|r| r.id), Some(second.id));
    assert_eq!(
        kind.take()
            .into_iter()
            .filter(|s| s.starts_with("deactivate"))
            .collect::<Vec<_>>(),
        [format!("deactivate {}", first.id)]
    );
}

#[tokio::test]
async fn a_failed_activation_undoes_the_register_hook_and_keeps_the_registration_in_force() {
    let pipeline = pipeline();
    let kind = Arc::new(Recorder::default());
    pipeline.set_kind(PluginType::DevicePlugin, kind.clone());
    let mut events = pipeline.subscribe();
    let first = pipeline
        .register(device_plugin("gpu-1.sock"))
        .await
        .unwrap();
    *kind.fail_activation.lock().unwrap() = true;
    let err = pipeline
        .register(device_plugin("gpu-2.sock"))
        .await
        .unwrap_err();
    assert_eq!(err.stage(), Stage::Activate);
    assert!(
        pluglet_core::error_chain(&err).contains("endpoint does not answer"),
        "{}",
        pluglet_core::error_chain(&err)
    );
    let ended = deregistrations(&mut events);
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert_eq!(ended[0].1, EndReason::ActivationFailed);
    assert_ne!(ended[0].0, first.id);
    assert!(!first.has_ended());
    let key = PluginKey::new(PluginType::DevicePlugin, "vendor.com/gpu");
    assert_eq!(pipeline.current(&key).await.map(|r| r.id), Some(first.id));
}

#[tokio::test]
async fn an_unknown_type_has_no_handler() {
    let pipeline = pipeline();
    let mut candidate = csi("/x.sock");
    candidate.info.plugin_type = "DRAPlugin".into();
    let err = pipeline.register(candidate).await.unwrap_err();
    assert_eq!(err.stage(), Stage::Handler);
    assert!(
        err.to_string()
            .contains("no handler registered for plugin type DRAPlugin")
    );
}

/// A kind that changes the handler set while the registration gathers its facts.
struct SwapDuringFacts {
    handlers: pluglet_handlers::Handlers,
    dir: std::path::PathBuf,
}

#[async_trait::async_trait]
impl PluginKind for SwapDuringFacts {
    async fn gather_facts(&self, _: &Candidate) -> Result<Facts, KindError> {
        std::fs::write(
            self.dir.join("handlers.toml"),
            "[plugin_types.FooPlugin]\nmodule = \"foo.wasm\"\nsettings = { version = \"2\" }\n",
        )
        .unwrap();
        let outcome = self.handlers.reload();
        assert!(
            matches!(outcome, pluglet_handlers::ReloadOutcome::Applied(_)),
            "{outcome:?}"
        );
        Ok(Facts::default())
    }

    async fn activate(&self, _: &Arc<Registration>) -> Result<(), KindError> {
        Ok(())
    }

    async fn deactivate(&self, _: &Registration) {}
}

#[tokio::test]
async fn one_registration_is_decided_by_the_handler_version_it_started_with() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        pluglet_wasm_guests::guest_path("misbehave"),
        dir.path().join("foo.wasm"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("handlers.toml"),
        "[plugin_types.FooPlugin]\nmodule = \"foo.wasm\"\nsettings = { version = \"1\" }\n",
    )
    .unwrap();
    let runtime = Runtime::new(RuntimeConfig::default()).unwrap();
    let builtins = Builtins::embedded(&runtime).unwrap();
    let handlers = Handlers::load(runtime, dir.path(), None, builtins, Trust::default()).unwrap();
    let pipeline = Pipeline::new(handlers.clone(), "node-1");
    let foo = PluginType::parse("FooPlugin");
    pipeline.set_kind(
        foo,
        Arc::new(SwapDuringFacts {
            handlers: handlers.clone(),
            dir: dir.path().to_path_buf(),
        }),
    );
    let first = handlers.for_plugin_type("FooPlugin").unwrap();
    let registration = pipeline
        .register(Candidate {
            info: PluginInfo {
                plugin_type: "FooPlugin".into(),
                name: "foo.example.com".into(),
                endpoint: "/foo.sock".into(),
                supported_versions: vec![],
            },
            door: Door::KubeletSock,
            connection: None,
        })
        .await
        .unwrap();
    // validate and register ran on version 1, although version 2 was in force before register.
    assert_eq!(registration.version.as_deref(), Some("1"));
    assert!(Arc::ptr_eq(&registration.handler, &first));
    assert_eq!(first.stats().snapshot().calls, 2);
    let second = handlers.for_plugin_type("FooPlugin").unwrap();
    assert_eq!(second.entry().unwrap().settings["version"], "2");
    assert_eq!(second.stats().snapshot().calls, 0);
    // The next registration uses the new version.
    pipeline
        .deregister(&registration, EndReason::SocketGone)
        .await;
}
