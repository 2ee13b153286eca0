"""Linearizability checker: known-illegal histories rejected, concurrent legal ones accepted,
agreement with a brute-force checker on random small histories, budget and performance."""

import itertools
import math
import random
import time

import pytest

from kvmesh.replog.sim.linearizability import (
    UNKNOWN,
    History,
    KvModel,
    KvOp,
    Operation,
    check,
    lost_acknowledged_writes,
)

INF = math.inf


def op(client, inp, call, out, ret):
    return Operation(client, inp, call, out, ret)


def pending(client, inp, call):
    return Operation(client, inp, call, UNKNOWN, INF)


def run(ops, **kw):
    return check(KvModel(), ops, **kw)


# ---------------------------------------------------------------- known illegal


def test_stale_read_is_rejected():
    ops = [
        op(1, KvOp.put("x", 1), 0, None, 1),
        op(1, KvOp.put("x", 2), 2, None, 3),
        op(2, KvOp.get("x"), 4, 1, 5),
    ]
    r = run(ops)
    assert r.outcome == "illegal"
    text = r.report()
    assert "ILLEGAL" in text and "key='x'" in text
    assert "cannot linearize next" in text and "get('x') -> 1" in text
    # The longest legal prefix is the two puts; the read is what blocks it.
    (p,) = r.illegal
    assert [o.input.op for o, _ in p.longest] == ["put", "put"]
    assert p.longest[-1][1] == 2
    assert p.blocked[0].input == KvOp.get("x")


def test_lost_write_is_rejected():
    ops = [
        op(1, KvOp.put("x", 1), 0, None, 1),
        op(2, KvOp.get("x"), 2, None, 3),
    ]
    assert run(ops).outcome == "illegal"


def test_lost_write_after_failover_with_many_keys_only_that_key_illegal():
    ops = []
    t = 0
    for k in range(20):
        ops.append(op(1, KvOp.put(k, k * 10), t, None, t + 1))
        t += 2
    for k in range(20):
        out = None if k == 7 else k * 10  # key 7's acknowledged put vanished
        ops.append(op(2, KvOp.get(k), t, out, t + 1))
        t += 2
    r = run(ops)
    assert r.outcome == "illegal"
    assert [p.name for p in r.illegal] == ["key=7"]
    assert sum(p.outcome == "ok" for p in r.partitions) == 19


def test_non_monotonic_reads_during_concurrent_write_rejected():
    # Both reads overlap the put, but once a read saw 1 a later read cannot see the old value.
    ops = [
        op(1, KvOp.put("x", 1), 0, None, 10),
        op(2, KvOp.get("x"), 1, 1, 2),
        op(3, KvOp.get("x"), 3, None, 4),
    ]
    assert run(ops).outcome == "illegal"


def test_read_of_never_written_value_rejected():
    ops = [op(1, KvOp.put("x", 1), 0, None, 2), op(2, KvOp.get("x"), 1, 99, 3)]
    assert run(ops).outcome == "illegal"


def test_definitely_failed_write_is_dropped():
    h = History(clock=iter(range(100)).__next__)
    a = h.invoke(1, KvOp.put("x", 1))
    h.fail(a)  # e.g. NotLeader before proposing: it never happened
    b = h.invoke(2, KvOp.get("x"))
    h.ok(b, 1)
    assert check(KvModel(), h).outcome == "illegal"
    # The same history with an unknown outcome is fine: the put may have happened.
    h2 = History(clock=iter(range(100)).__next__)
    a = h2.invoke(1, KvOp.put("x", 1))
    h2.info(a)
    b = h2.invoke(2, KvOp.get("x"))
    h2.ok(b, 1)
    assert check(KvModel(), h2).ok


