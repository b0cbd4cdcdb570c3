//! `deploy/kubernetes/`: every manifest validates against the Kubernetes schemas
//! (`kubernetes-validate` from PyPI, pinned, strict: an unknown field is an error) and the
//! ServiceMonitor against the Prometheus Operator's own CRD schema; each variant's ConfigMap
//! holds a config that `idemgate check-config` accepts in the environment its pod gets; and each
//! workload's numbers, ports and probes agree with that config, and a gateway run as its pod
//! runs it answers those probes (docs/operating.md#kubernetes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use testkit::PythonEnv;

use crate::common::{self, free_port, wait_until, RedisServer};

/// The release of kubernetes-validate the manifests are checked with.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
/// The Kubernetes versions whose schemas every manifest must pass: an older release still in
/// use and the newest that kubernetes-validate knows.
const VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];
const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");
const CRD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/deploy/servicemonitor-crd.yaml"
);
const DOCKERFILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile");
/// The variants, each a directory with its kustomization: the workload kind each holds.
const VARIANTS: [(&str, &str); 2] = [("deployment", "Deployment"), ("statefulset", "StatefulSet")];
/// After the drain the admin listener gives its own open requests at most this long
/// (docs/failure-semantics.md#graceful-shutdown), so the kubelet's grace must cover it too.
const ADMIN_DRAIN: Duration = Duration::from_secs(5);
/// How long `/readyz` waits for the store's PING before it answers 503 (docs/operating.md).
const READYZ_PING: Duration = Duration::from_secs(2);

/// The tests' venv with kubernetes-validate (and so PyYAML and jsonschema), made once.
fn python() -> &'static PythonEnv {
    static ENV: OnceLock<PythonEnv> = OnceLock::new();
    ENV.get_or_init(|| {
        PythonEnv::with_packages(
            env!("CARGO_TARGET_TMPDIR").as_ref(),
            "kubernetes-validate",
            &[KUBERNETES_VALIDATE],
        )
    })
}

/// Every manifest under deploy/kubernetes (kustomization files aside), sorted.
fn manifests() -> Vec<PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "yaml")
                && path.file_name().is_some_and(|n| n != "kustomization.yaml")
            {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    walk(Path::new(DIR), &mut found);
    found.sort();
    found
}

/// Every document of the YAML files `paths`, read by PyYAML, as JSON.
fn documents(paths: &[PathBuf]) -> Vec<Value> {
    const SCRIPT: &str = "import json, sys, yaml\n\
        print(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))";
    let args: Vec<&str> = paths.iter().map(|p| p.to_str().unwrap()).collect();
    let out = succeeded(python().run(SCRIPT, &args), "reading the YAML");
    serde_json::from_str(&out).unwrap()
}

/// What a variant deploys: its kustomization's resources, read.
struct Variant {
    name: &'static str,
    docs: Vec<Value>,
}

impl Variant {
    /// The variant in deploy/kubernetes/`name`, following its kustomization's resources (a
    /// directory is a kustomization of its own), with the Secret.
    fn read(name: &'static str) -> Self {
        fn files(dir: &Path, found: &mut Vec<PathBuf>) {
            let kustomization = documents(&[dir.join("kustomization.yaml")]);
            for resource in kustomization[0]["resources"].as_array().unwrap() {
                let path = dir.join(resource.as_str().unwrap());
                assert!(path.exists(), "{} names {path:?}", dir.display());
                if path.is_dir() {
                    files(&path, found);
                } else {
                    found.push(path);
                }
            }
        }
        // The Secret is applied apart (so that no kustomization overwrites the real one).
        let mut paths = vec![Path::new(DIR).join("secret.yaml")];
        files(&Path::new(DIR).join(name), &mut paths);
        Variant {
            name,
            docs: documents(&paths),
        }
    }

    /// Its one resource of `kind`.
    fn one(&self, kind: &str) -> &Value {
        let mut found = self.docs.iter().filter(|d| d["kind"] == kind);
        let one = found
            .next()
            .unwrap_or_else(|| panic!("{}: no {kind}", self.name));
        assert!(found.next().is_none(), "{}: two of {kind}", self.name);
        one
    }

    fn all<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Value> {
        self.docs.iter().filter(move |d| d["kind"] == kind)
    }

