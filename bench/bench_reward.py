"""Reward throughput: wall milliseconds per judged response, RewardPool against the per-response protocol it replaced.

Responses are long-CoT sized (--chars, 20K by default: filler with math-looking noise, then the final answer),
judged against their problem's ground truth in groups of --group, at --workers processes. Three columns:
- per response (before): the protocol before issue 14, kept here for comparison only: one pipe message each way
  per response, the worker finding and judging every response's answer (math-verify, nothing cached);
- RewardPool: the pool as shipped (answers found in the pool's process, each distinct (answer, ground truth)
  judged once, batches of reward.max_answers_per_message per message, the per-answer time limit kept);
- RewardPool, 1 answer per message: the same with one answer per message (what batching alone buys).
Three workloads: answers as a group gives them (a few distinct answers per group, in several spellings, some
responses without one), numeric or symbolic (sqrt, pi, polynomials: sympy's simplify does real work), and the
worst case for the pool, every response a different answer. Calls are made as
the trainer makes them (one score() per group, as groups complete) and as evaluation does (one call for all).
A fresh pool per cell (nothing cached from an earlier cell), warmed up on other problems; fresh problems per cell.

    python bench/bench_reward.py [--groups 32] [--group 16] [--workers 2] [--chars 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

from megatron_dapo.reward import RewardConfig, RewardPool


def _serve_per_response(conn) -> None:
    from megatron_dapo.reward.final_answer import final_answer
    from megatron_dapo.reward.math_verifier import judge_answer

    judge = judge_answer.__wrapped__  # no cache: the worker judged every response
    judge("\\frac{1}{2}", "0.5")
    conn.send("ready")
    while True:
        try:
            index, text, truth = conn.recv()
        except EOFError:
            return
        answer = final_answer(text)
        verdict = judge(answer, truth) if answer is not None else None
        conn.send((index, verdict))


class PerResponsePool:
    """score() with one message each way per response, as before (no time limit: the bench has no hangs)."""

    def __init__(self, workers: int, tail_chars: int):
        context = multiprocessing.get_context("spawn")
        self.tail_chars = tail_chars
        self.conns, self.procs = [], []
        for _ in range(workers):
            conn, child = context.Pipe()
            proc = context.Process(target=_serve_per_response, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(conn)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def score(self, responses, truths):
        todo = list(enumerate(zip(responses, truths)))[::-1]
        out, busy = [None] * len(responses), {}
        while todo or busy:
            for conn in self.conns:
                if todo and conn not in busy:
                    index, (text, truth) = todo.pop()
                    conn.send((index, text[-self.tail_chars:], truth))
                    busy[conn] = index
            for conn in multiprocessing.connection.wait(list(busy)):
                index, verdict = conn.recv()
                out[index] = verdict
                del busy[conn]
        return out

    def close(self):
        for proc in self.procs:
            proc.kill()
            proc.join()


FILLER = ["so", "we", "get", "$x^2+1$", "\\frac{3}{4}", "=", "12", "then", "subtract", "the", "area", "\n"]


def _response(rng: random.Random, chars: int, answer: str | None) -> str:
    body = " ".join(rng.choice(FILLER) for _ in range(chars // 4))[:chars]
    return body + ("\nThe reasoning ends without a final line." if answer is None else f"\nAnswer: {answer}")


def _workload(rng: random.Random, kind: str, groups: int, group: int, chars: int):
    """[(responses, ground_truths)] per group."""
    out = []
    for g in range(groups):
        p, q = rng.randint(2, 999), rng.randint(2, 9)
        if kind == "symbolic":  # sqrt, pi and polynomials: sympy's simplify does real work
            truth = f"\\frac{{{p}\\sqrt{{3}}}}{{{q}}}"
            right = [truth, f"${p}\\sqrt{{3}}/{q}$", f"\\boxed{{\\dfrac{{{p}\\sqrt3}}{{{q}}}}}"]
            wrong = [f"\\frac{{{p}\\sqrt{{2}}}}{{{q}}}", f"{p}\\pi/{q}", f"x^2+{p}x+{q}"]
        else:
            truth = f"\\frac{{{p}}}{{{q}}}"
            right = [truth, f"${p}/{q}$", f"\\boxed{{\\dfrac{{{p}}}{{{q}}}}}"]
            wrong = [f"\\frac{{{p + 1}}}{{{q}}}", f"{p * q}", f"\\frac{{{q}}}{{{p}}}"]
        answers = []
        for i in range(group):
            if kind == "distinct":
                answers.append(str(rng.randint(10**6, 10**9)))
            else:
                u = rng.random()
                answers.append(rng.choice(right) if u < 0.45 else rng.choice(wrong) if u < 0.9 else None)
        out.append(([_response(rng, chars, a) for a in answers], [truth] * group))
    return out


def _cell(make_pool, warmup, work, per_group: bool) -> float:
    """Milliseconds of wall time per response, in the steady state: a first call on other problems of the same kind
    pays each worker's first-use costs (sympy's caches and lazy imports: 10-100 ms an answer at first)."""
    pool = make_pool()
    try:
        pool.score([r for rs, _ in warmup for r in rs], [t for _, ts in warmup for t in ts])
        n = sum(len(r) for r, _ in work)
        start = time.perf_counter()
        if per_group:
            for responses, truths in work:
                pool.score(responses, truths)
        else:
            pool.score([r for rs, _ in work for r in rs], [t for _, ts in work for t in ts])
        return (time.perf_counter() - start) / n * 1e3
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chars", type=int, default=20000)
    args = parser.parse_args()
    cfg = RewardConfig(num_workers=args.workers)

    def shipped():
        pool = RewardPool(cfg)
        pool.wait_until_ready()
        return pool

    def one_per_message():
        pool = RewardPool(RewardConfig(num_workers=args.workers, max_answers_per_message=1))
        pool.wait_until_ready()
        return pool

    columns = [("per response (before)", lambda: PerResponsePool(args.workers, cfg.tail_chars)),
               ("RewardPool", shipped), ("RewardPool, 1 per message", one_per_message)]
    rng = random.Random(0)
    print(f"== reward: wall ms per response, {args.groups} groups x {args.group} responses of {args.chars} chars, "
          f"{args.workers} workers ==")
    header = "".join(f"{name:>28}" for name, _ in columns)
    print(f"{'workload':<18}{'calls':<10}{header}{'before/RewardPool':>20}")
    for kind in ("group answers", "symbolic", "distinct"):
        for calls, per_group in (("per group", True), ("one call", False)):
            ms = [_cell(make, _workload(rng, kind, 8, args.group, args.chars),
                        _workload(rng, kind, args.groups, args.group, args.chars), per_group)
                  for _, make in columns]
            print(f"{kind:<18}{calls:<10}" + "".join(f"{m:>28.3f}" for m in ms) + f"{ms[0] / ms[1]:>19.2f}x")


if __name__ == "__main__":
    main()
