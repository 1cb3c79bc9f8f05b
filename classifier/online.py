"""Learning from outcomes, online: each record is the arm that ran, its outcome, its cost and the
propensity of choosing it — off-policy, incremental, under a small explicit exploration share
(classifier.policy). Only the arm that ran reveals its outcome.

``OffPolicyLearner`` is a doubly-robust learner of *how much a stronger arm pays* on a prompt,
updated one logged ``OutcomeRecord`` at a time (sparse AdaGrad over the model's hashed features,
microseconds a record):

1. an outcome model μ(x, a) = σ(h(x) + s_a·d(x)) — ``s_a`` the arm's effort position in the
   arms in play, centred, from −½ (cheapest) to +½ (strongest) — learns from every revealed
   outcome whatever arm ran;
2. each record gives the doubly-robust pseudo-outcome of the effort contrast
   Ĝ = Σ_a c_a μ(x, a) + c_A (r − μ(x, A)) / p_A  (``c`` the least-squares slope over the arms'
   efforts, scaled so that two arms give Ĝ = Γ_strong − Γ_cheap; 1/p clipped at ``max_weight``),
   unbiased for the gain whenever the propensities are right, whatever μ's errors;
3. the router's score ĝ(x) = α·z(x) + w·x + b regresses Ĝ, where z is the base model's raw score
   standardised: before any update ĝ ranks prompts exactly as the base model does.

Per-tenant corrections (``tenant_weight`` > 0) learn the residual Ĝ − ĝ(x) of each tenant on
top of the global model, with their own stronger shrinkage. ``to_model`` folds everything
back into an ``EffortModel`` (same features, same decision cost) whose first version equals
the base model exactly; ``save_learner`` / ``load_learner`` keep the state between processes
(numpy ``.npz``, no pickle).

``OnlineRouter`` (at the end) is the older full-information variant that ``tiergate classifier
eval --prequential`` uses: it sees both arms' outcomes of every prompt.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifier.features import N_FEATURES, extract, extract_arrays, to_arrays
from classifier.model import SCORE_SLOPE, EffortModel, TenantCorrection
from classifier.outcomes import OutcomeRecord
from classifier.types import TIER_INDEX, TIERS, ClassifierError, Message, SparseFeatures

LEARNER_FORMAT = 1
PRIOR_WEIGHT = 100.0
STATS_HORIZON = 2000.0


@dataclass(frozen=True)
class LearnerConfig:
    arms: tuple[str, ...] = TIERS  # the arms in play, cheapest first (records of other arms are skipped)
    efforts: tuple[float, ...] = ()  # effort of each arm (default: the tier index, else evenly spaced)
    lr_outcome: float = 0.1  # AdaGrad step of the outcome model
    lr_score: float = 0.02  # AdaGrad step of the score's feature weights
    lr_scalar: float = 0.02  # AdaGrad step of the score's scale on the base score and its bias
    max_weight: float = 20.0  # importance weights 1/p are clipped here (variance control)
    prior_scale: float = 0.1  # gain per base-score standard deviation before any update
    tenant_weight: float = 0.0  # > 0: learn per-tenant corrections at this step size
    tenant_l2: float = 1e-2
    tenant_min_records: int = 50  # a tenant's correction is used (and exported) only after this many

    def effort_positions(self) -> np.ndarray:
        """Each arm's position from −½ (cheapest) to +½ (strongest)."""
        if self.efforts:
            e = np.asarray(self.efforts, dtype=float)
        elif all(a in TIER_INDEX for a in self.arms):
            e = np.asarray([TIER_INDEX[a] for a in self.arms], dtype=float)
        else:
            e = np.arange(len(self.arms), dtype=float)
        if len(e) != len(self.arms) or len(self.arms) < 2 or e.max() <= e.min():
            raise ClassifierError("the learner needs at least two arms of different effort")
        return (e - e.min()) / (e.max() - e.min()) - 0.5


