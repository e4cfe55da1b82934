"""What a graded check is, and what it gives: shared by the grader (grade.py) and the checks that
live beside their exercises (lesson 00's, puzzle_checks.py), which must not import the grader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One kernel launch of a correctness check."""

    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool = False
    logits: float | None = None  # scale q and k so that the largest |score| is this

    def __str__(self) -> str:
        text = f"S_q={self.seq_q} S_k={self.seq_k} D={self.head_dim} {'causal' if self.causal else 'non-causal'}"
        return text + (f", scores up to ±{self.logits:g}" if self.logits else "")


@dataclass(frozen=True)
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    detail: str


@dataclass(frozen=True)
class Check:
    name: str  # short id, for --only and test ids, and the results table's label: a region's label where
    # the check grades one region ("03-a", "00-c")
    title: str
    points: int
    run: Callable[..., Outcome]  # run(grading, this check): grading is grade.Grading
    gpu_only: bool = False
    kind: str = "correctness"  # or "point": the phase's own point; or "region": one region on its own
    cases: tuple[Case, ...] = ()
    region: str = ""  # the label of the exercise region the check grades (a "region" check, a puzzle)
    seeded: bool = False  # draws random inputs from the run's seed without `cases` (lesson 00's puzzles)
    aliases: tuple[str, ...] = ()  # older names that --only still takes

    @property
    def random_inputs(self) -> bool:
        """Whether its inputs come from the run's seed (so that --seed repeats a failure)."""
        return bool(self.cases) or self.seeded


@dataclass(frozen=True)
class Result:
    name: str
    title: str
    points: int
    status: str
    detail: str
    gpu_only: bool
    kind: str
    seconds: float = 0.0

    @property
    def earned(self) -> int:
        return self.points if self.status == "pass" else 0
