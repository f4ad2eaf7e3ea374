"""deploy/kubernetes/ and `splitserve deploy kubernetes` (splitserve/deploy/kubernetes.py): every
overlay and renderings with values a user changes are valid Kubernetes objects (kubernetes-validate's
schemas, offline; LeaderWorkerSets by their pod templates, docs/kubernetes.md "Validation"), their
container command lines are ones `splitserve serve` and `splitserve router` accept (the real parsers,
so a renamed flag fails here), probes ask real routes on declared ports, Services select the pods
whose ports they name, and the router lists every instance the manifests make."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitserve.deploy import kubernetes, kustomize
from splitserve.deploy.kubernetes import Values

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["cpu", "gpu", "pd-cpu", "pd-gpu", "multinode-pd-gpu"]
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]  # LeaderWorkerSet needs 1.26 or later
# The values each overlay is rendered with by default (no change), then renderings with other values.
DEFAULTS = {
    "cpu": Values(),
    "gpu": Values(gpus=1),
    "pd-cpu": Values(pd="1p1d"),
    "pd-gpu": Values(pd="1p1d", gpus=1),
    "multinode-pd-gpu": Values(pd="1p1d", gpus=2, nodes=2),
}
CHANGED = {
    "cpu-tp2": Values(
        model="Qwen/Qwen3-0.6B",
        image="registry.example/splitserve:cpu",
        tensor_parallel_size=2,
        replicas=2,
        max_replicas=6,
        cpus="8",
        memory="32Gi",
        namespace="llm",
        serve_args=["--max-model-len=4096", "--metrics-prefix", "vllm"],
    ),
    "gpu-tp2": Values(
        model="meta-llama/Llama-3.1-8B-Instruct",
        image="registry.example/splitserve:gpu",
        gpus=2,
        replicas=3,
        model_pvc="models",
    ),
    "pd-cpu-1p2d": Values(pd="1p2d", model="Qwen/Qwen3-0.6B", replicas=2, router_args=["--policy=round_robin"]),
    "pd-gpu-2p3d-tp2": Values(
        pd="2p3d", gpus=2, image="registry.example/splitserve:gpu", serve_args=["--kv-lease-seconds", "30"]
    ),
    "multinode-2p1d-tp8pp2": Values(
        pd="2p1d", gpus=16, nodes=2, pipeline_parallel_size=2, model="deepseek-ai/DeepSeek-V3"
    ),
}
CASES = {**{f"default-{name}": values for name, values in DEFAULTS.items()}, **CHANGED}


def rendered(name: str) -> list[dict]:
    return kubernetes.render(CASES[name])


def containers(doc: dict) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every container of a workload."""
    return [(spec, c) for spec in kubernetes.pod_specs(doc) for c in spec["containers"]]


def command_lines(docs: list[dict], first: str) -> list[list[str]]:
    return [c["args"] for doc in docs for _, c in containers(doc) if c.get("args", [])[:1] == [first]]


def _key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


