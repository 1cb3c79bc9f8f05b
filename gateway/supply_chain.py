"""Supply-chain checks on the installed environment: forbidden releases and stray .pth files.

A ``.pth`` file in site-packages runs code at every interpreter start; the malicious
litellm 1.82.7/1.82.8 releases used exactly that. Imports nothing from the gateway.
"""

from __future__ import annotations

import fnmatch
import sysconfig
from importlib import metadata
from pathlib import Path

FORBIDDEN_RELEASES: dict[str, frozenset[str]] = {"litellm": frozenset({"1.82.7", "1.82.8"})}

# .pth files that ordinary tooling writes: setuptools' shim and editable installs.
ALLOWED_PTH_PATTERNS: tuple[str, ...] = (
    "distutils-precedence.pth",
    "__editable__.tiergate-*.pth",
    "_virtualenv.pth",
)


def site_packages_dirs() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return [Path(p) for p in sorted(paths) if Path(p).is_dir()]


def unexpected_pth_files(dirs: list[Path] | None = None) -> list[Path]:
    found = []
    for d in dirs if dirs is not None else site_packages_dirs():
        for pth in sorted(d.glob("*.pth")):
            if not any(fnmatch.fnmatch(pth.name, pat) for pat in ALLOWED_PTH_PATTERNS):
                found.append(pth)
    return found


def forbidden_installed() -> list[str]:
    bad = []
    for name, versions in FORBIDDEN_RELEASES.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if version in versions:
            bad.append(f"{name}=={version}")
    return bad


def problems() -> list[str]:
    out = [f"forbidden release installed: {b}" for b in forbidden_installed()]
    out += [f"unexpected .pth file: {p}" for p in unexpected_pth_files()]
    return out