    /// Its workload's pod template.
    fn pod(&self, kind: &str) -> &Value {
        &self.one(kind)["spec"]["template"]
    }

    /// The gateway's container in its pod.
    fn container(&self, kind: &str) -> &Value {
        let containers = self.pod(kind)["spec"]["containers"].as_array().unwrap();
        assert_eq!(containers.len(), 1, "{}", self.name);
        &containers[0]
    }

    /// The config file the container runs with: the ConfigMap's key its `--config` names,
    /// through the volume mounted there.
    fn config_text(&self, kind: &str) -> String {
        let container = self.container(kind);
        let args: Vec<&str> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let at = args.iter().position(|a| *a == "--config").unwrap();
        let path = Path::new(args[at + 1]);
        let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap());
        let mount = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == dir.to_str().unwrap())
            .unwrap_or_else(|| panic!("{}: nothing mounted at {dir:?}", self.name));
        let volume = self.pod(kind)["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let name = &volume["configMap"]["name"];
        let map = self
            .all("ConfigMap")
            .find(|m| m["metadata"]["name"] == *name)
            .unwrap_or_else(|| panic!("{}: no ConfigMap {name}", self.name));
        map["data"][file.to_str().unwrap()]
            .as_str()
            .unwrap_or_else(|| panic!("{}: the ConfigMap has no {file:?}", self.name))
            .to_string()
    }

    /// The environment of the gateway's process in its pod: the image's `ENV`, the
    /// container's `env`, then the Secret's variables (`secrets` gives each its value).
    fn environment(
        &self,
        kind: &str,
        secrets: impl Fn(&str, &str) -> String,
    ) -> BTreeMap<String, String> {
        let mut env = image_env();
        let container = self.container(kind);
        for var in container["env"].as_array().into_iter().flatten() {
            let value = var["value"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: env {} is not a literal", self.name, var["name"]));
            env.insert(var["name"].as_str().unwrap().into(), value.into());
        }
        let from = container["envFrom"].as_array().unwrap();
        assert_eq!(from.len(), 1, "{}", self.name);
        let secret_name = &from[0]["secretRef"]["name"];
        let secret = self
            .all("Secret")
            .find(|s| s["metadata"]["name"] == *secret_name)
            .unwrap_or_else(|| panic!("{}: no Secret {secret_name}", self.name));
        for (name, value) in secret["stringData"].as_object().unwrap() {
            env.insert(name.clone(), secrets(name, value.as_str().unwrap()));
        }
        env
    }
}

/// The `ENV` the Dockerfile's runtime stage sets.
fn image_env() -> BTreeMap<String, String> {
    let dockerfile = std::fs::read_to_string(DOCKERFILE).unwrap();
    let at = dockerfile.find("\nENV ").expect("the Dockerfile sets ENV");
    let mut env = BTreeMap::new();
    for line in dockerfile[at + 5..].lines() {
        for pair in line.split_whitespace().filter(|w| *w != "\\") {
            let (k, v) = pair.split_once('=').unwrap();
            env.insert(k.to_string(), v.to_string());
        }
        if !line.trim_end().ends_with('\\') {
            break;
        }
    }
    assert!(env.contains_key("IDEMGATE_LISTEN"), "{env:?}");
    env
}

/// Test values for the Secret's variables: a fresh sealing key and a long admin token.
fn test_secret(name: &str, _placeholder: &str) -> String {
    match name {
        // 32 bytes, base64.
        "IDEMGATE_SEAL_KEYS" => "k1:QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVoxMjM0NTY=".into(),
        "IDEMGATE_ADMIN_TOKEN" => "a-test-token-of-32-characters-ok".into(),
        other => panic!("a Secret variable the tests have no value for: {other}"),
    }
}

/// `idemgate check-config FILE` with exactly `env`, as a pod runs it.
fn check_config(config: &str, env: &BTreeMap<String, String>) -> Output {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config).unwrap();
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .env_clear()
        .envs(env)
        .env("RUST_LOG", "off")
        .arg("check-config")
        .arg(file.path())
        .output()
        .unwrap()
}

