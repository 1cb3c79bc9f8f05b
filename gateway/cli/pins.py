"""`python -m gateway.cli.pins --check`: fail the set-up when the venv is not trustworthy."""

from __future__ import annotations

import sys

from gateway.supply_chain import problems


def main(argv: list[str]) -> int:
    found = problems()
    for p in found:
        print(f"tiergate: {p}", file=sys.stderr)
    return 1 if found and "--check" in argv else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