def contrast(positions: np.ndarray) -> np.ndarray:
    """Least-squares slope coefficients over arms at ``positions`` (spread 1): Σ c_a y_a is the
    slope of y over effort, i.e. the gain from the cheapest to the strongest arm if y is linear."""
    centred = positions - positions.mean()
    return centred / float(centred @ centred)


def _raw_stats(model: EffortModel) -> tuple[float, float]:
    """Median and spread (half the 16–84% range) of the base model's raw score on its reference."""
    q = np.asarray(model.score_quantiles)
    if len(q) < 3:
        return 0.5, 0.2
    p = np.clip(np.interp([0.16, 0.5, 0.84], np.linspace(0, 1, len(q)), q), 1e-9, 1 - 1e-9)
    raw = 0.5 + np.log(p / (1 - p)) / SCORE_SLOPE
    return float(raw[1]), float(max((raw[2] - raw[0]) / 2, 1e-3))


class _Sparse:
    """A sparse AdaGrad weight vector (dict-based: used per tenant)."""

    __slots__ = ("bias", "g_bias", "grad_sq", "n", "w")

    def __init__(self) -> None:
        self.w: dict[int, float] = {}
        self.grad_sq: dict[int, float] = {}
        self.bias = 0.0
        self.g_bias = 0.0
        self.n = 0

    def dot(self, idx: np.ndarray, val: np.ndarray) -> float:
        w = self.w
        return self.bias + sum(w.get(i, 0.0) * v for i, v in zip(idx.tolist(), val.tolist(), strict=True))

    def step(self, idx: np.ndarray, val: np.ndarray, grad: float, lr: float, l2: float) -> None:
        for i, v in zip(idx.tolist(), val.tolist(), strict=True):
            g = grad * v + l2 * self.w.get(i, 0.0)
            s = self.grad_sq.get(i, 0.0) + g * g
            self.grad_sq[i] = s
            self.w[i] = self.w.get(i, 0.0) - lr * g / math.sqrt(s + 1e-8)
        gb = grad + l2 * self.bias
        self.g_bias += gb * gb
        self.bias -= lr * gb / math.sqrt(self.g_bias + 1e-8)
        self.n += 1


