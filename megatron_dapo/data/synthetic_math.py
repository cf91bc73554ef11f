"""A built-in verifiable math task: integer arithmetic expressions, as DAPO-schema rows.

Difficulty knobs: operand size (digits), the operations (+ - *, usual precedence) and the number of
operands, fixed or drawn per row from a range (with steps=True the working then varies in length with the
problem: one line per operation). Two prompt styles: "short" ("12+7*3=", for tiny models with short contexts)
and "dapo" (DAPO-Math-17K's own instruction around the problem). Every row's extra_info carries a reference
response ending in the "Answer: N" line the reward parses (with the working first if steps=True),
for a supervised warm start.
"""

from __future__ import annotations

import random

from megatron_dapo.data.prompt_file import DataError

DATA_SOURCE = "synthetic_arithmetic"
STYLES = ("short", "dapo")
OPERATIONS = "+-*"
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    "Remember to put your answer on its own line after \"Answer:\"."
)


def _whole(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _check(n: int, digits: int, operations: str, num_operands: int | tuple[int, int], style: str) -> None:
    for name, value, low in (("n", n, 1), ("digits", digits, 1)):
        if not _whole(value, low):
            raise DataError(f"generate_rows {name}: must be a whole number >= {low}, got {value!r}")
    if not (_whole(num_operands, 2) or (isinstance(num_operands, tuple) and len(num_operands) == 2
                                        and _whole(num_operands[0], 2) and _whole(num_operands[1], num_operands[0]))):
        raise DataError(f"generate_rows num_operands: a whole number >= 2, or a range (low, high) with "
                        f"2 <= low <= high, got {num_operands!r}")
    if digits > 9:
        raise DataError(f"generate_rows digits: at most 9, got {digits}")
    if not isinstance(operations, str) or not operations or set(operations) - set(OPERATIONS):
        raise DataError(f"generate_rows operations: a non-empty string of {OPERATIONS!r}, got {operations!r}")
    if style not in STYLES:
        raise DataError(f"generate_rows style: one of {STYLES}, got {style!r}")


def _evaluate(operands: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Value of the expression (* before + and -, then left to right) and its working, one step a line."""
    steps = []
    terms, term_ops = [operands[0]], []
    for op, b in zip(ops, operands[1:]):
        if op == "*":
            steps.append(f"{terms[-1]}*{b}={terms[-1] * b}")
            terms[-1] *= b
        else:
            terms.append(b)
            term_ops.append(op)
    value = terms[0]
    for op, b in zip(term_ops, terms[1:]):
        new = value + b if op == "+" else value - b
        steps.append(f"{value}{op}{b}={new}")
        value = new
    return value, steps


def answer_line(answer: str) -> str:
    return f"Answer: {answer}"


def generate_rows(n: int, seed: int, *, digits: int = 2, operations: str = "+-",
                  num_operands: int | tuple[int, int] = 2, style: str = "short", steps: bool = False) -> list[dict]:
    """n DAPO-schema rows of random expressions, determined by the arguments (a prefix for a smaller n).

    Operands are drawn uniformly from [0, 10**digits); each operation uniformly from `operations`; with a range
    (low, high) of num_operands, each row's count uniformly from it, ends included.
    """
    _check(n, digits, operations, num_operands, style)
    low, high = (num_operands, num_operands) if isinstance(num_operands, int) else num_operands
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        count = rng.randint(low, high) if high > low else low  # a fixed count draws nothing: rows as before
        operands = [rng.randrange(10 ** digits) for _ in range(count)]
        ops = [rng.choice(operations) for _ in range(count - 1)]
        expression = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:]))
        value, working = _evaluate(operands, ops)
        if style == "short":
            content = f"{expression}="
        else:
            spaced = " ".join([str(operands[0])] + [f"{op} {b}" for op, b in zip(ops, operands[1:])])
            content = DAPO_INSTRUCTION.format(problem=f"What is {spaced}?")
        solution = "\n".join((working if steps else []) + [answer_line(str(value))])
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": content}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(value), "style": "rule"},
            "extra_info": {"index": index, "expression": expression, "solution": solution},
        })
    return rows
