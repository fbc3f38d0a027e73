"""Few-shot selection as lm-evaluation-harness 0.4.13's default sampler makes it.

The harness seeds one ``random.Random`` per task (``--fewshot_random_seed``, 1234 by default)
and draws each evaluated document's examples from it, in document order. For tasks that name
no few-shot split (BoolQ's config names a training split but neither a few-shot nor a test
split, and the harness compares those two) it takes the eval-doc path:
``sample(pool, n + 1)``, drops every example equal to the evaluated document and keeps the
first ``n``; when copies of the document leave fewer than ``n``, it draws ``n`` again from the
pool without them. Equal means the whole row (``Doc.row``): a copy of the question under
another ``idx`` is another document and stays. ``Random.sample`` picks positions from the pool's length alone, so drawing
indices reproduces the harness's draws exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import TypeVar

HARNESS_SEED = 1234

D = TypeVar("D")


def fewshot_indices(docs: Sequence[D], pool: Sequence[D], shots: int, seed: int = HARNESS_SEED) -> list[list[int]]:
    """For each of ``docs`` in order, the indices of its ``shots`` examples in ``pool``."""
    if shots == 0:
        return [[] for _ in docs]
    if shots >= len(pool):
        raise ValueError(f"{shots} shots asked for, the few-shot split has {len(pool)} documents "
                         f"(the harness draws {shots + 1} to leave out the evaluated document)")
    rnd = Random(seed)
    picked = []
    for doc in docs:
        drawn = [i for i in rnd.sample(range(len(pool)), shots + 1) if pool[i] != doc][:shots]
        if len(drawn) < shots:
            others = [i for i, example in enumerate(pool) if example != doc]
            drawn = [others[i] for i in rnd.sample(range(len(others)), shots)]
        picked.append(drawn)
    return picked