class OffPolicyLearner:
    """Doubly-robust, incremental learner of the gain of stronger arms (see the module docstring)."""

    def __init__(self, base: EffortModel, config: LearnerConfig | None = None) -> None:
        self.base = base
        self.config = cfg = config or LearnerConfig()
        self.arm_index = {a: i for i, a in enumerate(cfg.arms)}
        self.positions = cfg.effort_positions()
        self.contrast = contrast(self.positions)
        self.raw_mean, self.raw_sd = _raw_stats(base)
        # outcome model: h(x) = u·x + bu, d(x) = v·x + bv
        self.u = np.zeros(N_FEATURES)
        self.v = np.zeros(N_FEATURES)
        self.gu = np.zeros(N_FEATURES)
        self.gv = np.zeros(N_FEATURES)
        self.scalars = np.zeros(4)  # bu, bv, score scale a, score bias b
        self.scalars[2] = cfg.prior_scale
        self.g_scalars = np.zeros(4)
        # score model: ĝ(x) = a·z(x) + w·x + b
        self.w = np.zeros(N_FEATURES)
        self.gw = np.zeros(N_FEATURES)
        self.tenants: dict[str, _Sparse] = {}
        # running mean and variance of ĝ on the records learned from (prior: the base score's, i.e.
        # mean 0 and sd a0, worth PRIOR_WEIGHT records): the export maps ĝ's spread onto the base
        # score's, so learned scores stay in the same range (no saturation, same thresholds scale)
        self.g_stats = np.asarray([0.0, cfg.prior_scale ** 2])
        self.seen = 0
        self.skipped = 0

    # -- features -----------------------------------------------------------------------
    @staticmethod
    def arrays(record: OutcomeRecord) -> tuple[np.ndarray, np.ndarray]:
        if record.features is not None:
            return to_arrays(record.features)
        return extract_arrays(record.messages or [])

    def _z(self, idx: np.ndarray, val: np.ndarray) -> float:
        return (self.base.raw_score(idx, val) - self.raw_mean) / self.raw_sd

    # -- predictions --------------------------------------------------------------------
    def gain(self, idx: np.ndarray, val: np.ndarray, tenant: str | None = None) -> float:
        """ĝ(x): the predicted gain of the strongest over the cheapest arm (the routing score)."""
        a, b = self.scalars[2], self.scalars[3]
        g = a * self._z(idx, val) + float(val @ self.w[idx]) + b
        t = self.tenants.get(tenant) if tenant is not None else None
        if t is not None and t.n >= self.config.tenant_min_records:
            g += t.dot(idx, val)
        return g

    def outcome_probs(self, idx: np.ndarray, val: np.ndarray) -> np.ndarray:
        """μ(x, a) for every arm in play."""
        h = float(val @ self.u[idx]) + self.scalars[0]
        d = float(val @ self.v[idx]) + self.scalars[1]
        return 1.0 / (1.0 + np.exp(-np.clip(h + self.positions * d, -30, 30)))

    def score(self, idx: np.ndarray, val: np.ndarray, tenant: str | None = None) -> float:
        """The routing score in the base model's units (a squashed raw score in (0, 1)): what
        ``to_model`` would decide."""
        raw = self.raw_mean + self.raw_sd * (self.gain(idx, val, tenant) - self.g_stats[0]) / self._g_sd()
        return 1.0 / (1.0 + math.exp(-max(min(SCORE_SLOPE * (raw - 0.5), 700.0), -700.0)))

    def _g_sd(self) -> float:
        return float(max(math.sqrt(self.g_stats[1]), 1e-6))

    # -- learning -----------------------------------------------------------------------
    def pseudo_outcome(self, record: OutcomeRecord, idx: np.ndarray, val: np.ndarray,
                       mu: np.ndarray | None = None) -> float | None:
        """The doubly-robust contrast Ĝ of one record (None for an arm not in play)."""
        k = self.arm_index.get(record.arm)
        if k is None:
            return None
        mu = self.outcome_probs(idx, val) if mu is None else mu
        weight = min(1.0 / record.propensity, self.config.max_weight)
        return float(self.contrast @ mu + self.contrast[k] * weight * (record.outcome - mu[k]))

    def update(self, record: OutcomeRecord, arrays: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
        """Learn from one logged outcome; False if its arm is not in play."""
        idx, val = arrays if arrays is not None else self.arrays(record)
        k = self.arm_index.get(record.arm)
        if k is None:
            self.skipped += 1
            return False
        cfg = self.config
        mus = self.outcome_probs(idx, val)
        target = self.pseudo_outcome(record, idx, val, mus)
        assert target is not None
        # 1. outcome model (log-loss on the revealed outcome)
        err = mus[k] - record.outcome
        pos = self.positions[k]
        self._adagrad(self.u, self.gu, idx, val, err, cfg.lr_outcome)
        self._adagrad(self.v, self.gv, idx, val, err * pos, cfg.lr_outcome)
        # 2. score model (squared loss towards the pseudo-outcome)
        z = self._z(idx, val)
        g_global = self.scalars[2] * z + float(val @ self.w[idx]) + self.scalars[3]
        resid = g_global - target
        beta = max(1.0 / (self.seen + PRIOR_WEIGHT), 1.0 / STATS_HORIZON)
        delta = g_global - self.g_stats[0]
        self.g_stats[0] += beta * delta
        self.g_stats[1] = (1 - beta) * (self.g_stats[1] + beta * delta * delta)
        self._adagrad(self.w, self.gw, idx, val, resid, cfg.lr_score)
        grads = np.asarray([err, err * pos, resid * z, resid])
        self.g_scalars += grads * grads
        lrs = np.asarray([cfg.lr_outcome, cfg.lr_outcome, cfg.lr_scalar, cfg.lr_scalar])
        self.scalars -= lrs * grads / np.sqrt(self.g_scalars + 1e-8)
        # 3. the tenant's correction of what the global model still misses
        if cfg.tenant_weight > 0 and record.tenant is not None:
            t = self.tenants.setdefault(record.tenant, _Sparse())
            t.step(idx, val, g_global + t.dot(idx, val) - target, cfg.tenant_weight, cfg.tenant_l2)
        self.seen += 1
        return True

    @staticmethod
    def _adagrad(w: np.ndarray, g2: np.ndarray, idx: np.ndarray, val: np.ndarray, grad: float, lr: float) -> None:
        g = grad * val.astype(np.float64)
        g2[idx] += g * g
        w[idx] -= lr * g / np.sqrt(g2[idx] + 1e-8)

    def update_many(self, records: Sequence[OutcomeRecord]) -> int:
        return sum(self.update(r) for r in records)

    # -- export -------------------------------------------------------------------------
    def to_model(self, version: str) -> EffortModel:
        """The learned router as an ``EffortModel``: raw'(x) = m + sd·(ĝ(x) − mean ĝ) / sd ĝ with the
        base model's raw median m and spread sd, folded into one coefficient vector (before any
        update it is the base model exactly)."""
        a, b = float(self.scalars[2]), float(self.scalars[3])
        g_sd = self._g_sd()
        k = self.raw_sd / g_sd
        scale = a / g_sd  # on the base score
        coef = (scale * self.base.score_coef.astype(np.float64) + k * self.w).astype(np.float32)
        intercept = self.raw_mean + scale * (self.base.score_intercept - self.raw_mean) + k * (b - self.g_stats[0])
        tenants = {name: TenantCorrection(c.indices, scale * c.values, scale * c.bias)
                   for name, c in self.base.tenants.items()}
        for name, t in self.tenants.items():
            if t.n < self.config.tenant_min_records:
                continue
            merged: dict[int, float] = {}
            old = tenants.get(name)
            if old is not None:
                merged.update(zip(old.indices.tolist(), old.values.tolist(), strict=True))
            for i, x in t.w.items():
                merged[i] = merged.get(i, 0.0) + k * x
            order = sorted(merged)
            tenants[name] = TenantCorrection(np.asarray(order, dtype=np.int64),
                                             np.asarray([merged[i] for i in order], dtype=np.float32),
                                             (old.bias if old is not None else 0.0) + k * t.bias)
        return dataclasses.replace(self.base, score_coef=coef, score_intercept=float(intercept), tenants=tenants,
                                   version=version, parent_version=self.base.version,
                                   traffic=None)


def save_learner(learner: OffPolicyLearner, path: str | Path) -> None:
    """The learner's state (not its base model: that is the artifact named by ``base_version``)."""
    state: dict[str, np.ndarray] = {"format": np.asarray([LEARNER_FORMAT]), "scalars": learner.scalars,
                                    "g_stats": learner.g_stats,
                                    "g_scalars": learner.g_scalars, "counts": np.asarray([learner.seen,
                                                                                          learner.skipped]),
                                    "base_version": np.asarray([learner.base.version]),
                                    "arms": np.asarray(list(learner.config.arms))}
    for name in ("u", "v", "gu", "gv", "w", "gw"):
        vec = getattr(learner, name)
        nz = np.flatnonzero(vec)
        state[name + "_i"], state[name + "_x"] = nz.astype(np.int64), vec[nz]
    tenants = sorted(learner.tenants)
    state["tenant_names"] = np.asarray(tenants if tenants else [""])
    for j, name in enumerate(tenants):
        t = learner.tenants[name]
        keys = sorted(t.w)
        state[f"t{j}_i"] = np.asarray(keys, dtype=np.int64)
        state[f"t{j}_x"] = np.asarray([t.w[i] for i in keys])
        state[f"t{j}_g"] = np.asarray([t.grad_sq[i] for i in keys])
        state[f"t{j}_s"] = np.asarray([t.bias, t.g_bias, t.n])
    with Path(path).open("wb") as fh:
        np.savez_compressed(fh, **state)  # type: ignore[arg-type]


def load_learner(path: str | Path, base: EffortModel, config: LearnerConfig | None = None) -> OffPolicyLearner:
    """A learner saved by ``save_learner`` on top of ``base`` (which must be the version it was saved with)."""
    with np.load(Path(path), allow_pickle=False) as data:
        if int(data["format"][0]) != LEARNER_FORMAT:
            raise ClassifierError(f"learner state {path} has format {int(data['format'][0])}, expected "
                                  f"{LEARNER_FORMAT}")
        if str(data["base_version"][0]) != base.version:
            raise ClassifierError(f"learner state {path} was learned on {data['base_version'][0]}, not {base.version}")
        cfg = config or LearnerConfig(arms=tuple(str(a) for a in data["arms"]))
        learner = OffPolicyLearner(base, cfg)
        learner.scalars[:] = data["scalars"]
        learner.g_scalars[:] = data["g_scalars"]
        learner.g_stats[:] = data["g_stats"]
        learner.seen, learner.skipped = (int(x) for x in data["counts"])
        for name in ("u", "v", "gu", "gv", "w", "gw"):
            getattr(learner, name)[data[name + "_i"]] = data[name + "_x"]
        for j, name in enumerate(str(n) for n in data["tenant_names"]):
            if not name:
                continue
            t = _Sparse()
            t.w = dict(zip(data[f"t{j}_i"].tolist(), data[f"t{j}_x"].tolist(), strict=True))
            t.grad_sq = dict(zip(data[f"t{j}_i"].tolist(), data[f"t{j}_g"].tolist(), strict=True))
            t.bias, t.g_bias, n = (float(x) for x in data[f"t{j}_s"])
            t.n = int(n)
            learner.tenants[name] = t
    return learner


def _logit(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)  # only clip where float64 itself saturates: keep the base order
    return math.log(p / (1 - p))


class OnlineRouter:
    """Base score + an online logistic correction; ``score`` in [0, 1], higher = stronger tier."""

    def __init__(self, model: EffortModel, *, learning_rate: float = 0.05, l2: float = 1e-4) -> None:
        self.model = model
        self.learning_rate = learning_rate
        self.l2 = l2
        self.weights = np.zeros(N_FEATURES, dtype=np.float64)
        self.base_weight = 1.0
        self.bias = 0.0
        self.seen = 0

    def _z(self, features: SparseFeatures) -> tuple[float, float, np.ndarray, np.ndarray]:
        base = _logit(self.model.score_features(features))
        idx, val = to_arrays(features)
        return self.base_weight * base + self.bias + float(val @ self.weights[idx]), base, idx, val

    def score_features(self, features: SparseFeatures) -> float:
        z = self._z(features)[0]
        return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))

    def score(self, messages: Sequence[Message]) -> float:
        return self.score_features(extract(messages))

    def learn_features(self, features: SparseFeatures, target: float) -> None:
        """One SGD step on log-loss towards ``target`` in [0, 1] (1 = the strong tier was needed)."""
        z, base, idx, val = self._z(features)
        p = 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))
        grad = p - min(max(target, 0.0), 1.0)
        lr = self.learning_rate
        self.weights[idx] -= lr * (grad * val + self.l2 * self.weights[idx])
        self.bias -= lr * grad
        self.base_weight -= lr * grad * base * 0.1
        self.seen += 1

    def learn(self, messages: Sequence[Message], target: float) -> None:
        self.learn_features(extract(messages), target)


def outcome_target(cheap: float, strong: float) -> float:
    """How much a prompt needed the strong model, in [0, 1] (0.5 = no difference)."""
    return (float(strong) - float(cheap) + 1.0) / 2.0
