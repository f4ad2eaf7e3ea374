"""`splitserve deploy kubernetes`: the manifests of deploy/kubernetes/ with the values a user changes
(model, image, replicas, GPUs and parallelism per instance, prefill and decode instance counts).

deploy/kubernetes/ (shipped in the package as splitserve/deploy/manifests, a link to it) is the one
source: plain YAML, a base and one overlay per kind of deployment, which `kubectl apply -k` applies
as they are. The renderer builds the overlay the values choose (kustomize.py), sets the fields those
values name, and writes the result, one file per resource with a kustomization.yaml (`kubectl apply
-k DIR`), or one stream on stdout. It knows the manifests by their shape, not by line: a container
whose args begin with `serve` runs `splitserve serve`, one whose args begin with `router` the router,
and the pods' `app.kubernetes.io/component` label names their role (server, prefill, decode).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import yaml

from splitserve.deploy import kustomize

MANIFESTS = Path(__file__).resolve().parent / "manifests"
WRITTEN_MARK = "# Written by `splitserve deploy kubernetes`"
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


@dataclasses.dataclass
class Values:
    """What a user changes; None keeps the manifests' own value."""

    model: str | None = None
    image: str | None = None
    pd: str | None = None  # "XpYd": X prefill and Y decode instances behind the router
    gpus: int = 0  # GPUs per instance; 0: the CPU manifests
    nodes: int = 1  # pods (machines) per instance: above 1, LeaderWorkerSets with Ray inside
    tensor_parallel_size: int | None = None  # default: the GPUs per instance over the pipeline stages
    pipeline_parallel_size: int = 1
    replicas: int | None = None  # the server's (or, with pd, the router's) pods
    max_replicas: int | None = None  # the autoscaler's ceiling
    namespace: str | None = None
    cpus: str | None = None  # per pod, requests = limits
    memory: str | None = None
    model_pvc: str | None = None  # a PersistentVolumeClaim mounted at /models instead of the emptyDir
    serve_args: list[str] = dataclasses.field(default_factory=list)  # more `splitserve serve` flags
    router_args: list[str] = dataclasses.field(default_factory=list)  # more `splitserve router` flags

    def overlay(self) -> str:
        """The overlay of deploy/kubernetes/overlays/ these values start from."""
        device = "gpu" if self.gpus else "cpu"
        if self.nodes > 1:
            if not (self.pd and self.gpus):
                raise ValueError("--nodes above 1 (instances across machines) needs --pd and --gpus.")
            return "multinode-pd-gpu"
        return f"pd-{device}" if self.pd else device

    def parallel_sizes(self) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes: one rank per GPU, all the instance's GPUs used."""
        pp = self.pipeline_parallel_size
        tp = self.tensor_parallel_size
        if tp is None:
            tp = self.gpus // pp if self.gpus and self.gpus % pp == 0 else 1
        if tp < 1 or pp < 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be at least 1.")
        if self.gpus and tp * pp != self.gpus:
            raise ValueError(
                f"--gpus {self.gpus} per instance runs one rank per GPU: tensor parallel {tp} x pipeline "
                f"parallel {pp} must equal it."
            )
        if self.nodes < 1 or self.gpus % self.nodes:
            raise ValueError(f"--gpus {self.gpus} must divide into --nodes {self.nodes} pods of equal size.")
        return tp, pp


def parse_pd(spec: str) -> tuple[int, int]:
    """ "1p2d" -> (1, 2), as `serve --pd` reads it."""
    match = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"--pd must look like 1p1d or 2p2d (at least one of each), got {spec!r}.")
    return int(match[1]), int(match[2])