def test_cas_double_success_rejected():
    # Two sequential CAS from the same expected value cannot both succeed.
    ops = [
        op(1, KvOp.put("x", 0), 0, None, 1),
        op(1, KvOp.cas("x", 0, 1), 2, True, 3),
        op(2, KvOp.cas("x", 0, 2), 4, True, 5),
    ]
    assert run(ops).outcome == "illegal"
    # Concurrent ones: exactly one may win.
    ops2 = [
        op(1, KvOp.put("x", 0), 0, None, 1),
        op(1, KvOp.cas("x", 0, 1), 2, True, 6),
        op(2, KvOp.cas("x", 0, 2), 3, False, 5),
        op(3, KvOp.get("x"), 7, 1, 8),
    ]
    assert run(ops2).ok
    ops3 = ops2[:3] + [op(3, KvOp.get("x"), 7, 2, 8)]
    assert run(ops3).outcome == "illegal"


def test_delete_semantics():
    ops = [
        op(1, KvOp.put("x", 1), 0, None, 1),
        op(1, KvOp.delete("x"), 2, True, 3),
        op(2, KvOp.delete("x"), 4, False, 5),
        op(2, KvOp.get("x"), 6, None, 7),
    ]
    assert run(ops).ok
    bad = ops[:2] + [op(2, KvOp.delete("x"), 4, True, 5)]  # deleted twice
    assert run(bad).outcome == "illegal"


def test_lost_append_rejected_and_reordered_appends_accepted():
    ops = [
        op(1, KvOp.append("l", "a"), 0, 1, 1),
        op(2, KvOp.append("l", "b"), 2, 2, 3),
        op(3, KvOp.get("l"), 4, ("a",), 5),  # "b" was acknowledged, then lost
    ]
    assert run(ops).outcome == "illegal"
    concurrent = [
        op(1, KvOp.append("l", "a"), 0, 2, 5),
        op(2, KvOp.append("l", "b"), 1, 1, 4),
        op(3, KvOp.get("l"), 6, ("b", "a"), 7),
    ]
    assert run(concurrent).ok


# ---------------------------------------------------------------- known legal


def test_concurrent_history_accepted():
    ops = [
        op(1, KvOp.put("x", 1), 0, None, 10),
        op(2, KvOp.get("x"), 1, None, 2),
        op(3, KvOp.get("x"), 3, 1, 4),
        op(2, KvOp.get("x"), 5, 1, 6),
        op(4, KvOp.put("x", 2), 5, None, 12),
        op(3, KvOp.get("x"), 11, 2, 13),
    ]
    assert run(ops).ok


def test_pending_write_may_happen_late_or_never():
    base = [pending(1, KvOp.put("x", 1), 0)]
    assert run(base + [op(2, KvOp.get("x"), 5, 1, 6)]).ok  # took effect
    assert run(base + [op(2, KvOp.get("x"), 5, None, 6)]).ok  # never took effect
    # Took effect between two reads, long after the client gave up.
    assert run(base + [op(2, KvOp.get("x"), 5, None, 6), op(2, KvOp.get("x"), 7, 1, 8)]).ok
    # But it cannot be undone once observed.
    assert (
        run(base + [op(2, KvOp.get("x"), 5, 1, 6), op(2, KvOp.get("x"), 7, None, 8)]).outcome
        == "illegal"
    )
    # Nor take effect before its call.
    assert (
        run([op(2, KvOp.get("x"), 0, 1, 1), pending(1, KvOp.put("x", 1), 2)]).outcome == "illegal"
    )


def test_many_pending_reads_do_not_explode():
    ops = [op(1, KvOp.put("x", 1), 0, None, 1)]
    ops += [pending(c, KvOp.get("x"), 2 + c) for c in range(200)]
    ops += [op(999, KvOp.get("x"), 500, 1, 501)]
    r = run(ops, timeout_s=5)
    assert r.ok


def test_empty_history_and_unknown_operation():
    assert run([]).ok
    with pytest.raises(ValueError, match="unknown operation"):
        run([op(1, KvOp("incr", "x"), 0, None, 1)])
    with pytest.raises(ValueError, match="returns before its call"):
        run([op(1, KvOp.get("x"), 5, None, 1)])


