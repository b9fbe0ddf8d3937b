"""Builds the project's CUDA sources (ops/csrc) with nvcc into a cache folder, keyed by the source's and flags'
hash, for ctypes to load: no torch extension, no ninja. SPIN_CUDA_CACHE names the folder (default
~/.cache/spin_indexer)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def nvcc_path() -> str | None:
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda; None if there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def build_library(source: Path, flags: tuple[str, ...], out_dir: str | os.PathLike | None = None) -> Path:
    """Compiles `source` with nvcc `flags` into a shared library unless the cache holds it; returns its path.
    Raises RuntimeError with nvcc's message when nvcc is missing or fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"nvcc not found (PATH, CUDA_HOME): {source.name} cannot be built")
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    folder = Path(out_dir or os.environ.get("SPIN_CUDA_CACHE") or Path.home() / ".cache" / "spin_indexer")
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"{source.stem}_{digest}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: no half-written library
        part = Path(tmp) / lib.name
        proc = subprocess.run([nvcc, *flags, "-o", str(part), str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name}:\n{proc.stderr[-2000:]}")
        os.replace(part, lib)
    return lib
