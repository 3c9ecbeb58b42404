"""The CPU's own kernels: products over llama.cpp's block-quantized weights (Q8_0, Q4_0, Q4_1;
backends/torch/cpu/kernels.cpp) and the whole decode step in one call (backends/torch/cpu/step.h).

A decode step of a small model in torch's operators is mostly their launches (~200 a block,
6,600-9,000 a SmolLM2 step) and its float32 weights' bytes (docs/decisions.md, D-cpu-step). llama.cpp
runs the same step as one C++ loop over 4- or 8-bit blocks. These kernels do that inside this
server: compiled once per machine with g++ (-O3 -march=native: AVX2, and
AVX512-VNNI where the CPU has it), kept in torch's extension folder (TORCH_EXTENSIONS_DIR, by
default ~/.cache/torch_extensions), named by the source's hash, the compiler flags, the CPU's
flags and torch's version. `PHI2_CPU_MARCH` names another target than `native` (`x86-64-v3`:
AVX2 and FMA, nothing wider), to time the AVX2 path on an AVX-512 machine or to keep off
instructions a VM advertises but faults on.

Where they cannot be built (no C++ compiler), `kernels()` says why; block-quantized weights then
refuse to load with that reason, and the float step runs on torch's operators.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from backends.contract import ModelLoadError

log = logging.getLogger("phi2.cpu_kernels")

SOURCE = Path(__file__).with_name("kernels.cpp")
SOURCES = [SOURCE, Path(__file__).with_name("kquants.h"), Path(__file__).with_name("step.h")]  # the headers: included
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]  # errno-free: expf vectorizes (libmvec)

_lock = threading.Lock()
_module = None
_failure: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _name(flags: list[str]) -> str:
    import torch

    key = "\n".join([*(source.read_text() for source in SOURCES), " ".join(flags), _cpu_flags(), torch.__version__])
    return "phi2_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _target(march: str) -> list[str]:
    """FLAGS with -march={march}."""
    return [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS]


def _flags() -> list[str]:
    """FLAGS for PHI2_CPU_MARCH's target (default `native`); a name g++ does not know fails its build."""
    march = os.environ.get("PHI2_CPU_MARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ModelLoadError(f"PHI2_CPU_MARCH={march!r} is not a target name (as g++'s -march: native, x86-64-v3)")
    return _target(march)


def kernels():
    """The compiled module (built at the first call on this machine, ~20-40 s; loaded in
    milliseconds after). Raises ModelLoadError naming why it cannot be built."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise ModelLoadError(_failure)
        import torch  # noqa: F401  (the extension links libtorch)
        import torch.utils.cpp_extension as cpp

        try:
            flags = _flags()
        except ModelLoadError as exc:
            _failure = str(exc)
            raise
        name = _name(flags)
        built = Path(cpp._get_build_directory(name, verbose=False)) / f"{name}.so"
        if not built.is_file():
            started = time.perf_counter()
            log.info("compiling the CPU kernels (backends/torch/cpu/kernels.cpp) once for this machine, into %s", built)
            try:
                _compile(name, built, flags)
            except (OSError, subprocess.CalledProcessError) as exc:
                output = getattr(exc, "stderr", None) or str(exc)
                first = output.strip().splitlines()[0] if output.strip() else type(exc).__name__
                _failure = (
                    f"the CPU kernels (backends/torch/cpu/kernels.cpp) could not be built: {first}. They need a C++ "
                    "compiler (g++; Debian: apt-get install g++)"
                )
                raise ModelLoadError(_failure) from exc
            log.info("CPU kernels compiled in %.1f s", time.perf_counter() - started)
        _module = _import(name, built)
        log.info("CPU kernels: %s (%s)", _module.simd(), " ".join(flags[:2]))
        return _module


def variant(march: str):
    """The kernels built for another target (`-march=x86-64-v3`: AVX2 without AVX-512;
    `-march=x86-64`: the plain C++ path), for the tests to check every SIMD path on one machine."""
    import torch.utils.cpp_extension as cpp

    flags = _target(march)
    name = _name(flags)
    built = Path(cpp._get_build_directory(name, verbose=False)) / f"{name}.so"
    if not built.is_file():
        _compile(name, built, flags)
    return _import(name, built)


def _compile(name: str, target: Path, flags: list[str]) -> None:
    """g++ (or $CXX) straight to a shared object beside torch's own extensions: the flags
    torch.utils.cpp_extension would pass, without its ninja build. Written under a temporary
    name and renamed, so a server starting beside this one finds a whole file or none."""
    import sysconfig

    import torch
    import torch.utils.cpp_extension as cpp

    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    lib = Path(torch.__file__).parent / "lib"
    command = [
        os.environ.get("CXX", "c++"),
        *flags,
        "-shared",
        "-fPIC",
        "-std=c++17",
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(temporary),
        f"-L{lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-Wl,-rpath,{lib}",
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _import(name: str, file: Path):
    """The built extension, imported without cpp_extension's build check (ninja, ~0.5 s a start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available() -> bool:
    """Whether the kernels are built or can be (a failure is remembered, not retried)."""
    try:
        kernels()
    except ModelLoadError:
        return False
    return True
