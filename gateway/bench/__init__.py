"""The benchmarks behind `tiergate bench ...` (and `tiergate classifier bench` / `bench-routing`).

Each module holds one benchmark's implementation and returns or yields its report; the typer
commands that parse options and print live in gateway.cli (bench.py, classifier_cmd.py), the only
importer of this package (an import-linter contract). Benchmarks sit above the app in the layers:
they build a Runtime / the app, a Ledger or a Pipeline as the gateway does, and measure it.

- pipeline, workload, quality: `tiergate bench pipeline [--outcomes FILE]`
- gateway, tools: `tiergate bench gateway` (tools runs as ``python -m gateway.bench.tools``)
- ledger_pg (its serving load: ledger_load): `tiergate bench ledger`; ledger_sqlite: `tiergate bench ledger-sqlite`
- ttft: `tiergate bench ttft` (time to first token of the cheap tiers through `tiergate serve`)
- engine: `tiergate bench engine` (the measurements live in engine.bench)
- routing: `tiergate bench routing` = `tiergate classifier bench-routing`
- classifier_latency: `tiergate classifier bench`
"""
