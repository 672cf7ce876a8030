"""Model check of the pair walk (csrc/kernels/sm90_fp8_grouped_gemm.cuh, kPairs; off by default, MEGAMOE_FP8_PAIRS=1):
the fused FP8 grouped GEMM's walk in two-CTA clusters that share each weight tile by TMA multicast, so a CTA-stage
moves 24 KB instead of 40. Planned when T=8192 read as bound by L2 -> SM bandwidth (eleventh session); built and
measured slower in the twelfth (docs/perf-notes.md). It extends the one-CTA walk's model as it was then, with one
producer warp per CTA that defers token parts ("Pending"); since a8ea2ae the kernel fills each stage from two producer
warps (weights; token parts, which simply wait), modelled for the one-CTA walk in fused_fp8_protocol.py, not yet here.
Rerun both when the protocol changes.

Modelled:
- Work units in list order: L1 units (expert, token-block pair p, weight block n), then L2 units; the pair covers
  token blocks 2p (CTA rank 0) and 2p + 1 (rank 1). An expert with an odd number of blocks gives its last pair a
  phantom half: that CTA streams its weight half for its peer, loads no token part, stores nothing, counts nothing.
- The cluster's rank-0 producer claims units from the global counter and publishes them to rank 1 through a claim
  ring of `claim_depth` entries (in the kernel: distributed shared memory and an mbarrier pair).
- Each CTA has a ring of `stages` slots; both CTAs issue the same stage sequence. A producer issues stage s only when
  slot s % stages is free in both CTAs (the empty barriers count both CTAs' consumer warps: remote arrivals), then
  multicasts its half of the weight rows into both CTAs' slot and loads its own token part (deferred, as in the
  one-CTA walk, until the grid dependency and, for L2, its expert's L1 count; none for a phantom half). A slot is
  full once its own producer's expect_tx arrival and 32 scale-lane arrivals are in and all expected bytes landed:
  both halves plus its own token part (the peer's half may land first: bytes before the expect_tx of the same
  phase are allowed, and cannot belong to an earlier phase because the slot was free in both CTAs).
- Consumers take stages in order; an L1 unit's real half counts its expert after the epilogue.
- Clusters start at random times (late-resident clusters), random transfer and epilogue delays.
Checked: no deadlock; every (unit, rank) consumed exactly once; no multicast into a slot the other CTA has not
released; no L2 token part before its expert's L1 blocks are counted; every L1 count comes from a real block.
Not modelled: the exit (in the kernel both CTAs pass a cluster barrier before exit, so no multicast lands in an
exited CTA).

    python3 docs/models/fused_fp8_cluster_protocol.py [configurations]
"""
import random
import sys


