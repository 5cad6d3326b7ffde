"""Before any part: is there a GPU, and can Triton build its launcher here?

Triton compiles a small C launcher per kernel signature on first use. That needs a C compiler ($CC,
else gcc, else clang on PATH), the Python headers (Python.h in sysconfig's include dir) and
libcuda.so.1 where Triton looks for it ($TRITON_LIBCUDA_PATH, else ``/sbin/ldconfig -p``, else
$LD_LIBRARY_PATH). Where one is missing, graphcp's attention falls back to torch but the first
Triton KV write raises, so every capture fails: the check would measure nothing. Each item is looked
up the way Triton does and named when missing; then one tiny kernel is compiled and launched.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile

# Where drivers put libcuda.so.1 (distro packages, CUDA containers, WSL): searched only to say where
# it is when Triton's own lookup misses it.
USUAL_LIBCUDA_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu",
                      "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/wsl/lib")
LDCONFIG = "/sbin/ldconfig"          # Triton runs this exact path


def _row(item: str, found: bool, detail: str, needed: bool) -> dict:
    return {"item": item, "found": found, "needed": needed, "ok": found or not needed,
            "detail": detail}


def check_cuda() -> tuple[bool, str]:
    import torch
    if torch.cuda.is_available():
        cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
        return True, (f"{torch.cuda.device_count()} device(s); {torch.cuda.get_device_name(0)} "
                      f"(sm {cap}); torch {torch.__version__} with CUDA {torch.version.cuda}")
    cuda = torch.version.cuda
    build = "built without CUDA" if cuda is None else f"built with CUDA {cuda}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return False, (f"torch.cuda.is_available() is False (torch {torch.__version__}, {build}"
                   + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
                   + "): run on the GPU machine, or pass --dry-run for the CPU rehearsal")


def find_c_compiler() -> tuple[bool, str]:
    cc = os.environ.get("CC")
    if cc:
        path = shutil.which(cc)
        if path:
            return True, f"$CC={cc} ({path})"
        return False, f"$CC={cc} is set but not found: Triton calls it to build its launcher"
    for name in ("gcc", "clang"):
        path = shutil.which(name)
        if path:
            return True, f"{name} ({path})"
    if shutil.which("cc"):
        return False, ("no gcc or clang on PATH; Triton does not try cc by itself: "
                       f"export CC={shutil.which('cc')}")
    return False, "no C compiler ($CC unset; no gcc, clang or cc on PATH): install gcc, or set CC"


def python_include_dir() -> str:
    """The include dir Triton passes to the compiler (Debian's posix_local scheme maps to
    posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def find_python_h() -> tuple[bool, str]:
    include = python_include_dir()
    header = os.path.join(include, "Python.h")
    if os.path.isfile(header):
        return True, header
    version = sysconfig.get_python_version()
    return False, (f"{header} does not exist: install the Python {version} development headers "
                   f"(e.g. apt-get install python{version}-dev)")


def ldconfig_listing() -> str | None:
    """``/sbin/ldconfig -p`` as Triton reads it; None where it cannot run."""
    try:
        return subprocess.run([LDCONFIG, "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def find_libcuda() -> tuple[bool, str]:
    env_path = os.environ.get("TRITON_LIBCUDA_PATH")
    if env_path:
        if os.path.isfile(os.path.join(env_path, "libcuda.so.1")):
            return True, f"$TRITON_LIBCUDA_PATH={env_path}"
        return False, f"$TRITON_LIBCUDA_PATH={env_path} holds no libcuda.so.1"
    listing = ldconfig_listing()
    listed = [line.split()[-1] for line in (listing or "").splitlines() if "libcuda.so.1" in line]
    listed = [p for p in listed if os.path.exists(p)]
    if listed:
        return True, f"{listed[0]} (from {LDCONFIG} -p)"
    for d in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        if os.path.isfile(os.path.join(d, "libcuda.so.1")):
            return True, f"{d}/libcuda.so.1 (from $LD_LIBRARY_PATH)"
    why = (f"{LDCONFIG} cannot run" if listing is None
           else f"{LDCONFIG} -p does not list libcuda.so.1")
    elsewhere = [d for d in USUAL_LIBCUDA_DIRS if os.path.isfile(os.path.join(d, "libcuda.so.1"))]
    if elsewhere:
        return False, (f"{why}, so Triton will not find {elsewhere[0]}/libcuda.so.1: "
                       f"export TRITON_LIBCUDA_PATH={elsewhere[0]} (or run ldconfig as root)")
    return False, (f"libcuda.so.1 not found ({why}; not in $LD_LIBRARY_PATH nor in "
                   f"{', '.join(USUAL_LIBCUDA_DIRS)}): is the NVIDIA driver installed or mounted?")


def triton_cache_writable() -> tuple[bool, str]:
    default = os.path.join(os.path.expanduser("~"), ".triton", "cache")
    cache = os.environ.get("TRITON_CACHE_DIR") or default
    try:
        os.makedirs(cache, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache):
            pass
    except OSError as e:
        return False, f"{cache} is not writable ({e.strerror}): set TRITON_CACHE_DIR to one that is"
    return True, cache


def tiny_kernel(device: str) -> tuple[bool, str]:
    """Compile and launch one element-wise kernel: the launcher build is the step that fails."""
    import time

    import torch
    try:
        from .tiny_kernel import add_one
        x = torch.arange(1000, dtype=torch.float32, device=device)
        t = time.monotonic()
        y = add_one(x)
        if device == "cuda":
            torch.cuda.synchronize()
        secs = time.monotonic() - t
        if not torch.equal(y.cpu(), torch.arange(1, 1001, dtype=torch.float32)):
            return False, "compiled and launched but computed a wrong result"
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return False, f"{type(e).__name__}: {first}"
    return True, f"compiled and launched on {device} in {secs:.1f} s"


def run_preflight(dry_run: bool) -> list[dict]:
    """One row per item. On a dry run (Triton's interpreter, no GPU) only Triton itself is needed.
    """
    need = not dry_run
    found, detail = check_cuda()
    rows = [_row("CUDA device", found, detail, need)]
    triton = importlib.util.find_spec("triton") is not None
    rows.append(_row("triton", triton, _triton_version() if triton else "not installed", True))
    finders = (("C compiler", find_c_compiler), ("Python.h", find_python_h),
               ("libcuda.so.1", find_libcuda), ("Triton cache dir", triton_cache_writable))
    for item, finder in finders:
        found, detail = finder()
        rows.append(_row(item, found, detail, need))
    if all(r["ok"] for r in rows):
        found, detail = tiny_kernel("cpu" if dry_run else "cuda")
        rows.append(_row("tiny Triton kernel", found, detail, True))
    else:
        rows.append(_row("tiny Triton kernel", False, "not tried: fix the items above first", True))
    return rows


def stop_message(rows: list[dict]) -> str | None:
    """The message to stop with, or None when every needed item is there."""
    missing = [r for r in rows if not r["ok"]]
    if not missing:
        return None
    lines = ["gpu_check: stopping before any part; the pre-flight found missing:"]
    lines += [f"  - {r['item']}: {r['detail']}" for r in missing]
    return "\n".join(lines)


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"triton {version('triton')}"
    except PackageNotFoundError:
        return "triton (version unknown)"
