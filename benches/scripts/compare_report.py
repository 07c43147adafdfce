#!/usr/bin/env python3
"""Turn benches/scripts/compare-rabbitmq.sh results into the table in
docs/benchmarks.md (between the compare-rabbitmq markers) and the chart
docs/compare-rabbitmq.png."""
import datetime
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEMS = ["rabbitmq-mirrored", "rabbitmq-quorum", "mirrorq"]
LABELS = {"rabbitmq-mirrored": "RabbitMQ mirrored", "rabbitmq-quorum": "RabbitMQ quorum", "mirrorq": "mirrorq"}
START, END = "<!-- compare-rabbitmq:start -->", "<!-- compare-rabbitmq:end -->"


def load(path):
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows[(r["system"], r["case"])] = r
    return rows


def machine():
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB"


def fmt(v, digits=0):
    return "-" if v is None else f"{v:,.{digits}f}"


def ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def main(path):
    rows = load(path)
    cases = []
    for (_, case) in rows:
        if case not in cases and not case.startswith("fill"):
            cases.append(case)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = [START, "", f"Run {datetime.date.today()} at commit `{commit}` on {machine()};",
           "command: `benches/scripts/compare-rabbitmq.sh` (TIME=10 s per case, one `mirrorq perf` client,",
           "persistent messages, publisher confirms, 1 producer and 1 consumer unless the case says otherwise).",
           "RabbitMQ 3.10.8 (Debian); every server is a 3-node cluster on loopback, queues declared on node 1,",
           "client on node 1. RabbitMQ is stopped before mirrorq starts, and each system starts after a `sync` and",
           "a 5 s pause. Confirmed msg/s and confirm p99 (ms); drain: consumed msg/s of a 50,000-message queue",
           "with no publisher. Ratios are mirrorq over RabbitMQ quorum.", "",
           "| case | RabbitMQ mirrored | RabbitMQ quorum | mirrorq | mirrorq / quorum msg/s | p99 mirrored | p99 quorum | p99 mirrorq | mirrorq p99 / quorum p99 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        rate_key = "consumed_per_sec" if case.startswith("drain") else "confirmed_per_sec"
        rates = {s: rows.get((s, case), {}).get(rate_key) for s in SYSTEMS}
        p99 = {s: rows.get((s, case), {}).get("confirm_latency_ms", {}).get("p99") for s in SYSTEMS}
        if case.startswith("drain"):
            p99 = {s: None for s in SYSTEMS}
        q, m = rates["rabbitmq-quorum"], rates["mirrorq"]
        out.append(f"| {case} | " + " | ".join(fmt(rates[s]) for s in SYSTEMS) + f" | {ratio(m, q)} | "
                   + " | ".join(fmt(p99[s], 1) for s in SYSTEMS)
                   + f" | {ratio(p99['mirrorq'], p99['rabbitmq-quorum'])} |")
    out += ["", "![mirrorq vs RabbitMQ](compare-rabbitmq.png)", "", END]
    section = "\n".join(out)

    doc = "docs/benchmarks.md"
    text = open(doc).read()
    if START in text:
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        text = before + section + after
    else:
        text = text.rstrip() + "\n\n## Side by side with RabbitMQ\n\n" + section + "\n"
    open(doc, "w").write(text)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    width = 0.27
    xs = range(len(cases))
    confirmed = [c for c in cases if not c.startswith("drain")]
    colors = {"rabbitmq-mirrored": "#f4a259", "rabbitmq-quorum": "#e76f51", "mirrorq": "#2a9d8f"}
    for i, s in enumerate(SYSTEMS):
        rate = [rows.get((s, c), {}).get("consumed_per_sec" if c.startswith("drain") else "confirmed_per_sec") or 0
                for c in cases]
        lat = [rows.get((s, c), {}).get("confirm_latency_ms", {}).get("p99") or 0 for c in confirmed]
        ax1.bar([x + (i - 1) * width for x in xs], rate, width, label=LABELS[s], color=colors[s])
        ax2.bar([x + (i - 1) * width for x in range(len(confirmed))], lat, width, label=LABELS[s], color=colors[s])
    for ax, names, title in ((ax1, cases, "msg/s (confirmed; drain: consumed), log scale"),
                             (ax2, confirmed, "confirm p99, ms, log scale (lower is better)")):
        ax.set_xticks(list(range(len(names))))
        ax.set_xticklabels([c.replace(" window", "\nwindow").replace(" 10p10c", "\n10p10c") for c in names],
                           fontsize=8, rotation=0)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_yscale("log")
    fig.suptitle(f"3-node clusters on one {os.cpu_count()}-core machine, persistent + confirms ({datetime.date.today()})")
    fig.tight_layout()
    fig.savefig("docs/compare-rabbitmq.png", dpi=90)
    print(section)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/compare/results.jsonl")
