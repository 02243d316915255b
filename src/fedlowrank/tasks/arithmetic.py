"""Arithmetic word problems with worked answers: a small instruction set made by this project, not real data.

It ships with the package (``fedlowrank/data/arithmetic/train.jsonl``, 400 problems, and ``test.jsonl``, 100) so
that the ``tiny-lm`` config and the tests run without downloading anything (``data.source = "arithmetic"``).
Each problem fills one of ten templates, two per skill (``addition``, ``subtraction``, ``multiplication``,
``division``, ``two-step``), with a name, an object and numbers drawn by :func:`~fedlowrank.seeding.derive_seed`
(a hash: the same problems on every platform and Python). The answer works the problem out in a sentence or two
and ends, as GSM8K's answers do, with ``#### <number>``. Records: ``{"question", "answer", "skill"}``; ``skill``
is a column for ``partition.partition_by``. No question occurs twice, in or across the two files.

The packaged files are :func:`problems` ``(500, seed=0)``, the first 400 for training; the test suite checks that.
Rewrite them with ``python -m fedlowrank.tasks.arithmetic``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..seeding import derive_seed

PACKAGED = Path(__file__).resolve().parents[1] / "data" / "arithmetic"  # train.jsonl, test.jsonl
NUM_TRAIN, NUM_TEST, SEED = 400, 100, 0
SKILLS = ("addition", "subtraction", "multiplication", "division", "two-step")

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jun", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "cards", "shells", "stamps", "beads", "books")


def _addition(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    a, b = n(5, 90), n(3, 60)
    return (f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {things} now.\n#### {a + b}")


def _addition_days(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    a, b = n(10, 400), n(10, 400)
    return (f"A library lends {a} books on Monday and {b} books on Tuesday. How many books does it lend on the "
            "two days together?", f"It lends {a} + {b} = {a + b} books on the two days.\n#### {a + b}")


def _subtraction(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    b = n(2, 40)
    a = b + n(1, 60)
    return (f"{name} had {a} {things} and gave {b} of them to a friend. How many {things} does {name} have left?",
            f"{name} has {a} - {b} = {a - b} {things} left.\n#### {a - b}")


def _subtraction_train(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    b = n(5, 120)
    a = b + n(10, 200)
    return (f"A train carries {a} passengers. At the first stop {b} passengers get off and nobody gets on. How "
            "many passengers are still on the train?",
            f"{a} - {b} = {a - b} passengers are still on the train.\n#### {a - b}")


def _multiplication(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    a, b = n(2, 12), n(3, 25)
    return (f"{name} buys {a} packs of {things} with {b} {things} in each pack. How many {things} does {name} buy?",
            f"{name} buys {a} * {b} = {a * b} {things}.\n#### {a * b}")


def _multiplication_rows(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    a, b = n(3, 20), n(4, 30)
    return (f"A garden has {a} rows with {b} plants in each row. How many plants are in the garden?",
            f"The garden has {a} * {b} = {a * b} plants.\n#### {a * b}")


def _division(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    each, friends = n(2, 15), n(2, 9)
    return (f"{name} shares {each * friends} {things} equally among {friends} friends. How many {things} does each "
            "friend get?", f"Each friend gets {each * friends} / {friends} = {each} {things}.\n#### {each}")


def _division_boxes(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    boxes, per_box = n(2, 20), n(3, 12)
    return (f"A baker puts {boxes * per_box} muffins into boxes of {per_box}. How many boxes does the baker fill?",
            f"The baker fills {boxes * per_box} / {per_box} = {boxes} boxes.\n#### {boxes}")


def _two_step_change(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    count, price = n(2, 9), n(2, 9)
    cost = count * price
    paid = (cost // 10 + 1 + n(0, 1)) * 10
    return (f"{name} buys {count} {things} at ${price} each and pays with ${paid}. How much change does {name} get?",
            f"The {things} cost {count} * {price} = ${cost}. The change is {paid} - {cost} = ${paid - cost}.\n"
            f"#### {paid - cost}")


def _two_step_pages(n: Callable[[int, int], int], name: str, things: str) -> tuple[str, str]:
    per_day, days, extra = n(5, 40), n(2, 7), n(3, 30)
    read = per_day * days
    return (f"{name} reads {per_day} pages a day for {days} days and then {extra} more pages. How many pages does "
            f"{name} read in all?", f"In {days} days {name} reads {per_day} * {days} = {read} pages. In all "
                                    f"{name} reads {read} + {extra} = {read + extra} pages.\n#### {read + extra}")


TEMPLATES = (("addition", _addition), ("addition", _addition_days), ("subtraction", _subtraction),
             ("subtraction", _subtraction_train), ("multiplication", _multiplication),
             ("multiplication", _multiplication_rows), ("division", _division), ("division", _division_boxes),
             ("two-step", _two_step_change), ("two-step", _two_step_pages))


def problem(seed: int, i: int) -> dict[str, str]:
    """Draw ``i`` of the stream ``seed``: a template, a name, an object and numbers, all from
    ``derive_seed(seed, "arithmetic", i, k)``."""
    draws = iter(range(1, 1_000))

    def n(low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        return low + derive_seed(seed, "arithmetic", i, next(draws)) % (high - low + 1)

    skill, template = TEMPLATES[n(0, len(TEMPLATES) - 1)]
    name, things = NAMES[n(0, len(NAMES) - 1)], OBJECTS[n(0, len(OBJECTS) - 1)]
    question, answer = template(n, name, things)
    return {"question": question, "answer": answer, "skill": skill}


def problems(count: int, seed: int = SEED) -> list[dict[str, str]]:
    """The first ``count`` problems of the stream ``seed`` whose question has not occurred before."""
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    i = 0
    while len(out) < count:
        record = problem(seed, i)
        i += 1
        if record["question"] not in seen:
            seen.add(record["question"])
            out.append(record)
    return out


def jsonl(records: list[dict[str, str]]) -> str:
    """The records as JSON lines (UTF-8, ``\\n`` after each)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write(folder: Path = PACKAGED) -> None:
    """Write ``train.jsonl`` (the first :data:`NUM_TRAIN` problems) and ``test.jsonl`` (the next :data:`NUM_TEST`)."""
    records = problems(NUM_TRAIN + NUM_TEST)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text(jsonl(records[:NUM_TRAIN]), encoding="utf-8")
    (folder / "test.jsonl").write_text(jsonl(records[NUM_TRAIN:]), encoding="utf-8")


if __name__ == "__main__":
    write()
    print(f"wrote {PACKAGED}/train.jsonl ({NUM_TRAIN} problems) and test.jsonl ({NUM_TEST})")
