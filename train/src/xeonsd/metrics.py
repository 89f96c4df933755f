"""Run metrics: one JSON line per logged step, and the loss plot.

While the run is going the lines go to ``metrics.partial.jsonl`` (tail it to watch progress); the finished run
renames it to ``metrics.jsonl``, so a crashed run never leaves a file that looks complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from xeonsd.fsutil import atomic_path

PARTIAL = "metrics.partial.jsonl"
FINAL = "metrics.jsonl"


class MetricsLog:
    def __init__(self, out_dir: Path, resume_step: int = 0) -> None:
        self.partial = Path(out_dir) / PARTIAL
        self.final = Path(out_dir) / FINAL
        rows = read_metrics(self.partial) if self.partial.exists() else []
        if not rows and self.final.exists() and resume_step > 0:
            rows = read_metrics(self.final)
        # On resume keep what the checkpoint covers; later lines belong to the interrupted attempt.
        self.rows = [r for r in rows if r.get("step", 0) <= resume_step]
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with open(self.partial, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in self.rows)
        self.final.unlink(missing_ok=True)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.partial, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()

    def finish(self) -> Path:
        self.partial.replace(self.final)
        return self.final


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def plot_loss(rows: list[dict], path: Path, title: str = "textual inversion") -> Path:
    """Loss per step (and a moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="loss")
    window = max(1, len(loss) // 20)
    if window > 1:
        smooth = [sum(loss[max(0, i - window + 1) : i + 1]) / len(loss[max(0, i - window + 1) : i + 1])
                  for i in range(len(loss))]  # fmt: skip
        ax.plot(steps, smooth, lw=1.5, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)
