"""The KV offloading tier (`--kv-offloading-size`, `--kv-cache-dir`): prefix-cache blocks evicted from
the device kept in host memory and on disk, and loaded back instead of computed again. The engine's
side is the index (index.py, disk_index.py: which blocks the tier holds, which copies a step needs);
the ranks' side is the copier (copier.py: host memory, the disk files of files.py); ops.py is what a
step carries between them."""