def test_history_recorder_guards():
    h = History(clock=iter(range(10)).__next__)
    a = h.invoke(1, KvOp.get("x"))
    h.ok(a, None)
    with pytest.raises(ValueError, match="already completed"):
        h.info(a)
    b = h.invoke(1, KvOp.get("x"))  # never completed: pending in the history
    ops = h.operations()
    assert ops[1].pending and ops[1].output is UNKNOWN
    assert len(h) == 2 and b == 1


# ---------------------------------------------------------------- budget


def _hard_illegal(n):
    # n fully concurrent puts of distinct values, then a read of a value nobody wrote: the
    # search must refute every ordering of the puts (bounded by the 2^n bitset cache).
    ops = [op(c, KvOp.put("x", c), 0, None, 100) for c in range(n)]
    ops.append(op(99, KvOp.get("x"), 200, -1, 201))
    return ops


def test_budget_gives_unknown_not_hang():
    r = run(_hard_illegal(16), max_steps_per_partition=5_000)
    assert r.outcome == "unknown"
    assert "UNKNOWN" in r.report()
    r = run(_hard_illegal(16), timeout_s=0.0)
    assert r.outcome == "unknown"
    # With enough budget the same shape is decided.
    assert run(_hard_illegal(8)).outcome == "illegal"


# ---------------------------------------------------------------- random vs brute force


def gen_linearizable(rng, n_ops, n_clients, keys, pending_p=0.1, max_dur=5.0):
    """Clients issue ops against an atomic map; each op takes effect at a random instant
    inside its [call, ret] window. Pending ops take effect (or not) after their call."""
    events = []
    t_free = {c: 0.0 for c in range(n_clients)}
    counter = itertools.count()
    for _ in range(n_ops):
        c = rng.randrange(n_clients)
        call = t_free[c] + rng.random()
        dur = rng.random() * max_dur
        ret = call + dur
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.35:
            inp = KvOp.put(k, next(counter))
        elif r < 0.45:
            inp = KvOp.delete(k)
        elif r < 0.55:
            inp = KvOp.cas(k, rng.choice([None, 0, 1, 2]), next(counter))
        elif r < 0.65:
            inp = KvOp.append(("list", k), next(counter))
        else:
            inp = KvOp.get(k)
        is_pending = rng.random() < pending_p
        lin = call + rng.random() * dur
        if is_pending:
            ret = INF
            t_free[c] = call + dur  # the client moves on after its timeout
            applied = rng.random() < 0.5
        else:
            t_free[c] = ret
            applied = True
        events.append([lin, applied, c, inp, call, ret])
    events.sort(key=lambda e: e[0])
    state = {}
    model = KvModel()
    ops = []
    for _lin, applied, c, inp, call, ret in events:
        if applied:
            cur = state.get(inp.key)
            # Derive the true output from the model itself with no expected output.
            out = _true_output(cur, inp)
            _, state[inp.key] = model.step(cur, inp, UNKNOWN)
        else:
            out = None
        ops.append(Operation(c, inp, call, out if ret != INF else UNKNOWN, ret))
    return ops


def _true_output(cur, inp):
    if inp.op == "get":
        return cur
    if inp.op == "put":
        return None
    if inp.op == "delete":
        return cur is not None
    if inp.op == "cas":
        return cur == inp.expected
    if inp.op == "append":
        return len(cur or ()) + 1
    raise AssertionError


def brute_force(ops):
    """Reference: try every subset of pending ops and every real-time-respecting order."""
    model = KvModel()
    definite = [o for o in ops if not o.pending]
    pend = [o for o in ops if o.pending]
    for r in range(len(pend) + 1):
        for chosen in itertools.combinations(pend, r):
            seq = definite + list(chosen)
            for perm in itertools.permutations(seq):
                okay = True
                for i, a in enumerate(perm):
                    # a placed before b requires not (b.ret < a.call)
                    if any(b.ret < a.call for b in perm[i + 1 :]):
                        okay = False
                        break
                if not okay:
                    continue
                states = {}
                for a in perm:
                    good, states[a.input.key] = model.step(
                        states.get(a.input.key), a.input, a.output
                    )
                    if not good:
                        okay = False
                        break
                if okay:
                    return True
    return False


