"""`tinylm plot`'s legend never covers a curve (issue 36 item 10): the drawn SVG's legend
box lies outside the axes' box, which clips every curve, and inside the file."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tinylm.cli import main

pytest.importorskip("matplotlib")

SVG = "{http://www.w3.org/2000/svg}"


def _run(folder: Path, rise: float) -> Path:
    """A run folder whose curves fill the plot: train loss from 11 down to 3, then (with
    ``rise``) back up at the end, periodic estimates and a final value."""
    folder.mkdir()
    records = []
    for s in range(1, 301):
        loss = 8 * math.exp(-s / 40) + 3 + rise * max(0, s - 200) / 100
        records.append({"step": s, "train_loss": loss})
        if s % 25 == 0:
            records.append({"step": s, "val_loss_estimate": loss + 0.2})
    records.append({"step": 300, "val_loss": 3.3 + rise, "final": True})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _box(group: ET.Element) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of the first path under ``group`` (a patch: axes or legend frame)."""
    d = next(group.iter(f"{SVG}path")).get("d")
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", d)]
    xs, ys = nums[0::2], nums[1::2]
    return min(xs), min(ys), max(xs), max(ys)


def _group(root: ET.Element, gid: str) -> ET.Element:
    return next(g for g in root.iter(f"{SVG}g") if g.get("id") == gid)


@pytest.mark.parametrize("log_scale", [False, True])
def test_the_legend_lies_beside_the_curves_not_on_them(tmp_path, capsys, log_scale) -> None:
    runs = [str(_run(tmp_path / name, rise)) for name, rise in
            (("first", 0.0), ("second-run-with-a-long-name", 6.0), ("third", 2.0))]
    out = tmp_path / "cmp.svg"
    assert main(["plot", *runs, "--out", str(out), *(["--log-scale"] if log_scale else [])]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    root = ET.parse(out).getroot()
    axes = _box(_group(_group(root, "axes_1"), "patch_2"))  # the plot area's background
    legend = _box(_group(root, "legend_1"))
    ids = [g.get("id") or "" for g in _group(root, "legend_1").iter(f"{SVG}g")]
    assert sum(i.startswith("text_") for i in ids) == 9  # 3 entries per run, all listed
    overlap_x = min(axes[2], legend[2]) - max(axes[0], legend[0])
    overlap_y = min(axes[3], legend[3]) - max(axes[1], legend[1])
    assert overlap_x <= 0 or overlap_y <= 0, (axes, legend)  # disjoint boxes
    width = float(root.get("width").removesuffix("pt"))
    assert legend[0] >= axes[2] and legend[2] <= width  # beside the plot, inside the file