def render(values: Values) -> list[dict]:
    """The resources of the chosen overlay, with `values` set."""
    docs = kustomize.build(MANIFESTS / "overlays" / values.overlay())
    tp, pp = values.parallel_sizes()
    for doc in docs:
        if values.namespace:
            doc["metadata"]["namespace"] = values.namespace
        for spec in pod_specs(doc):
            _set_pod(spec, values, tp, pp, doc)
    if values.nodes > 1:
        for doc in _of_kind(docs, "LeaderWorkerSet"):
            doc["spec"]["leaderWorkerTemplate"]["size"] = values.nodes
    if values.pd:
        counts = dict(zip(("prefill", "decode"), parse_pd(values.pd)))
        for doc in docs:
            if doc["kind"] in WORKLOADS and _component(doc) in counts:
                doc["spec"]["replicas"] = counts[_component(doc)]
    _set_replicas(docs, values)
    _set_router_urls(docs)
    return docs


def pod_specs(doc: dict) -> list[dict]:
    """The pod specs of a workload (a LeaderWorkerSet has two: its leader's and its workers')."""
    if doc["kind"] == "LeaderWorkerSet":
        template = doc["spec"]["leaderWorkerTemplate"]
        return [template[t]["spec"] for t in ("leaderTemplate", "workerTemplate") if t in template]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]["spec"]]
    return []


def _set_pod(spec: dict, values: Values, tp: int, pp: int, doc: dict) -> None:
    for container in spec["containers"]:
        if values.image:
            container["image"] = values.image
        args = container.get("args", [])
        if args[:1] == ["router"]:
            container["args"] = args + values.router_args
            continue
        if args[:1] == ["serve"]:
            if values.model:
                args = set_flag(args, "--model", values.model)
            args = set_flag(args, "--tensor-parallel-size", str(tp) if tp > 1 else None)
            args = set_flag(args, "--pipeline-parallel-size", str(pp) if pp > 1 else None)
            container["args"] = args + values.serve_args
        resources = container.setdefault("resources", {})
        for key, value in (("cpu", values.cpus), ("memory", values.memory)):
            if value:
                resources.setdefault("requests", {})[key] = resources.setdefault("limits", {})[key] = value
        if values.gpus:
            resources.setdefault("limits", {})["nvidia.com/gpu"] = str(values.gpus // values.nodes)
    if values.model_pvc:
        for volume in spec.get("volumes", []):
            if volume["name"] == "models":
                volume.clear()
                volume.update(name="models", persistentVolumeClaim={"claimName": values.model_pvc})


def set_flag(args: list[str], flag: str, value: str | None) -> list[str]:
    """`args` with `flag` given `value` where it first stood (else at the end), or without it (None);
    both spellings, `--flag value` and `--flag=value`, are recognised."""
    out: list[str] = []
    where = None
    i = 0
    while i < len(args):
        if args[i] == flag or args[i].startswith(flag + "="):
            where = len(out) if where is None else where
            i += 2 if args[i] == flag else 1
            continue
        out.append(args[i])
        i += 1
    if value is not None:
        where = len(out) if where is None else where
        out[where:where] = [flag, value]
    return out


def _set_replicas(docs: list[dict], values: Values) -> None:
    scaled = "router" if values.pd else "server"
    for doc in docs:
        if doc["kind"] == "Deployment" and _component(doc) == scaled and values.replicas is not None:
            doc["spec"]["replicas"] = values.replicas
        if doc["kind"] == "HorizontalPodAutoscaler":
            spec = doc["spec"]
            if values.replicas is not None:
                spec["minReplicas"] = values.replicas
            if values.max_replicas is not None:
                spec["maxReplicas"] = values.max_replicas
            if spec["maxReplicas"] < spec.get("minReplicas", 1):
                raise ValueError(f"--max-replicas {spec['maxReplicas']} is below --replicas {spec['minReplicas']}.")


def instance_urls(docs: list[dict], role: str) -> list[str]:
    """The base URLs of the `role` instances: pod i of a StatefulSet, or group i's leader of a
    LeaderWorkerSet, by its name under the headless Service, on its server's --port."""
    urls = []
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "LeaderWorkerSet") or _component(doc) != role:
            continue
        name = doc["metadata"]["name"]
        service = doc["spec"].get("serviceName", name)  # the LWS controller names its Service after the set
        args = next(c["args"] for c in pod_specs(doc)[0]["containers"] if c.get("args", [])[:1] == ["serve"])
        port = flag_value(args, "--port") or "8000"
        urls += [f"http://{name}-{i}.{service}:{port}" for i in range(doc["spec"].get("replicas", 1))]
    return urls


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _set_router_urls(docs: list[dict]) -> None:
    """The router's --prefill and --decode lists, one URL per instance the manifests make."""
    for doc in docs:
        for spec in pod_specs(doc):
            for container in spec["containers"]:
                args = container.get("args", [])
                if args[:1] != ["router"]:
                    continue
                for role in ("prefill", "decode"):
                    args = set_flag(args, f"--{role}", None)
                    args += [a for url in instance_urls(docs, role) for a in (f"--{role}", url)]
                container["args"] = args


