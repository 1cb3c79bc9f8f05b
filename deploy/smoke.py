"""The traffic half of `make deploy-smoke` (deploy/smoke.sh starts the compose stack first).

Everything goes through the nginx proxy, with the official SDKs where there is one:
  1. one OpenAI chat completion (``openai``), checked against its ledger row;
  2. one Anthropic Messages request (``anthropic``), checked against its ledger row;
  3. one batch (files + batches API) run by the Celery worker to completion;
  4. a stream of chat requests while one gateway replica's container is killed with SIGKILL and
     replaced by a new container on the same journal volume; afterwards every request answered
     200 must have its ledger row (the new replica replays the dead one's journal).
Prints a summary and exits 1 on any failure. Needs the repo's .venv (openai, anthropic, httpx,
psycopg) and the docker CLI.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import httpx
import openai
import psycopg

from gateway.ledger.entries import LedgerEntry
from gateway.ledger.journal import read_segment

MODEL = "demo-moe"


@dataclass
class Outcome:
    failures: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, ok: bool, what: str) -> bool:
        self.say(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failures.append(what)
        return ok


def ledger_rows(dsn: str, request_ids: list[str]) -> dict[str, int]:
    """Ledger rows per request id, for the ids given."""
    if not request_ids:
        return {}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT request_id, count(*) FROM ledger_entries WHERE request_id = ANY(%s) "
                            "GROUP BY request_id", (request_ids,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def wait_for_rows(dsn: str, request_ids: list[str], timeout_s: float) -> dict[str, int]:
    """Ledger rows for ``request_ids``, polled until every id has one or ``timeout_s`` passes (the
    journal flushes in the background, and a restarted replica replays its dead writer's rows)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = ledger_rows(dsn, request_ids)
        if len(found) == len(set(request_ids)) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def chat_request(out: Outcome, base: str, key: str, dsn: str) -> None:
    out.say("1. OpenAI chat completion through the proxy (openai SDK)")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Say hello to the operators."}])
    resp = raw.parse()
    request_id = raw.headers.get("x-request-id", "")
    text = resp.choices[0].message.content or ""
    out.say(f"     id={resp.id} x-request-id={request_id} usage={resp.usage.model_dump() if resp.usage else None}"
            f" text={text[:60]!r}")
    out.check(raw.status_code == 200 and bool(resp.choices) and resp.usage is not None, "chat answered 200 with usage")
    rows = wait_for_rows(dsn, [request_id], 30)
    out.check(rows.get(request_id, 0) >= 1, f"ledger rows for the chat request: {rows.get(request_id, 0)}")


def anthropic_request(out: Outcome, base: str, key: str, dsn: str) -> None:
    out.say("2. Anthropic Messages request through the proxy (anthropic SDK)")
    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=16, system="You are terse.",
        messages=[{"role": "user", "content": "Name one colour."}])
    msg = raw.parse()
    request_id = raw.headers.get("x-request-id", "")
    text = "".join(b.text for b in msg.content if b.type == "text")
    out.say(f"     id={msg.id} x-request-id={request_id} stop_reason={msg.stop_reason} "
            f"usage=in {msg.usage.input_tokens}/out {msg.usage.output_tokens} text={text[:60]!r}")
    out.check(msg.type == "message" and msg.usage.output_tokens > 0, "messages answered 200 with usage")
    rows = wait_for_rows(dsn, [request_id], 30) if request_id else {}
    out.check(rows.get(request_id, 0) >= 1, f"ledger rows for the Anthropic request: {rows.get(request_id, 0)}")


def batch_request(out: Outcome, base: str, key: str, timeout_s: float) -> None:
    out.say("3. Batch (files + batches API, Celery worker) through the proxy")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"Count to {i}."}]}}
             for i in range(1, 4)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = client.files.create(file=("smoke.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    out.say(f"     file={f.id} batch={batch.id} status={batch.status}")
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    out.say(f"     status={batch.status} request_counts={counts.model_dump() if counts else None}")
    if not out.check(batch.status == "completed" and counts is not None and counts.completed == len(lines),
                     f"batch completed, {len(lines)} lines"):
        return
    assert batch.output_file_id is not None
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines() if x.strip()]
    codes = sorted(r["response"]["status_code"] for r in results)
    out.check(codes == [200] * len(lines), f"output file: status codes {codes}")


def journaled_entry_ids(volume: str) -> set[str]:
    """Ids of the ledger rows in the journal segments on a docker volume (all writers' dirs)."""
    mount = subprocess.run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", volume],
                           check=True, capture_output=True, text=True).stdout.strip()
    ids: set[str] = set()
    for path in Path(mount).rglob("*.jsonl"):
        if path.stem.isdigit():
            ids.update(r.id for r in read_segment(path).records if isinstance(r, LedgerEntry))
    return ids


def rows_present(dsn: str, ids: set[str]) -> set[str]:
    if not ids:
        return set()
    with psycopg.connect(dsn) as conn:
        return {str(r[0]) for r in conn.execute("SELECT id FROM ledger_entries WHERE id = ANY(%s)", (list(ids),))}


def container_id(project: str, service: str) -> str:
    ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}",
                          "--filter", f"label=com.docker.compose.service={service}"],
                         check=True, capture_output=True, text=True).stdout.split()
    if len(ids) != 1:
        raise RuntimeError(f"expected one container of {project}/{service}, found {len(ids)}")
    return ids[0]


def wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def kill_under_load(out: Outcome, args: argparse.Namespace) -> None:
    out.say(f"4. kill -9 of {args.kill_service} under load ({args.load_threads} clients through the proxy)")
    answered: list[tuple[int, str]] = []  # (status, x-request-id)
    errors: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client(n: int) -> None:
        with httpx.Client(base_url=args.base, timeout=120,
                          headers={"Authorization": f"Bearer {args.key}"}) as http:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": MODEL, "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"client {n} request {i}: say ok"}]}
                try:
                    r = http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as err:
                    with lock:
                        errors[type(err).__name__] += 1
                    continue
                with lock:
                    answered.append((r.status_code, r.headers.get("x-request-id", "")))

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(args.load_threads)]
    for t in threads:
        t.start()
    time.sleep(args.load_before_s)
    cid = container_id(args.project, args.kill_service)
    with lock:
        before = len(answered)
    subprocess.run(["docker", "kill", "--signal", "KILL", cid], check=True, capture_output=True)
    out.say(f"     {before} requests answered before the kill; sent SIGKILL to the container of "
            f"{args.kill_service} ({cid[:12]}) while requests were in flight")
    # What the dead replica left: rows in its journal volume that are not in the database yet
    # (answered, not yet committed; deploy/docker-compose.smoke.yml spaces its commits 2 s
    # apart). Its restart must replay exactly these.
    volume = f"{args.project}_{args.kill_volume}"
    journaled = journaled_entry_ids(volume)
    pending = journaled - rows_present(args.dsn, journaled)
    out.say(f"     its journal ({volume}): {len(journaled)} rows in live segments, {len(pending)} of them "
            f"not yet in the database at the kill")
    # A new container, not the old one started again: what carries the journal over is the
    # replica's volume, as when an orchestrator replaces a dead container.
    subprocess.run(["docker", "rm", "-f", cid], check=True, capture_output=True)
    compose = ["docker-compose", "-p", args.project, *[x for f in args.compose_files.split(",") for x in ("-f", f)]]
    subprocess.run([*compose, "up", "-d", "--no-deps", args.kill_service], check=True, capture_output=True)
    cid = container_id(args.project, args.kill_service)
    out.say(f"     removed it and created a new {args.kill_service} container ({cid[:12]}) on the same journal volume")
    ready = wait_ready(args.kill_ready_url, args.restart_timeout_s)
    with lock:
        at_restart = len(answered)
    out.check(ready, f"the new {args.kill_service} is ready ({args.kill_ready_url})")
    time.sleep(args.load_after_s)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    statuses = Counter(s for s, _ in answered)
    ok_ids = [rid for s, rid in answered if s == 200]
    out.say(f"     responses: {len(answered)} ({dict(sorted(statuses.items()))}), transport errors: "
            f"{dict(errors) or 0}; {at_restart} answered by the time the replica was ready again")
    out.check(len(ok_ids) > 0 and all(ok_ids), "requests answered 200, each with an x-request-id")
    rows = wait_for_rows(args.dsn, ok_ids, args.ledger_timeout_s)
    missing = [rid for rid in ok_ids if rid not in rows]
    out.say(f"     ledger: {len(rows)} of {len(ok_ids)} requests answered 200 have their rows "
            f"({sum(rows.values())} rows); missing: {len(missing)}")
    out.check(not missing, "no ledger row lost: every request answered 200 has its ledger row")
    replayed = rows_present(args.dsn, pending)
    out.check(replayed == pending, f"the {len(pending)} rows pending in the killed replica's journal are in the "
                                   f"database after its restart ({len(replayed)} found)")
    logs = subprocess.run(["docker", "logs", "--since", "2m", cid], capture_output=True, text=True)
    replay = [line for line in (logs.stdout + logs.stderr).splitlines() if "replaying" in line or "adopted" in line]
    out.say(f"     its log after the restart: {replay[-1][:200] if replay else 'no journal replay logged'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="http://127.0.0.1:28080", help="the proxy")
    p.add_argument("--key", required=True, help="a tenant API key")
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:25432/tiergate")
    p.add_argument("--project", default="tiergate-smoke")
    p.add_argument("--compose-files", default="deploy/docker-compose.yml,deploy/docker-compose.smoke.yml")
    p.add_argument("--kill-service", default="gateway-1")
    p.add_argument("--kill-volume", default="journal-gateway-1", help="its journal volume (compose name)")
    p.add_argument("--kill-ready-url", default="http://127.0.0.1:28081/readyz")
    p.add_argument("--load-threads", type=int, default=4)
    p.add_argument("--load-before-s", type=float, default=4.0)
    p.add_argument("--load-after-s", type=float, default=4.0)
    p.add_argument("--restart-timeout-s", type=float, default=180.0)
    p.add_argument("--ledger-timeout-s", type=float, default=30.0)
    p.add_argument("--batch-timeout-s", type=float, default=300.0)
    args = p.parse_args()
    out = Outcome()
    steps = [lambda: chat_request(out, args.base, args.key, args.dsn),
             lambda: anthropic_request(out, args.base, args.key, args.dsn),
             lambda: batch_request(out, args.base, args.key, args.batch_timeout_s),
             lambda: kill_under_load(out, args)]
    for step in steps:
        try:
            step()
        except Exception as err:  # a step that raises is a failed step; the others still run
            out.check(False, f"step raised {type(err).__name__}: {err}")
    print("\n== deploy smoke summary ==")
    for line in out.lines:
        if line.lstrip().startswith("[") or not line.startswith(" "):
            print(line)
    print(f"RESULT: {'FAIL (' + str(len(out.failures)) + ' failed)' if out.failures else 'PASS'}")
    return 1 if out.failures else 0


if __name__ == "__main__":
    sys.exit(main())
