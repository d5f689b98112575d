"""Remove the engine-cache entries a plan names, and orphans and debris (a cache GC Job).

    kiln cache-gc --plan /etc/kiln/cache-gc/plan.json [--cache-dir DIR] [--dry-run]

The operator decides and writes the plan (a ConfigMap mounted at --plan), having removed
the due keys from its engine index first; this executes it on the claim, mounted
read-write at --cache-dir:

    {"schema": 1, "namespace": "ns", "decidedAt": <epoch seconds>, "graceSeconds": 3600,
     "dryRun": false, "remove": [{"model", "key"}, ...], "keep": [{"model", "key"}, ...]}

A `remove` entry goes unless a build touched it at or after decidedAt; an entry in neither
list goes once older than graceSeconds (an orphan); `keep` entries stay; debris (.trash-*,
dead .tmp-*, old .quarantine-*, symbolic links) goes; nothing outside
<cache-dir>/<namespace>/ (runtime/engine/cache/gc.py). A dry run (--dry-run, or the plan's
dryRun) reports the same and removes nothing. A line per removal goes to stderr; the
result, as JSON under 4 KiB, to stdout and the termination log:
{"ok": true, "dryRun", "removedEntries", "removedBytes" (entries and debris),
"removedDebris", "seconds", "skipped": [{"model", "key", "reason"}], "orphans": [{"model",
"key", "bytes"}], "truncated"} - `skipped` (reasons: touched, absent, locked, failed) and
the orphans removed, cut to fit, `truncated` how many items were cut; the plan's entries
removed are its `remove` less `skipped`. Or {"ok": false, "reason", "message"}.

Exit codes (reason):
  0  done (also when some entries were skipped)
  1  BuildFailed: any other failure (the namespace directory is a link, the cache unreadable)
  2  BadRequest: the plan is unreadable or malformed (refused whole: nothing removed)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kiln.runtime.api.contract import CACHE_DIR as DEFAULT_CACHE_DIR
from kiln.runtime.api.contract import TERMINATION_LOG as DEFAULT_TERMINATION_LOG
from kiln.runtime.api.errors import BadRequest, BuildError
from kiln.runtime.commands.termination import (TERMINATION_LOG_LIMIT, stderr_logger,
                                               termination_log, write_message, write_result)

log = stderr_logger("cache-gc")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--plan", required=True, metavar="PATH",
                        help="the plan the operator decided (JSON)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR",
                        help=f"engine cache root (default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--termination-log", default=None, metavar="PATH",
                        help=f"where to write the result JSON (default {DEFAULT_TERMINATION_LOG} "
                             f"when writable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="report what would be removed, remove nothing")
    parser.add_argument("--lock-settle-seconds", type=float, default=None, metavar="S",
                        help="wait after making a model directory's GC lock file, before "
                             "using it (default 60: longer than NFS clients cache its "
                             "absence; 0 on a local disk)")


def fit(result: dict[str, Any], limit: int = TERMINATION_LOG_LIMIT) -> str:
    """The result as JSON within `limit` bytes: `skipped` kept before `orphans`, each cut
    to a prefix, `truncated` counting what was cut."""
    lists = ("skipped", "orphans")
    total = sum(len(result[name]) for name in lists)
    text = json.dumps(result, separators=(",", ":"))
    if len(text.encode()) <= limit:
        return text
    # Room for the items: the result without them, `truncated` at its widest.
    room = limit - len(json.dumps({**result, **{n: [] for n in lists}, "truncated": total},
                                  separators=(",", ":")).encode())
    kept: dict[str, list] = {name: [] for name in lists}
    for name in lists:
        for item in result[name]:
            cost = len(json.dumps(item, separators=(",", ":")).encode()) + bool(kept[name])
            if cost > room:
                break
            kept[name].append(item)
            room -= cost
    cut = total - sum(len(v) for v in kept.values())
    return json.dumps({**result, **kept, "truncated": cut}, separators=(",", ":"))


# The operator's plan lists entries by name: a few hundred bytes each.
MAX_PLAN_BYTES = 16 << 20


def _plan(path: str):
    from kiln.runtime.api.localfile import UnreadableFile, read_json
    from kiln.runtime.engine.cache.gc import Plan, PlanError

    try:
        raw = read_json(path, MAX_PLAN_BYTES, "the plan")
    except UnreadableFile as e:
        raise BadRequest(f"{e}; nothing removed") from None
    try:
        return Plan.from_dict(raw)
    except PlanError as e:
        raise BadRequest(f"the plan {path} is refused, nothing removed: {e}") from None


def run(args: argparse.Namespace) -> int:
    from kiln.runtime.engine.cache.gc import collect
    from kiln.runtime.engine.cache.gclock import LOCK_SETTLE_SECONDS

    term = termination_log(args.termination_log)
    settle = LOCK_SETTLE_SECONDS if args.lock_settle_seconds is None else args.lock_settle_seconds
    try:
        plan = _plan(args.plan)
        outcome = collect(args.cache_dir, plan, dry_run=args.dry_run, settle_seconds=settle,
                          log=log)
    except BuildError as e:
        return _failed(term, e.reason, str(e), e.exit_code)
    except Exception as e:  # anything unforeseen still leaves a readable reason for the Job
        return _failed(term, BuildError.reason, f"{type(e).__name__}: {e}", BuildError.exit_code)
    text = fit(outcome.to_dict())
    log(f"{'dry run: would remove' if outcome.dry_run else 'removed'} "
        f"{len(outcome.entries)} entries and {len(outcome.debris)} debris, "
        f"{sum(r.bytes for r in (*outcome.entries, *outcome.debris))} bytes, "
        f"{len(outcome.skipped)} skipped, in {outcome.seconds:.2f} s")
    write_message(term, text, log)
    print(text, flush=True)
    return 0


def _failed(term: Path | None, reason: str, message: str, code: int) -> int:
    log(f"failed ({reason}): {message}")
    write_result(term, {"ok": False, "reason": reason, "message": message}, log)
    return code