/// Standard output of `out`, or a panic with its output.
fn succeeded(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_manifest_passes_kubernetes_validate_strictly() {
    let files = manifests();
    let docs = documents(&files);
    assert!(docs.len() >= 9, "{docs:?}");
    let mut args = vec!["--strict".to_string()];
    for version in VERSIONS {
        args.extend(["-k".into(), version.into()]);
    }
    args.extend(files.iter().map(|f| f.display().to_string()));
    args.push(CRD.into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    const CLI: &str = "import sys\nfrom kubernetes_validate.__main__ import main\n\
        sys.argv[0] = 'kubernetes-validate'\nsys.exit(main())";
    let out = succeeded(python().run(CLI, &args), "kubernetes-validate");
    // It passes a kind it has no schema for with a warning: only the ServiceMonitor may be
    // one (it is checked against its CRD below), and every other resource passed each version.
    for line in out.lines().filter(|l| l.starts_with("WARN")) {
        assert!(
            line.contains("servicemonitor.yaml") && line.contains("kind ServiceMonitor"),
            "{line}"
        );
    }
    for doc in docs.iter().filter(|d| d["kind"] != "ServiceMonitor") {
        let resource = format!(
            "for resource {}/{}",
            doc["kind"].as_str().unwrap().to_lowercase(),
            doc["metadata"]["name"].as_str().unwrap()
        );
        for version in VERSIONS {
            let minor = &version[..version.len() - 2];
            assert!(
                out.lines().any(|l| l.starts_with("INFO")
                    && l.contains(&resource)
                    && l.ends_with(&format!("against version {minor}"))),
                "{resource} against {version}:\n{out}"
            );
        }
    }

    // And it refuses what it should: a field no Deployment has.
    let deployment = std::fs::read_to_string(Path::new(DIR).join("deployment/deployment.yaml"))
        .unwrap()
        .replace(
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesystem: true\n            readOnlyRootFileSystem: true",
        );
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), deployment).unwrap();
    let out = python().run(CLI, &["--strict", bad.path().to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("'readOnlyRootFileSystem' was unexpected"),
        "{out:?}"
    );
}

#[test]
fn the_service_monitor_passes_its_crd_schema_strictly() {
    // The CRD's openAPIV3Schema, with every object that lists its properties closed to others
    // (as the API server's strict field validation is), checked by jsonschema; then the same
    // with a misspelt field, which must fail.
    const SCRIPT: &str = r#"
import copy, sys, yaml, jsonschema
crd = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d)
version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
schema = version["schema"]["openAPIV3Schema"]
def closed(s):
    if isinstance(s, dict):
        if "properties" in s and "additionalProperties" not in s \
                and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
        for v in s.values():
            closed(v)
    elif isinstance(s, list):
        for v in s:
            closed(v)
closed(schema)
monitors = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d]
assert monitors and all(m["kind"] == crd["spec"]["names"]["kind"] for m in monitors)
for m in monitors:
    assert m["apiVersion"] == crd["spec"]["group"] + "/v1", m["apiVersion"]
    jsonschema.validate(m, schema)
    print("passed", m["metadata"]["name"])
    bad = copy.deepcopy(m)
    bad["spec"]["endpoints"][0]["scrape_interval"] = "15s"
    try:
        jsonschema.validate(bad, schema)
        sys.exit("a misspelt field passed")
    except jsonschema.ValidationError:
        pass
"#;
    let monitor = Path::new(DIR).join("servicemonitor.yaml");
    let out = succeeded(
        python().run(SCRIPT, &[CRD, monitor.to_str().unwrap()]),
        "the ServiceMonitor against its CRD",
    );
    assert_eq!(out.trim(), "passed idemgate");
}

#[test]
fn every_manifest_is_in_a_kustomization_but_the_secret_and_the_service_monitor() {
    let mut listed: Vec<PathBuf> = Vec::new();
    for dir in ["common", "deployment", "statefulset"] {
        let dir = Path::new(DIR).join(dir);
        let kustomization = documents(&[dir.join("kustomization.yaml")]);
        for resource in kustomization[0]["resources"].as_array().unwrap() {
            let path = dir.join(resource.as_str().unwrap());
            if path.is_file() {
                listed.push(path.canonicalize().unwrap());
            }
        }
    }
    for file in manifests() {
        let file = file.canonicalize().unwrap();
        let alone = ["servicemonitor.yaml", "secret.yaml"]
            .iter()
            .any(|f| file == Path::new(DIR).join(f).canonicalize().unwrap());
        assert!(
            alone || listed.contains(&file),
            "{file:?} is in no kustomization"
        );
    }
}