# --- the overlays as kubectl applies them -------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_values_choose_the_overlay(overlay):
    assert DEFAULTS[overlay].overlay() == overlay


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_defaults_equal_kubectl_kustomize(overlay):
    """With no value changed the renderer writes what `kubectl apply -k overlays/X` applies: one
    source, read the same way by both."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy/kubernetes/overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert sorted(kubernetes.render(DEFAULTS[overlay]), key=_key) == sorted(yaml.safe_load_all(out), key=_key)


def test_the_package_ships_the_repository_manifests():
    assert kubernetes.MANIFESTS.resolve() == (ROOT / "deploy/kubernetes").resolve()
    pyproject = (ROOT / "pyproject.toml").read_text()
    pattern = re.search(r'"(deploy/manifests/[^"]+)"', pyproject)[1]
    shipped = {p.resolve() for p in (ROOT / "splitserve").glob(pattern)}
    assert shipped == {p.resolve() for p in (ROOT / "deploy/kubernetes").rglob("*.yaml")}


def test_kustomize_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages: [{name: splitserve, newTag: v2}]\n")
    with pytest.raises(ValueError, match="images"):
        kustomize.build(tmp_path)


def test_strategic_merge_by_name():
    target = {"containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}}}], "tolerations": [{"key": "x"}]}
    patch = {"containers": [{"name": "a", "resources": {"limits": {"gpu": "1"}}}], "tolerations": [{"key": "y"}]}
    kustomize.merge(target, patch)
    assert target == {
        "containers": [{"name": "a", "resources": {"limits": {"cpu": "1", "gpu": "1"}}}],
        "tolerations": [{"key": "y"}],
    }


# --- validity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", CASES)
def test_manifests_are_valid_kubernetes_objects(name, version):
    for doc in rendered(name):
        if doc["kind"] == "LeaderWorkerSet":
            check_leader_worker_set(doc, version)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def check_leader_worker_set(doc: dict, version: str) -> None:
    """kubernetes-validate has no schema for the LWS CRD: the fields used here, by the CRD's rules,
    and each pod template as a Pod."""
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert set(doc["spec"]) <= {"replicas", "leaderWorkerTemplate", "startupPolicy", "rolloutStrategy", "networkConfig"}
    assert isinstance(doc["spec"]["replicas"], int) and doc["spec"]["replicas"] >= 0
    assert doc["spec"].get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    template = doc["spec"]["leaderWorkerTemplate"]
    assert set(template) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
    assert isinstance(template["size"], int) and template["size"] >= 1
    assert template["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    for part in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **template[part]["metadata"]}}
        kubernetes_validate.validate({**pod, "spec": template[part]["spec"]}, version, strict=True)


@pytest.mark.parametrize("name", CASES)
def test_serve_command_lines_are_accepted_by_splitserve_serve(name):
    from splitserve.entrypoints.cli import build_parser
    from splitserve.entrypoints.openai.args import split_args

    lines = command_lines(rendered(name), "serve")
    assert lines
    for args in lines:
        engine_args, server_args = split_args(build_parser("serve").parse_args(args))
        world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
        if CASES[name].gpus:
            assert world == CASES[name].gpus
        if engine_args.pd_role == "prefill":
            assert engine_args.kv_host == "$(POD_IP)" and engine_args.kv_port


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].pd])
def test_router_lists_every_instance(name):
    """The router's command line parses with its own parser, and names one URL per instance the
    manifests make, each a pod (or leader) under its headless Service, on its server's port."""
    from splitserve.entrypoints.cli import build_parser
    from splitserve.entrypoints.router.config import config_from_args

    docs = rendered(name)
    [args] = command_lines(docs, "router")
    config = config_from_args(build_parser("router").parse_args(args))
    prefill, decode = kubernetes.parse_pd(CASES[name].pd)
    assert (len(config.prefill_urls), len(config.decode_urls)) == (prefill, decode)
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet")}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for url in config.prefill_urls + config.decode_urls:
        host, port = re.fullmatch(r"http://([^:/]+):(\d+)", url).groups()
        pod, service = host.split(".")
        workload = workloads[pod.rsplit("-", 1)[0]]
        assert int(pod.rsplit("-", 1)[1]) < workload["spec"]["replicas"]
        if workload["kind"] == "StatefulSet":  # a LeaderWorkerSet's Service is its controller's
            assert workload["spec"]["serviceName"] == service
            assert services[service]["spec"]["clusterIP"] == "None"
            assert services[service]["spec"]["publishNotReadyAddresses"] is True
        [serve] = [c for _, c in containers(workload) if c.get("args", [])[:1] == ["serve"]]
        assert kubernetes.flag_value(serve["args"], "--port") == port


