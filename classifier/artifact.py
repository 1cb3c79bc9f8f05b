"""The versioned classifier artifact: a skops file of plain arrays plus JSON metadata.

``<name>.skops`` holds only numpy arrays, strings and numbers (loaded with
``skops.io.load`` and an explicit, empty list of extra trusted types: nothing is ever
unpickled; skops is imported lazily because it imports every scikit-learn module, which
pulls in torch where torch is installed). ``<name>.json`` records the format and feature versions, library versions,
the training-data hash, the metrics and thresholds, and the sha256 of the .skops file;
loading refuses a file whose hash or versions do not match.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from classifier.features import FEATURE_VERSION, N_FEATURES
from classifier.model import EffortModel, TenantCorrection
from classifier.thresholds import ScoreWindow
from classifier.types import ArtifactError

ARTIFACT_FORMAT = 2  # 2: six single-tier bands, tier shares, tenant corrections, parent version
TRUSTED_TYPES: list[str] = []  # only skops's built-in safe types (ndarray, dict, list, str, numbers)


@dataclass(frozen=True)
class LoadedArtifact:
    model: EffortModel
    metadata: dict[str, Any]


def metadata_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    import scipy
    import sklearn
    import skops

    return {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "scikit-learn": sklearn.__version__, "skops": skops.__version__}


def new_version(data_hash: str, now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    return f"effort-{now.strftime('%Y%m%dT%H%M%S')}-{data_hash[:8]}"


def _payload(model: EffortModel) -> dict[str, Any]:
    return {
        "classes": list(model.classes), "tier_coef": model.tier_coef, "tier_intercept": model.tier_intercept,
        "temperature": float(model.temperature), "score_coef": model.score_coef,
        "score_intercept": float(model.score_intercept), "thresholds": [float(t) for t in model.thresholds],
        "bands": [list(b) for b in model.bands], "version": model.version,
        "feature_version": model.feature_version, "score_quantiles": [float(q) for q in model.score_quantiles],
        "ordinal_slope": float(model.ordinal_slope), "ordinal_cuts": [float(c) for c in model.ordinal_cuts],
        "ordinal_smoothing": float(model.ordinal_smoothing), "tier_shares": [float(x) for x in model.tier_shares],
        "tenants": {name: {"i": np.asarray(c.indices, dtype=np.int64), "x": np.asarray(c.values, dtype=np.float32),
                           "b": float(c.bias)} for name, c in model.tenants.items()},
        "parent_version": model.parent_version or "",
    }


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; an artifact is meant to be read by others
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_artifact(model: EffortModel, path: str | Path, *, data_hash: str,
                  metrics: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``path`` (.skops) then its metadata atomically; returns the metadata."""
    import skops.io as sio  # lazily: skops imports every sklearn module (and torch, if installed)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda tmp: sio.dump(_payload(model), tmp, compression=zipfile.ZIP_DEFLATED,
                                            compresslevel=6))
    meta = {
        "format": ARTIFACT_FORMAT, "version": model.version, "feature_version": model.feature_version,
        "n_features": N_FEATURES, "classes": list(model.classes), "thresholds": list(model.thresholds),
        "bands": [list(b) for b in model.bands], "temperature": model.temperature,
        "ordinal": [model.ordinal_slope, list(model.ordinal_cuts), model.ordinal_smoothing],
        "tier_shares": list(model.tier_shares), "parent_version": model.parent_version,
        "tenants": sorted(model.tenants),
        "training_data_hash": data_hash, "libraries": library_versions(), "metrics": metrics or {},
        "sha256": _sha256(path), "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    _atomic_write(metadata_path(path),
                  lambda tmp: tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8"))
    return meta


def read_metadata(path: str | Path) -> dict[str, Any]:
    mpath = metadata_path(path)
    try:
        meta = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"artifact metadata {mpath} is missing") from None
    except json.JSONDecodeError as err:
        raise ArtifactError(f"artifact metadata {mpath} is not valid JSON: {err}") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"artifact metadata {mpath} must be a JSON object")
    return meta


