"""Compile `tg_kernels.c` (which includes ``tg_step.c``) into a shared library for this machine, once, and cache it.

The library is built with the system C compiler (``$CC`` or ``cc``) at ``-O3 -march=native``
(``TIERGATE_NATIVE_MARCH`` picks another target) and OpenMP; the cache key covers the sources (every ``.c``
file beside ``tg_kernels.c``), the flags, the compiler's version and the CPU's
feature flags (for ``-march=native`` builds), so a cache copied to another machine is rebuilt
rather than run with instructions that machine lacks. Builds write to a temporary file and rename it into place,
so concurrent processes never load a half-written library.

Cache folder: ``$TIERGATE_NATIVE_CACHE``, else ``~/.cache/tiergate/native``, else a folder
under the system temp dir. ``python -m engine.native.build`` builds it ahead of time (the
Makefile does, so the first request does not pay ~2 s of compilation) and prints the path.

Imports nothing outside the standard library.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("tg_kernels.c")
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-Wall", "-Werror")


def flags() -> tuple[str, ...]:
    """Compiler flags: ``-march=native`` unless ``TIERGATE_NATIVE_MARCH`` names a target (for a library built
    on one machine to run on others, e.g. ``x86-64-v3``; the kernels use AVX-512 only when it is targeted)."""
    return (*BASE_FLAGS, f"-march={os.environ.get('TIERGATE_NATIVE_MARCH') or 'native'}")


class BuildError(RuntimeError):
    """The native kernels could not be compiled here (no compiler, or it failed)."""


def compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    exe = cc.split()[0]
    return exe if shutil.which(exe) else (shutil.which("cc") or shutil.which("gcc"))


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    configured = os.environ.get("TIERGATE_NATIVE_CACHE")
    candidates = [Path(configured)] if configured else []
    candidates += [Path.home() / ".cache" / "tiergate" / "native", Path(tempfile.gettempdir()) / "tiergate-native"]
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise BuildError(f"no writable cache folder among {', '.join(map(str, candidates))}")


def sources() -> list[Path]:
    """The main source and the files it includes (every ``.c`` file beside it)."""
    return [SOURCE, *sorted(p for p in SOURCE.parent.glob("*.c") if p != SOURCE)]


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    native = "-march=native" in flags()  # only a native build depends on this CPU; a named target runs anywhere
    for part in (*(p.read_bytes() for p in sources()), " ".join(flags()).encode(), version.encode(),
                 (_cpu_fingerprint() if native else "").encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"tg_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Path to the compiled library, compiling it first if this machine has no cached copy."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (set CC, or install gcc)")
    target = library_path(cc)
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags(), str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise BuildError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def main() -> int:
    try:
        print(build())
    except BuildError as exc:
        print(f"native kernels not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