@pytest.mark.parametrize("name", CASES)
def test_probes_and_ports(name):
    """Probes ask /health, a route of the server and of the router, on a port the container
    declares, which is the one its command line listens on; every Service targets a port the pods
    it selects declare."""
    from splitserve.entrypoints.openai.api_docs import ROUTE_DOCS
    from splitserve.entrypoints.router import RouterConfig, build_router_app

    router_routes = {r.path for r in build_router_app(RouterConfig(["http://p:1"], ["http://d:1"])).routes}
    docs = rendered(name)
    for doc in docs:
        for _, container in containers(doc):
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            args = container.get("args", [])
            if args[:1] in (["serve"], ["router"]):
                assert str(ports["http"]) == kubernetes.flag_value(args, "--port")
                assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            if args[:1] == ["serve"]:
                assert {"startupProbe", "livenessProbe"} <= set(container)
            if "kv" in ports:
                assert str(ports["kv"]) == kubernetes.flag_value(args, "--kv-port")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = container.get(probe, {}).get("httpGet") or container.get(probe, {}).get("tcpSocket")
                if container.get(probe):
                    assert action["port"] in ports
                if "httpGet" in container.get(probe, {}):
                    routes = router_routes if args[:1] == ["router"] else ROUTE_DOCS
                    assert action["path"] in routes
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [c for d in docs for _, c in containers(d) if _pod_labels(d).items() >= selector.items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            assert all(port["targetPort"] in {p["name"] for p in c.get("ports", [])} for c in pods)


def _pod_labels(doc: dict) -> dict:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return doc["spec"]["template"]["metadata"]["labels"]
    return {}


@pytest.mark.parametrize("name", [n for n in CASES if not CASES[n].pd])
def test_autoscaler_scales_the_server_on_its_queue(name):
    docs = rendered(name)
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    [deployment] = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "splitserve_num_requests_waiting"
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    if CASES[name].replicas:
        assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"] == CASES[name].replicas
    # the series the adapter rule of docs/kubernetes.md renames is one the server exports
    assert "splitserve_num_requests_waiting" in (ROOT / "docs/kubernetes.md").read_text()


# --- values -------------------------------------------------------------------------------------
def test_changed_values_land_where_they_belong():
    docs = {_key(d): d for d in rendered("pd-gpu-2p3d-tp2")}
    assert docs["StatefulSet", "splitserve-prefill"]["spec"]["replicas"] == 2
    assert docs["StatefulSet", "splitserve-decode"]["spec"]["replicas"] == 3
    for role in ("prefill", "decode"):
        [(_, c)] = containers(docs["StatefulSet", f"splitserve-{role}"])
        assert c["image"] == "registry.example/splitserve:gpu"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert kubernetes.flag_value(c["args"], "--tensor-parallel-size") == "2"
        assert c["args"][-2:] == ["--kv-lease-seconds", "30"]
    docs = {_key(d): d for d in rendered("multinode-2p1d-tp8pp2")}
    lws = docs["LeaderWorkerSet", "splitserve-prefill"]
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for _, c in containers(lws):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    [serve] = command_lines([lws], "serve")
    assert kubernetes.flag_value(serve, "--tensor-parallel-size") == "8"
    assert kubernetes.flag_value(serve, "--pipeline-parallel-size") == "2"
    assert kubernetes.flag_value(serve, "--distributed-executor-backend") == "ray"
    docs = rendered("cpu-tp2")
    assert {d["metadata"]["namespace"] for d in docs} == {"llm"}
    docs = {_key(d): d for d in rendered("gpu-tp2")}
    volumes = docs["Deployment", "splitserve"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in volumes


def test_leader_runs_the_serve_command_line_after_ray():
    """The leader's command is `sh -c SCRIPT splitserve`, so its args are the serve command line
    ("$@"), and its workers join the leader's Ray head on the port it starts it on, retrying until it
    is up: a worker that exited would restart the whole group."""
    [lws, *_] = [d for d in rendered("default-multinode-pd-gpu") if d["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    shell, flag, script, name = leader["command"]
    assert (shell, flag, name) == ("/bin/sh", "-c", "splitserve")
    assert script.startswith("ray start --head --port=6379") and script.endswith('exec splitserve "$@"')
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    assert "until ray start --address=$(LWS_LEADER_ADDRESS):6379 --block" in worker["command"][2]


@pytest.mark.parametrize(
    "values, message",
    [
        (Values(nodes=2, gpus=2), "needs --pd"),
        (Values(pd="1p1d", nodes=2), "needs --pd and --gpus"),
        (Values(gpus=4, tensor_parallel_size=2), "must equal"),
        (Values(pd="1p1d", gpus=3, nodes=2), "must divide"),
        (Values(pd="0p1d"), "--pd must look like"),
        (Values(replicas=5, max_replicas=2), "below"),
    ],
)
def test_impossible_values_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        kubernetes.render(values)


@pytest.mark.parametrize("spec", ["1p1d", "2P3d", " 4p1d "])
def test_pd_specs_read_as_serve_reads_them(spec):
    from splitserve.disagg.launch import parse_pd_spec

    assert kubernetes.parse_pd(spec) == parse_pd_spec(spec)


def test_command_writes_a_kustomization_and_rewrites_it(tmp_path, capsys):
    from splitserve.entrypoints.cli import main

    main(["deploy", "kubernetes", "--pd", "2p2d", "--gpus", "1", "--output", str(tmp_path)])
    first = sorted(p.name for p in tmp_path.iterdir())
    assert "statefulset-splitserve-prefill.yaml" in first and "kustomization.yaml" in first
    main(["deploy", "kubernetes", "--model", "Qwen/Qwen3-0.6B", "--output", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "deployment-splitserve.yaml",
        "horizontalpodautoscaler-splitserve.yaml",
        "kustomization.yaml",
        "service-splitserve.yaml",
    ]
    capsys.readouterr()
    main(["deploy", "kubernetes", "--pd", "1p1d"])  # stdout: one stream
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)].count("StatefulSet") == 2
    (tmp_path / "kustomization.yaml").write_text("resources: []\n")
    with pytest.raises(ValueError, match="not written by"):
        kubernetes.write([], tmp_path)


def test_dockerfile_copies_what_exists():
    """The image is not built here (no Docker daemon): its COPY sources must exist, and what the
    dockerignore lets through must include them."""
    dockerfile = ROOT / "deploy/docker/Dockerfile"
    text = dockerfile.read_text()
    copies = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / "deploy/docker/Dockerfile.dockerignore").read_text().split()
        if line.startswith("!")
    }
    assert {s.rstrip("/") for sources in copies for s in sources} <= allowed
    assert "splitserve" in re.search(r'ENTRYPOINT \["([^"]+)"\]', text)[1]


def test_docs_walk_through_every_overlay():
    doc = (ROOT / "docs/kubernetes.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in doc
    assert "docs/kubernetes.md" in (ROOT / "README.md").read_text()
