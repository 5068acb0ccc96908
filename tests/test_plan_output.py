"""What `meshrun plan` prints, read as a user reads it: the pick first and the rows in the order
of the rule that picked it, step~ agreeing with the pick, every column explained, why a
checkpointed layout can be faster, and sizes in a unit that shows them."""

from __future__ import annotations

import json
import re

import pytest
from helpers import meshrun_here

from meshrun.plan.show import size, table_unit

GiB, MiB = 2**30, 2**20
LLAMA3_8B_2X8 = ["--model", "llama3-8b", "--nnodes", "2", "--gpus-per-node", "8", "--gpu-mem", "80GiB"]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def _seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def _said(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def _plan(*args: str) -> tuple[list[list[str]], str, dict]:
    """The table's rows, the text, and the same plan as JSON."""
    out = meshrun_here("plan", *args)
    assert out.returncode == 0, out.stderr
    js = meshrun_here("plan", *args, "--json")
    return _rows(out.stdout), out.stdout, json.loads(js.stdout)


CASES = [
    LLAMA3_8B_2X8,
    ["--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "h100"],
    ["--model", "llama-13b", "--gpus-per-node", "8", "--gpu-mem", "40GiB", "--seq-len", "2048"],
    ["--model", "llama-7b", "--gpus-per-node", "4", "--gpu", "l4", "--global-batch", "64"],
    ["--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "h200", "--precision", "fp8"],
    ["--model", "llama3-70b", "--nnodes", "4", "--gpus-per-node", "8", "--gpu", "h100", "--framework", "any"],
]


@pytest.mark.parametrize("args", CASES, ids=["llama3-8b-2x8", "llama3-8b-h100", "llama-13b-40g", "llama-7b-l4",
                                             "llama3-8b-fp8", "llama3-70b-any"])
def test_the_pick_is_first_and_the_shortest_step_of_the_rows_it_is_chosen_from(args):
    """With the micro-batch the planner's to size, the pick is the first row and its step~ the
    shortest (within the 1% the rule gives the simpler layout) of --framework's rows that fit
    (every engine's when none of those fits: llama-7b on 4 L4s); those follow it, fastest
    first; no line says another of them is faster."""
    rows, text, js = _plan(*args)
    framework = args[args.index("--framework") + 1] if "--framework" in args else "torch"
    if js["recommended"]["engine"] == "deepspeed" and framework == "torch":
        assert "nothing torch runs fits" in text
        framework = "any"
    deepspeed = [c["strategy"] for c in js["candidates"] if c["engine"] == "deepspeed"]
    ours = [r for r in rows if r[9] == "yes" and (framework == "any" or r[0].lstrip("*") not in deepspeed)]
    pick = rows[0]
    assert pick[0] == "*" + js["recommended"]["strategy"] and pick == ours[0]
    # the rows that offload the optimizer state after the others: the last resort, where nothing else fits
    kept = [r for r in ours if "offload" not in r[0]] or ours
    assert ours[:len(kept)] == kept
    steps = [_seconds(r[-1]) for r in kept]
    assert steps[1:] == sorted(steps[1:]) and all(steps[0] <= 1.01 * s for s in steps), ours
    offloading = [_seconds(r[-1]) for r in ours[len(kept):]]
    assert offloading == sorted(offloading), ours
    assert "* the pick, first: the shortest step~ of the" in text
    assert "leaves this out" not in text and "shows a shorter step" not in text
    assert all(r[9] == "no" for r in rows[rows.index(ours[-1]) + 1:] if r[0].lstrip("*") not in deepspeed)


def test_with_the_micro_batch_given_the_pick_is_the_first_that_fits_in_the_flowcharts_order():
    """--micro-batch given: the rule is the flowchart's order, said once; the pick comes first,
    then every other row in that order (the --json order)."""
    args = ["--model", "llama-13b", "--gpus-per-node", "8", "--gpu-mem", "40GiB", "--seq-len", "2048",
            "--micro-batch", "1"]
    rows, text, js = _plan(*args)
    order = [c["strategy"] for c in js["candidates"]]
    first = next(c["strategy"] for c in js["candidates"] if c["fits"] and c["engine"] == "torch")
    assert rows[0][0] == "*" + first == "*" + js["recommended"]["strategy"]
    assert [r[0] for r in rows[1:]] == [name for name in order if name != first]
    assert sum("* the pick, first: with the micro-batch given, the first of the torch rows that fits in the "
               "flowchart's order" in line for line in _said(text)) == 1


def test_the_legend_explains_every_column_under_the_table():
    rows, text, _ = _plan(*LLAMA3_8B_2X8)
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    assert columns == ["strategy", "mb x acc", "params", "grads", "optim", "activ", "logits", "buffers", "peak",
                       "fits", "step~"]
    legend = text.split("└", 1)[1]
    for said in ("strategy +ac: with activation checkpointing", "mb x acc: micro-batch per GPU x accumulation steps",
                 "params, grads, optim(izer state) as the layout keeps them", "activ: saved for backward",
                 "logits: the loss's bf16 logits", "buffers: gathered parameters, communication buckets",
                 "peak: these + workspace, allocator fragmentation, CUDA context", "fits: peak <= 72 GiB",
                 "step~: estimated seconds per optimizer step"):
        assert said in legend, said
    assert len(text.splitlines()) < len(rows) + 25  # compact: --explain has the formulas


def test_a_checkpointed_row_faster_than_without_says_why():
    """A +ac row with a shorter step~ than the same layout without checkpointing: a line names
    the two rows as the table shows them and what the larger micro-batch buys."""
    rows, text, _ = _plan(*LLAMA3_8B_2X8)
    line = next(x for x in _said(text) if x.startswith("+ac: "))
    m = re.match(r"\+ac: (\S+) takes (.+?) against (\S+)'s (.+?): checkpointing frees the memory for micro-batch "
                 r"(\d+) instead of (\d+), so \d+x fewer micro-steps communicate .*; compute .+ against .+: each "
                 r"block's forward recomputed \(\+1/3\), on matmuls at (\d+)% of their best instead of (\d+)%$", line)
    assert m, line
    table = {r[0].lstrip("*"): r for r in rows}
    ac, plain = table[m[1]], table[m[3]]
    assert m[3] + "+ac" == m[1] and (ac[-1], plain[-1]) == (m[2], m[4])
    assert _seconds(ac[-1]) < _seconds(plain[-1])
    assert ac[1].startswith(m[5] + " x") and plain[1].startswith(m[6] + " x") and int(m[5]) > int(m[6])
    assert int(m[7]) > int(m[8])


@pytest.fixture(scope="module")
def tiny_plan() -> str:
    out = meshrun_here("plan", "--model", "gpt-tiny", "--gpus-per-node", "2", "--gpu-mem", "24GiB",
                       "--micro-batch", "1")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_small_models_sizes_are_shown_in_a_unit_that_shows_them(tiny_plan):
    """gpt-tiny (3.3M parameters) at micro-batch 1: its states and activations are MiB, not
    0.00 GiB; the legend names the units."""
    rows = _rows(tiny_plan)
    cells = [c for r in rows for c in r[2:8]]
    assert not any(c in ("0.00", "0.01", "0.02") for c in cells), cells
    assert any(re.fullmatch(r"[\d.]+[MK]", c) for r in rows for c in (r[2], r[4], r[5])), rows
    assert "(M MiB, K KiB, B bytes: where GiB would show less than 0.1)" in tiny_plan


@pytest.mark.parametrize("n,unit,shown", [
    (3 * MiB, ("GiB", GiB), "3M"), (1.5 * GiB, ("GiB", GiB), "1.50"), (0.1 * GiB, ("GiB", GiB), "0.10"),
    (300 * 1024, ("GiB", GiB), "300K"), (12, ("GiB", GiB), "12B"), (0, ("GiB", GiB), "0.00"),
    (300 * MiB, ("MiB", MiB), "300.00"), (2 * 1024, ("MiB", MiB), "2K"),
])
def test_a_size_reads_in_the_tables_unit_or_one_that_shows_it(n, unit, shown):
    assert size(n, unit) == shown


def test_the_table_unit_is_the_largest_its_largest_peak_reads_1_in():
    assert table_unit([3 * GiB, 200 * MiB]) == ("GiB", GiB)
    assert table_unit([500 * MiB]) == ("MiB", MiB)
    assert table_unit([]) == ("KiB", 1024)
