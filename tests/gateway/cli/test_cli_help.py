"""`tiergate … --help` renders flags as flags (issue 15: every bool option, --help included, was
shown with a ``<bool>`` value type, as if it took a value)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import gateway.cli as cli


@pytest.mark.parametrize("command", [[], ["tenants", "create"], ["tenants", "set"], ["serve"], ["batches", "show"],
                                     ["bench", "pipeline"]])
def test_help_shows_flags_without_a_value_type(command: list[str]) -> None:
    if not cli.app.registered_groups:
        cli._register()
    result = CliRunner().invoke(cli.app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    help_line = next(x for x in result.output.splitlines() if x.strip().startswith("--help"))
    assert help_line.split() == ["--help", "Show", "this", "message", "and", "exit."]