def _component(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def _of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def dump(docs: list[dict]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=120)


def file_name(doc: dict) -> str:
    return f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"


def write(docs: list[dict], output: Path) -> list[Path]:
    """One file per resource and a kustomization.yaml listing them; the files a previous run wrote
    there (its kustomization.yaml says which) are removed first."""
    output.mkdir(parents=True, exist_ok=True)
    index = output / kustomize.KUSTOMIZATION
    if index.exists():
        if not index.read_text().startswith(WRITTEN_MARK):
            raise ValueError(f"{index} was not written by splitserve deploy kubernetes; choose another --output.")
        for name in yaml.safe_load(index.read_text()).get("resources", []):
            (output / name).unlink(missing_ok=True)
    paths = []
    for doc in docs:
        path = output / file_name(doc)
        path.write_text(dump([doc]))
        paths.append(path)
    listing = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    listing["resources"] = [p.name for p in paths]
    index.write_text(f"{WRITTEN_MARK}; apply with `kubectl apply -k {output}`.\n" + dump([listing]))
    return [*paths, index]


# --- command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="the model every instance serves (hub id, or a path under /models)")
    parser.add_argument("--image", help="the container image (deploy/docker/Dockerfile builds one)")
    parser.add_argument("--pd", metavar="XpYd", help="X prefill and Y decode instances behind a router")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per instance (default 0: the CPU manifests)")
    parser.add_argument(
        "--nodes", type=int, default=1, help="pods per instance: above 1, LeaderWorkerSets with Ray (GPU, --pd)"
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, help="default: --gpus / --pipeline-parallel-size")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--replicas", type=int, help="pods of the server (with --pd, of the router)")
    parser.add_argument("--max-replicas", type=int, help="the autoscaler's maximum (single server)")
    parser.add_argument("--namespace", help="the namespace of every resource (default: kubectl's)")
    parser.add_argument("--cpus", help="CPU cores per pod, e.g. 8 (requests = limits)")
    parser.add_argument("--memory", help="memory per pod, e.g. 32Gi (requests = limits)")
    parser.add_argument("--model-pvc", metavar="CLAIM", help="a PersistentVolumeClaim to mount at /models")
    parser.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more argument for every `splitserve serve`, e.g. --serve-arg=--max-model-len=8192 (repeatable)",
    )
    parser.add_argument(
        "--router-arg",
        dest="router_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more argument for the router, e.g. --router-arg=--policy=cache_aware (repeatable)",
    )
    parser.add_argument(
        "--output", "-o", default="-", help="a directory for the files (default: one YAML stream on stdout)"
    )


def values_from_args(ns: argparse.Namespace) -> Values:
    return Values(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Values)})


def main(ns: argparse.Namespace) -> None:
    docs = render(values_from_args(ns))
    if ns.output == "-":
        sys.stdout.write(dump(docs))
        return
    for path in write(docs, Path(ns.output)):
        print(path)
