"""The GPU suite's results file and its markdown table: `write_results(path, results)` writes both atomically,
`render_markdown(results)` is the table (measurement, hfl3, reference, ratio with the range of the single rounds' ratios
where the arms were measured several times, goal, pass/fail, note) per section.

`results` = `{"environment": {date, profile, device, commit, versions, checks}, "sections": {name: {status, rows,
details, seconds, share_seconds, run, error?}}}`, rows as `gpu_sections.row` makes them.
"""

from __future__ import annotations

from pathlib import Path

from gpu_sections import SECTIONS

VERSIONS_SHOWN = ("torch", "torch_cuda", "transformers", "accelerate", "peft", "trl", "datasets", "torchao",
                  "liger-kernel", "python")


def number(value: float | None) -> str:
    """A table cell: thousands separated from 1000 up, 3 significant digits below, "—" for a missing value."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) >= 1e-3 else f"{value:.1e}"


def verdict(row: dict, judged: bool) -> str:
    if row["goal"] is None:
        return ""
    if not judged:
        return "not judged (CPU)"
    return {True: "pass", False: "**FAIL**", None: "not measured"}[row["passed"]]


def _run_line(stamp: dict) -> str:
    versions = stamp.get("versions", {})
    shown = ", ".join(f"{name} {versions[name]}" for name in VERSIONS_SHOWN if versions.get(name))
    return f"{stamp['date']}, {stamp['device']}, commit {stamp['commit']}, profile {stamp['profile']}; {shown}"


def render_markdown(results: dict) -> str:
    environment = results["environment"]
    judged = environment["profile"] == "gpu"
    lines = [f"# hfl3 GPU suite: {environment['device']}", "", f"Run: {_run_line(environment)}.", ""]
    missing = [check["fix"] for check in environment.get("checks", []) if not check["ok"]]
    lines += ["Environment: " + ("everything found." if not missing else "missing — " + "; ".join(missing)), ""]
    if not judged:
        lines += [f"A {environment['profile']} run on a CPU: it proves that every section runs and fills its fields; "
                  "its numbers say nothing about GPU speed and no goal is judged.", ""]
    rows = [row for entry in results["sections"].values() for row in entry["rows"]]
    if judged:
        counts = [sum(row["passed"] is value for row in rows if row["goal"]) for value in (True, False, None)]
        lines += [f"Goals: {counts[0]} met, {counts[1]} missed, {counts[2]} not measured.", ""]
    for index, (name, entry) in enumerate(results["sections"].items(), 1):
        title = SECTIONS[name].title if name in SECTIONS else name
        status = entry["status"]
        cpu = f" ({entry['cpu_seconds']:.0f} s CPU)" if "cpu_seconds" in entry else ""
        timing = (f", {entry['seconds']:.0f} s{cpu} of a {entry['share_seconds']:.0f} s share"
                  if entry.get("share_seconds") else "")
        lines += [f"## {index}. `{name}`: {title} ({status}{timing})", ""]
        if entry.get("error"):
            lines += [f"{status}: {entry['error']}", ""]
        if entry.get("run") and entry["run"]["date"] != environment["date"]:
            lines += [f"Run: {_run_line(entry['run'])}.", ""]
        if not entry["rows"]:
            continue
        lines += ["| measurement | hfl3 | reference | ratio (rounds' range) | goal | pass/fail | note |",
                  "|---|---:|---:|---:|---|---|---|"]
        for row in entry["rows"]:
            reference = number(row["reference"]) + (f" ({row['reference_name']})" if row["reference_name"] else "")
            goal = f"{row['goal'][0].replace('>=', '≥').replace('<=', '≤')} {row['goal'][1]}" if row["goal"] else ""
            ratio = "—" if row["ratio"] is None else f"{row['ratio']:.3f}"
            if row.get("spread"):  # the lowest and highest single-round ratio
                ratio += f" ({row['spread'][0]:.3f}–{row['spread'][1]:.3f})"
            cells = [row["measurement"], number(row["hfl3"]), reference, ratio, goal, verdict(row, judged),
                     row["note"] or ""]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_results(path: Path, results: dict) -> None:
    """`results` as JSON at `path` and its markdown beside it (`.md`), each written atomically."""
    from hfl3.atomic import atomic_path, write_json_atomic

    write_json_atomic(path, results)
    with atomic_path(path.with_suffix(".md")) as tmp:
        tmp.write_text(render_markdown(results) + "\n", encoding="utf-8")