def load_artifact(path: str | Path, *, traffic: bool = True) -> LoadedArtifact:
    """Load and verify an artifact; raises ArtifactError with the reason on any mismatch. With
    ``traffic`` the model calibrates its thresholds on the scores it decides (a fresh
    ``ScoreWindow``; before it is warm, the stored thresholds apply)."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"classifier artifact {path} does not exist (train one with "
                            "`tiergate classifier train`)")
    meta = read_metadata(path)
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"artifact {path} has format {meta.get('format')!r}; this classifier reads "
                            f"format {ARTIFACT_FORMAT}. Retrain with `tiergate classifier train`.")
    if meta.get("feature_version") != FEATURE_VERSION or meta.get("n_features") != N_FEATURES:
        raise ArtifactError(f"artifact {path} was built for features {meta.get('feature_version')!r} "
                            f"({meta.get('n_features')} columns); this classifier computes "
                            f"{FEATURE_VERSION!r} ({N_FEATURES}). Retrain with `tiergate classifier train`.")
    digest = _sha256(path)
    if digest != meta.get("sha256"):
        raise ArtifactError(f"artifact {path} does not match the sha256 in its metadata "
                            f"(file {digest[:12]}…, metadata {str(meta.get('sha256'))[:12]}…): "
                            "it was modified or is half-written")
    import skops.io as sio

    try:
        untrusted = sio.get_untrusted_types(file=path)
        if [t for t in untrusted if t not in TRUSTED_TYPES]:
            raise ArtifactError(f"artifact {path} contains types outside the trusted list: {untrusted}")
        data = sio.load(path, trusted=TRUSTED_TYPES)
    except ArtifactError:
        raise
    except Exception as err:  # skops raises a variety of errors on corrupt zips
        raise ArtifactError(f"artifact {path} could not be read: {err}") from err
    try:
        model = EffortModel(
            classes=tuple(data["classes"]), tier_coef=np.asarray(data["tier_coef"], dtype=np.float32),
            tier_intercept=np.asarray(data["tier_intercept"], dtype=np.float32),
            temperature=float(data["temperature"]), score_coef=np.asarray(data["score_coef"], dtype=np.float32),
            score_intercept=float(data["score_intercept"]), thresholds=tuple(data["thresholds"]),
            bands=tuple(tuple(b) for b in data["bands"]), version=str(data["version"]),
            feature_version=str(data["feature_version"]),
            score_quantiles=tuple(float(q) for q in data.get("score_quantiles", [])),
            ordinal_slope=float(data.get("ordinal_slope", 0.0)),
            ordinal_cuts=tuple(float(c) for c in data.get("ordinal_cuts", [])),
            ordinal_smoothing=float(data.get("ordinal_smoothing", 0.0)),
            tier_shares=tuple(float(x) for x in data["tier_shares"]),
            tenants={str(name): TenantCorrection(np.asarray(c["i"], dtype=np.int64), np.asarray(c["x"], dtype=np.float32),
                                                 float(c["b"])) for name, c in dict(data.get("tenants", {})).items()},
            parent_version=str(data.get("parent_version") or "") or None,
            traffic=ScoreWindow() if traffic else None)
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"artifact {path} is missing or has malformed field: {err}") from err
    if model.version != meta.get("version"):
        raise ArtifactError(f"artifact {path} holds version {model.version} but its metadata says "
                            f"{meta.get('version')}")
    return LoadedArtifact(model=model, metadata=meta)


def publish_artifact(model: EffortModel, out_dir: str | Path, *, data_hash: str, live_name: str = "effort.skops",
                     metrics: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``<out_dir>/versions/<version>.skops`` and make it the live ``<out_dir>/<live_name>`` that
    running gateways hot-reload: metadata first, then the .skops (a reader between the two sees a hash
    mismatch, keeps its current model and retries). Returns (versioned path, live path)."""
    out = Path(out_dir)
    versioned = out / "versions" / f"{model.version}.skops"
    save_artifact(model, versioned, data_hash=data_hash, metrics=metrics,
                  extra={"parent_version": model.parent_version, **(extra or {})})
    live = out / live_name
    for src, dst in ((metadata_path(versioned), metadata_path(live)), (versioned, live)):
        _atomic_write(dst, lambda tmp, src=src: tmp.write_bytes(src.read_bytes()))
    return versioned, live
