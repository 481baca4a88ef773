"""Compiling and loading the C++ CPU kernels on first use, with a per-machine cache.

The extension is built with `torch.utils.cpp_extension.load` (`-O3 -march=native -fopenmp`) into
`<kernel cache dir>/<name>/` (`$KVFLOW_KERNEL_CACHE_DIR`, else `<kvflow cache dir>/kernels`), where `<name>`
hashes the sources, the torch and Python versions, the compiler flags and the CPU's feature flags: a source edit,
a torch upgrade or another CPU gets its own build, and every other process (and test run) imports the finished
build in milliseconds. A file lock serialises builds, so two processes never race on one folder; a `.complete`
marker written after a successful build says a folder is usable.

`KVFLOW_CPU_KERNELS=0` (also `false`, `off`, `no`) forces the pure-PyTorch paths. A missing compiler or a failed
build logs one warning and falls back to them too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

from kvflow.utils import kvflow_cache_dir

logger = logging.getLogger(__name__)

CPU_KERNELS_ENV = "KVFLOW_CPU_KERNELS"
KERNEL_CACHE_DIR_ENV = "KVFLOW_KERNEL_CACHE_DIR"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = (
    "bindings.cpp",
    "gemv.cpp",
    "gemm.cpp",
    "amx.cpp",
    "elementwise.cpp",
    "attention.cpp",
    "decode_layer.cpp",
    "fused_moe.cpp",
    "quant_reference.cpp",
    "quant_activations.cpp",
    "quant_gemv_8bit.cpp",
    "quant_gemv_integer.cpp",
    "quant_repack.cpp",
    "quant_tiled.cpp",
    "quant_w8a8.cpp",
    "quant_linear.cpp",
    "quant_moe.cpp",
    "lora.cpp",
    "encoder_attention.cpp",
)
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17")
_LDFLAGS = ("-fopenmp",)
_COMPLETE_MARKER = ".complete"


def cpu_kernels_requested() -> bool:
    """False when `KVFLOW_CPU_KERNELS` says off (`0`, `false`, `off`, `no`); unset or anything else means on."""
    return os.environ.get(CPU_KERNELS_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), else the platform's processor name."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.processor() or platform.machine()


def cpu_feature_flags() -> frozenset[str]:
    """The CPU's feature flags as a set (empty where /proc/cpuinfo has none, e.g. off Linux)."""
    flags = _cpu_flags()
    return frozenset(flags.split()) if " " in flags else frozenset()


def extension_name() -> str:
    """`kvflow_cpu_kernels_<hash>`: the hash covers sources, torch version, flags and CPU features."""
    import torch

    digest = hashlib.sha256()
    for source in sorted(SOURCE_DIR.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(sys.version.encode())
    return f"kvflow_cpu_kernels_{digest.hexdigest()[:16]}"


def kernels_build_dir() -> Path:
    """Where builds live: `$KVFLOW_KERNEL_CACHE_DIR`, else `<kvflow cache dir>/kernels`."""
    root = os.environ.get(KERNEL_CACHE_DIR_ENV)
    return Path(root).expanduser() if root else kvflow_cache_dir() / "kernels"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The finished build in `build_dir`, or None when there is none."""
    if not (build_dir / _COMPLETE_MARKER).is_file():
        return None
    library = next(iter(sorted(build_dir.glob(f"{name}*.so"))), None)
    if library is None:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive `flock` on `path` (created if absent), held for the block."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(name: str, build_dir: Path) -> ModuleType:
    """Compile into `build_dir` (already locked) and mark it complete."""
    import torch  # noqa: F401  (the extension links against the loaded torch)
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    logger.info("building kvflow CPU kernels %s (first use on this machine) in %s", name, build_dir)
    module = load(
        name=name,
        sources=[str(SOURCE_DIR / source) for source in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    (build_dir / _COMPLETE_MARKER).write_text(f"{time.time()}\n")
    logger.info("built kvflow CPU kernels in %.1fs", time.perf_counter() - started)
    return module


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, building it on first use; None when disabled or unavailable (logged once).

    Cached per process: every later call returns the same module (or None) without touching the disk.
    """
    if not cpu_kernels_requested():
        logger.info("%s=0: using the pure-PyTorch CPU paths", CPU_KERNELS_ENV)
        return None
    try:
        name = extension_name()
        build_dir = kernels_build_dir() / name
        module = _import_built(name, build_dir)
        if module is None:
            build_dir.mkdir(parents=True, exist_ok=True)
            with file_lock(build_dir.parent / f"{name}.lock"):
                module = _import_built(name, build_dir) or _build(name, build_dir)
        logger.debug("loaded kvflow CPU kernels from %s", build_dir)
        return module
    except Exception as error:  # any build failure means: fall back, once, loudly
        logger.warning(
            "kvflow CPU kernels unavailable, using the pure-PyTorch paths (set %s=0 to silence): %s",
            CPU_KERNELS_ENV,
            str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
        )
        return None
