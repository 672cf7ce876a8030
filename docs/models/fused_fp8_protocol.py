"""Model check of the fused FP8 grouped GEMM's producer / consumer protocol (csrc/kernels/sm90_fp8_grouped_gemm.cuh,
Gemms::kFused): a Python model of the protocol, not the kernel itself; rerun it when the protocol changes.

Modelled (two producer warps since a8ea2ae): tiles handed out in list order (L1 tiles, then L2 tiles) by an atomic
counter; per CTA a ring of `stages` slots that both producer warps fill in the same stage order, each once the
consumers released the slot. The weight producer claims the tiles, hands each to the token producer through a ring
of `ring_depth` entries (full / empty barriers), writes the tile info into the tile's first stage and adds its
expect_tx arrival, its 32 scale-lane arrivals and the weight bytes to every stage; it never waits for anything but
free slots and ring entries. The token producer takes the tiles in order, waits for the grid dependency before its
first token part and, for an L2 tile, for its expert's L1 count, then adds its own 33 arrivals and the token bytes to
each of the tile's stages. The end marker: both producers arrive on one more stage. Consumers take stages in order
and count each L1 tile after its epilogue. Random transfer delays, epilogue times and CTA start times (late-resident
CTAs). Checked: no deadlock, every tile consumed exactly once, no L2 token part loaded before its expert's L1 tiles are
counted, 66 arrivals and both parts' bytes on every stage the consumers take, and both producers' parts of a stage
belong to the same tile. Mutations the model catches: ungated L2 token parts (early read), a weight producer that
overwrites a ring entry the token producer has not read (a tile lost or repeated).

    python3 docs/models/fused_fp8_protocol.py [configurations]
"""
import random
import sys

ARRIVALS = 2 * (1 + 32)  # per producer warp: lane 0's expect_tx (or plain) arrival + 32 scale lanes


