"""The venv must hold no forbidden release and no unexpected .pth file."""

from pathlib import Path

from gateway.supply_chain import forbidden_installed, unexpected_pth_files


def test_no_unexpected_pth_files_in_venv() -> None:
    assert unexpected_pth_files() == []


def test_unexpected_pth_detected(tmp_path: Path) -> None:
    (tmp_path / "distutils-precedence.pth").write_text("")
    (tmp_path / "litellm_init.pth").write_text("import os")
    assert [p.name for p in unexpected_pth_files([tmp_path])] == ["litellm_init.pth"]


def test_no_forbidden_release() -> None:
    assert forbidden_installed() == []


def test_pins_exclude_malicious_litellm() -> None:
    pins = (Path(__file__).resolve().parents[1] / "requirements" / "constraints.txt").read_text()
    assert "litellm==1.82.7" not in pins and "litellm==1.82.8" not in pins
    assert "litellm==" in pins and "torch==2.13.0" in pins
