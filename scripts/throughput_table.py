#!/usr/bin/env python
"""One table of every ``bench_throughput.py --json`` report in a folder (the device check's).

    python scripts/throughput_table.py /tmp/qil-device-check

A row per system run: output tok/s, TTFT and ITL (mean / p99), the attention backend, overlap,
how many steps replayed decode and mixed-step graphs and how many ran eagerly, graphs captured
and their capture time. Columns a run does not report are blank. No torch needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = [  # (heading, field, format)
    ("out tok/s", "output_tok_s", "{:.0f}"),
    ("TTFT mean/p99 s", ("ttft_mean_s", "ttft_p99_s"), "{:.2f} / {:.2f}"),
    ("ITL mean/p99 ms", ("itl_mean_ms", "itl_p99_ms"), "{:.1f} / {:.1f}"),
    ("attention", "attention", "{}"),
    ("overlap", "overlap", "{}"),
    ("decode graph steps", "graph_decode_steps", "{}"),
    ("mixed graph steps", "graph_mixed_steps", "{}"),
    ("eager steps", "eager_steps", "{}"),
    ("graphs", "graphs", "{}"),
    ("capture s", "graph_capture_s", "{}"),
]


def cell(row: dict, field: str | tuple[str, ...], form: str) -> str:
    fields = field if isinstance(field, tuple) else (field,)
    if any(row.get(f) is None for f in fields):
        return ""
    return form.format(*(row[f] for f in fields))


def rows_of(folder: Path) -> list[tuple[str, dict]]:
    """(report file stem, result row) for every result of every JSON report in ``folder``."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        results = report.get("results") if isinstance(report, dict) else None
        if not isinstance(results, dict):
            continue  # not a bench_throughput report
        for dtype, rows in results.items():
            for row in rows:
                found.append((f"{path.stem} {dtype}", row))
    return found


def table(found: list[tuple[str, dict]]) -> str:
    header = ["run", "system"] + [c[0] for c in COLUMNS]
    lines = [[name, str(row.get("system", ""))] + [cell(row, f, form) for _, f, form in COLUMNS] for name, row in found]
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    found = rows_of(args.folder)
    if not found:
        print(f"no bench_throughput reports in {args.folder}")
        return 1
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
