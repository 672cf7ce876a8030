"""Model check of the fused FP8 grouped GEMM's producer / consumer protocol (csrc/kernels/sm90_fp8_grouped_gemm.cuh,
Gemms::kFused): a Python model of the protocol, not the kernel itself; rerun it when the protocol changes.

Modelled: tiles handed out in list order (L1 tiles, then L2 tiles) by an atomic counter; per CTA a ring of
`stages` slots; the producer's deferred token parts ("Pending": flushed when the ring holds only deferred
stages or at each tile boundary, after the grid dependency and, for an L2 tile, its expert's L1 count);
the end marker; consumers taking stages in order and counting each L1 tile after its epilogue. Random
transfer delays, epilogue times and CTA start times (late-resident CTAs). Checked: no deadlock, every tile
consumed exactly once, no L2 token part loaded before its expert's L1 tiles are counted, 33 arrivals and all
bytes on every stage the consumers take. Mutations that the model catches: dropping the ring-full flush
(deadlock), ungated L2 token parts (early read).

    python3 docs/models/fused_fp8_protocol.py [configurations]
"""
import random, sys

def run(seed, num_experts, blocks, nb1, nb2, kb1, kb2, stages, ctas, grid_delay):
    rnd = random.Random(seed)
    l1 = [(e, m, n) for e in range(num_experts) for n in range(nb1) for m in range(blocks[e])]
    l2 = [(e, m, n) for e in range(num_experts) for n in range(nb2) for m in range(blocks[e])]
    tiles = [("L1",) + t for t in l1] + [("L2",) + t for t in l2]
    needed = [blocks[e] * nb1 for e in range(num_experts)]
    g = dict(next=0, done=[0] * num_experts, now=0, consumed=[], grid_ready_at=grid_delay)
    class CTA: pass
    ctas_ = []
    for c in range(ctas):
        x = CTA()
        x.start = rnd.randint(0, 30)
        x.slots = [None] * stages     # stage record or None (free)
        x.issue_seq = 0; x.cons_seq = 0
        x.prod = dict(state="top", pending=[], grid_ready=False, tile=None, kb=0, tile_ready=True, done=False)
        x.cons = dict(tile=None, kb=0, done=False, epi=None)
        ctas_.append(x)
    def slot_free(x):
        return x.issue_seq - x.cons_seq < stages
    def new_stage(x, tile, kb, is_end=False):
        st = dict(tile=tile, kb=kb, arrivals=0, bytes_due=0, bytes_at=[], end=is_end, token_ok_at=None)
        x.slots[x.issue_seq % stages] = st; x.issue_seq += 1
        return st
    def l1_done(e): return g["done"][e] >= needed[e]
    def token_part(st):
        t = st["tile"]
        if t[0] == "L2":
            assert l1_done(t[1]), ("L2 token part before its expert's L1", t)
        st["bytes_at"].append(g["now"] + rnd.randint(1, 8)); st["arrivals"] += 32
    def prod_step(x):
        p = x.prod
        if p["done"]: return False
        if p["state"] == "top":
            # flush pending (blocking)
            if p["pending"]:
                if not p["grid_ready"]:
                    if g["now"] < g["grid_ready_at"]: return False
                    p["grid_ready"] = True
                t = p["pending"][0]["tile"]
                if t[0] == "L2" and not l1_done(t[1]): return False
                for st in p["pending"]: token_part(st)
                p["pending"] = []
                return True
            p["tile"] = g["next"]; g["next"] += 1
            if p["tile"] >= len(tiles):
                p["state"] = "end"; return True
            t = tiles[p["tile"]]
            p["kb"] = 0
            p["tile_ready"] = not (t[0] == "L2")
            if t[0] == "L2" and p["grid_ready"] and l1_done(t[1]): p["tile_ready"] = True
            p["state"] = "stages"; return True
        if p["state"] == "end":
            if not slot_free(x): return False
            st = new_stage(x, None, 0, True); st["arrivals"] = 33; p["done"] = True; return True
        if p["state"] == "stages":
            t = tiles[p["tile"]]
            nk = kb1 if t[0] == "L1" else kb2
            if p["kb"] == nk: p["state"] = "top"; return True
            if len(p["pending"]) == stages:
                if not p["grid_ready"]:
                    if g["now"] < g["grid_ready_at"]: return False
                    p["grid_ready"] = True
                if t[0] == "L2" and not l1_done(t[1]): return False
                for st in p["pending"]: token_part(st)
                p["pending"] = []; p["tile_ready"] = True
                return True
            if not slot_free(x): return False
            st = new_stage(x, t, p["kb"])
            st["arrivals"] += 1; st["bytes_at"].append(g["now"] + rnd.randint(1, 8))  # weights (expect_tx)
            if not p["grid_ready"] or not p["tile_ready"]:
                p["pending"].append(st)
            else:
                token_part(st)
            p["kb"] += 1; return True
    def full(st):
        return st["arrivals"] == 33 and (st["end"] or (len(st["bytes_at"]) == 2 and max(st["bytes_at"]) <= g["now"]))
    def cons_step(x):
        c = x.cons
        if c["done"]: return False
        if c["epi"] is not None:
            if g["now"] < c["epi"][0]: return False
            t = c["epi"][1]
            if t[0] == "L1": g["done"][t[1]] += 1
            c["epi"] = None; return True
        if x.cons_seq == x.issue_seq: return False
        st = x.slots[x.cons_seq % stages]
        if not full(st): return False
        assert st["arrivals"] == 33
        if st["end"]:
            c["done"] = True; return True
        t = st["tile"]
        if st["kb"] == 0:
            c["tile"] = t
        assert c["tile"] == t
        x.cons_seq += 1
        nk = kb1 if t[0] == "L1" else kb2
        if st["kb"] == nk - 1:
            g["consumed"].append(t)
            c["epi"] = (g["now"] + rnd.randint(1, 5), t)
        return True
    for step in range(200000):
        g["now"] = step
        progressed = False
        order = list(range(ctas)); rnd.shuffle(order)
        for i in order:
            x = ctas_[i]
            if step < x.start: progressed = True; continue
            # Random interleaving, but every agent gets at least one try per tick (else a quiet tick reads as a
            # deadlock).
            agents = [prod_step, cons_step]
            rnd.shuffle(agents)
            for f in agents:
                for _ in range(rnd.randint(1, 3)):
                    progressed |= f(x)
        if all(x.prod["done"] and x.cons["done"] and x.cons["epi"] is None for x in ctas_):
            assert sorted(g["consumed"]) == sorted(tiles), "tiles lost or repeated"
            return step
        pending_async = any(bt > step for x in ctas_ for st in x.slots if st for bt in st["bytes_at"]) or step < g["grid_ready_at"] \
            or any(x.cons["epi"] is not None for x in ctas_)
        if not progressed and not pending_async:
            raise AssertionError(f"deadlock at step {step}: next={g['next']} done={g['done']}")
    raise AssertionError("no completion within the step budget")

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rnd = random.Random(0)
    for s in range(n):
        e = rnd.randint(1, 6)
        blocks = [rnd.randint(0, 3) for _ in range(e)]
        if sum(blocks) == 0: blocks[0] = 1
        args = dict(num_experts=e, blocks=blocks, nb1=rnd.randint(1, 4), nb2=rnd.randint(1, 3),
                    kb1=rnd.randint(1, 9), kb2=rnd.randint(1, 9), stages=rnd.randint(2, 6),
                    ctas=rnd.randint(1, 12), grid_delay=rnd.randint(0, 40))
        run(s, **args)
    print(f"{n} random configurations: no deadlock, every tile consumed once, L2 token parts after their expert's L1")