def run(seed, num_experts, blocks, nb1, nb2, kb1, kb2, stages, ctas, grid_delay, ring_depth=2, mutation=None):
    """One random run; raises AssertionError on a violated claim. `mutation`: "no_l1_gate" (L2 token parts ignore the
    L1 count) or "ring_overwrite" (the weight producer does not wait for a free ring entry)."""
    rnd = random.Random(seed)
    l1 = [(e, m, n) for e in range(num_experts) for n in range(nb1) for m in range(blocks[e])]
    l2 = [(e, m, n) for e in range(num_experts) for n in range(nb2) for m in range(blocks[e])]
    tiles = [("L1",) + t for t in l1] + [("L2",) + t for t in l2]
    needed = [blocks[e] * nb1 for e in range(num_experts)]
    g = dict(next=0, done=[0] * num_experts, now=0, consumed=[], grid_ready_at=grid_delay)

    def nk(t):
        return kb1 if t[0] == "L1" else kb2

    def l1_done(e):
        return g["done"][e] >= needed[e]

    class CTA:
        pass

    ctas_ = []
    for _ in range(ctas):
        x = CTA()
        x.start = rnd.randint(0, 30)
        x.stage = {}  # stage sequence number -> record
        x.cons_seq = 0
        x.ring = [None] * ring_depth
        x.ring_w = x.ring_t = 0  # entries handed over / taken
        x.wp = dict(state="claim", tile=None, kb=0, seq=0, done=False)
        x.tp = dict(state="take", tile=None, kb=0, seq=0, grid_ready=False, done=False)
        x.cons = dict(tile=None, done=False, epi=None)
        ctas_.append(x)

    def record(x, seq):
        return x.stage.setdefault(seq, dict(arrivals=0, bytes_at=[], tile=None, kb=None, tok_tile=None, end=False))

    def slot_free(x, seq):
        return seq - x.cons_seq < stages  # the slot's previous stage (seq - stages) is released

    def next_stage(x, p):
        """Producer warp p's next stage once its slot is free (else None): the record, with p's arrivals counted."""
        if not slot_free(x, p["seq"]):
            return None
        st = record(x, p["seq"])
        st["arrivals"] += ARRIVALS // 2
        p["seq"] += 1
        return st

    def end_stage(x, p, marks_end):
        # One more stage, no data: a producer warp's arrivals (the weight producer also writes the end marker).
        st = next_stage(x, p)
        if st is None:
            return False
        st["end"] |= marks_end
        p["done"] = True
        return True

    def wp_step(x):
        p = x.wp
        if p["done"]:
            return False
        if p["state"] == "claim":
            p["tile"] = g["next"]
            g["next"] += 1
            p["state"] = "hand"
            return True
        if p["state"] == "hand":  # the tile (or the end) into the ring
            if mutation != "ring_overwrite" and x.ring_w - x.ring_t == ring_depth:
                return False
            end = p["tile"] >= len(tiles)
            x.ring[x.ring_w % ring_depth] = None if end else tiles[p["tile"]]
            x.ring_w += 1
            p["state"] = "end" if end else "stages"
            p["kb"] = 0
            return True
        if p["state"] == "end":
            return end_stage(x, p, True)
        t = tiles[p["tile"]]
        if p["kb"] == nk(t):
            p["state"] = "claim"
            return True
        st = next_stage(x, p)
        if st is None:
            return False
        st["tile"], st["kb"] = t, p["kb"]
        st["bytes_at"].append(g["now"] + rnd.randint(1, 8))  # weight tile and scales
        p["kb"] += 1
        return True

    def tp_step(x):
        p = x.tp
        if p["done"]:
            return False
        if p["state"] == "take":
            if x.ring_t == x.ring_w:
                return False
            p["tile"] = x.ring[x.ring_t % ring_depth]
            x.ring_t += 1
            p["kb"] = 0
            p["state"] = "end" if p["tile"] is None else "gate"
            return True
        if p["state"] == "end":
            return end_stage(x, p, False)
        t = p["tile"]
        if p["state"] == "gate":  # the grid dependency, then an L2 tile's L1 count
            if not p["grid_ready"]:
                if g["now"] < g["grid_ready_at"]:
                    return False
                p["grid_ready"] = True
            if t[0] == "L2" and mutation != "no_l1_gate" and not l1_done(t[1]):
                return False
            p["state"] = "stages"
            return True
        if p["kb"] == nk(t):
            p["state"] = "take"
            return True
        st = next_stage(x, p)
        if st is None:
            return False
        if t[0] == "L2":
            assert l1_done(t[1]), ("L2 token part before its expert's L1", t)
        st["tok_tile"] = (t, p["kb"])
        st["bytes_at"].append(g["now"] + rnd.randint(1, 8))  # token tile and scales
        p["kb"] += 1
        return True

    def full(st):
        landed = len(st["bytes_at"]) == 2 and max(st["bytes_at"]) <= g["now"]
        return st["arrivals"] == ARRIVALS and (st["end"] or landed)

    def cons_step(x):
        c = x.cons
        if c["done"]:
            return False
        if c["epi"] is not None:
            if g["now"] < c["epi"][0]:
                return False
            t = c["epi"][1]
            if t[0] == "L1":
                g["done"][t[1]] += 1
            c["epi"] = None
            return True
        st = x.stage.get(x.cons_seq)
        if st is None or not full(st):
            return False
        if st["end"]:
            c["done"] = True
            return True
        t = st["tile"]
        assert st["tok_tile"] == (t, st["kb"]), ("weight and token parts of different tiles", st)
        if st["kb"] == 0:
            c["tile"] = t
        assert c["tile"] == t
        del x.stage[x.cons_seq]
        x.cons_seq += 1
        if st["kb"] == nk(t) - 1:
            g["consumed"].append(t)
            c["epi"] = (g["now"] + rnd.randint(1, 5), t)
        return True

    for step in range(200000):
        g["now"] = step
        progressed = False
        order = list(range(ctas))
        rnd.shuffle(order)
        for i in order:
            x = ctas_[i]
            if step < x.start:
                progressed = True
                continue
            # Random interleaving, but every agent gets at least one try per tick (else a quiet tick reads as a
            # deadlock).
            agents = [wp_step, tp_step, cons_step]
            rnd.shuffle(agents)
            for f in agents:
                for _ in range(rnd.randint(1, 3)):
                    progressed |= f(x)
        if all(x.wp["done"] and x.tp["done"] and x.cons["done"] and x.cons["epi"] is None for x in ctas_):
            assert sorted(g["consumed"]) == sorted(tiles), "tiles lost or repeated"
            return step
        pending_async = any(bt > step for x in ctas_ for st in x.stage.values() for bt in st["bytes_at"]) \
            or step < g["grid_ready_at"] or any(x.cons["epi"] is not None for x in ctas_)
        if not progressed and not pending_async:
            raise AssertionError(f"deadlock at step {step}: next={g['next']} done={g['done']}")
    raise AssertionError("no completion within the step budget")


def random_configuration(rnd):
    e = rnd.randint(1, 6)
    blocks = [rnd.randint(0, 3) for _ in range(e)]
    if sum(blocks) == 0:
        blocks[0] = 1
    return dict(num_experts=e, blocks=blocks, nb1=rnd.randint(1, 4), nb2=rnd.randint(1, 3), kb1=rnd.randint(1, 9),
                kb2=rnd.randint(1, 9), stages=rnd.randint(2, 6), ctas=rnd.randint(1, 12), grid_delay=rnd.randint(0, 40),
                ring_depth=rnd.randint(1, 3))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rnd = random.Random(0)
    for s in range(n):
        run(s, **random_configuration(rnd))
    print(f"{n} random configurations: no deadlock, every tile consumed once, L2 token parts after their expert's L1")
