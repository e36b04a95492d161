"""The phases of the workbook, in one place: what each is called, which notebook teaches it, whether
a workload's flags carry it into the next, and whether the bench measures it.

Everything that speaks of phases reads this table: a flag names its phase (``flags.flag``, which
refuses a name not here), ``flags.through_phase`` follows the workbook's order, and
``python -m accel bench`` runs each bench phase from ``accel/lab/cases/<name>.py`` (its
``run(ctx)``, and its ``parts()`` where ``--only`` can pick parts of it), in this order.

Adding a phase is one line below (ARCHITECTURE.md, "Adding a phase", says what else it needs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    notebook: str = ""  # notebooks/<notebook>.ipynb teaches it; "" where none does
    workbook: bool = False  # its adopted flags carry into the later workbook phases
    bench: bool = True  # accel/lab/cases/<name>.py measures it

    @property
    def case(self) -> str:
        """The module of its bench case."""
        return f"accel.lab.cases.{self.name}"


PHASES: tuple[Phase, ...] = (
    Phase("ceilings"),  # this machine's copy and matmul rates, which rows are read against
    Phase("sync", "01_sync", workbook=True),
    Phase("fusion", "02_fusion", workbook=True),
    Phase("memory", "03_memory", workbook=True),
    Phase("graphs", "04_graphs", workbook=True),
    Phase("sdpa", "05_sdpa", workbook=True),
    Phase("diversity", "06_diversity", workbook=True),
    Phase("recipe", "07_recipe"),
    # the recipe's own steps, which group the neural operator's flags, in the recipe's order
    # (memory, its step 2, is the workbook's): the recipe case measures them together
    Phase("compile", "07_recipe", bench=False),
    Phase("loss", "07_recipe", bench=False),
    Phase("data", "07_recipe", bench=False),
    Phase("optimizer", "07_recipe", bench=False),
    Phase("precision", "07_recipe", bench=False),
    Phase("distributed", "08_distributed"),
    Phase("doctor", "09_doctor"),
    Phase("overhead"),  # each component as a user calls it, beside the plain PyTorch it replaces
    Phase("notebooks"),  # the notebooks' own running time
)
BY_NAME = {p.name: p for p in PHASES}
# the workbook's phases in notebook order: each starts from the flags the ones before it adopted
WORKBOOK = tuple(p.name for p in PHASES if p.workbook)
BENCH = tuple(p.name for p in PHASES if p.bench)


def checked_phase(name: str, among: tuple[str, ...] = tuple(BY_NAME)) -> str:
    """``name`` if it is one of ``among`` (every phase by default), else a ValueError listing them."""
    if name not in among:
        raise ValueError(f"unknown phase {name!r}; expected one of {', '.join(among)}")
    return name