#[test]
fn each_configmap_passes_check_config_in_its_pods_environment() {
    for (name, kind) in VARIANTS {
        let variant = Variant::read(name);
        let config = variant.config_text(kind);
        let env = variant.environment(kind, test_secret);
        let shown = succeeded(check_config(&config, &env), name);
        let backend = if name == "statefulset" {
            "\nbackend = \"embedded\""
        } else {
            "\nbackend = \"redis\""
        };
        assert!(shown.contains(backend), "{name}: {shown}");
        for secret in ["IDEMGATE_SEAL_KEYS", "IDEMGATE_ADMIN_TOKEN"] {
            let value = test_secret(secret, "");
            let value = value.trim_start_matches("k1:");
            assert!(!shown.contains(value), "{name}: {secret} shown");
        }

        // The Secret as shipped holds placeholders the gateway refuses, each naming its
        // variable, so that nobody runs with a published key.
        let shipped = variant.environment(kind, |_, placeholder| placeholder.into());
        let out = check_config(&config, &shipped);
        assert!(!out.status.success(), "{name}: the placeholders pass");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("IDEMGATE_SEAL_KEYS"),
            "{out:?}"
        );
        let mut keys_only = shipped.clone();
        keys_only.insert(
            "IDEMGATE_SEAL_KEYS".into(),
            test_secret("IDEMGATE_SEAL_KEYS", ""),
        );
        let out = check_config(&config, &keys_only);
        assert!(
            !out.status.success(),
            "{name}: the placeholder token passes"
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("admin.admin_token"),
            "{out:?}"
        );

        // Kubernetes' service links (IDEMGATE_SERVICE_HOST, ...) would be settings the gateway
        // refuses: the pods turn them off.
        let mut linked = env.clone();
        linked.insert("IDEMGATE_SERVICE_HOST".into(), "10.0.0.1".into());
        assert!(!check_config(&config, &linked).status.success());
        assert_eq!(
            variant.pod(kind)["spec"]["enableServiceLinks"],
            false,
            "{name}"
        );
    }
}