def test_random_linearizable_histories_accepted():
    rng = random.Random(1234)
    for _ in range(300):
        ops = gen_linearizable(
            rng, rng.randrange(1, 40), rng.randrange(1, 6), ["a", "b", "c"][: rng.randrange(1, 4)]
        )
        r = run(ops)
        assert r.ok, r.report()


def test_agrees_with_brute_force_on_mutated_histories():
    rng = random.Random(99)
    verdicts = {True: 0, False: 0}
    for _ in range(400):
        ops = gen_linearizable(rng, rng.randrange(2, 7), rng.randrange(1, 4), ["a"], pending_p=0.2)
        # Corrupt one completed op's output (often, but not always, making it illegal).
        idx = [i for i, o in enumerate(ops) if not o.pending]
        if idx:
            i = rng.choice(idx)
            o = ops[i]
            if o.input.op == "get":
                new = rng.choice([None, 0, 1, 2, 3, (0,), (1, 2)])
            elif o.input.op in ("delete", "cas"):
                new = not o.output
            elif o.input.op == "append":
                new = o.output + rng.choice([-1, 1])
            else:
                new = o.output
            ops[i] = Operation(o.client, o.input, o.call, new, o.ret)
        expected = brute_force(ops)
        got = run(ops)
        assert got.ok == expected, (ops, got.report())
        verdicts[expected] += 1
    # The corpus exercises both verdicts substantially.
    assert verdicts[True] > 50 and verdicts[False] > 50, verdicts


# ---------------------------------------------------------------- performance, ack-set check


def test_few_thousand_op_history_checks_fast():
    rng = random.Random(7)
    ops = gen_linearizable(rng, 4000, 16, list(range(40)), pending_p=0.02, max_dur=3.0)
    t0 = time.process_time()
    r = run(ops, timeout_s=30)
    cpu = time.process_time() - t0
    assert r.ok, r.report()
    # CPU time, not wall time: the machine is shared. Target is well under a second.
    assert cpu < 1.0, f"checking 4000 ops took {cpu:.2f}s of CPU"
    # And an illegal variant of the same history is found as fast.
    gets = [
        i
        for i, o in enumerate(ops)
        if o.input.op == "get" and not o.pending and o.output is not None
    ]
    i = gets[len(gets) // 2]
    o = ops[i]
    ops[i] = Operation(o.client, o.input, o.call, "never-written", o.ret)
    t0 = time.process_time()
    r = run(ops, timeout_s=30)
    cpu = time.process_time() - t0
    assert r.outcome == "illegal"
    assert cpu < 1.0, f"refuting took {cpu:.2f}s of CPU"


def test_lost_acknowledged_writes_check():
    ops = [
        op(1, KvOp.put("a", 1), 0, None, 1),
        op(1, KvOp.put("b", 2), 2, None, 3),
        op(1, KvOp.delete("c"), 4, True, 5),
        op(2, KvOp.put("d", 1), 0, None, 10),  # concurrent writes to d: ambiguous, skipped
        op(3, KvOp.put("d", 2), 1, None, 9),
        pending(4, KvOp.put("e", 5), 0),
    ]
    assert lost_acknowledged_writes(ops, {"a": 1, "b": 2, "d": 1}) == []
    problems = lost_acknowledged_writes(ops, {"a": 1, "c": 7, "d": 2})
    assert len(problems) == 2
    assert any("'b'" in p and "wants 2" in p for p in problems)
    assert any("'c'" in p and "delete" in p for p in problems)
