"""The exact cast placement (passes/cast_cut.py) against brute force: every labeling of up to
14 free labels, on random problems of several cost models."""

from __future__ import annotations

import itertools
import random

import pytest
from amp_graph.passes.cast_cut import (
    FLOAT32,
    LOW,
    CastProblem,
    CastValue,
    casts_of,
    cost_of,
    savings,
    solve,
)


def brute_force(problem: CastProblem) -> tuple[int, int]:
    """The least cost over every labeling that keeps the ties, and the fewest labels raised
    at that cost."""
    best: tuple[int, int] | None = None
    for bits in itertools.product((False, True), repeat=len(problem.free)):
        raised = [name for name, up in zip(problem.free, bits, strict=True) if up]
        try:
            cost = cost_of(problem, raised)
        except ValueError:  # breaks a tie
            continue
        if best is None or (cost, len(raised)) < best:
            best = (cost, len(raised))
    assert best is not None
    return best


def random_problem(seed: int, model: str) -> CastProblem:
    """A random problem: ``model`` picks how values are read ("chain": each value read by the
    next few; "fanout": wide fan-outs, so cast sharing matters; "mixed": ties and raise costs
    too)."""
    rng = random.Random(seed)
    n = rng.randint(1, 14)
    free = tuple(f"x{i}" for i in range(n))
    labels = [*free, LOW, FLOAT32]
    values = []
    for i in range(rng.randint(1, 2 * n + 2)):
        own = rng.choice(labels)
        if model == "chain":
            start = free.index(own) + 1 if own in free else rng.randrange(n)
            readers = [*free[start : start + rng.randint(1, 3)], rng.choice([LOW, FLOAT32])]
        else:
            readers = rng.sample(labels, rng.randint(1, min(len(labels), 6)))
        cost = rng.choice([1, 2, 3, 8, 64, 1000]) if model != "unit" else 1
        values.append(CastValue(f"v{i}", own, cost, tuple(readers)))
    tied: list = []
    raise_cost: dict[str, int] = {}
    if model == "mixed":
        for _ in range(rng.randint(0, 3)):
            a, b = rng.choice([*free, LOW]), rng.choice(free)
            tied.append((a, b))
        raise_cost = {name: rng.randint(0, 5) for name in free if rng.random() < 0.5}
    return CastProblem(free, tuple(values), tuple(tied), raise_cost)


@pytest.mark.parametrize("model", ["chain", "fanout", "unit", "mixed"])
@pytest.mark.parametrize("seed", range(15))
def test_the_cut_is_the_brute_force_optimum(model, seed):
    problem = random_problem(seed, model)
    placement = solve(problem)
    assert (placement.cost, len(placement.raised)) == brute_force(problem)
    assert placement.cost == cost_of(problem, placement.raised)
    # casts_of counts what cost_of weighs: with every cast one byte, they agree
    unit = CastProblem(
        problem.free,
        tuple(CastValue(v.name, v.label, 1, v.readers) for v in problem.values),
        problem.tied,
    )
    assert casts_of(problem, placement.raised) == cost_of(unit, placement.raised)
    assert placement.cost <= placement.cost_before == cost_of(problem, ())
    # each raised label's own saving is what lowering it alone would cost again
    tied = {label for pair in problem.tied for label in pair}
    for name, saved in savings(problem, placement.raised).items():
        assert saved == cost_of(problem, placement.raised - {name}) - placement.cost
        assert saved > 0  # the fewest raised: none is raised for nothing
    assert set(savings(problem, placement.raised)) == placement.raised - tied


def test_a_value_read_wider_by_many_costs_one_cast():
    # x is low; three float32 reads of it share one cast (4 bytes): raising x pays only
    # if its own low input costs less to cast up
    shared = CastValue("x", "x", 4, (FLOAT32, FLOAT32, FLOAT32))
    producer = CastValue("a", LOW, 10, ("x",))  # raising x casts its low input up
    problem = CastProblem(("x",), (shared, producer))
    assert cost_of(problem, ()) == 4
    assert cost_of(problem, ["x"]) == 10
    assert solve(problem).raised == frozenset()
    # with its input cheaper than the one shared cast, raising x pays
    cheap = CastProblem(("x",), (shared, CastValue("a", LOW, 3, ("x",))))
    assert solve(cheap).raised == frozenset({"x"})
    assert solve(cheap).cost == 3


def test_ties_move_together_and_nothing_moves_for_free():
    # a view (y) of x: tied; raising both saves the float32 reader's cast of y
    values = (
        CastValue("x", "x", 2, ("y",)),
        CastValue("y", "y", 8, (FLOAT32,)),
        CastValue("in", LOW, 2, ("x",)),
    )
    problem = CastProblem(("x", "y"), values, tied=(("x", "y"),))
    placement = solve(problem)
    assert placement.raised == frozenset({"x", "y"})
    assert (placement.cost_before, placement.cost) == (8, 2)
    # at equal cost the fewest labels move: none
    even = CastProblem(("x",), (CastValue("x", "x", 5, (FLOAT32,)), CastValue("i", LOW, 5, ("x",))))
    assert solve(even).raised == frozenset()


def test_unknown_labels_and_bad_costs_are_errors():
    with pytest.raises(ValueError, match="neither free nor a constant"):
        CastProblem(("x",), (CastValue("v", "z", 1, ("x",)),))
    with pytest.raises(ValueError, match="int >= 0"):
        CastProblem(("x",), (CastValue("v", "x", -1, (LOW,)),))
    with pytest.raises(ValueError, match="tied to FLOAT32"):
        CastProblem(("x",), (), tied=(("x", FLOAT32),))
    with pytest.raises(ValueError, match="named twice"):
        CastProblem(("x", "x"), ())
