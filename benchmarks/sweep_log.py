"""The sweeps' log (benchmarks/sweep_*.py): each line printed as it comes and kept, written to --out at the end."""

from __future__ import annotations


class SweepLog:
    """say = SweepLog(args.out); say("a line") prints and keeps it; say.save() writes the lines (no path: nothing)."""

    def __init__(self, path: str | None = None):
        self.path, self.lines = path, []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
