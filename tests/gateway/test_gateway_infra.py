"""The gateway's deployment files say what the gateway does: its image installs no torch and runs
as non-root; its Kubernetes Deployment, Service and HPA fit together; every option they pass is a
`qworker gateway` option; probes hit the routes it serves; secrets come from the Secret, never
argv. (The Kubernetes schema check of every manifest, this one included, is tests/unit/test_infra.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from qworker.gateway.auth import OPEN_PATHS

pytestmark = pytest.mark.timeout(60)

INFRA = Path(__file__).resolve().parents[2] / "infra"
MANIFEST = INFRA / "k8s" / "gateway-deployment.yaml"
DOCKERFILE = INFRA / "Dockerfile.gateway"


def _objects() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


def _gateway_options() -> set[str]:
    import typer.main

    from qworker.cli import app

    params = typer.main.get_command(app).commands["gateway"].params
    return {opt for param in params for opt in (*param.opts, *param.secondary_opts)}


def _check_args(args: list[str], where: str) -> None:
    assert args[0] == "gateway", f"{where}: must run `qworker gateway`"
    used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    unknown = used - _gateway_options()
    assert not unknown, f"{where} uses options `qworker gateway` does not have: {sorted(unknown)}"
    assert not any("://" in a for a in args), f"{where}: a URL on the command line"


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_dockerfile_installs_the_gateway_extra_without_torch_as_non_root():
    text = DOCKERFILE.read_text()
    assert re.search(r'pip install "\.\[gateway,aws\]"', text)
    # No torch is installed, and the build fails should a dependency bring one in.
    assert "TORCH_INDEX_URL" not in text and ".[engine" not in text
    assert "find_spec('torch') is None" in text
    assert not re.search(r"https?://(?!127\.0\.0\.1)", text)
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.MULTILINE)[-1])
    assert entrypoint[-1] == "qworker"
    cmd = json.loads(re.findall(r"^CMD\s+(\[.*\])\s*$", text, flags=re.MULTILINE)[-1])
    _check_args(cmd, "Dockerfile.gateway CMD")
    assert f":{_option(cmd, '--port')}/healthz" in text


def test_deployment_service_and_hpa_fit_together():
    objects = _objects()
    assert set(objects) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    deployment, service, hpa = objects["Deployment"], objects["Service"], objects["HorizontalPodAutoscaler"]
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    args = [str(a) for a in container["args"]]
    _check_args(args, "gateway Deployment args")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(_option(args, "--port"))}
    # Probes: the open routes (no key needed), on the served port.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"/healthz", "/readyz"} <= OPEN_PATHS
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert int(template["metadata"]["annotations"]["prometheus.io/port"]) == ports["http"]
    # The Service selects these pods and targets the named port; the HPA scales this Deployment on CPU.
    labels = template["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert container["resources"]["requests"]["cpu"], "an HPA on CPU utilisation needs a CPU request"


def test_secrets_come_from_the_secret_as_env_and_a_file():
    (secret,) = [d for d in yaml.safe_load_all((INFRA / "k8s" / "secret.example.yaml").read_text()) if d]
    keys = set(secret["stringData"])
    deployment = _objects()["Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    ref = env["QWORKER_QUEUE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys
    (volume,) = spec["volumes"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert item["key"] in keys
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"]
    assert (
        _option([str(a) for a in container["args"]], "--api-key-file")
        == f"{mount['mountPath']}/{item['path']}"
    )


def test_compose_gateway_service():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    assert gateway["build"]["dockerfile"] == "infra/Dockerfile.gateway"
    _check_args([str(a) for a in gateway["command"]], "compose gateway command")
    assert "QWORKER_QUEUE_URL" in gateway["environment"]