def run(seed, num_experts, blocks, nb1, nb2, kb1, kb2, stages, clusters, grid_delay, claim_depth=2, mutation=None):
    """One random run; raises AssertionError on a violated claim. `mutation` breaks one rule on purpose (the tests
    check that the model notices): "own_slot_only" (a producer checks only its own CTA's slot before multicasting),
    "no_l1_gate" (L2 token parts ignore the L1 count), "no_ring_flush" (deferred token parts wait for the unit's end
    even when the ring holds nothing else)."""
    rnd = random.Random(seed)
    pairs = [(b + 1) // 2 for b in blocks]
    units = [("L1", e, p, n) for e in range(num_experts) for n in range(nb1) for p in range(pairs[e])]
    units += [("L2", e, p, n) for e in range(num_experts) for n in range(nb2) for p in range(pairs[e])]
    needed = [blocks[e] * nb1 for e in range(num_experts)]
    g = dict(next=0, done=[0] * num_experts, now=0, consumed=[], grid_ready_at=grid_delay)

    def real(unit, rank):
        return 2 * unit[2] + rank < blocks[unit[1]]

    def l1_done(e):
        return g["done"][e] >= needed[e]

    class Cluster:
        pass

    cls = []
    for k in range(clusters):
        c = Cluster()
        c.start = rnd.randint(0, 30)
        c.claims = []  # units claimed by rank 0, read in order by rank 1
        c.slots = [[None] * stages for _ in range(2)]  # per CTA: the physical slots' stage records (None: released)
        c.issue = [0, 0]  # next stage seq per producer
        c.cons_seq = [0, 0]
        c.prod = [dict(state="top", pending=[], grid_ready=False, unit=None, claim_idx=0, kb=0, tile_ready=True,
                       done=False) for _ in range(2)]
        c.cons = [dict(unit=None, done=False, epi=None) for _ in range(2)]
        cls.append(c)

    def stage(c, cta, seq):
        st = c.slots[cta][seq % stages]
        if st is None:
            st = c.slots[cta][seq % stages] = dict(seq=seq, unit=None, kb=None, own=0, bytes_at=[], expected=None,
                                                   end=False)
        assert st["seq"] == seq, ("a write into a slot its consumers have not released", cta, seq, st["seq"])
        return st

    def slot_free(c, r, seq):
        # Both CTAs' consumers have taken the slot's previous use (seq - stages).
        ctas = [r] if mutation == "own_slot_only" else range(2)
        return all(c.cons_seq[x] > seq - stages for x in ctas)

    def token_part(c, cta, seq):
        st = stage(c, cta, seq)
        u = st["unit"]
        if u[0] == "L2":
            assert l1_done(u[1]), ("L2 token part before its expert's L1", u)
        assert st["seq"] == seq
        st["bytes_at"].append(("tok", g["now"] + rnd.randint(1, 8)))
        st["own"] += 32  # the scale lanes' cp.async arrivals

    def gates_open(p, u):
        if not p["grid_ready"]:
            if g["now"] < g["grid_ready_at"]:
                return False
            p["grid_ready"] = True
        return u[0] == "L1" or mutation == "no_l1_gate" or l1_done(u[1])

    def prod_step(c, r):
        p = c.prod[r]
        if p["done"]:
            return False
        if p["state"] == "top":
            if p["pending"]:  # the previous unit's deferred token parts (blocking)
                if not gates_open(p, stage(c, r, p["pending"][0])["unit"]):
                    return False
                for seq in p["pending"]:
                    token_part(c, r, seq)
                p["pending"] = []
                return True
            if r == 0:
                if len(c.claims) - c.prod[1]["claim_idx"] >= claim_depth:
                    return False  # the claim ring is full: rank 1 has not read the oldest claim
                u = g["next"]
                g["next"] += 1
                c.claims.append(u)
            else:
                if p["claim_idx"] == len(c.claims):
                    return False
                u = c.claims[p["claim_idx"]]
            p["claim_idx"] += 1
            if u >= len(units):
                p["state"] = "end"
                return True
            p["unit"], p["kb"] = u, 0
            unit = units[u]
            p["tile_ready"] = unit[0] == "L1" or not real(unit, r) or (
                p["grid_ready"] and (mutation == "no_l1_gate" or l1_done(unit[1])))
            p["state"] = "stages"
            return True
        seq = c.issue[r]
        if p["state"] == "end":
            if not slot_free(c, r, seq):
                return False
            st = stage(c, r, seq)
            st.update(end=True, own=33, expected=0)
            c.issue[r] += 1
            p["done"] = True
            return True
        unit = units[p["unit"]]
        nk = kb1 if unit[0] == "L1" else kb2
        if p["kb"] == nk:
            p["state"] = "top"
            return True
        if len(p["pending"]) == stages and mutation != "no_ring_flush":  # only deferred stages: flush (blocking)
            if not gates_open(p, unit):
                return False
            for s in p["pending"]:
                token_part(c, r, s)
            p["pending"] = []
            p["tile_ready"] = True
            return True
        if not slot_free(c, r, seq):
            return False
        has_tokens = real(unit, r)
        for cta in range(2):  # this producer's weight half, multicast into both CTAs' slot
            st = stage(c, cta, seq)
            assert not st["end"] and (st["unit"] in (None, unit)) and st["kb"] in (None, p["kb"]), \
                ("multicast into a slot holding another stage", cta, seq)
            st["unit"], st["kb"] = unit, p["kb"]
            st["bytes_at"].append((f"half{r}", g["now"] + rnd.randint(1, 8)))
        own = stage(c, r, seq)
        own["own"] += 1  # expect_tx: both halves, plus its own token part
        own["expected"] = 3 if has_tokens else 2
        if has_tokens:
            if not p["grid_ready"] or not p["tile_ready"]:
                p["pending"].append(seq)
            else:
                token_part(c, r, seq)
        else:
            own["own"] += 32  # no token scales to copy: the lanes arrive at once
        c.issue[r] += 1
        p["kb"] += 1
        return True

    def full(st):
        if st["end"]:
            return st["own"] == 33
        return (st["expected"] is not None and st["own"] == 33 and len(st["bytes_at"]) == st["expected"]
                and max(t for _, t in st["bytes_at"]) <= g["now"])

    def cons_step(c, r):
        x = c.cons[r]
        if x["done"]:
            return False
        if x["epi"] is not None:
            if g["now"] < x["epi"][0]:
                return False
            unit = x["epi"][1]
            if unit[0] == "L1" and real(unit, r):
                g["done"][unit[1]] += 1
            x["epi"] = None
            return True
        seq = c.cons_seq[r]
        st = c.slots[r][seq % stages]
        if st is None or st["seq"] != seq or not full(st):
            return False
        if st["end"]:
            x["done"] = True
            return True
        unit = st["unit"]
        if st["kb"] == 0:
            x["unit"] = unit
        assert x["unit"] == unit
        c.slots[r][seq % stages] = None
        c.cons_seq[r] += 1  # releases the slot (local and remote empty-barrier arrivals)
        nk = kb1 if unit[0] == "L1" else kb2
        if st["kb"] == nk - 1:
            g["consumed"].append((unit, r))
            x["epi"] = (g["now"] + rnd.randint(1, 5), unit)
        return True

    for step in range(400000):
        g["now"] = step
        progressed = False
        order = list(range(clusters))
        rnd.shuffle(order)
        for k in order:
            c = cls[k]
            if step < c.start:
                progressed = True
                continue
            agents = [(prod_step, 0), (prod_step, 1), (cons_step, 0), (cons_step, 1)]
            rnd.shuffle(agents)
            for f, r in agents:
                for _ in range(rnd.randint(1, 3)):
                    progressed |= f(c, r)
        if all(c.prod[r]["done"] and c.cons[r]["done"] and c.cons[r]["epi"] is None for c in cls for r in range(2)):
            want = sorted((u, r) for u in units for r in range(2))
            assert sorted(g["consumed"]) == want, "units lost or repeated"
            assert g["done"] == needed, "L1 counts differ from the real blocks"
            return step
        pending_async = step < g["grid_ready_at"] or any(
            t > step for c in cls for sl in c.slots for st in sl if st for _, t in st["bytes_at"]) or any(
            c.cons[r]["epi"] is not None for c in cls for r in range(2))
        if not progressed and not pending_async:
            raise AssertionError(f"deadlock at step {step}: next={g['next']} done={g['done']} needed={needed}")
    raise AssertionError("no completion within the step budget")


def random_configuration(rnd):
    e = rnd.randint(1, 6)
    blocks = [rnd.randint(0, 5) for _ in range(e)]
    if sum(blocks) == 0:
        blocks[0] = 1
    return dict(num_experts=e, blocks=blocks, nb1=rnd.randint(1, 4), nb2=rnd.randint(1, 3), kb1=rnd.randint(1, 9),
                kb2=rnd.randint(1, 9), stages=rnd.randint(2, 6), clusters=rnd.randint(1, 6),
                grid_delay=rnd.randint(0, 40), claim_depth=rnd.randint(1, 3))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rnd = random.Random(0)
    for s in range(n):
        run(s, **random_configuration(rnd))
    print(f"{n} random configurations: no deadlock, every (unit, rank) consumed once, no multicast into an unreleased "
          "slot, L2 token parts after their expert's L1")
