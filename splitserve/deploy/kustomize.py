"""The part of Kustomize that deploy/kubernetes/ uses, so that `splitserve deploy kubernetes` reads
the same files `kubectl apply -k` does: a kustomization.yaml's `resources` (files, or directories
with a kustomization.yaml of their own) and its `patches` given by `path`, each a strategic-merge
patch of the resource with its kind and name.

The merge is strategic merge as Kubernetes does it for what the overlays patch: maps merge key by
key, lists of maps that all have a `name` (containers, env, volumes) merge item by item on it, and
any other list is replaced. Anything else in a kustomization.yaml is refused, so that an overlay
that needs more of Kustomize fails here, loudly, rather than rendering differently
(tests/unit/test_kubernetes_manifests.py compares both renderings where kubectl is installed).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KUSTOMIZATION = "kustomization.yaml"
_KEYS = {"apiVersion", "kind", "resources", "patches"}


def build(directory: Path) -> list[dict]:
    """The resources `kubectl kustomize directory` makes, in the order they are listed."""
    directory = Path(directory)
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text()) or {}
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise ValueError(f"{directory / KUSTOMIZATION}: {unknown} are not supported here (only {sorted(_KEYS)}).")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += build(path) if path.is_dir() else load_documents(path)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory / KUSTOMIZATION}: a patch is given by its `path` alone, got {patch}.")
        for doc in load_documents(directory / patch["path"]):
            merge(find(docs, doc["kind"], doc["metadata"]["name"]), doc)
    return docs


def load_documents(path: Path) -> list[dict]:
    return [copy.deepcopy(doc) for doc in yaml.safe_load_all(Path(path).read_text()) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} named {name!r} among the resources")


def merge(target: dict, patch: dict) -> dict:
    """Merge `patch` into `target` (in place) by the rules in the module's docstring."""
    for key, value in patch.items():
        old = target.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            merge(old, value)
        elif isinstance(old, list) and isinstance(value, list) and _named(old) and _named(value):
            by_name = {item["name"]: item for item in old}
            for item in value:
                if item["name"] in by_name:
                    merge(by_name[item["name"]], item)
                else:
                    old.append(copy.deepcopy(item))
        else:
            target[key] = copy.deepcopy(value)
    return target


def _named(items: list) -> bool:
    return all(isinstance(item, dict) and "name" in item for item in items)
