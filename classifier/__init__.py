"""The effort classifier: a sub-millisecond perceive layer that assigns reasoning-effort tiers.

Public API (the gateway uses only these names): features (`extract`), the inference
model (`EffortModel`), artifacts (`save_artifact`, `load_artifact`), the dataset builder
(`build_dataset`), training (`train`, `TrainConfig`), calibration, routing evaluation,
online learning (`OnlineRouter`) and the plain types.

scikit-learn, numpy and scipy only; never torch, web frameworks, databases, the gateway
or the engine. Importing this package loads no model and reads no file.
"""

from classifier.artifact import (
    ARTIFACT_FORMAT,
    LoadedArtifact,
    library_versions,
    load_artifact,
    metadata_path,
    new_version,
    read_metadata,
    save_artifact,
)
from classifier.calibrate import (
    DEFAULT_TARGET_MIX,
    bands_from_mix,
    calibrate_thresholds,
    expected_calibration_error,
    fit_temperature,
)
from classifier.data import EXCLUDED_SOURCES, build_dataset, dataset_hash
from classifier.evaluate import (
    Interval,
    RoutingCurve,
    RoutingMetrics,
    apgr,
    auroc,
    bootstrap,
    cpt,
    metrics,
    oracle_scores,
    prequential,
    routing_curve,
)
from classifier.features import FEATURE_VERSION, N_FEATURES, extract, split_conversation
from classifier.model import Contribution, EffortModel
from classifier.online import OnlineRouter, outcome_target
from classifier.outcomes import Outcome, load_outcomes
from classifier.routing_report import RouterEval, evaluate_routers, quality_at
from classifier.train import CVReport, TierMetrics, TrainConfig, TrainResult, cross_validate, featurize, train
from classifier.types import (
    TIER_INDEX,
    TIERS,
    ArtifactError,
    ClassifierError,
    EffortDecision,
    FeatureVersionError,
    LabelledExample,
    SparseFeatures,
    user_prompt,
)

__all__ = [
    "ARTIFACT_FORMAT", "DEFAULT_TARGET_MIX", "EXCLUDED_SOURCES", "FEATURE_VERSION", "N_FEATURES", "TIERS",
    "TIER_INDEX", "ArtifactError", "CVReport", "ClassifierError", "Contribution", "EffortDecision",
    "EffortModel", "FeatureVersionError", "Interval", "LabelledExample", "LoadedArtifact", "OnlineRouter",
    "Outcome", "RouterEval", "RoutingCurve", "RoutingMetrics", "SparseFeatures", "TierMetrics", "TrainConfig",
    "TrainResult", "apgr", "auroc", "bands_from_mix", "bootstrap", "build_dataset", "calibrate_thresholds",
    "cpt", "cross_validate", "dataset_hash", "evaluate_routers", "expected_calibration_error", "extract", "featurize", "fit_temperature",
    "library_versions", "load_artifact", "load_outcomes", "metadata_path", "metrics", "new_version",
    "oracle_scores", "outcome_target", "prequential", "quality_at", "read_metadata", "routing_curve", "save_artifact",
    "split_conversation", "train", "user_prompt",
]