/// A setting of the pod's effective config: its `IDEMGATE_...` variable if the environment
/// has one, else the file's value.
fn effective(
    config: &toml::Table,
    env: &BTreeMap<String, String>,
    path: &[&str],
) -> Option<String> {
    let var = format!("IDEMGATE_{}", path.join("__").to_uppercase());
    if let Some(value) = env.get(&var) {
        return Some(value.clone());
    }
    let mut at = config.get(path[0])?;
    for part in &path[1..] {
        at = at.get(part)?;
    }
    Some(match at {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

/// The port of `addr` ("0.0.0.0:8080"), which must listen on every interface of the pod.
fn port_of(addr: &str) -> u64 {
    let (host, port) = addr.rsplit_once(':').unwrap();
    assert_eq!(
        host, "0.0.0.0",
        "{addr}: the pod's other interfaces would not reach it"
    );
    port.parse().unwrap()
}

/// The container port named `name` (a probe or a Service names ports by name).
fn named_port(container: &Value, name: &Value) -> u64 {
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == *name)
        .unwrap_or_else(|| panic!("no container port {name}"))["containerPort"]
        .as_u64()
        .unwrap()
}

#[test]
fn each_workload_agrees_with_its_config() {
    let dockerfile = std::fs::read_to_string(DOCKERFILE).unwrap();
    for (name, kind) in VARIANTS {
        let variant = Variant::read(name);
        let config: toml::Table = toml::from_str(&variant.config_text(kind)).unwrap();
        let env = variant.environment(kind, test_secret);
        let workload = variant.one(kind);
        let pod = &variant.pod(kind)["spec"];
        let container = variant.container(kind);

        // Shutdown: the kubelet kills the pod terminationGracePeriodSeconds after it starts
        // stopping it, preStop included; the gateway needs shutdown_grace after SIGTERM, plus
        // the admin listener's last requests. The config names its grace: no default relied on.
        assert!(
            config.contains_key("shutdown_grace"),
            "{name}: name shutdown_grace"
        );
        let grace =
            humantime::parse_duration(&effective(&config, &env, &["shutdown_grace"]).unwrap())
                .unwrap();
        let command = container["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .unwrap();
        assert_eq!(command[0], "/bin/sleep", "{name}");
        let pre_stop = Duration::from_secs(command[1].as_str().unwrap().parse().unwrap());
        assert!(pre_stop >= Duration::from_secs(5), "{name}: {pre_stop:?}");
        let kill = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
        assert!(
            kill > pre_stop + grace + ADMIN_DRAIN,
            "{name}: terminationGracePeriodSeconds {kill:?} <= preStop {pre_stop:?} + \
             shutdown_grace {grace:?} + {ADMIN_DRAIN:?}"
        );

        // Ports: the container's are the ones the gateway listens on.
        let http = port_of(&effective(&config, &env, &["listen"]).unwrap());
        let admin = port_of(&effective(&config, &env, &["admin", "listen"]).unwrap());
        assert_eq!(named_port(container, &"http".into()), http, "{name}");
        assert_eq!(named_port(container, &"admin".into()), admin, "{name}");

        // Probes: liveness on /healthz, readiness on /readyz, both on the admin port; the
        // readiness timeout leaves /readyz its store PING.
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            let get = &container[probe]["httpGet"];
            assert_eq!(get["path"], path, "{name} {probe}");
            assert_eq!(named_port(container, &get["port"]), admin, "{name} {probe}");
        }
        let timeout = container["readinessProbe"]["timeoutSeconds"]
            .as_u64()
            .unwrap();
        assert!(Duration::from_secs(timeout) > READYZ_PING, "{name}");

        // Locked down: the image's non-root user, nothing to escalate to, nothing written
        // outside the volumes.
        let user = pod["securityContext"]["runAsUser"].as_u64().unwrap();
        assert!(dockerfile.contains(&format!("\nUSER {user}\n")), "{name}");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        let security = &container["securityContext"];
        assert_eq!(security["readOnlyRootFilesystem"], true, "{name}");
        assert_eq!(security["allowPrivilegeEscalation"], false, "{name}");
        assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
        assert!(security["capabilities"]["add"].is_null(), "{name}");

        // Resources: a worker per CPU requested; memory requested and bounded.
        let resources = &container["resources"];
        let cpus: u64 = resources["requests"]["cpu"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let workers = effective(&config, &env, &["workers"]).unwrap();
        assert_eq!(workers, cpus.to_string(), "{name}: workers and CPUs");
        assert!(resources["requests"]["memory"].is_string(), "{name}");
        assert!(resources["limits"]["memory"].is_string(), "{name}");

        // The Services and the budget select these pods, and name ports the container has.
        let labels = &variant.pod(kind)["metadata"]["labels"];
        let selects = |selector: &Value| {
            selector
                .as_object()
                .unwrap()
                .iter()
                .all(|(k, v)| labels[k] == *v)
        };
        assert!(selects(&workload["spec"]["selector"]["matchLabels"]));
        for service in variant.all("Service") {
            assert!(selects(&service["spec"]["selector"]), "{service}");
            for port in service["spec"]["ports"].as_array().unwrap() {
                named_port(container, &port["targetPort"]);
            }
        }
        for budget in variant.all("PodDisruptionBudget") {
            assert!(selects(&budget["spec"]["selector"]["matchLabels"]));
        }

        // The store: a shared one for several replicas, the embedded one on the claimed volume
        // for the single replica.
        let backend = effective(&config, &env, &["store", "backend"]).unwrap();
        let replicas = workload["spec"]["replicas"].as_u64().unwrap();
        if kind == "StatefulSet" {
            assert_eq!(backend, "embedded");
            assert_eq!(replicas, 1, "one process per embedded store");
            let path = effective(&config, &env, &["store", "path"]).unwrap();
            let claim = &workload["spec"]["volumeClaimTemplates"][0]["metadata"]["name"];
            assert!(
                container["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["name"] == *claim && m["mountPath"] == path.as_str()),
                "the embedded store's {path} is the claimed volume"
            );
            assert_eq!(pod["securityContext"]["fsGroup"].as_u64(), Some(user));
            let governing = &workload["spec"]["serviceName"];
            assert!(variant
                .all("Service")
                .any(|s| s["metadata"]["name"] == *governing));
        } else {
            assert!(
                ["redis", "redis-cluster", "redis-sentinel", "postgres"]
                    .contains(&backend.as_str()),
                "{name}: {backend} is not shared by replicas"
            );
            assert!(replicas > 1, "{name}");
            assert_eq!(variant.all("PodDisruptionBudget").count(), 1);
        }
    }

    // The ServiceMonitor scrapes /metrics on a port of the admin Service, and only that one.
    let common = documents(&[Path::new(DIR).join("common/service.yaml")]);
    let monitor = &documents(&[Path::new(DIR).join("servicemonitor.yaml")])[0];
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    let scraped: Vec<&Value> = common
        .iter()
        .filter(|s| {
            selector
                .iter()
                .all(|(k, v)| s["metadata"]["labels"][k] == *v)
        })
        .collect();
    assert_eq!(scraped.len(), 1, "{scraped:?}");
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    assert!(scraped[0]["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == endpoint["port"] && p["targetPort"] == "admin"));
}

/// The gateway binary as a pod runs it, killed on drop.
struct Pod(std::process::Child);

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether `GET url` answers 200.
async fn answers_200(url: &str) -> bool {
    matches!(common::client().get(url).send().await, Ok(r) if r.status() == 200)
}

/// Each variant's gateway, run from its container's arguments, its ConfigMap's config and its
/// pod's environment (the listeners moved to free loopback ports, the store to a local Redis
/// or directory), answers its liveness and readiness probes with 200, and on SIGTERM exits 0
/// well within what the kubelet leaves it after the preStop sleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_configmap_runs_and_answers_its_probes() {
    let redis = RedisServer::start().await;
    for (name, kind) in VARIANTS {
        let variant = Variant::read(name);
        let container = variant.container(kind);
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(config.path(), variant.config_text(kind)).unwrap();
        let args: Vec<String> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let at = args.iter().position(|a| a == "--config").unwrap();
        let data = tempfile::tempdir().unwrap();
        let mut env = variant.environment(kind, test_secret);
        if name == "statefulset" {
            env.insert(
                "IDEMGATE_STORE__PATH".into(),
                data.path().display().to_string(),
            );
        } else {
            env.insert("IDEMGATE_STORE__URL".into(), redis.url());
        }

        let mut running = None;
        for _ in 0..3 {
            let admin = free_port();
            env.insert(
                "IDEMGATE_LISTEN".into(),
                format!("127.0.0.1:{}", free_port()),
            );
            env.insert(
                "IDEMGATE_ADMIN__LISTEN".into(),
                format!("127.0.0.1:{admin}"),
            );
            let mut args = args.clone();
            args[at + 1] = config.path().display().to_string();
            let mut pod = Pod(Command::new(env!("CARGO_BIN_EXE_idemgate"))
                .args(&args)
                .env_clear()
                .envs(&env)
                .env("RUST_LOG", "off")
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap());
            let probe = |probe: &str| {
                let path = container[probe]["httpGet"]["path"].as_str().unwrap();
                format!("http://127.0.0.1:{admin}{path}")
            };
            let (live, ready) = (probe("livenessProbe"), probe("readinessProbe"));
            let mut exited = false;
            wait_until(
                Duration::from_secs(10),
                "the gateway answers its readiness probe",
                async || {
                    exited = pod.0.try_wait().unwrap().is_some();
                    exited || answers_200(&ready).await
                },
            )
            .await;
            if !exited {
                assert!(answers_200(&live).await, "{name}: {live}");
                running = Some(pod);
                break;
            }
        }
        let mut pod = running.unwrap_or_else(|| panic!("{name}: no start on 3 pairs of ports"));

        let pod_spec = &variant.pod(kind)["spec"];
        let command = &container["lifecycle"]["preStop"]["exec"]["command"];
        let left = pod_spec["terminationGracePeriodSeconds"].as_u64().unwrap()
            - command[1].as_str().unwrap().parse::<u64>().unwrap();
        let pid = pod.0.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let mut status = None;
        wait_until(
            Duration::from_secs(left),
            "the gateway exits after SIGTERM",
            async || {
                status = pod.0.try_wait().unwrap();
                status.is_some()
            },
        )
        .await;
        assert!(status.unwrap().success(), "{name}: {status:?}");
    }
}
