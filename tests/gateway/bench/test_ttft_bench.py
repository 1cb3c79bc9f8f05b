"""`tiergate bench ttft`: the repository's config served from a temporary copy (state moved, paths
absolute), and a tiny run end to end against `tiergate serve` on the bundled demo model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.bench.ttft import REPO, TtftArgs, _config, run_ttft


def test_the_served_config_keeps_the_tiers_and_moves_the_state(tmp_path: Path) -> None:
    path = _config(tmp_path, REPO / "config.yaml")
    original = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg = yaml.safe_load(path.read_text())
    assert cfg["tiers"] == original["tiers"]
    assert cfg["database"]["default_url"] == f"sqlite:///{tmp_path / 'ttft.db'}"
    assert cfg["ledger"]["journal_dir"] == str(tmp_path / "journal")
    assert cfg["classifier"]["feedback_dir"] == str(tmp_path / "classifier")
    assert Path(cfg["classifier"]["artifact"]).is_file()
    model = cfg["models"]["demo-moe"]
    assert Path(model["model"]).is_absolute() and (Path(model["model"]) / "config.json").is_file()


@pytest.mark.integration
@pytest.mark.process
@pytest.mark.slow
def test_ttft_bench_runs_end_to_end(tmp_path: Path) -> None:
    text = run_ttft(TtftArgs(tiers=("none",), clients=(1, 2), requests=4, max_tokens=8))
    rows = re.findall(r"^none +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+|nan) +([\d.]+) +"
                      r"(met|NOT met) / (met|NOT met)$", text, re.M)
    assert [r[0] for r in rows] == ["1", "2"]
    for _, p50, p90, p99, stream, _, agg, _, _ in rows:
        assert 0 < float(p50) <= float(p90) <= float(p99)
        assert float(p50) <= float(stream)  # the first token comes before the stream's end
        assert float(agg) > 0
