"""The config and tokenizer of a .gguf file, kept as a small Hugging Face directory after the first
load.

transformers reads a GGUF's config and its tokenizer by parsing the whole metadata and converting
the vocabulary, once for each (seconds apiece: 6.5 s and 12 s for SmolLM2 on an AVX2 machine, and
every API worker and the engine process did it again). splitserve does it once per file and saves
the result under `~/.cache/splitserve/gguf/<key>/` (config.json and the tokenizer files), the key
changing with the file's path, size and modification time; later loads read those files in a
fraction of a second. SPLITSERVE_CACHE_DIR moves the cache; a cache that cannot be written is
logged and the file is then parsed each time, as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time

from splitserve import envs

logger = logging.getLogger(__name__)

_COMPLETE = "splitserve-complete"  # written last: a directory without it is an interrupted save


def cache_key(gguf_path: str) -> str:
    """Changes whenever the file is replaced or rewritten."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    digest = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{os.path.basename(path).removesuffix('.gguf')}-{digest}"


def hf_dir_for_gguf(gguf_path: str) -> str | None:
    """A directory with the config and tokenizer of `gguf_path`, saved on first use; None when the
    cache cannot be written (the caller then reads the .gguf itself)."""
    target = os.path.join(envs.cache_root(), "gguf", cache_key(gguf_path))
    if os.path.isfile(os.path.join(target, _COMPLETE)):
        return target
    try:
        _save(gguf_path, target)
    except OSError as exc:
        logger.warning(
            "Could not cache the config and tokenizer of %s (%s): it is read at every start.", gguf_path, exc
        )
        return None
    return target


# GGUF metadata transformers' reader leaves out for the mixture-of-experts models it reads
# (llama.cpp's converter writes them): `<arch>.<key>` -> config attribute
_MOE_KEYS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def read_gguf_config(directory: str, name: str, **kwargs):
    """transformers' config of a .gguf file, with the experts' sizes of an MoE file (transformers
    keeps its config class's defaults for them, which are another model's)."""
    from transformers import AutoConfig

    from splitserve.loader.gguf_file import GGUFFile

    config = AutoConfig.from_pretrained(directory, gguf_file=name, **kwargs)
    metadata = GGUFFile(os.path.join(directory, name)).metadata
    arch = metadata.get("general.architecture")
    for key, attribute in _MOE_KEYS.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None and hasattr(config, attribute):
            setattr(config, attribute, int(value))
    return config


def _save(gguf_path: str, target: str) -> None:
    from transformers import AutoTokenizer

    start = time.perf_counter()
    directory, name = os.path.split(os.path.abspath(gguf_path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".saving-", dir=os.path.dirname(target))
    try:
        with gguf_parsed_once():
            read_gguf_config(directory, name).save_pretrained(staging)
            AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(staging)
        open(os.path.join(staging, _COMPLETE), "w").close()
        try:
            os.rename(staging, target)
        except OSError:  # another process saved it first (or an interrupted save left a directory)
            if not os.path.isfile(os.path.join(target, _COMPLETE)):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "Read the config and tokenizer of %s in %.1f s and saved them to %s (later starts read them from there).",
        name,
        time.perf_counter() - start,
        target,
    )


_reader_lock = threading.Lock()


@contextlib.contextmanager
def gguf_parsed_once():
    """Within this block, transformers' reads of a .gguf (its config, its tokenizer, its weights)
    share one parse of the file (gguf.GGUFReader; about 3 s of the default model's 4-5 s per read):
    the reader is only read. Blocks are taken one at a time; nested ones share the outer one's."""
    try:
        import gguf
    except ImportError:
        yield
        return
    if getattr(gguf.GGUFReader, "_splitserve_parsed_once", False):
        yield  # an enclosing block (or another thread's) already shares the parses
        return
    with _reader_lock:
        original = gguf.GGUFReader
        shared = functools.lru_cache(maxsize=2)(original)
        shared._splitserve_parsed_once = True
        gguf.GGUFReader = shared
        try:
            yield
        finally:
            gguf.GGUFReader = original
            shared.cache_clear()
