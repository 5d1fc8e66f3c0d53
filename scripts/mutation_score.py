"""How much wrong code do the exercise checks catch? A mutation score per exercise.

Every reference solution in `kvlab.workbook.exercises` is parsed with `ast`, and single-point mutants are
made from it: a comparison operator swapped (< <= > >= == != is in), an integer constant +1/-1,
an index or slice bound +1/-1, and/or swapped, True/False swapped, one statement deleted, min and
max swapped, the other end of a queue (popitem(last=False) vs popitem(), pop() vs pop(0)), one
argument of a call removed. Each mutant is run through its exercise's check (the real-model case
runs only when every fast case passed; a mutant past its time limit counts as caught). A mutant
is caught when the check fails on it.

    .venv/bin/python scripts/mutation_score.py                 # every exercise
    .venv/bin/python scripts/mutation_score.py schedule fork   # some
    .venv/bin/python scripts/mutation_score.py --fast-only     # no real model (a lower bound)
    .venv/bin/python scripts/mutation_score.py -v              # list the survivors

Mutants that do not change behaviour at all (equivalent mutants) are listed in EQUIVALENT with a
reason, and left out of the score. Targets: 80% caught overall, 60% per exercise.
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import sys
import textwrap
import time
from dataclasses import dataclass

from kvlab.workbook import exercises
from kvlab.workbook.exercises._report import run_check

OVERALL_TARGET, PER_EXERCISE_TARGET = 0.80, 0.60
MUTANT_TIMEOUT_S = 20.0  # a mutant that runs longer than this counts as caught

# (exercise, statement before, statement after) -> why the mutant behaves exactly like the
# solution. Statements are as `ast.unparse` prints their first line.
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("tier_hit", "last = min(len(block_keys), num_tokens // block_size)",
     "last = max(len(block_keys), num_tokens // block_size)"):
        "block_keys holds exactly the request's full blocks (the contract, and the engine's "
        "block hasher): len(block_keys) == num_tokens // block_size, so min and max agree",
    ("tier_hit", "for key in block_keys[first:last]:", "for key in block_keys[first:last + 1]:"):
        "last is len(block_keys) (see the min/max mutant): a slice past the end is the same slice",
    ("window_blocks", "num_skipped_tokens = max(0, num_computed_tokens - sliding_window + 1)",
     "num_skipped_tokens = max(-1, num_computed_tokens - sliding_window + 1)"):
        "a negative count of skipped tokens is at most -1 blocks either way (floor division): "
        "the loop over skipped blocks runs zero times, as for 0",
    ("timing_attack", "return ttft < threshold", "return ttft <= threshold"):
        "differs only when a TTFT equals the threshold exactly, which measured floats never do",
    ("chunked_prefill", "if num_new > 0:", "if num_new >= 0:"):
        "adds entries of 0 tokens, which mean 'not scheduled' just as a missing entry does",
    ("chunked_prefill", "if num_new > 0:", "if num_new > -1:"):
        "the same as >= 0 on integers (see above)",
    ("block_pool",
     "raise ValueError(f'cannot get {num_blocks} blocks: {len(self.free_queue)} are free')",
     "raise ValueError()"): "only the error's message changes; the pool's behaviour does not",
    ("quantize_int8", "q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)",
     "q = torch.round(x.float() / scale[..., None]).clamp(-127).to(torch.int8)"):
        "with scale = absmax / 127 no value divides past 127: the upper bound never binds",
    ("quantize_int8", "q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)",
     "q = torch.round(x.float() / scale[..., None]).clamp(-127, 128).to(torch.int8)"):
        "no value divides past 127, so a bound of 128 is never reached either",
    ("quantize_int8", "q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)",
     "q = torch.round(x.float() / scale[..., None]).clamp(-128, 127).to(torch.int8)"):
        "no value divides below -127, so a bound of -128 is never reached",
    ("chunk_budget", "return min(4096, max(16, int((max_gap_s - intercept) / slope)))",
     "return min(4095, max(16, int((max_gap_s - intercept) / slope)))"):
        "a budget of 4095 or 4096 takes a 1,024-token prompt in one step either way",
    ("schedule", "running = list(running)", "(deleted)"):
        "preempting then pops from the caller's list, a throwaway copy; the decision returned "
        "is the same",
}

# Challenges whose answer is a choice, not code: a dict of settings has no mechanism to mutate
# (a setting moved by one lands within the check's tolerance, as it should). Left out, saying so.
CHOICES: dict[str, str] = {
    "tuning_lab": "returns a dict of engine settings; the check grades it by goodput measured "
                  "beside the reference and the defaults (tests/workbook/test_tuning_lab.py)",
}

RELATED = {
    ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
    ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
    ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,),
}
SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
          ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


@dataclass
class Mutant:
    kind: str
    before: str  # the enclosing statement's first line, before and after
    after: str
    source: str  # the whole mutated solution


def _has_int_constant(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and type(n.value) is int for n in ast.walk(node))


def _plus(node: ast.expr, delta: int) -> ast.expr:
    return ast.BinOp(node, ast.Add() if delta > 0 else ast.Sub(), ast.Constant(1))


def _is_docstring(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str))


def _edits(node: ast.AST):
    """(kind, function that mutates a copy of `node` in place) for every single-point mutant."""
    if isinstance(node, ast.Compare):
        for j, op in enumerate(node.ops):
            for new in RELATED.get(type(op), ()):
                def swap(n, j=j, new=new):
                    n.ops[j] = new()
                yield f"{SYMBOL[type(op)]} -> {SYMBOL[new]}", swap
    if isinstance(node, ast.Constant) and type(node.value) is int:
        for delta in (1, -1):
            def shift(n, delta=delta):
                n.value += delta
            yield f"constant {node.value} -> {node.value + delta}", shift
    if isinstance(node, ast.Constant) and type(node.value) is bool:
        def flip(n):
            n.value = not n.value
        yield f"{node.value} -> {not node.value}", flip
    if isinstance(node, ast.Subscript):
        s = node.slice
        if isinstance(s, ast.Slice):
            for part in ("lower", "upper"):
                bound = getattr(s, part)
                if bound is not None and not _has_int_constant(bound):
                    for delta in (1, -1):
                        def bump(n, part=part, delta=delta):
                            setattr(n.slice, part, _plus(getattr(n.slice, part), delta))
                        yield f"slice {part} {delta:+d}", bump
        elif not _has_int_constant(s) and not (isinstance(s, ast.Constant)):
            for delta in (1, -1):
                def bump_index(n, delta=delta):
                    n.slice = _plus(n.slice, delta)
                yield f"index {delta:+d}", bump_index
    if isinstance(node, ast.BoolOp):
        def other(n):
            n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
        yield "and <-> or", other
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("min", "max"):
            def minmax(n):
                n.func = ast.Name("max" if n.func.id == "min" else "min", ast.Load())
            yield "min <-> max", minmax
        if isinstance(func, ast.Attribute) and func.attr == "popitem" and not any(
                k.arg == "last" for k in node.keywords):
            def head(n):
                n.keywords.append(ast.keyword("last", ast.Constant(False)))
            yield "popitem() -> popitem(last=False)", head
        if isinstance(func, ast.Attribute) and func.attr == "pop" and not node.args:
            def pop_head(n):
                n.args.append(ast.Constant(0))
            yield "pop() -> pop(0)", pop_head
        for j in range(len(node.args)):
            def drop(n, j=j):
                del n.args[j]
            yield f"drop argument {j + 1}", drop
        for j, kw in enumerate(node.keywords):
            def drop_kw(n, j=j):
                del n.keywords[j]
            yield f"drop argument {kw.arg}=", drop_kw
    for field in ("body", "orelse"):
        body = getattr(node, field, None)
        if not isinstance(body, list) or isinstance(node, ast.Module):
            continue
        for j, stmt in enumerate(body):
            if _is_docstring(stmt) or isinstance(stmt, (ast.Pass, ast.FunctionDef,
                                                        ast.ClassDef)):
                continue
            def delete(n, field=field, j=j):
                stmts = getattr(n, field)
                if len(stmts) == 1 or (len(stmts) == 2 and _is_docstring(stmts[0])):
                    stmts[j] = ast.Pass()
                else:
                    del stmts[j]
            delete.deleted = stmt
            yield "delete statement", delete


def _first_line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0].strip() if node is not None else ""


def mutants(solution) -> list[Mutant]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(solution)))
    nodes = list(ast.walk(tree))
    # The innermost statement around each node (by position in ast.walk's order).
    owner: dict[int, int] = {}
    for k, node in enumerate(nodes):
        if isinstance(node, ast.stmt):
            for child in ast.walk(node):
                owner[id(child)] = k  # inner statements are walked later and overwrite
    original = ast.unparse(tree)
    seen, out = {original}, []
    for k, node in enumerate(nodes):
        for kind, edit in _edits(node):
            mutated = copy.deepcopy(tree)
            copies = list(ast.walk(mutated))
            target = copies[k]
            stmt_k = owner.get(id(node))
            edit(target)
            if hasattr(edit, "deleted"):  # name the deleted statement itself
                before, after = _first_line(edit.deleted), "(deleted)"
            else:
                before = _first_line(nodes[stmt_k]) if stmt_k is not None else ""
                after = _first_line(copies[stmt_k]) if stmt_k is not None else ""
            ast.fix_missing_locations(mutated)
            try:
                source = ast.unparse(mutated)
            except Exception:  # noqa: BLE001 - an edit that cannot be printed is not a mutant
                continue
            if source in seen:
                continue
            seen.add(source)
            out.append(Mutant(kind, before, after, source))
    return out


def run_mutant(ex, m: Mutant, real_model: bool) -> bool:
    """True when the check catches the mutant."""
    namespace: dict = {}
    try:
        exec(ex.imports, namespace)
        exec(compile(m.source, f"<mutant {ex.name}>", "exec"), namespace)
        impl = namespace[ex.entry_point]
    except Exception:  # noqa: BLE001 - does not even define the function: caught at once
        return True
    result = run_check(ex, impl, real_model=real_model, fast_timeout_s=MUTANT_TIMEOUT_S,
                       real_timeout_s=MUTANT_TIMEOUT_S)
    return not result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="exercises (default: all)")
    parser.add_argument("--fast-only", action="store_true", help="skip the real-model cases")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every survivor")
    args = parser.parse_args(argv)
    names = args.names or list(exercises.EXERCISES)
    for name in [n for n in names if n in CHOICES]:
        print(f"  {name}: left out, a choice and not code: {CHOICES[name]}", file=sys.stderr)
    names = [n for n in names if n not in CHOICES]
    real_model = not args.fast_only
    rows, survivors, excluded = [], [], []
    start = time.perf_counter()
    for name in names:
        ex = exercises.EXERCISES[name]
        # The solution itself must pass (this also computes kvlab's reference runs once).
        baseline = ex.check(ex.solution, real_model=real_model)
        if not baseline:
            print(f"{name}: the reference solution fails its own check!\n{baseline}")
            return 2
        t0 = time.perf_counter()
        total = caught = 0
        for m in mutants(ex.solution):
            reason = EQUIVALENT.get((name, m.before, m.after))
            if reason:
                excluded.append((name, m, reason))
                continue
            total += 1
            if run_mutant(ex, m, real_model):
                caught += 1
            else:
                survivors.append((name, m))
        rows.append((name, total, caught, time.perf_counter() - t0))
        print(f"  {name}: {caught}/{total} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
              flush=True)

    print(f"\n{'exercise':<20} {'mutants':>7} {'caught':>7} {'score':>7}")
    for name, total, caught, _ in rows:
        print(f"{name:<20} {total:>7} {caught:>7} {caught / max(total, 1):>7.0%}")
    all_total = sum(r[1] for r in rows)
    all_caught = sum(r[2] for r in rows)
    overall = all_caught / max(all_total, 1)
    print(f"{'overall':<20} {all_total:>7} {all_caught:>7} {overall:>7.0%}")
    print(f"({'fast cases only' if not real_model else 'with the real model'}; "
          f"{time.perf_counter() - start:.0f} s)")
    if excluded:
        print("\nexcluded as equivalent:")
        for name, m, reason in excluded:
            print(f"  {name}: `{m.before}` -> `{m.after}`: {reason}")
    if survivors and (args.verbose or len(survivors) <= 20):
        print("\nsurvivors:")
        for name, m in survivors:
            print(f"  {name}: {m.kind}: `{m.before}` -> `{m.after}`")
    ok = overall >= OVERALL_TARGET and all(
        r[2] / max(r[1], 1) >= PER_EXERCISE_TARGET for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
